//! libtorch's default random generators' state: read and set (for checkpoints and
//! [`AgreedSeed`](crate::AgreedSeed)), and rank 0's, shared at rendezvous
//! ([`RandomState`]); the hashes that the SDK fingerprints bytes and seeds with.

use tch::{Device, Tensor};

use crate::error::{Error, Result};
use crate::ffi;
use crate::rendezvous::store::Store;

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
    ffi::random::rng_state(cuda_index).map_err(Error::Torch)
}

/// The seed the CPU's (`cuda_index < 0`) or a CUDA device's default generator was last
/// seeded with (`tch::manual_seed`, or a state set since), as `torch.initial_seed()`;
/// drawing numbers does not change it.
pub(crate) fn current_seed(cuda_index: i32) -> Result<u64> {
    ffi::random::current_seed(cuda_index).map_err(Error::Torch)
}

/// Restores a state from [`rng_state`], as `torch.set_rng_state()`.
pub(crate) fn set_rng_state(cuda_index: i32, state: &Tensor) -> Result<()> {
    ffi::random::set_rng_state(cuda_index, state).map_err(Error::Torch)
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

/// FNV-1a, 64 bits, over `bytes`: the fingerprint the SDK uses wherever ranks or runs
/// compare bytes (checkpoint manifests, sample rows, model descriptions, random states).
pub(crate) fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    fnv1a_from(FNV1A_START, bytes)
}

/// FNV-1a's offset basis, where [`fnv1a`] starts.
pub(crate) const FNV1A_START: u64 = 0xcbf2_9ce4_8422_2325;

/// [`fnv1a`] going on from `hash` (what the bytes before hashed to): the hash of a
/// stream, a block at a time.
pub(crate) fn fnv1a_from(hash: u64, bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes
        .into_iter()
        .fold(hash, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// SplitMix64's finalizer: spreads nearby keys (loop 0 run 1, loop 0 run 2) far apart.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
