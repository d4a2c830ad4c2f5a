//! c10d key-value stores (`shim.cpp`'s `tdc_store_*`, `sealed_store.cpp`): an owned
//! handle, [`StoreHandle`], whose methods are the store's operations, and the
//! trampolines through which a sealed store calls a Rust cipher ([`Sealer`]).

use std::ffi::{c_char, c_int, CStr};
use std::os::fd::{IntoRawFd, OwnedFd};
use std::ptr::NonNull;

use super::sys::{self, SECRET_BYTES};
use super::{check, check_ptr, MallocBuffer};

/// An owned c10d store (`tdc_store*`, a `c10::intrusive_ptr<c10d::Store>`): freed when
/// dropped. A view made from it ([`prefixed`](Self::prefixed), [`sealed`](Self::sealed),
/// [`clone_connection`](Self::clone_connection)) holds its own reference to the C++
/// store it views, so it borrows nothing from this handle.
pub(crate) struct StoreHandle(NonNull<sys::Store>);

// SAFETY: a `tdc_store` holds only an intrusive pointer to a c10d store (atomic
// count); c10d's stores are thread-safe, as they serve the process group's own
// threads (TCPStore's client locks around each request, HashStore and PrefixStore
// lock or forward, the sealed store only reads its own fields), so the handle may be
// used, and freed, from any thread.
unsafe impl Send for StoreHandle {}
// SAFETY: as for `Send`: every operation through `&StoreHandle` is one of the
// store's thread-safe methods.
unsafe impl Sync for StoreHandle {}

impl StoreHandle {
    /// A `c10d::TCPStore` client of `host:port`, or, with `listener`, its server on that
    /// socket, already bound and listening, which the store takes over and closes
    /// (`tdc_tcp_store_new`).
    ///
    /// # Errors
    /// libtorch's message when the store cannot be made or reached within `timeout_ms`.
    pub(crate) fn tcp(
        host: &CStr,
        port: u16,
        world_size: i32,
        listener: Option<OwnedFd>,
        timeout_ms: i64,
    ) -> Result<StoreHandle, String> {
        // c10d owns the socket from here on (it closes it with the store, or when the
        // store cannot be made).
        let listen_fd = listener.map_or(-1, IntoRawFd::into_raw_fd);
        // SAFETY: `host` is a C string for the call; `listen_fd` is -1 or a listening
        // socket that this function gave up (the shim's store closes it).
        let raw = unsafe {
            sys::tdc_tcp_store_new(
                host.as_ptr(),
                port.into(),
                world_size,
                listen_fd,
                timeout_ms,
            )
        };
        Self::made(raw)
    }

    /// An in-process `c10d::HashStore` (`tdc_hash_store_new`).
    ///
    /// # Errors
    /// libtorch's message when it cannot be made.
    pub(crate) fn hash() -> Result<StoreHandle, String> {
        // SAFETY: no arguments; the result is NULL or a new store for the caller.
        Self::made(unsafe { sys::tdc_hash_store_new() })
    }

    /// A view of this store whose keys are prefixed with `prefix`
    /// (`c10d::PrefixStore`, `tdc_prefix_store_new`).
    ///
    /// # Errors
    /// libtorch's message when it cannot be made.
    pub(crate) fn prefixed(&self, prefix: &CStr) -> Result<StoreHandle, String> {
        // SAFETY: `self` is a live store and `prefix` a C string for the call; the
        // view holds its own reference to the base store.
        Self::made(unsafe { sys::tdc_prefix_store_new(prefix.as_ptr(), self.0.as_ptr()) })
    }

    /// The sealed view of this store (`sealed_store.cpp`): keys under `prefix`, values
    /// sealed and opened by `S` with `secret` ([`Sealer`]), which adds
    /// `S::OVERHEAD` bytes to each value.
    ///
    /// # Errors
    /// libtorch's message when it cannot be made.
    pub(crate) fn sealed<S: Sealer>(
        &self,
        prefix: &CStr,
        secret: &[u8; SECRET_BYTES],
    ) -> Result<StoreHandle, String> {
        // SAFETY: `self` is a live store, `prefix` a C string and `secret` holds the
        // `TDC_SECRET_BYTES` bytes the shim copies (it keeps no pointer to either);
        // `seal` and `open` are functions that live for the whole program and meet
        // `tdc_seal_fn`'s and `tdc_open_fn`'s contracts (see them).
        let raw = unsafe {
            sys::tdc_sealed_store_new(
                prefix.as_ptr(),
                self.0.as_ptr(),
                secret.as_ptr(),
                S::OVERHEAD,
                seal::<S>,
                open::<S>,
            )
        };
        Self::made(raw)
    }

    /// A second connection to the same store (c10d's `Store::clone`,
    /// `tdc_store_clone`): a new TCP client for a TCP store.
    ///
    /// # Errors
    /// libtorch's message when it cannot connect.
    pub(crate) fn clone_connection(&self) -> Result<StoreHandle, String> {
        // SAFETY: `self` is a live store; the clone is a new store for the caller.
        Self::made(unsafe { sys::tdc_store_clone(self.0.as_ptr()) })
    }

    fn made(raw: *mut sys::Store) -> Result<StoreHandle, String> {
        check_ptr(raw).map(StoreHandle).map_err(|t| t.message())
    }

    /// The raw handle, for another wrapper of this module's parent that passes it to
    /// the shim while `self` is borrowed.
    pub(super) fn as_raw(&self) -> *mut sys::Store {
        self.0.as_ptr()
    }

    /// Sets how long `get` waits for a key (`tdc_store_set_timeout`).
    ///
    /// # Errors
    /// libtorch's message.
    pub(crate) fn set_timeout(&self, timeout_ms: i64) -> Result<(), String> {
        // SAFETY: `self` is a live store.
        check(unsafe { sys::tdc_store_set_timeout(self.0.as_ptr(), timeout_ms) })
    }

    /// The port a TCP store listens on or connects to; `None` for other stores
    /// (`tdc_store_port`).
    pub(crate) fn port(&self) -> Option<u16> {
        // SAFETY: `self` is a live store.
        match unsafe { sys::tdc_store_port(self.0.as_ptr()) } {
            sys::TDC_NO_PORT => None,
            port => u16::try_from(port).ok(),
        }
    }

    /// Sets `key` to `value` (`tdc_store_set`).
    ///
    /// # Errors
    /// libtorch's message.
    pub(crate) fn set(&self, key: &CStr, value: &[u8]) -> Result<(), String> {
        // SAFETY: `self` is a live store, `key` a C string and `value` holds
        // `value.len()` bytes, all for the call (the shim copies them).
        check(unsafe {
            sys::tdc_store_set(self.0.as_ptr(), key.as_ptr(), value.as_ptr(), value.len())
        })
    }

    /// The value of `key`, waiting for it up to the store's timeout (`tdc_store_get`).
    ///
    /// # Errors
    /// libtorch's message (a timeout among them).
    pub(crate) fn get(&self, key: &CStr) -> Result<MallocBuffer, String> {
        // SAFETY: `self` is a live store and `key` a C string for the call; on success
        // the shim stores a `malloc`'ed buffer (never NULL) and its length.
        unsafe {
            MallocBuffer::out::<u8>(|data, len| {
                sys::tdc_store_get(self.0.as_ptr(), key.as_ptr(), data, len)
            })
        }
        .map_err(|t| t.message())
    }

    /// Adds `delta` to the integer at `key` and returns the new value
    /// (`tdc_store_add`).
    ///
    /// # Errors
    /// libtorch's message.
    pub(crate) fn add(&self, key: &CStr, delta: i64) -> Result<i64, String> {
        let mut result = 0;
        // SAFETY: `self` is a live store, `key` a C string and `result` an `i64` the
        // shim writes, all for the call.
        check(unsafe { sys::tdc_store_add(self.0.as_ptr(), key.as_ptr(), delta, &mut result) })?;
        Ok(result)
    }

    /// Every key of the store, each followed by a NUL (`tdc_store_list_keys`).
    ///
    /// # Errors
    /// libtorch's message.
    pub(crate) fn list_keys(&self) -> Result<MallocBuffer, String> {
        // SAFETY: `self` is a live store; on success the shim stores a `malloc`'ed
        // buffer (never NULL) and its length.
        unsafe {
            MallocBuffer::out::<c_char>(|data, len| {
                sys::tdc_store_list_keys(self.0.as_ptr(), data, len)
            })
        }
        .map_err(|t| t.message())
    }
}

impl Drop for StoreHandle {
    fn drop(&mut self) {
        // SAFETY: the handle owns the store, which no one uses after this; the views
        // made from it hold references of their own.
        unsafe { sys::tdc_store_free(self.0.as_ptr()) }
    }
}

/// The cipher of a sealed store ([`StoreHandle::sealed`]), in safe Rust: the store
/// calls it through this module's trampolines, from any thread that uses the store.
/// Neither function may panic (a panic cannot unwind into C++: it aborts).
pub(crate) trait Sealer: 'static {
    /// How many bytes sealing adds to a value.
    const OVERHEAD: usize;

    /// Seals `plain` with `secret` and `key` (the full key, the associated data) into
    /// `out`, which holds `plain.len() + OVERHEAD` bytes; `false` when it cannot.
    fn seal(secret: &[u8; SECRET_BYTES], key: &[u8], plain: &[u8], out: &mut [u8]) -> bool;

    /// Opens `sealed` (at least `OVERHEAD` bytes) into `out`, which holds
    /// `sealed.len() - OVERHEAD` bytes; `false` unless it was sealed with this secret
    /// under this key.
    fn open(secret: &[u8; SECRET_BYTES], key: &[u8], sealed: &[u8], out: &mut [u8]) -> bool;
}

/// The status a cipher's result is for the shim: `TDC_OK`, else `TDC_ERROR`.
fn status(ok: bool) -> c_int {
    if ok {
        sys::TDC_OK
    } else {
        sys::TDC_ERROR
    }
}

/// The `len` bytes at `data` (which may be NULL when `len` is 0: an empty
/// `std::vector`'s `data()`).
///
/// # Safety
/// When `len` is not 0, `data` points at `len` bytes that stay valid and unwritten for
/// `'a`.
unsafe fn bytes<'a>(data: *const u8, len: usize) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    // SAFETY: the caller's contract, for `len` > 0.
    unsafe { std::slice::from_raw_parts(data, len) }
}

/// The `len` bytes at `data`, to write (`data` may be NULL when `len` is 0).
///
/// # Safety
/// When `len` is not 0, `data` points at `len` bytes that only the returned slice
/// reaches for `'a`.
unsafe fn bytes_mut<'a>(data: *mut u8, len: usize) -> &'a mut [u8] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: the caller's contract, for `len` > 0.
    unsafe { std::slice::from_raw_parts_mut(data, len) }
}

/// `tdc_seal_fn` over [`Sealer::seal`].
///
/// # Safety
/// `secret` holds [`SECRET_BYTES`] bytes, `key` is a C string, `plain` holds `len`
/// bytes and `out` has room for `len + S::OVERHEAD`, none of it written by anyone else
/// during the call (the sealed store's own buffers).
unsafe extern "C" fn seal<S: Sealer>(
    secret: *const u8,
    key: *const c_char,
    plain: *const u8,
    len: usize,
    out: *mut u8,
) -> c_int {
    // SAFETY: the contract above: each pointer is valid for its length for the call,
    // and `out` does not overlap the inputs (it is a buffer of its own).
    let (secret, key, plain, out) = unsafe {
        (
            &*secret.cast::<[u8; SECRET_BYTES]>(),
            CStr::from_ptr(key).to_bytes(),
            bytes(plain, len),
            bytes_mut(out, len + S::OVERHEAD),
        )
    };
    status(S::seal(secret, key, plain, out))
}

/// `tdc_open_fn` over [`Sealer::open`]: a value shorter than `S::OVERHEAD` does not
/// open.
///
/// # Safety
/// `secret` holds [`SECRET_BYTES`] bytes, `key` is a C string, `sealed` holds `len`
/// bytes and `out` has room for `len - S::OVERHEAD` (when `len` is at least that),
/// none of it written by anyone else during the call.
unsafe extern "C" fn open<S: Sealer>(
    secret: *const u8,
    key: *const c_char,
    sealed: *const u8,
    len: usize,
    out: *mut u8,
) -> c_int {
    let Some(body_len) = len.checked_sub(S::OVERHEAD) else {
        return status(false);
    };
    // SAFETY: the contract above: each pointer is valid for its length for the call,
    // and `out` does not overlap the inputs.
    let (secret, key, sealed, out) = unsafe {
        (
            &*secret.cast::<[u8; SECRET_BYTES]>(),
            CStr::from_ptr(key).to_bytes(),
            bytes(sealed, len),
            bytes_mut(out, body_len),
        )
    };
    status(S::open(secret, key, sealed, out))
}
