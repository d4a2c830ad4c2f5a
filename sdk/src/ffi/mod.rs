//! The one safe layer over the C shim (`csrc/shim.h`) and the C library: every call
//! into C goes through a wrapper here, as rust-rocksdb's `ffi_util` and torch-sys's
//! `PROTECT` do, and the modules above contain no `unsafe`.
//!
//! - [`sys`]: the raw `extern "C"` declarations, opaque handle types, callback types
//!   and status codes (shim.h's `TDC_*`, matched by name here). Private to this module.
//! - One file per part of the shim, each turning its calls into safe functions and
//!   types: an owned handle frees its C object in `Drop`
//!   ([`StoreHandle`](store::StoreHandle), [`PgHandle`](process_group::PgHandle),
//!   [`WorkHandle`](process_group::WorkHandle),
//!   [`ReducerHandle`](reducer::ReducerHandle),
//!   [`GradHooksHandle`](sharding::GradHooksHandle)); tensors cross as borrows for
//!   the call ([`TensorArray`](tensor::TensorArray) carries their lifetime) and come
//!   back as owned `tch::Tensor`s; a callback's `extern "C"` trampoline lives here and
//!   calls a safe Rust closure. [`store`] (stores, and `sealed_store.cpp`'s cipher
//!   callbacks), [`process_group`] (process groups, collectives), [`reducer`] (DDP's
//!   Reducer), [`sharding`] (`sharding.cpp`: storages, gradient hooks),
//!   [`activation`] (`activation.cpp`: activation checkpointing), [`optim`]
//!   (`optim.cpp`: optimizer kernels, libtorch's optimizer archive), [`random`]
//!   (default generators, `randperm`), [`amp`] (autocast, gradient unscaling, the
//!   device's capability), [`tensor`] (tensor pointers), [`os`] (the C library:
//!   signals, processes, file descriptors, host names).
//! - Here: the shim's thread-local error ([`last_error_text`]), the status checks, and
//!   a `malloc`'ed buffer the shim hands over ([`MallocBuffer`]).
//!
//! Every `unsafe` block and `unsafe impl` in this module carries a `// SAFETY:`
//! comment naming the invariant it relies on (clippy's `undocumented_unsafe_blocks`
//! is on for the crate).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr::NonNull;

use crate::error::TorchText;

pub(crate) mod activation;
pub(crate) mod amp;
pub(crate) mod optim;
pub(crate) mod os;
pub(crate) mod process_group;
pub(crate) mod random;
pub(crate) mod reducer;
pub(crate) mod sharding;
pub(crate) mod store;
mod sys;
pub(crate) mod tensor;

pub(crate) use sys::SECRET_BYTES;
pub(crate) use tensor::{tensor_key, TensorArray};

/// Takes this thread's last shim error (or a placeholder when none was recorded),
/// whole: libtorch's text with its C++ frames.
fn last_error_text() -> TorchText {
    // SAFETY: `tdc_last_error` takes no argument; it returns NULL or a string that it
    // `malloc`'ed for the caller, which `MallocBuffer` frees once.
    let ptr = unsafe { sys::tdc_last_error() };
    let Some(ptr) = NonNull::new(ptr) else {
        return TorchText::new("unknown error in the c10d shim");
    };
    // SAFETY: `ptr` is the NUL-terminated string the shim just handed over.
    let len = unsafe { CStr::from_ptr(ptr.as_ptr()) }.to_bytes().len();
    // SAFETY: the shim `malloc`'ed the string (strdup) and gives it up; it holds `len`
    // bytes before its NUL.
    let text = unsafe { MallocBuffer::from_raw(ptr.cast(), len) };
    TorchText::new(String::from_utf8_lossy(text.as_bytes()).into_owned())
}

/// Turns a shim status (`TDC_OK` = success) into a `Result`, with the shim's message.
fn check(status: c_int) -> Result<(), String> {
    check_text(status).map_err(|t| t.message())
}

/// Turns a shim status (`TDC_OK` = success) into a `Result`, with libtorch's whole
/// text.
fn check_text(status: c_int) -> Result<(), TorchText> {
    if status == sys::TDC_OK {
        Ok(())
    } else {
        Err(last_error_text())
    }
}

/// Turns a shim constructor's result (NULL = failure) into a `Result`.
fn check_ptr<T>(ptr: *mut T) -> Result<NonNull<T>, TorchText> {
    NonNull::new(ptr).ok_or_else(last_error_text)
}

/// Bytes that the shim `malloc`'ed and handed over (`tdc_store_get`'s value, a list of
/// keys, the runtime report): owned, freed once with `free` when dropped.
pub(crate) struct MallocBuffer {
    data: NonNull<u8>,
    len: usize,
}

impl MallocBuffer {
    /// Takes `data` over.
    ///
    /// # Safety
    /// `data` was allocated with `malloc` (by the shim), holds at least `len`
    /// initialized bytes, and no one else frees or writes it.
    unsafe fn from_raw(data: NonNull<u8>, len: usize) -> MallocBuffer {
        MallocBuffer { data, len }
    }

    /// Calls `fill` with an out-pointer and an out-length, as the shim's functions
    /// that hand a buffer over take them, and takes the buffer once `fill` succeeded.
    ///
    /// # Safety
    /// `fill` must be a shim call that, when it returns `TDC_OK`, has stored a
    /// `malloc`'ed buffer of at least the stored length (never NULL) for the caller.
    unsafe fn out<C>(
        fill: impl FnOnce(*mut *mut C, *mut usize) -> c_int,
    ) -> Result<MallocBuffer, TorchText> {
        let mut data: *mut C = std::ptr::null_mut();
        let mut len = 0usize;
        check_text(fill(&mut data, &mut len))?;
        let data = NonNull::new(data.cast::<u8>())
            .ok_or_else(|| TorchText::new("the c10d shim handed over no buffer"))?;
        // SAFETY: the caller's contract: on success the shim stored a `malloc`'ed
        // buffer of `len` bytes for us.
        Ok(unsafe { MallocBuffer::from_raw(data, len) })
    }

    /// The bytes.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        // SAFETY: `data` holds `len` initialized bytes (`from_raw`'s contract), which
        // live until `self` is dropped and which no one writes.
        unsafe { std::slice::from_raw_parts(self.data.as_ptr(), self.len) }
    }
}

impl Drop for MallocBuffer {
    fn drop(&mut self) {
        // SAFETY: `data` came from `malloc` and this is its only owner (`from_raw`).
        unsafe { libc::free(self.data.as_ptr().cast::<c_void>()) }
    }
}

/// What libtorch was built with and finds here, for `tchrun env`: `key\tvalue\n` lines
/// (`tdc_runtime_report`).
///
/// # Errors
/// libtorch's message when the report cannot be made.
pub(crate) fn runtime_report() -> Result<MallocBuffer, String> {
    // SAFETY: `tdc_runtime_report` stores a `malloc`'ed buffer and its length on
    // success, as `MallocBuffer::out` needs.
    unsafe { MallocBuffer::out::<c_char>(|data, len| sys::tdc_runtime_report(data, len)) }
        .map_err(|t| t.message())
}
