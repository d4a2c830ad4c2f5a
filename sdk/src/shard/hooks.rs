//! The shim's storage and autograd hooks (`csrc/sharding.cpp`), for Rust.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use tch::Tensor;

use crate::error::{Error, Result};
use crate::ffi;

fn torch(what: &str, status: c_int) -> Result<()> {
    ffi::check(status).map_err(|e| Error::Torch(format!("{what}: {e}")))
}

/// Frees the memory of `t`'s storage; its sizes stay (FSDP2's resharding). Until
/// [`storage_alias`] gives it memory again, any read or write of its data is a
/// libtorch error whose text is `message` (never a null pointer a kernel follows).
pub(crate) fn free_storage(t: &Tensor, message: &str) -> Result<()> {
    let message = std::ffi::CString::new(message.replace('\0', " ")).expect("no NUL left");
    // SAFETY: `t` is a live tensor for this call and `message` a NUL-terminated string
    // that the shim copies; the shim catches every C++ exception.
    torch("freeing a parameter", unsafe {
        ffi::tdc_storage_free(ffi::tensor(t), message.as_ptr())
    })
}

/// Gives `t` memory again if it was freed, and returns a tensor over that memory whose
/// writes do not count as writes to `t`: autograd's saved tensors of `t` see the
/// values written through it in backward.
pub(crate) fn storage_alias(t: &Tensor) -> Result<Tensor> {
    let raw = unsafe { ffi::tdc_storage_alias(ffi::tensor(t)) };
    ffi::check_ptr(raw)
        .map(|p| unsafe { Tensor::from_ptr(p as *mut torch_sys::C_tensor) })
        .map_err(|e| Error::Torch(format!("gathering a parameter: {e}")))
}

/// The bytes `t`'s storage holds now (0 once freed).
pub(crate) fn storage_bytes(t: &Tensor) -> Result<usize> {
    let mut out = 0;
    torch("reading a storage's size", unsafe {
        ffi::tdc_storage_bytes(ffi::tensor(t), &mut out)
    })?;
    Ok(out)
}

/// Sets `t`'s `.grad` to `grad`.
pub(crate) fn set_grad(t: &Tensor, grad: &Tensor) -> Result<()> {
    torch("setting a gradient", unsafe {
        ffi::tdc_set_grad(ffi::tensor(t), ffi::tensor(grad))
    })
}

/// Sets `t`'s `.grad` to none.
pub(crate) fn clear_grad(t: &Tensor) -> Result<()> {
    torch("dropping a gradient", unsafe {
        ffi::tdc_set_grad(ffi::tensor(t), std::ptr::null_mut())
    })
}

/// What a hook runs with its index: `true` when it went well (a failure keeps its
/// cause where the caller reports it, and fails the backward pass).
pub(crate) type Hook = dyn Fn(usize) -> bool + Send + Sync;

unsafe extern "C" fn call(ctx: *mut c_void, index: c_int) -> c_int {
    let hook = &*(ctx as *const Arc<Hook>);
    // No panic may unwind into libtorch.
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hook(index as usize))) {
        Ok(true) => 0,
        _ => 1,
    }
}

unsafe extern "C" fn drop_hook(ctx: *mut c_void) {
    drop(Box::from_raw(ctx as *mut Arc<Hook>));
}

fn context(hook: &Arc<Hook>) -> *mut c_void {
    Box::into_raw(Box::new(hook.clone())) as *mut c_void
}

/// Runs `hook(index)` each time `t`'s gradient is computed in a backward pass (before
/// the backward of what made `t`), for as long as autograd keeps `t`'s graph.
pub(crate) fn on_gradient(t: &Tensor, hook: &Arc<Hook>, index: usize) -> Result<()> {
    torch("hooking an output's gradient", unsafe {
        ffi::tdc_hook_gradient(
            ffi::tensor(t),
            call,
            context(hook),
            drop_hook,
            index as c_int,
        )
    })
}

/// Runs `hook(i)` each time parameter `i`'s `.grad` has been accumulated in a
/// backward pass, as c10d's Reducer learns of ready gradients; until dropped.
pub(crate) struct GradHooks {
    raw: *mut ffi::GradHooks,
    /// How many parameters are hooked.
    count: usize,
}

// Only dropped (which frees the hooks) from another thread.
unsafe impl Send for GradHooks {}
unsafe impl Sync for GradHooks {}

impl GradHooks {
    pub fn new(params: &[Tensor], hook: &Arc<Hook>) -> Result<Self> {
        let ptrs = ffi::tensors(params);
        let raw = unsafe {
            ffi::tdc_grad_hooks_new(
                ptrs.as_ptr(),
                ptrs.len() as c_int,
                call,
                context(hook),
                drop_hook,
            )
        };
        ffi::check_ptr(raw)
            .map(|raw| GradHooks {
                raw,
                count: params.len(),
            })
            .map_err(|e| Error::Torch(format!("hooking the parameters' gradients: {e}")))
    }

    /// Per parameter, in the order given to [`new`](Self::new), whether a backward
    /// pass from `roots` accumulates its gradient: whether its gradient accumulator is
    /// in their autograd graph, as the Reducer searches for unused parameters.
    pub fn reachable(&self, roots: &[Tensor]) -> Result<Vec<bool>> {
        let ptrs = ffi::tensors(roots);
        let mut out = vec![0; self.count];
        torch("searching the autograd graph", unsafe {
            ffi::tdc_grad_hooks_reachable(
                self.raw,
                ptrs.as_ptr(),
                ptrs.len() as c_int,
                out.as_mut_ptr(),
            )
        })?;
        Ok(out.into_iter().map(|r| r != 0).collect())
    }
}

impl Drop for GradHooks {
    fn drop(&mut self) {
        unsafe { ffi::tdc_grad_hooks_free(self.raw) }
    }
}
