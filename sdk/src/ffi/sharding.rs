//! Fully sharded training's calls into libtorch (`sharding.cpp`): storages freed and
//! given memory again, gradients set, and autograd hooks that call a Rust closure
//! ([`Hook`]) through this module's trampolines: on a tensor's gradient
//! ([`hook_gradient`]) and on parameters' accumulated gradients
//! ([`GradHooksHandle`], an owned handle).

use std::ffi::{c_int, c_void, CStr};
use std::ptr::NonNull;
use std::sync::Arc;

use tch::Tensor;

use super::sys;
use super::tensor::{ptr, take, TensorArray};
use super::{check, check_ptr};

/// What a hook runs with its index: `true` when it went well, `false` (or a panic,
/// which is caught) to fail the backward pass. Called on autograd's threads, several
/// at once.
pub(crate) type Hook = dyn Fn(usize) -> bool + Send + Sync;

/// Frees the memory of `t`'s storage, keeping its sizes (FSDP2's resharding,
/// `tdc_storage_free`): until [`storage_alias`] gives it memory again, any access to its
/// data is a libtorch error whose text is `message`, never a read of freed memory (c10's
/// check on a storage without data, the same as `untyped_storage().resize_(0)` leaves).
///
/// # Errors
/// libtorch's message.
pub(crate) fn storage_free(t: &Tensor, message: &CStr) -> Result<(), String> {
    // SAFETY: `t` is a tensor borrowed for the call and `message` a C string that the
    // shim copies.
    check(unsafe { sys::tdc_storage_free(ptr(t), message.as_ptr()) })
}

/// Gives `t`'s storage memory again if it was freed, and returns a new tensor over it
/// whose writes do not count as writes to `t` (`tdc_storage_alias`).
///
/// # Errors
/// libtorch's message.
pub(crate) fn storage_alias(t: &Tensor) -> Result<Tensor, String> {
    // SAFETY: `t` is a tensor borrowed for the call; the result is NULL or a new
    // `torch::Tensor*` for the caller.
    let raw = unsafe { sys::tdc_storage_alias(ptr(t)) };
    let raw = check_ptr(raw).map_err(|t| t.message())?;
    // SAFETY: the shim allocated this tensor for the caller, who takes it once.
    Ok(unsafe { take(raw.as_ptr()) })
}

/// The bytes `t`'s storage holds now (`tdc_storage_bytes`).
///
/// # Errors
/// libtorch's message.
pub(crate) fn storage_bytes(t: &Tensor) -> Result<usize, String> {
    let mut out = 0;
    // SAFETY: `t` is a tensor borrowed for the call and `out` a `size_t` the shim
    // writes.
    check(unsafe { sys::tdc_storage_bytes(ptr(t), &mut out) })?;
    Ok(out)
}

/// Sets `t`'s `.grad` to `grad`, or to none (`tdc_set_grad`).
///
/// # Errors
/// libtorch's message.
pub(crate) fn set_grad(t: &Tensor, grad: Option<&Tensor>) -> Result<(), String> {
    let grad = grad.map_or(std::ptr::null_mut(), ptr);
    // SAFETY: `t` and `grad` (or NULL, which the shim reads as none) are tensors
    // borrowed for the call; the shim keeps its own reference to `grad`.
    check(unsafe { sys::tdc_set_grad(ptr(t), grad) })
}

/// Copies `src` into `dst` without waiting (`tdc_copy_async`): between pinned host
/// memory and a GPU the copy is queued on the current stream, and the host must wait
/// for the stream before it reads or writes the host side.
///
/// # Errors
/// libtorch's message (shapes that do not broadcast, say).
pub(crate) fn copy_async(dst: &Tensor, src: &Tensor) -> Result<(), String> {
    // SAFETY: `dst` and `src` are tensors borrowed for the call. A copy still in
    // flight when they are dropped reads and writes no freed memory: device memory is
    // reused in stream order, after the copy, and pinned host memory comes from
    // libtorch's caching host allocator, which reuses a block only once the copies
    // recorded on it have completed.
    check(unsafe { sys::tdc_copy_async(ptr(dst), ptr(src)) })
}

/// A hook's context for the shim: a boxed `Arc` of it, which [`drop_hook`] frees.
fn context(hook: &Arc<Hook>) -> *mut c_void {
    Box::into_raw(Box::new(hook.clone())).cast::<c_void>()
}

/// `tdc_callback` over a [`Hook`]: `TDC_OK` when it went well.
///
/// # Safety
/// `ctx` came from [`context`] and [`drop_hook`] has not freed it yet (the shim holds
/// it until its last hook is gone).
unsafe extern "C" fn call(ctx: *mut c_void, index: c_int) -> c_int {
    // SAFETY: the contract above: `ctx` is a live `Box<Arc<Hook>>`, only read here
    // (several threads may read it at once: `Hook` is `Sync`).
    let hook = unsafe { &*ctx.cast::<Arc<Hook>>() };
    // No panic may unwind into libtorch.
    let index = usize::try_from(index).unwrap_or(usize::MAX);
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hook(index))) {
        Ok(true) => sys::TDC_OK,
        _ => sys::TDC_ERROR,
    }
}

/// `tdc_drop` for a [`context`]: frees it.
///
/// # Safety
/// `ctx` came from [`context`], and the shim calls this once, when no hook can call
/// [`call`] with it any more.
unsafe extern "C" fn drop_hook(ctx: *mut c_void) {
    // SAFETY: the contract above: this is the context's last use and only release.
    drop(unsafe { Box::from_raw(ctx.cast::<Arc<Hook>>()) });
}

/// Runs `hook(index)` each time `t`'s gradient is computed in a backward pass, for as
/// long as autograd keeps `t`'s graph (`tdc_hook_gradient`).
///
/// # Errors
/// libtorch's message.
pub(crate) fn hook_gradient(t: &Tensor, hook: &Arc<Hook>, index: usize) -> Result<(), String> {
    let index = c_int::try_from(index).map_err(|_| format!("hook index {index} too large"))?;
    // SAFETY: `t` is a tensor borrowed for the call; the context is a new one that the
    // shim owns from here on (it calls `drop_hook` once, on failure too), and `call`
    // meets `tdc_callback`'s contract for it.
    check(unsafe { sys::tdc_hook_gradient(ptr(t), call, context(hook), drop_hook, index) })
}

/// Hooks that run a [`Hook`] with `i` each time parameter `i`'s `.grad` has been
/// accumulated in a backward pass, as c10d's Reducer learns of ready gradients
/// (`tdc_grad_hooks*`): owned, the hooks are removed when it is dropped.
pub(crate) struct GradHooksHandle {
    raw: NonNull<sys::GradHooks>,
    /// How many parameters are hooked: the entries `reachable` writes.
    count: usize,
}

// SAFETY: a `tdc_grad_hooks` holds the parameters' gradient accumulators (shared
// pointers, atomic counts) and their hooks' keys, written only when it is made and
// freed: `reachable` reads them, which any thread may do, and freeing it from another
// thread removes the hooks under autograd's own locks.
unsafe impl Send for GradHooksHandle {}
// SAFETY: as for `Send`: `&GradHooksHandle` only reads the accumulators.
unsafe impl Sync for GradHooksHandle {}

impl GradHooksHandle {
    /// Hooks `params`' gradient accumulators (`tdc_grad_hooks_new`).
    ///
    /// # Errors
    /// libtorch's message (a parameter that does not require a gradient).
    pub(crate) fn new(params: &TensorArray<'_>, hook: &Arc<Hook>) -> Result<Self, String> {
        params.assert_complete(params.len(), "the hooked parameters");
        // SAFETY: `params` holds `count()` tensors borrowed for the call; the context
        // is a new one that the shim owns from here on (it calls `drop_hook` once, on
        // failure too), and `call` meets `tdc_callback`'s contract for it.
        let raw = unsafe {
            sys::tdc_grad_hooks_new(
                params.as_ptr(),
                params.count(),
                call,
                context(hook),
                drop_hook,
            )
        };
        check_ptr(raw)
            .map(|raw| GradHooksHandle {
                raw,
                count: params.len(),
            })
            .map_err(|t| t.message())
    }

    /// Per parameter, in the order given to [`new`](Self::new), whether a backward
    /// pass from `roots` accumulates its gradient (`tdc_grad_hooks_reachable`).
    ///
    /// # Errors
    /// libtorch's message.
    pub(crate) fn reachable(&self, roots: &TensorArray<'_>) -> Result<Vec<bool>, String> {
        roots.assert_complete(roots.len(), "the graph's roots");
        let mut out: Vec<c_int> = vec![0; self.count];
        // SAFETY: `self` is live; `roots` holds `count()` tensors borrowed for the
        // call; `out` has an entry for each hooked parameter, as many as the shim
        // writes.
        check(unsafe {
            sys::tdc_grad_hooks_reachable(
                self.raw.as_ptr(),
                roots.as_ptr(),
                roots.count(),
                out.as_mut_ptr(),
            )
        })?;
        Ok(out.into_iter().map(|r| r != 0).collect())
    }
}

impl Drop for GradHooksHandle {
    fn drop(&mut self) {
        // SAFETY: the handle owns the hooks, which no one uses after this.
        unsafe { sys::tdc_grad_hooks_free(self.raw.as_ptr()) }
    }
}
