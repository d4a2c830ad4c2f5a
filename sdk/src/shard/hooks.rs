//! The shim's storage and autograd hooks (`csrc/sharding.cpp`, through
//! [`ffi::sharding`]), with the SDK's errors.

use std::sync::Arc;

use tch::Tensor;

use crate::error::{Error, Result};
use crate::ffi::sharding::{self, GradHooksHandle};
use crate::ffi::TensorArray;

pub(crate) use crate::ffi::sharding::Hook;

fn torch<T>(what: &str, done: std::result::Result<T, String>) -> Result<T> {
    done.map_err(|e| Error::Torch(format!("{what}: {e}")))
}

/// Frees the memory of `t`'s storage; its sizes stay (FSDP2's resharding). Until
/// [`storage_alias`] gives it memory again, any read or write of its data is a
/// libtorch error whose text is `message` (never a null pointer a kernel follows).
pub(crate) fn free_storage(t: &Tensor, message: &str) -> Result<()> {
    let message = std::ffi::CString::new(message.replace('\0', " ")).expect("no NUL left");
    torch("freeing a parameter", sharding::storage_free(t, &message))
}

/// Gives `t` memory again if it was freed, and returns a tensor over that memory whose
/// writes do not count as writes to `t`: autograd's saved tensors of `t` see the
/// values written through it in backward.
pub(crate) fn storage_alias(t: &Tensor) -> Result<Tensor> {
    torch("gathering a parameter", sharding::storage_alias(t))
}

/// The bytes `t`'s storage holds now (0 once freed).
pub(crate) fn storage_bytes(t: &Tensor) -> Result<usize> {
    torch("reading a storage's size", sharding::storage_bytes(t))
}

/// Sets `t`'s `.grad` to `grad`.
pub(crate) fn set_grad(t: &Tensor, grad: &Tensor) -> Result<()> {
    torch("setting a gradient", sharding::set_grad(t, Some(grad)))
}

/// Sets `t`'s `.grad` to none.
pub(crate) fn clear_grad(t: &Tensor) -> Result<()> {
    torch("dropping a gradient", sharding::set_grad(t, None))
}

/// Runs `hook(index)` each time `t`'s gradient is computed in a backward pass (before
/// the backward of what made `t`), for as long as autograd keeps `t`'s graph.
pub(crate) fn on_gradient(t: &Tensor, hook: &Arc<Hook>, index: usize) -> Result<()> {
    torch(
        "hooking an output's gradient",
        sharding::hook_gradient(t, hook, index),
    )
}

/// Runs `hook(i)` each time parameter `i`'s `.grad` has been accumulated in a
/// backward pass, as c10d's Reducer learns of ready gradients; until dropped.
pub(crate) struct GradHooks {
    raw: GradHooksHandle,
}

impl GradHooks {
    pub fn new(params: &[Tensor], hook: &Arc<Hook>) -> Result<Self> {
        GradHooksHandle::new(&TensorArray::new(params), hook)
            .map(|raw| GradHooks { raw })
            .map_err(|e| Error::Torch(format!("hooking the parameters' gradients: {e}")))
    }

    /// Per parameter, in the order given to [`new`](Self::new), whether a backward
    /// pass from `roots` accumulates its gradient: whether its gradient accumulator is
    /// in their autograd graph, as the Reducer searches for unused parameters.
    pub fn reachable(&self, roots: &[Tensor]) -> Result<Vec<bool>> {
        torch(
            "searching the autograd graph",
            self.raw.reachable(&TensorArray::new(roots)),
        )
    }
}
