//! Activation checkpointing's autograd node (`activation.cpp`): [`checkpoint`] hands
//! the shim a Rust closure, the block, which the shim calls through this module's
//! trampoline in the forward pass and again in the backward pass.

use std::ffi::{c_int, c_void};
use std::sync::Mutex;

use tch::Tensor;

use super::check;
use super::sys;
use super::tensor::{ptr, take, take_all, TensorArray};

/// The block, called from the thread that runs the forward pass and from autograd's
/// in the backward pass (one at a time, under the lock).
pub(crate) type Block = Box<dyn Fn(&[Tensor]) -> Vec<Tensor> + Send>;

/// Why [`checkpoint`] failed, as the shim's status tells it.
pub(crate) enum CheckpointError {
    /// `TDC_USAGE_ERROR`: a block that returns its input, or ignores the inputs that
    /// require a gradient, or returns too many outputs.
    Usage(String),
    /// Any other failure of the forward pass.
    Failed(String),
}

/// Runs `block` on `inputs` under the shim's checkpoint node (`tdc_checkpoint`), which
/// keeps the block until the backward pass has run it again; at most `max_outputs`
/// outputs.
///
/// # Errors
/// [`CheckpointError`] with libtorch's message.
pub(crate) fn checkpoint(
    block: Block,
    inputs: &[Tensor],
    max_outputs: usize,
) -> Result<Vec<Tensor>, CheckpointError> {
    let ctx = Box::into_raw(Box::new(Mutex::new(block))).cast::<c_void>();
    let inputs = TensorArray::new(inputs);
    let cap = c_int::try_from(max_outputs).expect("a small number of outputs");
    let mut outputs: Vec<sys::Tensor> = vec![std::ptr::null_mut(); max_outputs];
    let mut n: c_int = 0;
    // SAFETY: `ctx` is a new context that the shim owns from here on (it calls
    // `drop_block` once, when its node is gone or at once on failure), and `run`
    // meets `tdc_block_fn`'s contract for it; `inputs` holds `count()` tensors
    // borrowed for the call; `outputs` has room for `cap` pointers and `n` is an int,
    // both written by the shim.
    let status = unsafe {
        sys::tdc_checkpoint(
            run,
            ctx,
            drop_block,
            inputs.as_ptr(),
            inputs.count(),
            outputs.as_mut_ptr(),
            cap,
            &mut n,
        )
    };
    // What the shim wrote is Rust's, whatever the status: take every pointer once.
    // SAFETY: `outputs` holds NULL or `torch::Tensor*`s that the shim allocated for the
    // caller (`new at::Tensor`), each taken once here.
    let written = unsafe { take_all(outputs) };
    if let Err(message) = check(status) {
        return Err(match status {
            sys::TDC_USAGE_ERROR => CheckpointError::Usage(message),
            _ => CheckpointError::Failed(message),
        });
    }
    let n = usize::try_from(n).unwrap_or(0);
    Ok(written.into_iter().take(n).flatten().collect())
}

/// `tdc_block_fn` over a [`Block`]: runs it on the inputs (each a handle of its own,
/// which Rust frees) and hands each output's handle to the shim, which frees it.
/// Returns the output count, `TDC_BLOCK_TOO_MANY_OUTPUTS` for more than `cap`, or
/// `TDC_BLOCK_PANICKED` when the block panicked.
///
/// # Safety
/// `ctx` came from [`checkpoint`] and [`drop_block`] has not freed it; `inputs` holds
/// `n` `torch::Tensor*`s that the shim allocated for this call (`new at::Tensor`) and
/// gives up; `outputs` has room for `cap` pointers.
unsafe extern "C" fn run(
    ctx: *mut c_void,
    inputs: *const sys::Tensor,
    n: c_int,
    outputs: *mut sys::Tensor,
    cap: c_int,
) -> c_int {
    // SAFETY: the contract above: `ctx` is a live `Mutex<Block>`, shared only through
    // `&` (the lock orders the calls).
    let block = unsafe { &*ctx.cast::<Mutex<Block>>() };
    let n = usize::try_from(n).unwrap_or(0);
    let cap = usize::try_from(cap).unwrap_or(0);
    // SAFETY: the contract above: `inputs` holds `n` owned pointers, each taken once.
    let xs: Vec<Tensor> = (0..n).map(|i| unsafe { take(*inputs.add(i)) }).collect();
    // No panic may unwind into libtorch: it fails the backward pass instead.
    let call = || block.lock().unwrap_or_else(|e| e.into_inner())(&xs);
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)) {
        Ok(ys) if ys.len() <= cap => {
            let count = ys.len() as c_int;
            for (i, y) in ys.into_iter().enumerate() {
                // SAFETY: `i < cap`, within `outputs`' room (the contract above).
                unsafe { *outputs.add(i) = ptr(&y) };
                // The shim frees the handle now.
                std::mem::forget(y);
            }
            count
        }
        Ok(_) => sys::TDC_BLOCK_TOO_MANY_OUTPUTS,
        Err(_) => sys::TDC_BLOCK_PANICKED,
    }
}

/// `tdc_drop` for [`checkpoint`]'s context: frees the block.
///
/// # Safety
/// `ctx` came from [`checkpoint`], and the shim calls this once, when [`run`] cannot be
/// called with it any more.
unsafe extern "C" fn drop_block(ctx: *mut c_void) {
    // SAFETY: the contract above: this is the context's last use and only release.
    drop(unsafe { Box::from_raw(ctx.cast::<Mutex<Block>>()) });
}
