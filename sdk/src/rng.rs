//! libtorch's default random generators: their state (for checkpoints) and
//! [`AgreedSeed`], which makes every rank draw the same numbers for a while.

use tch::{Device, Tensor};

use crate::error::{Error, Result};
use crate::{ffi, init};

/// The generators a rank's random state covers: the CPU's, and its CUDA device's
/// when it computes on one. Named as in a checkpoint's rank file.
pub(crate) fn generators(device: Device) -> Vec<(&'static str, i32)> {
    let mut gens = vec![("cpu", -1)];
    if let Device::Cuda(index) = device {
        gens.push(("cuda", index as i32));
    }
    gens
}

/// The state of the CPU's (`cuda_index < 0`) or CUDA device `cuda_index`'s default
/// generator, as `torch.get_rng_state()`.
pub(crate) fn rng_state(cuda_index: i32) -> Result<Tensor> {
    let mut out: ffi::Tensor = std::ptr::null_mut();
    ffi::check(unsafe { ffi::tdc_rng_state(cuda_index, &mut out) }).map_err(Error::Torch)?;
    Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
}

/// Restores a state from [`rng_state`], as `torch.set_rng_state()`.
pub(crate) fn set_rng_state(cuda_index: i32, state: &Tensor) -> Result<()> {
    ffi::check(unsafe { ffi::tdc_set_rng_state(cuda_index, ffi::tensor(state)) })
        .map_err(Error::Torch)
}

/// While it lives, every rank draws the same random numbers from libtorch's default
/// generators (the CPU's and this rank's CUDA device's), whatever each rank drew
/// before: they are seeded from the job's seed ([`Context::seed`](crate::Context::seed),
/// agreed at rendezvous) and `key`. When it is dropped, each generator returns to the
/// state it had, so the rank's own random numbers (dropout, sampling) go on as if
/// nothing had been drawn.
///
/// It is what makes a shuffle agree on every rank without hoping that the ranks'
/// generators stayed in step, as PyTorch's `DistributedSampler` seeds its own
/// generator with `seed + epoch`. `#[distributed]` puts one around the iterator
/// expression of every `for` loop it shards (keyed by the loop and how many times it
/// started), so `data.iter_shuffle(…)` or `Iter2::new(…).shuffle()` in the loop's head
/// draws the same permutation on every rank. With a world of one process, or outside
/// a job, it does nothing: a single process draws exactly what it draws without it.
///
/// ```no_run
/// # fn main() -> anyhow::Result<()> {
/// let data = tch::data::TextData::new("input.txt")?;
/// let _ctx = tch_distributed::init()?;
/// for epoch in 0..10u64 {
///     let batches = {
///         let _agreed = tch_distributed::AgreedSeed::enter(epoch)?;
///         data.iter_shuffle(65, 32) // the same permutation on every rank
///     };
///     for batch in tch_distributed::shard(batches) {
/// #       let _ = batch;
///     }
/// }
/// # Ok(()) }
/// ```
///
/// Every rank must use the same keys in the same places; different keys give
/// independent streams. Errors: [`Error::Torch`] when a generator's state cannot be
/// read or set.
#[must_use = "the generators agree only while the guard lives"]
pub struct AgreedSeed {
    /// Each seeded generator and its state before.
    saved: Vec<(i32, Tensor)>,
}

impl AgreedSeed {
    /// Seeds the generators from the job's seed and `key`; see [`AgreedSeed`].
    pub fn enter(key: u64) -> Result<AgreedSeed> {
        let Some(ctx) = init::current().filter(|c| c.world_size() > 1) else {
            return Ok(AgreedSeed { saved: Vec::new() });
        };
        let seed = mix(ctx.seed() ^ mix(key));
        let mut saved = Vec::new();
        for (_, index) in generators(ctx.device()) {
            saved.push((index, rng_state(index)?));
            ffi::check(unsafe { ffi::tdc_seed_rng(index, seed) }).map_err(Error::Torch)?;
        }
        Ok(AgreedSeed { saved })
    }
}

impl Drop for AgreedSeed {
    fn drop(&mut self) {
        for (index, state) in self.saved.drain(..) {
            if let Err(e) = set_rng_state(index, &state) {
                crate::log::warn(format_args!(
                    "could not restore the random generator's state: {e}"
                ));
            }
        }
    }
}

/// SplitMix64's finalizer: spreads nearby keys (loop 0 run 1, loop 0 run 2) far apart.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
