//! `DistributedSampler`, as PyTorch's.

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::init;

/// Which samples each rank reads in an epoch, as PyTorch's
/// `torch.utils.data.distributed.DistributedSampler`, with the same arithmetic and the
/// same permutation:
///
/// - with `shuffle` (the default), the epoch's order is
///   `torch.randperm(len, generator=torch.Generator().manual_seed(seed + epoch))`,
///   drawn from a generator of its own (the global ones are not touched), so it is the
///   same on every rank, differs between epochs ([`set_epoch`](Self::set_epoch)) and
///   repeats for the same seed;
/// - without `drop_last` (the default) the order is padded to a multiple of
///   `world_size` by repeating its first indices, so every rank gets
///   `ceil(len / world_size)` samples; with `drop_last` the tail is dropped instead and
///   every rank gets `floor(len / world_size)`;
/// - rank `r` takes positions `r, r + world_size, …` (`indices[rank::world_size]`).
///
/// It differs from PyTorch's only in taking the dataset's length rather than the
/// dataset, and in rejecting an empty dataset (PyTorch's pads with nothing and fails
/// later, in the first `next`).
#[derive(Clone, Debug)]
pub struct DistributedSampler {
    len: usize,
    rank: usize,
    world_size: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
}

impl DistributedSampler {
    /// A sampler over `len` samples for `rank` of `world_size` ranks, shuffled with
    /// seed 0, padded, at epoch 0.
    ///
    /// # Errors
    /// [`Error::Usage`] when `world_size` is 0 or `rank >= world_size`,
    /// with [`Error::InvalidInput`] when `len` is 0.
    pub fn new(len: usize, rank: usize, world_size: usize) -> Result<Self> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::Usage(format!(
                "DistributedSampler: rank {rank} is not in a world of {world_size} ranks: \
                 pass the rank and world size of the process group (tch_distributed::current())"
            )));
        }
        if len == 0 {
            return Err(Error::InvalidInput(
                "DistributedSampler: the dataset is empty: check the data path".into(),
            ));
        }
        Ok(DistributedSampler {
            len,
            rank,
            world_size,
            shuffle: true,
            seed: 0,
            drop_last: false,
            epoch: 0,
        })
    }

    /// [`new`](Self::new) for this process's rank in the current job (rank 0 of 1 when
    /// there is none).
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn for_current_rank(len: usize) -> Result<Self> {
        let (rank, world_size) = init::rank_and_world_size();
        Self::new(len, rank, world_size)
    }

    /// Whether to shuffle every epoch (default `true`).
    pub fn shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// The seed of the shuffle, the same on every rank (default 0).
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Drop the tail that does not divide by the world size instead of padding
    /// (default `false`).
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Sets the epoch: the shuffle of epoch `e` uses seed `seed + e`. Call it at the
    /// start of every epoch, as with PyTorch's `set_epoch`, or every epoch repeats the
    /// same order.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Samples per rank and epoch: `ceil(len / world_size)`, or with `drop_last`
    /// `floor(len / world_size)` (PyTorch's `num_samples`).
    pub fn num_samples(&self) -> usize {
        if self.drop_last {
            self.len / self.world_size
        } else {
            self.len.div_ceil(self.world_size)
        }
    }

    /// Samples per epoch over all ranks, padding included (PyTorch's `total_size`).
    pub fn total_size(&self) -> usize {
        self.num_samples() * self.world_size
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The dataset's length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always `false`: an empty dataset is rejected by [`new`](Self::new).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The whole epoch's order over all ranks, padded or cut to
    /// [`total_size`](Self::total_size).
    fn epoch_order(&self) -> Result<Vec<usize>> {
        let mut order: Vec<usize> = if self.shuffle {
            let perm = Tensor::empty([self.len as i64], (Kind::Int64, Device::Cpu));
            crate::ffi::random::randperm(
                self.len as i64,
                self.seed.wrapping_add(self.epoch),
                &perm,
            )
            .map_err(|e| Error::Torch(format!("DistributedSampler's shuffle: {e}")))?;
            Vec::<i64>::try_from(&perm)?
                .into_iter()
                .map(|i| i as usize)
                .collect()
        } else {
            (0..self.len).collect()
        };
        let total = self.total_size();
        if total <= order.len() {
            order.truncate(total);
        } else {
            let padding: Vec<usize> = order
                .iter()
                .copied()
                .cycle()
                .take(total - order.len())
                .collect();
            order.extend(padding);
        }
        Ok(order)
    }

    /// This rank's sample indices for the current epoch, in order:
    /// [`num_samples`](Self::num_samples) of them.
    ///
    /// # Errors
    /// [`Error::Torch`] only if libtorch fails to draw the permutation.
    pub fn indices(&self) -> Result<Vec<usize>> {
        Ok(self
            .epoch_order()?
            .into_iter()
            .skip(self.rank)
            .step_by(self.world_size)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::DistributedSampler;
    use std::collections::BTreeSet;

    fn all_ranks(
        len: usize,
        world: usize,
        f: impl Fn(DistributedSampler) -> DistributedSampler,
    ) -> Vec<Vec<usize>> {
        (0..world)
            .map(|rank| {
                f(DistributedSampler::new(len, rank, world).unwrap())
                    .indices()
                    .unwrap()
            })
            .collect()
    }

    #[test]
    fn sampler_covers_the_dataset_plus_exactly_the_padding() {
        for world in 1..=4 {
            for len in [1, 2, 5, 7, 10, 13] {
                let shards = all_ranks(len, world, |s| s.seed(3));
                let per_rank = len.div_ceil(world);
                assert!(shards.iter().all(|s| s.len() == per_rank));
                let all: Vec<usize> = shards.concat();
                let distinct: BTreeSet<usize> = all.iter().copied().collect();
                assert_eq!(distinct, (0..len).collect(), "len {len}, world {world}");
                assert_eq!(
                    all.len() - len,
                    per_rank * world - len,
                    "only the padding repeats"
                );

                let shards = all_ranks(len, world, |s| s.drop_last(true));
                let all: Vec<usize> = shards.concat();
                let distinct: BTreeSet<usize> = all.iter().copied().collect();
                assert_eq!(all.len(), distinct.len(), "drop_last: disjoint");
                assert_eq!(all.len(), len / world * world);
            }
        }
    }

    #[test]
    fn sampler_shuffles_alike_on_every_rank_differently_every_epoch() {
        let order = |epoch, seed| {
            let shards = all_ranks(100, 4, |mut s| {
                s.set_epoch(epoch);
                s.seed(seed)
            });
            // Interleave the ranks back into the epoch's order.
            (0..25)
                .flat_map(|i| shards.iter().map(move |s| s[i]))
                .collect::<Vec<_>>()
        };
        assert_eq!(order(0, 1), order(0, 1), "the same seed repeats");
        assert_ne!(order(0, 1), order(1, 1), "epochs differ");
        assert_eq!(order(1, 1), order(0, 2), "epoch e uses seed + e");
        let mut sorted = order(2, 5);
        sorted.sort();
        assert_eq!(
            sorted,
            (0..100).collect::<Vec<_>>(),
            "one permutation across the ranks"
        );
        let plain = all_ranks(6, 2, |s| s.shuffle(false));
        assert_eq!(plain, vec![vec![0, 2, 4], vec![1, 3, 5]]);
    }

    #[test]
    fn sampler_rejects_bad_input() {
        assert!(DistributedSampler::new(10, 2, 2).is_err());
        assert!(DistributedSampler::new(10, 0, 0).is_err());
        let e = DistributedSampler::new(0, 0, 1).unwrap_err().to_string();
        assert!(e.contains("empty"), "{e}");
    }
}
