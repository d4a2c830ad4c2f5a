//! Mixed precision's calls into libtorch (`shim.cpp`): autocast's state, the
//! gradients' unscaling, oneDNN's switch, and a CUDA device's compute capability.

use std::ffi::c_int;

use tch::Tensor;

use super::check;
use super::sys;
use super::tensor::{ptr, TensorArray};

/// Autocast's setting for one device type, as [`autocast_enter`] returns the previous
/// one for [`autocast_exit`] to restore.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AutocastState {
    enabled: c_int,
    dtype: c_int,
}

/// Turns autocast on for `device_type` (0 CPU, 1 CUDA) to `dtype` (a
/// `c10::ScalarType` code) and enters a nesting level (`tdc_autocast_enter`); returns
/// the previous setting.
///
/// # Errors
/// libtorch's message.
pub(crate) fn autocast_enter(device_type: c_int, dtype: c_int) -> Result<AutocastState, String> {
    let (mut enabled, mut prev) = (0, 0);
    // SAFETY: plain values, and two ints the shim writes.
    check(unsafe { sys::tdc_autocast_enter(device_type, dtype, &mut enabled, &mut prev) })?;
    Ok(AutocastState {
        enabled,
        dtype: prev,
    })
}

/// Leaves a nesting level and restores `previous` for `device_type`
/// (`tdc_autocast_exit`); leaving the outermost level clears the cast cache.
///
/// # Errors
/// libtorch's message.
pub(crate) fn autocast_exit(device_type: c_int, previous: AutocastState) -> Result<(), String> {
    // SAFETY: plain values.
    check(unsafe { sys::tdc_autocast_exit(device_type, previous.enabled, previous.dtype) })
}

/// Turns libtorch's use of oneDNN on or off for the process
/// (`tdc_set_onednn_enabled`).
///
/// # Errors
/// libtorch's message.
pub(crate) fn set_onednn_enabled(enabled: bool) -> Result<(), String> {
    // SAFETY: a plain value.
    check(unsafe { sys::tdc_set_onednn_enabled(c_int::from(enabled)) })
}

/// The compute capability (major, minor) of CUDA device `device`
/// (`tdc_cuda_capability`).
///
/// # Errors
/// libtorch's message (a build without CUDA, a device that does not exist).
pub(crate) fn cuda_capability(device: c_int) -> Result<(i32, i32), String> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: a plain value, and two ints the shim writes.
    check(unsafe { sys::tdc_cuda_capability(device, &mut major, &mut minor) })?;
    Ok((major, minor))
}

/// Multiplies `grads` (one device and dtype) by `inv_scale` in place and sets
/// `found_inf` to 1 when one holds an inf or NaN (`tdc_amp_unscale`, ATen's
/// `_amp_foreach_non_finite_check_and_unscale_`).
///
/// # Errors
/// libtorch's message.
pub(crate) fn unscale(
    grads: &TensorArray<'_>,
    found_inf: &Tensor,
    inv_scale: &Tensor,
) -> Result<(), String> {
    grads.assert_complete(grads.len(), "the gradients");
    // SAFETY: `grads` holds `count()` tensors, and `found_inf` and `inv_scale` are
    // tensors, all borrowed for the call.
    check(unsafe {
        sys::tdc_amp_unscale(
            grads.as_ptr(),
            grads.count(),
            ptr(found_inf),
            ptr(inv_scale),
        )
    })
}
