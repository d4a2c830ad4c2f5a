//! The optimizer updates, libtorch's optimizer archive, and the parameters' gradient
//! accumulators held from when they joined the optimizer (`optim.cpp`). Each update
//! borrows one group's parameters and state tensors for the call ([`TensorArray`]) and
//! checks that every array the shim reads whole is complete; the tensors the shim
//! makes come back owned.

use std::ffi::c_int;
use std::ptr::NonNull;

use tch::Tensor;

use super::sys;
use super::tensor::{take_all, TensorArray};
use super::{check_ptr, check_text};
use crate::error::TorchText;

/// Which arithmetic an update runs (`optim.cpp`'s `mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KernelMode {
    /// libtorch's C++ `torch::optim` arithmetic (tch's), in `_foreach_*` ops.
    Tch = 0,
    /// `torch.optim`'s `foreach=True` arithmetic.
    Foreach = 1,
    /// ATen's fused kernels (`_fused_sgd_`, `_fused_adam_`, `_fused_adamw_`).
    Fused = 2,
}

/// SGD's options (`tdc_sgd_step`).
pub(crate) struct SgdOptions {
    pub lr: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub weight_decay: f64,
    pub nesterov: bool,
    pub mode: KernelMode,
}

/// One SGD update of `params` in place from their gradients (`tdc_sgd_step`), with
/// their momentum buffers `bufs`, or `None` at the group's first step with momentum:
/// the new buffers are then returned, one per parameter (else none).
///
/// # Errors
/// libtorch's text.
pub(crate) fn sgd_step(
    params: &TensorArray<'_>,
    bufs: Option<&TensorArray<'_>>,
    o: &SgdOptions,
) -> Result<Vec<Tensor>, TorchText> {
    let n = params.len();
    params.assert_complete(n, "SGD's parameters");
    let first = o.momentum != 0.0 && bufs.is_none();
    if let (true, Some(bufs)) = (o.momentum != 0.0, bufs) {
        bufs.assert_complete(n, "SGD's momentum buffers");
    }
    let mut made: Vec<sys::Tensor> = vec![std::ptr::null_mut(); n];
    // SAFETY: every array holds `n` tensors borrowed for the call, complete where the
    // shim reads it (the momentum buffers with momentum, asserted above); `made` has
    // room for the `n` new buffers the shim hands out at a first step.
    let status = unsafe {
        sys::tdc_sgd_step(
            params.as_ptr(),
            bufs.map_or(std::ptr::null(), TensorArray::as_ptr),
            made.as_mut_ptr(),
            params.count(),
            o.lr,
            o.momentum,
            o.dampening,
            o.weight_decay,
            c_int::from(o.nesterov),
            o.mode as c_int,
        )
    };
    // The buffers the shim handed out are Rust's, whatever the status.
    // SAFETY: `made` holds NULL or `torch::Tensor*`s the shim allocated for the caller,
    // each taken once here.
    let made: Vec<Tensor> = unsafe { take_all(made) }.into_iter().flatten().collect();
    check_text(status)?;
    Ok(if first { made } else { Vec::new() })
}

/// Adam's and AdamW's options (`tdc_adam_step`).
pub(crate) struct AdamOptions {
    /// The update's number (1 at the first).
    pub step: i64,
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub amsgrad: bool,
    /// AdamW.
    pub decoupled: bool,
    pub mode: KernelMode,
}

/// The state tensors of one Adam update, one per parameter: `max_exp_avg_sqs` is
/// read under `amsgrad`, `steps` (float32 step counts) by the fused kernels.
pub(crate) struct AdamState<'s, 'a> {
    pub exp_avgs: &'s TensorArray<'a>,
    pub exp_avg_sqs: &'s TensorArray<'a>,
    pub max_exp_avg_sqs: &'s TensorArray<'a>,
    pub steps: &'s TensorArray<'a>,
}

/// One Adam (or AdamW) update of `params` in place (`tdc_adam_step`).
///
/// # Errors
/// libtorch's text.
pub(crate) fn adam_step(
    params: &TensorArray<'_>,
    state: &AdamState<'_, '_>,
    o: &AdamOptions,
) -> Result<(), TorchText> {
    let n = params.len();
    params.assert_complete(n, "Adam's parameters");
    state.exp_avgs.assert_complete(n, "Adam's exp_avg");
    state.exp_avg_sqs.assert_complete(n, "Adam's exp_avg_sq");
    state.max_exp_avg_sqs.assert_len(n, "Adam's max_exp_avg_sq");
    if o.amsgrad {
        state
            .max_exp_avg_sqs
            .assert_complete(n, "Adam's max_exp_avg_sq");
    }
    state.steps.assert_len(n, "Adam's steps");
    if o.mode == KernelMode::Fused {
        state.steps.assert_complete(n, "Adam's steps");
    }
    // SAFETY: every array holds `n` tensors borrowed for the call, complete where the
    // shim reads it (asserted above: `max_exp_avg_sqs` under amsgrad, `steps` for the
    // fused kernels).
    check_text(unsafe {
        sys::tdc_adam_step(
            params.as_ptr(),
            state.exp_avgs.as_ptr(),
            state.exp_avg_sqs.as_ptr(),
            state.max_exp_avg_sqs.as_ptr(),
            state.steps.as_ptr(),
            params.count(),
            o.step,
            o.lr,
            o.beta1,
            o.beta2,
            o.eps,
            o.weight_decay,
            c_int::from(o.amsgrad),
            c_int::from(o.decoupled),
            o.mode as c_int,
        )
    })
}

/// RMSprop's options (`tdc_rmsprop_step`).
pub(crate) struct RmsPropOptions {
    pub lr: f64,
    pub alpha: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub momentum: f64,
    pub centered: bool,
    pub mode: KernelMode,
}

/// One RMSprop update of `params` in place (`tdc_rmsprop_step`), with their square
/// averages, their momentum buffers (read with momentum) and their gradient averages
/// (read when centered).
///
/// # Errors
/// libtorch's text.
pub(crate) fn rmsprop_step(
    params: &TensorArray<'_>,
    square_avgs: &TensorArray<'_>,
    momentum_bufs: &TensorArray<'_>,
    grad_avgs: &TensorArray<'_>,
    o: &RmsPropOptions,
) -> Result<(), TorchText> {
    let n = params.len();
    params.assert_complete(n, "RMSprop's parameters");
    square_avgs.assert_complete(n, "RMSprop's square_avg");
    momentum_bufs.assert_len(n, "RMSprop's momentum_buffer");
    if o.momentum > 0.0 {
        momentum_bufs.assert_complete(n, "RMSprop's momentum_buffer");
    }
    grad_avgs.assert_len(n, "RMSprop's grad_avg");
    if o.centered {
        grad_avgs.assert_complete(n, "RMSprop's grad_avg");
    }
    // SAFETY: every array holds `n` tensors borrowed for the call, complete where the
    // shim reads it (asserted above).
    check_text(unsafe {
        sys::tdc_rmsprop_step(
            params.as_ptr(),
            square_avgs.as_ptr(),
            momentum_bufs.as_ptr(),
            grad_avgs.as_ptr(),
            params.count(),
            o.lr,
            o.alpha,
            o.eps,
            o.weight_decay,
            o.momentum,
            c_int::from(o.centered),
            o.mode as c_int,
        )
    })
}

/// Sets the gradients of `params` to none, as `zero_grad(set_to_none=True)`
/// (`tdc_zero_grad`).
///
/// # Errors
/// libtorch's text.
pub(crate) fn zero_grad(params: &TensorArray<'_>) -> Result<(), TorchText> {
    params.assert_complete(params.len(), "the parameters");
    // SAFETY: `params` holds `count()` tensors borrowed for the call.
    check_text(unsafe { sys::tdc_zero_grad(params.as_ptr(), params.count()) })
}

/// The per-parameter state in a libtorch optimizer archive
/// (`tdc_optimizer_archive_state`): for an optimizer of `kind` (0 SGD, 1 Adam, 2
/// AdamW, 3 RMSprop) over `params`, parameter `i` in group `groups[i]`, read from
/// `data`. Returns four state tensors per parameter (`None` where absent), in order,
/// and each parameter's step count (-1 without state).
///
/// # Errors
/// libtorch's text when the archive cannot be read.
pub(crate) fn archive_state(
    kind: c_int,
    params: &TensorArray<'_>,
    groups: &[i64],
    data: &[u8],
) -> Result<(Vec<Option<Tensor>>, Vec<i64>), TorchText> {
    let n = params.len();
    params.assert_complete(groups.len(), "the archive's parameters");
    let mut out: Vec<sys::Tensor> = vec![std::ptr::null_mut(); n * 4];
    let mut steps = vec![-1i64; n];
    // SAFETY: `params` holds `n` tensors borrowed for the call, `groups` `n` group
    // numbers and `data` `data.len()` bytes; `out` has room for the `4 n` pointers and
    // `steps` for the `n` counts the shim writes.
    let status = unsafe {
        sys::tdc_optimizer_archive_state(
            kind,
            params.as_ptr(),
            groups.as_ptr(),
            params.count(),
            data.as_ptr(),
            data.len(),
            out.as_mut_ptr(),
            steps.as_mut_ptr(),
        )
    };
    // The tensors the shim handed out are Rust's, whatever the status.
    // SAFETY: `out` holds NULL or `torch::Tensor*`s the shim allocated for the caller,
    // each taken once here.
    let out = unsafe { take_all(out) };
    check_text(status)?;
    Ok((out, steps))
}

/// The gradient accumulators of an optimizer's parameters, held from when they joined
/// it (`tdc_accumulators*`), so that a replaced one shows: libtorch's `set_data` with
/// another dtype or device gives a variable a new accumulator, which has none of the
/// hooks (DDP's Reducer's, the sharding's) on the one it had. Owned; freed when
/// dropped.
pub(crate) struct GradAccumulators {
    raw: NonNull<sys::Accumulators>,
}

// SAFETY: a `tdc_accumulators` is a vector of autograd's shared pointers (atomic
// counts), which no other object points into; it is read and written only through
// this owner, so moving the owner to another thread moves all access with it.
unsafe impl Send for GradAccumulators {}

impl GradAccumulators {
    /// None held yet (`tdc_accumulators_new`).
    ///
    /// # Errors
    /// libtorch's text (out of memory).
    pub(crate) fn new() -> Result<Self, TorchText> {
        // SAFETY: no arguments; the handle returned is owned here (freed in `drop`).
        let raw = check_ptr(unsafe { sys::tdc_accumulators_new() })?;
        Ok(GradAccumulators { raw })
    }

    /// Holds the accumulators of `params`, the parameters that join now, after those
    /// added before (`tdc_accumulators_add`): autograd's own, made if it had none yet;
    /// none for a parameter that does not require a gradient.
    ///
    /// # Errors
    /// libtorch's text.
    pub(crate) fn add(&mut self, params: &TensorArray<'_>) -> Result<(), TorchText> {
        params.assert_complete(params.len(), "the parameters");
        // SAFETY: `self.raw` is live and owned; `params` holds `count()` tensors
        // borrowed for the call.
        check_text(unsafe {
            sys::tdc_accumulators_add(self.raw.as_ptr(), params.as_ptr(), params.count())
        })
    }

    /// The first of `params` (every parameter added, in the order added) whose
    /// gradient accumulator is no longer the one held, if any
    /// (`tdc_accumulators_changed`).
    ///
    /// # Errors
    /// libtorch's text; one that names both counts when `params` is not as long as the
    /// parameters added.
    pub(crate) fn first_changed(
        &self,
        params: &TensorArray<'_>,
    ) -> Result<Option<usize>, TorchText> {
        params.assert_complete(params.len(), "the parameters");
        let mut first: c_int = -1;
        // SAFETY: `self.raw` is live; `params` holds `count()` tensors borrowed for the
        // call (the shim reads no more than it holds, and fails on another count);
        // `first` is a live `int`.
        check_text(unsafe {
            sys::tdc_accumulators_changed(
                self.raw.as_ptr(),
                params.as_ptr(),
                params.count(),
                &mut first,
            )
        })?;
        Ok(usize::try_from(first).ok())
    }
}

impl Drop for GradAccumulators {
    fn drop(&mut self) {
        // SAFETY: the handle owns the accumulators, which no one uses after this.
        unsafe { sys::tdc_accumulators_free(self.raw.as_ptr()) }
    }
}
