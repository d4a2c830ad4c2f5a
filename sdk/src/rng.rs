//! [`AgreedSeed`], which makes every rank draw the same numbers from libtorch's default
//! random generators for a while (their state itself: `random_state`).

use tch::Tensor;

use crate::error::{Error, Result};
use crate::random_state::{generators, rng_state, set_rng_state};
use crate::{ffi, init};

// The macro's runtime names these here.
pub(crate) use crate::random_state::{current_seed, mix};

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
/// expression of every `for` loop it shards (seeded from the loop, how many times it
/// started and libtorch's current seed), so `data.iter_shuffle(…)` or
/// `Iter2::new(…).shuffle()` in the loop's head draws the same permutation on every rank. With a world of one process, or outside
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
    ///
    /// # Errors
    /// [`Error::Torch`] when libtorch cannot seed a generator.
    pub fn enter(key: u64) -> Result<AgreedSeed> {
        match init::current() {
            Some(ctx) => Self::seeded(mix(ctx.seed() ^ mix(key))),
            None => Self::seeded(0),
        }
    }

    /// Seeds the generators with `seed`, which the caller made the same on every rank.
    pub(crate) fn seeded(seed: u64) -> Result<AgreedSeed> {
        let Some(ctx) = init::current().filter(|c| c.world_size() > 1) else {
            return Ok(AgreedSeed { saved: Vec::new() });
        };
        let mut saved = Vec::new();
        for (_, index) in generators(ctx.device()) {
            saved.push((index, rng_state(index)?));
            ffi::random::seed_rng(index, seed).map_err(Error::Torch)?;
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
