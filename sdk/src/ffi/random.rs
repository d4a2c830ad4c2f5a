//! libtorch's random generators (`shim.cpp`): the default generators' state and seed,
//! and `randperm` with a generator of its own.

use std::ffi::c_int;

use tch::Tensor;

use super::check;
use super::sys;
use super::tensor::{ptr, take};

/// The state of the CPU's (`cuda_index < 0`) or CUDA device `cuda_index`'s default
/// generator, as a new uint8 tensor (`tdc_rng_state`).
///
/// # Errors
/// libtorch's message.
pub(crate) fn rng_state(cuda_index: c_int) -> Result<Tensor, String> {
    let mut out: sys::Tensor = std::ptr::null_mut();
    // SAFETY: `out` is a pointer the shim writes.
    check(unsafe { sys::tdc_rng_state(cuda_index, &mut out) })?;
    if out.is_null() {
        return Err("the c10d shim handed over no generator state".into());
    }
    // SAFETY: on success the shim stored a `torch::Tensor*` it allocated for the caller,
    // taken once here.
    Ok(unsafe { take(out) })
}

/// Sets a default generator's state from one that [`rng_state`] returned
/// (`tdc_set_rng_state`).
///
/// # Errors
/// libtorch's message (a state of another generator).
pub(crate) fn set_rng_state(cuda_index: c_int, state: &Tensor) -> Result<(), String> {
    // SAFETY: `state` is a tensor borrowed for the call.
    check(unsafe { sys::tdc_set_rng_state(cuda_index, ptr(state)) })
}

/// The seed a default generator was last seeded with (`tdc_rng_current_seed`).
///
/// # Errors
/// libtorch's message.
pub(crate) fn current_seed(cuda_index: c_int) -> Result<u64, String> {
    let mut seed = 0;
    // SAFETY: `seed` is a `u64` the shim writes.
    check(unsafe { sys::tdc_rng_current_seed(cuda_index, &mut seed) })?;
    Ok(seed)
}

/// Seeds a default generator, as `torch.Generator.manual_seed` (`tdc_seed_rng`).
///
/// # Errors
/// libtorch's message.
pub(crate) fn seed_rng(cuda_index: c_int, seed: u64) -> Result<(), String> {
    // SAFETY: plain values.
    check(unsafe { sys::tdc_seed_rng(cuda_index, seed) })
}

/// Writes into `out` (int64, `n` elements) the permutation of `0..n` that PyTorch's
/// `torch.randperm(n, generator=torch.Generator().manual_seed(seed))` draws
/// (`tdc_randperm`).
///
/// # Errors
/// libtorch's message (an `out` of another size or dtype among them).
pub(crate) fn randperm(n: i64, seed: u64, out: &Tensor) -> Result<(), String> {
    // SAFETY: `out` is a tensor borrowed for the call; the shim copies into it with
    // `copy_`, which checks its size.
    check(unsafe { sys::tdc_randperm(n, seed, ptr(out)) })
}
