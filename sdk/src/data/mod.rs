//! Splitting data across ranks: the sampler, datasets, the loader, and `shard` for
//! tch's own iterators.

use tch::Tensor;

use crate::error::{Error, Result};
use crate::init;
use crate::loop_position::LoopPosition;
use crate::observe::progress_bar::Progress;
use crate::process_group::ReduceOp;

mod batch_size;
mod dataset;
mod executable_batch_size;
mod loader;
mod sampler;
mod split;

pub use batch_size::{global_batch_size, per_rank_batch_size, LrScaling};
pub use dataset::{Batch, Dataset, TensorDataset, TextDataset};
pub use executable_batch_size::find_executable_batch_size;
pub use loader::{Batches, DataLoader, LoaderPosition};
pub use sampler::DistributedSampler;
pub use split::{split_between_processes, split_between_processes_padded, Gatherable, Splittable};

/// Deals the batches of `batches` across the ranks of the current job; see
/// [`Sharded`]. `#[distributed]` wraps the `for` loops over tch's data iterators in it.
///
/// ```no_run
/// # fn main() -> anyhow::Result<()> {
/// let data = tch::data::TextData::new("input.txt")?;
/// let _ctx = tch_distributed::init()?;
/// for batch in tch_distributed::shard(data.iter_shuffle(65, 32)) {
///     // this rank's batches: [32, 65] each
/// #   let _ = batch;
/// }
/// # Ok(()) }
/// ```
pub fn shard<I: IntoIterator>(batches: I) -> Sharded<I::IntoIter> {
    Sharded::new(batches.into_iter()).with_progress(None)
}

/// An iterator split across ranks, batch by batch, as Accelerate's `even_batches`
/// data loader: batches are dealt round-robin (rank `r` gets batches `r`,
/// `r + world_size`, …), and a final incomplete round is completed with the first
/// batches of the epoch, so every rank yields `ceil(batches / world_size)` batches
/// and no rank waits on a collective that the others never reach. The shards are
/// disjoint except for those `world_size - batches % world_size` repeated batches,
/// and together they cover the epoch. Every rank must see the same sequence of
/// batches: the same data, shuffled the same way. `#[distributed]` draws the shuffle
/// in a sharded loop's head under an [`AgreedSeed`](crate::AgreedSeed); with this
/// function, draw it under one yourself (or use the [`DataLoader`](crate::DataLoader),
/// whose sampler is seeded explicitly).
///
/// It reads one batch ahead, to know which of its batches is the epoch's last: there
/// an [`Optimizer`](crate::Optimizer) accumulating gradients ends its cycle early.
pub struct Sharded<I: Iterator> {
    inner: std::iter::Peekable<I>,
    rank: usize,
    world_size: usize,
    /// The first batches of the epoch (at most `rank` of them, all dealt to lower
    /// ranks), kept to complete a final incomplete round.
    first: Vec<I::Item>,
    /// How many batches `inner` has yielded.
    seen: usize,
    done: bool,
    /// What the loop yields, for `TCH_DISTRIBUTED_RECORD`.
    recording: Option<crate::record::Recording<I::Item>>,
    /// Rank 0's bar for this loop.
    progress: Progress,
    /// How many batches this rank's loop has had.
    steps: usize,
    /// For a loop that `#[distributed]` shards because it trains: the count of
    /// gradient averages when it started (see [`Sharded::watching`]).
    watch: Option<(crate::ProcessGroup, u64)>,
    /// For a loop that `#[distributed]` sharded: the run's record of where it stands,
    /// the loop's site and run, and the batches skipped at its start (see
    /// [`Sharded::positioned`]).
    position: Option<(init::Context, LoopPosition)>,
}

impl<I: Iterator> Sharded<I> {
    /// Shards `inner` for this process's rank in the current job (a world of one,
    /// where nothing is dropped or repeated, when there is none).
    pub fn new(inner: I) -> Self {
        let (rank, world_size) = init::rank_and_world_size();
        Self::for_rank(inner, rank, world_size)
    }

    /// Shards `inner` for `rank` of `world_size` ranks.
    pub fn for_rank(inner: I, rank: usize, world_size: usize) -> Self {
        Sharded {
            inner: inner.peekable(),
            rank,
            world_size,
            first: Vec::new(),
            seen: 0,
            done: false,
            recording: None,
            progress: Progress::none(),
            steps: 0,
            watch: None,
            position: None,
        }
    }

    /// Makes this loop run `run` of loop `site`, starting past the run's first `skip`
    /// batches (of all ranks together: dealt before a checkpoint that the run
    /// resumes), and keeps the run's record of where it stands
    /// ([`Context::loops`](init::Context::loops)), which checkpoints save. The skipped
    /// batches are drawn from the iterator and dropped; those among the epoch's first
    /// ones that a final incomplete round reuses are kept for it, as in a run that
    /// did not stop.
    pub(crate) fn positioned(mut self, site: u64, run: u64, skip: u64) -> Self {
        for _ in 0..skip {
            let Some(item) = self.inner.next() else {
                break;
            };
            self.passed(item);
        }
        if let Some(ctx) = init::current() {
            let position = LoopPosition {
                site,
                run,
                batches: self.seen as u64,
            };
            ctx.loops().update(position);
            self.position = Some((ctx, position));
        }
        self
    }

    /// Says on rank 0, when the loop ends (or is left), if it had batches on several
    /// ranks but no gradient was averaged over the ranks meanwhile: `#[distributed]`
    /// sharded it as a training loop, and its optimizer steps where the attribute
    /// cannot see it (a method or helper that steps an optimizer), so the ranks train
    /// apart; or it only evaluates, and each rank saw its share of the data.
    pub(crate) fn watching(mut self) -> Self {
        if let Some(ctx) = init::current().filter(|c| c.world_size() > 1) {
            let group = ctx.process_group().clone();
            let start = group.gradient_averages();
            self.watch = Some((group, start));
        }
        self
    }

    /// Shows rank 0's progress bar for this loop (see [`crate::PROGRESS_ENV`]), as
    /// epoch `epoch` when known. Its length is this rank's share of the batches,
    /// `ceil(batches / world_size)`, when `inner` knows how many it yields
    /// (`size_hint`); tch's `Iter2` and `TextDataIter` do not say, and the bar then
    /// counts steps without a total.
    pub(crate) fn with_progress(mut self, epoch: Option<u64>) -> Self {
        let steps = match self.inner.size_hint() {
            (low, Some(high)) if low == high => Some(low.div_ceil(self.world_size) as u64),
            _ => None,
        };
        self.progress = Progress::start(epoch, steps, 0);
        self
    }

    /// Records the rows this rank gets, when `TCH_DISTRIBUTED_RECORD` asks for it.
    pub(crate) fn recording(
        mut self,
        recording: Option<crate::record::Recording<I::Item>>,
    ) -> Self {
        self.recording = recording;
        self
    }

    /// Checks, with one all-reduce, that every rank's loop starts with the same batch
    /// (`samples` fingerprints a batch): the same data, shuffled the same way. Ranks
    /// that would deal different sequences get an error, all of them, instead of
    /// training on overlapping shards in silence.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when the first batches differ, [`Error::Collective`]
    /// when the all-reduce fails.
    pub(crate) fn check_same_start(mut self, samples: fn(&I::Item) -> Vec<u64>) -> Result<Self> {
        let Some(ctx) = init::current().filter(|c| c.world_size() > 1) else {
            return Ok(self);
        };
        let first = self.inner.peek().map(samples).unwrap_or_default();
        let mine = first.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, f| {
            crate::random_state::mix(h ^ f)
        }) as i64;
        // max(x) and max(!x) = !min(x): every rank learns whether all are equal.
        let mut extremes = Tensor::from_slice(&[mine, !mine]).to_device(ctx.device());
        ctx.process_group()
            .all_reduce(&mut extremes, ReduceOp::Max)?;
        let extremes = Vec::<i64>::try_from(extremes.to_device(tch::Device::Cpu))?;
        if extremes[0] != !extremes[1] {
            return Err(Error::InvalidInput(
                "the ranks' first batches differ at the start of a sharded loop: each rank would deal \
                 from a differently shuffled (or a different) dataset, and the shards would overlap. \
                 Build the same data on every rank, draw the shuffle in the loop's head \
                 (`for b in data.iter_shuffle(…)`, `for b in Iter2::new(…).shuffle()`), and seed \
                 libtorch alike on every rank (a `tch::manual_seed` that depends on the rank makes \
                 the shuffles differ)"
                    .into(),
            ));
        }
        Ok(self)
    }

    /// The loop's end: no batch follows, and the bar is finished; a resumed run of
    /// the loop starts its next run.
    fn end(&mut self) -> Option<I::Item> {
        if let Some((ctx, position)) = self.position.take() {
            ctx.loops().update(LoopPosition {
                run: position.run + 1,
                batches: 0,
                ..position
            });
        }
        crate::optim::set_end_of_data(false);
        self.progress = Progress::none();
        None
    }

    fn yielded(&mut self, item: I::Item) -> Option<I::Item> {
        self.steps += 1;
        if let Some((ctx, position)) = &mut self.position {
            // Every rank has dealt its batch of this round: a round of the world.
            position.batches += self.world_size as u64;
            ctx.loops().update(*position);
        }
        self.progress.handed_out();
        if let Some(r) = &mut self.recording {
            r.add(&item);
        }
        Some(item)
    }
}

impl<I: Iterator> Iterator for Sharded<I> {
    type Item = I::Item;
    fn next(&mut self) -> Option<I::Item> {
        if self.done {
            return self.end();
        }
        let mut got = 0;
        for i in 0..self.world_size {
            let Some(item) = self.inner.next() else {
                break;
            };
            got += 1;
            if i == self.rank {
                self.seen += 1;
                self.skip_rest(i);
                return self.yielded(item);
            }
            self.passed(item);
        }
        self.done = true;
        if got == 0 || self.first.is_empty() {
            // The epoch ended on a round boundary (or was empty).
            return self.end();
        }
        // An incomplete round: this rank takes one of the epoch's first batches,
        // as the ranks after the last real batch do in turn.
        let k = (self.rank - got) % self.seen;
        crate::optim::set_end_of_data(true);
        let item = self.first.swap_remove(k);
        self.yielded(item)
    }
}

impl<I: Iterator> Drop for Sharded<I> {
    fn drop(&mut self) {
        crate::optim::set_end_of_data(false);
        let unaveraged = self
            .watch
            .as_ref()
            .is_some_and(|(group, start)| self.steps > 0 && group.gradient_averages() == *start);
        // Once a process: every epoch's loop would say it again.
        static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if unaveraged
            && self.rank == 0
            && !std::thread::panicking()
            && !SAID.swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            crate::log::warn(format!(
                "warning: a training loop that #[distributed] sharded ran {} steps on each of \
                 {} ranks and averaged no gradients over them: the optimizer steps where the \
                 attribute cannot see it (a method or helper that steps it, or an optimizer \
                 that is not tch's or the SDK's), so each rank trains on its own. Put the \
                 attribute on the `impl` block instead (`#[distributed] impl Trainer {{ … }}`): \
                 it adapts every method, the one that steps the optimizer too. Or step the \
                 optimizer in the #[distributed] function itself (`self.opt.backward_step(&loss)` \
                 in `fn fit(&mut self)`), or build it there with `.build(&vs, lr)`. A loop that \
                 only evaluates was sharded because it calls a method on `self`: each rank saw \
                 1/{} of the data",
                self.steps, self.world_size, self.world_size
            ));
        }
        if let Some(r) = self.recording.take() {
            r.finish();
        }
    }
}

impl<I: Iterator> Sharded<I> {
    /// Counts a batch that another rank takes (or that a resumed loop skips), keeping
    /// it if it is one of the epoch's first `rank` batches, which a final incomplete
    /// round reuses.
    fn passed(&mut self, item: I::Item) {
        self.seen += 1;
        if self.seen <= self.rank {
            self.first.push(item);
        }
    }

    /// Consumes the rest of the round after this rank's batch at position `i`.
    fn skip_rest(&mut self, i: usize) {
        for _ in i + 1..self.world_size {
            if self.inner.next().is_none() {
                break;
            }
            self.seen += 1;
        }
        crate::optim::set_end_of_data(self.inner.peek().is_none());
    }
}

#[cfg(test)]
mod tests {
    use super::Sharded;

    #[test]
    fn shards_are_even_disjoint_but_for_padding_and_cover_the_epoch() {
        for world in 1..=5 {
            for batches in 0..13usize {
                let per_rank = batches.div_ceil(world);
                let mut all = Vec::new();
                for rank in 0..world {
                    let mine: Vec<usize> = Sharded::for_rank(0..batches, rank, world).collect();
                    assert_eq!(
                        mine.len(),
                        per_rank,
                        "world {world}, {batches} batches, rank {rank}"
                    );
                    // Round-robin until the data runs out.
                    for (j, b) in mine.iter().enumerate() {
                        if rank + j * world < batches {
                            assert_eq!(*b, rank + j * world);
                        }
                    }
                    all.extend(mine);
                }
                all.sort();
                let mut distinct = all.clone();
                distinct.dedup();
                assert_eq!(
                    distinct,
                    (0..batches).collect::<Vec<_>>(),
                    "cover the epoch"
                );
                assert_eq!(
                    all.len() - distinct.len(),
                    per_rank * world - batches,
                    "padding only"
                );
            }
        }
    }
}
