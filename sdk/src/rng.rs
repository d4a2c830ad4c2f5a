//! libtorch's default random generators: their state (for checkpoints) and
//! [`AgreedSeed`], which makes every rank draw the same numbers for a while.

use tch::{Device, Tensor};

use crate::error::{Error, Result};
use crate::rendezvous::store::Store;
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

/// The seed the CPU's (`cuda_index < 0`) or a CUDA device's default generator was last
/// seeded with (`tch::manual_seed`, or a state set since), as `torch.initial_seed()`;
/// drawing numbers does not change it.
pub(crate) fn current_seed(cuda_index: i32) -> Result<u64> {
    let mut seed = 0;
    ffi::check(unsafe { ffi::tdc_rng_current_seed(cuda_index, &mut seed) })
        .map_err(Error::Torch)?;
    Ok(seed)
}

/// Restores a state from [`rng_state`], as `torch.set_rng_state()`.
pub(crate) fn set_rng_state(cuda_index: i32, state: &Tensor) -> Result<()> {
    ffi::check(unsafe { ffi::tdc_set_rng_state(cuda_index, ffi::tensor(state)) })
        .map_err(Error::Torch)
}

/// Rank 0's random state when the job formed, the same on every rank: each default
/// generator's state (the CPU's, and the rank's CUDA device's) and the job's seed, a
/// hash of it.
#[derive(Clone)]
pub(crate) struct RandomState {
    seed: u64,
    states: Vec<(&'static str, Vec<u8>)>,
}

impl std::fmt::Debug for RandomState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RandomState")
            .field("seed", &self.seed)
            .finish()
    }
}

impl RandomState {
    /// Rank 0 publishes its generators' states in the store, the others read them: the
    /// agreement is explicit, whatever each rank's generator holds. With a world of
    /// one, this process's own state (nothing is published).
    pub(crate) fn share(
        store: &Store,
        rank: usize,
        world_size: usize,
        device: Device,
    ) -> Result<Self> {
        let mut states = Vec::new();
        for (name, index) in generators(device) {
            let key = format!("tch_distributed/random_state/{name}");
            let bytes = if world_size == 1 || rank == 0 {
                let state = rng_state(index)?;
                let bytes = Vec::<u8>::try_from(&state)?;
                if world_size > 1 {
                    store.set(&key, &bytes)?;
                }
                bytes
            } else {
                store.get(&key)?
            };
            states.push((name, bytes));
        }
        let seed = fnv1a(states.iter().flat_map(|(_, b)| b.iter().copied()));
        Ok(RandomState {
            seed: mix(seed),
            states,
        })
    }

    pub(crate) fn seed(&self) -> u64 {
        self.seed
    }

    /// Sets this rank's generators to rank 0's states, so every rank draws what rank 0
    /// draws from here on (initial weights, dropout), as if each ran rank 0's program.
    pub(crate) fn adopt(&self, device: Device) -> Result<()> {
        for (name, index) in generators(device) {
            if let Some((_, bytes)) = self.states.iter().find(|(n, _)| *n == name) {
                set_rng_state(index, &Tensor::from_slice(bytes))?;
            }
        }
        Ok(())
    }
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

/// FNV-1a, 64 bits, over `bytes`: the fingerprint the SDK uses wherever ranks or runs
/// compare bytes (checkpoint manifests, sample rows, model descriptions, random states).
pub(crate) fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// SplitMix64's finalizer: spreads nearby keys (loop 0 run 1, loop 0 run 2) far apart.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
