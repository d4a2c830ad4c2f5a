//! `DataLoader`: this rank's batches, read ahead by worker threads.

use std::cell::Cell;
use std::sync::mpsc::{sync_channel, Receiver};
use std::thread::JoinHandle;

use tch::{Device, Tensor};

use super::dataset::{Batch, Dataset};
use super::sampler::DistributedSampler;
use crate::error::{Error, Result};
use crate::init;
use crate::observe::progress_bar::Progress;

/// This rank's batches of a [`Dataset`], as PyTorch's `DataLoader` over a
/// [`DistributedSampler`]: every rank gets the same number of batches
/// ([`len`](Self::len)), disjoint apart from the sampler's padding, and every epoch a
/// new shuffle that is the same on every rank.
///
/// ```no_run
/// # fn main() -> tch_distributed::Result<()> {
/// use tch_distributed::{DataLoader, TensorDataset};
/// let xs = tch::Tensor::randn([1000, 10], tch::kind::FLOAT_CPU);
/// let ys = tch::Tensor::zeros([1000], tch::kind::INT64_CPU);
/// let loader = DataLoader::new(TensorDataset::new(&xs, &ys)?, 32)?
///     .num_workers(2)
///     .to_device(tch::Device::cuda_if_available());
/// for epoch in 0..3 {
///     for batch in &loader {            // epoch 0, 1, 2: a new shuffle each time
///         let (x, y) = batch?;          // x: [32, 10] on the device
/// #       let _ = (x, y, epoch);
///     }
/// }
/// # Ok(()) }
/// ```
///
/// Each loop over the loader is one epoch: the first uses epoch 0 (or the one given to
/// [`set_epoch`](Self::set_epoch)) and each later one the next, so unlike PyTorch's
/// there is no `set_epoch` to forget.
pub struct DataLoader<D: Dataset> {
    dataset: D,
    sampler: DistributedSampler,
    batch_size: usize,
    drop_last: bool,
    num_workers: usize,
    prefetch_factor: usize,
    device: Device,
    pin_memory: bool,
    /// The epoch the next loop uses.
    next_epoch: Cell<u64>,
    /// Rows of this rank's epoch that the last batch held (start, count), for
    /// `gather_for_metrics`.
    last_batch: Cell<(usize, usize)>,
    /// Where training stands: the epoch being read and the batches of it yielded.
    position: Cell<(u64, usize)>,
    /// Batches the next loop skips (set when resuming mid-epoch).
    skip: Cell<usize>,
    /// The run's record of where its loaders stand, and this loader's number in it
    /// (the loaders of a run are numbered in the order they are made).
    slot: Option<(init::Context, usize)>,
}

pub use crate::loop_position::LoaderPosition;

impl<D: Dataset> DataLoader<D> {
    /// A loader of `batch_size` samples per rank and step over `dataset`, shuffled
    /// (seed 0), with the last smaller batch kept, no worker threads, on the CPU.
    ///
    /// In a job of several ranks this is a collective: every rank must build its
    /// loader, and the datasets' lengths are compared, so that ranks that would run a
    /// different number of steps (and hang in the first collective that only some
    /// reach) fail here instead.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when `batch_size` is 0, the dataset is empty,
    /// or the ranks' datasets differ in length; [`Error::Collective`] when comparing
    /// fails.
    pub fn new(dataset: D, batch_size: usize) -> Result<Self> {
        if batch_size == 0 {
            return Err(Error::InvalidInput(
                "DataLoader: batch_size must be at least 1".into(),
            ));
        }
        check_same_length(dataset.len())?;
        let sampler = DistributedSampler::for_current_rank(dataset.len())?;
        Ok(DataLoader {
            dataset,
            sampler,
            batch_size,
            drop_last: false,
            num_workers: 0,
            prefetch_factor: 2,
            device: Device::Cpu,
            pin_memory: true,
            next_epoch: Cell::new(0),
            last_batch: Cell::new((0, 0)),
            position: Cell::new((0, 0)),
            skip: Cell::new(0),
            slot: init::current().map(|ctx| {
                let number = ctx.loops().add_loader();
                (ctx, number)
            }),
        })
    }

    /// Whether to shuffle every epoch (default `true`), as the sampler's `shuffle`.
    pub fn shuffle(mut self, shuffle: bool) -> Self {
        self.sampler = self.sampler.shuffle(shuffle);
        self
    }

    /// The shuffle's seed, the same on every rank (default 0).
    pub fn seed(mut self, seed: u64) -> Self {
        self.sampler = self.sampler.seed(seed);
        self
    }

    /// Drop the samples that do not fill a last batch on every rank, instead of padding
    /// the epoch and keeping a smaller last batch (default `false`). Sets both
    /// PyTorch's `DistributedSampler(drop_last=…)` and `DataLoader(drop_last=…)`.
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.sampler = self.sampler.drop_last(drop_last);
        self.drop_last = drop_last;
        self
    }

    /// Worker threads that read batches ahead of the training loop (default 0: read
    /// on the loop's own thread). The batches and their order do not depend on it.
    pub fn num_workers(mut self, workers: usize) -> Self {
        self.num_workers = workers;
        self
    }

    /// Batches each worker reads ahead (default 2, as PyTorch's `prefetch_factor`);
    /// at least 1.
    pub fn prefetch_factor(mut self, batches: usize) -> Self {
        self.prefetch_factor = batches.max(1);
        self
    }

    /// Where batches are delivered (default: the CPU, where the dataset reads them).
    /// On CUDA, batches are read into pinned host memory and copied without blocking,
    /// unless [`pin_memory`](Self::pin_memory) is turned off.
    pub fn to_device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// Whether to pin host memory for copies to CUDA (default `true`; no effect on
    /// the CPU).
    pub fn pin_memory(mut self, pin: bool) -> Self {
        self.pin_memory = pin;
        self
    }

    /// Sets the epoch of the next loop (the shuffle of epoch `e` uses seed
    /// `seed + e`), e.g. when resuming from a checkpoint.
    pub fn set_epoch(&self, epoch: u64) {
        self.next_epoch.set(epoch);
    }

    /// The epoch the next loop will use.
    pub fn epoch(&self) -> u64 {
        self.next_epoch.get()
    }

    /// Where training stands, for a checkpoint: after the last batch of an epoch it
    /// is the start of the next one.
    pub fn position(&self) -> LoaderPosition {
        let (epoch, batches) = self.position.get();
        if batches >= self.len() {
            return LoaderPosition {
                epoch: epoch + 1,
                samples_in_epoch: 0,
            };
        }
        LoaderPosition {
            epoch,
            samples_in_epoch: (batches * self.batch_size * self.sampler.world_size()) as u64,
        }
    }

    /// Continues from `position` (from [`position`](Self::position), possibly saved
    /// with another world size): the next loop reads that epoch's order, skipping the
    /// batches already consumed.
    ///
    /// [`Checkpointer::load_state`](crate::Checkpointer::load_state) does it by itself
    /// for the loaders of a run that has a context (`#[distributed]`, or
    /// [`init`](crate::init)): the run's `n`-th loader takes the position of the
    /// checkpointed run's `n`-th loader at the start of its next loop. Calling `resume`
    /// after `load_state` sets the position instead.
    pub fn resume(&self, position: LoaderPosition) {
        if let Some((ctx, number)) = &self.slot {
            ctx.loops().take_loader_resume(*number);
        }
        let per_batch = (self.batch_size * self.sampler.world_size()) as u64;
        self.next_epoch.set(position.epoch);
        self.skip
            .set((position.samples_in_epoch / per_batch) as usize);
        self.position.set((position.epoch, self.skip.get()));
    }

    /// Steps (batches) per epoch on every rank: `ceil(ceil(len / world_size) /
    /// batch_size)`, or with `drop_last` `floor(floor(len / world_size) / batch_size)`.
    /// It shrinks with the world size, e.g. 29,500 samples at batch 4 with `drop_last`:
    /// 7,375 steps on 1 rank, 3,687 on 2, 1,843 on 4, 921 on 8.
    pub fn len(&self) -> usize {
        let samples = self.sampler.num_samples();
        if self.drop_last {
            samples / self.batch_size
        } else {
            samples.div_ceil(self.batch_size)
        }
    }

    /// Whether an epoch has no steps.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The sampler (samples per rank, the dataset's length).
    pub fn sampler(&self) -> &DistributedSampler {
        &self.sampler
    }

    /// The dataset.
    pub fn dataset(&self) -> &D {
        &self.dataset
    }

    /// One epoch of this rank's batches; the next call uses the next epoch.
    pub fn iter(&self) -> Batches<'_, D> {
        if let Some(resume) = self
            .slot
            .as_ref()
            .and_then(|(c, n)| c.loops().take_loader_resume(*n))
        {
            self.resume(resume);
        }
        let epoch = self.next_epoch.get();
        self.next_epoch.set(epoch + 1);
        let skip = self.skip.replace(0);
        self.position.set((epoch, skip));
        let mut sampler = self.sampler.clone();
        sampler.set_epoch(epoch);
        let plan = sampler.indices().map(|indices| {
            let mut batches: Vec<Vec<usize>> = indices
                .chunks(self.batch_size)
                .map(<[usize]>::to_vec)
                .collect();
            if self.drop_last && batches.last().is_some_and(|b| b.len() < self.batch_size) {
                batches.pop();
            }
            // Resuming mid-epoch: the batches already consumed are not read again.
            batches.split_off(skip.min(batches.len()))
        });
        let pin = (self.pin_memory && self.device.is_cuda()).then_some(self.device);
        let (batches, source) = match plan {
            Err(e) => (Vec::new(), Source::Failed(Some(e))),
            Ok(batches) if self.num_workers == 0 => (batches, Source::Inline),
            Ok(batches) => {
                let workers = spawn_workers(
                    &self.dataset,
                    &batches,
                    self.num_workers,
                    self.prefetch_factor,
                    pin,
                );
                (batches, Source::Workers(workers))
            }
        };
        let steps = (skip + batches.len()) as u64;
        Batches {
            progress: Progress::start(Some(epoch), Some(steps), skip as u64),
            loader: self,
            batches,
            skipped: skip,
            next: 0,
            row: skip * self.batch_size,
            pin,
            source,
        }
    }

    /// Gathers `values` (rows: one per sample) from every rank into the epoch's order,
    /// dropping the rows of the sampler's padding, as Accelerate's
    /// `gather_for_metrics`: evaluation metrics computed on the result are exactly the
    /// single-process ones.
    ///
    /// `values`: [rows, …], the rows of the batch this rank's loop yielded last, or of
    /// its whole epoch ([`DistributedSampler::num_samples`] rows). Returns
    /// [kept rows over all ranks, …] on every rank. A collective: every rank calls it
    /// at the same step.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when `values` has neither row count;
    /// [`Error::Collective`] when the all-gather fails.
    pub fn gather_for_metrics(&self, values: &Tensor) -> Result<Tensor> {
        let rows = values.size().first().copied().unwrap_or(0) as usize;
        let (last_start, last_rows) = self.last_batch.get();
        let start = if rows == last_rows {
            last_start
        } else if rows == self.sampler.num_samples() {
            0
        } else {
            return Err(Error::InvalidInput(format!(
                "gather_for_metrics: the values have {rows} rows, but the last batch had {last_rows} and this rank's epoch {}: pass one row per sample of the last batch or of the whole epoch",
                self.sampler.num_samples()
            )));
        };
        let world_size = self.sampler.world_size();
        let gathered = match init::current() {
            Some(ctx) if ctx.world_size() > 1 => ctx.process_group().all_gather(values)?,
            _ => vec![values.shallow_clone()],
        };
        // Row k of rank r is position (start + k) * world_size + r of the epoch's
        // order; positions past the dataset's end are padding.
        let keep: Vec<i64> = (0..rows)
            .flat_map(|k| (0..world_size).map(move |r| (k, r)))
            .filter(|&(k, r)| (start + k) * world_size + r < self.sampler.len())
            .map(|(k, r)| (r * rows + k) as i64)
            .collect();
        let all = Tensor::f_cat(&gathered, 0)?;
        let keep = Tensor::from_slice(&keep).to_device(all.device());
        Ok(all.f_index_select(0, &keep)?)
    }
}

impl<'a, D: Dataset> IntoIterator for &'a DataLoader<D> {
    type Item = Result<D::Item>;
    type IntoIter = Batches<'a, D>;
    fn into_iter(self) -> Batches<'a, D> {
        self.iter()
    }
}

/// Every rank must hold a dataset of the same length: all-gathers the lengths and
/// names the ranks that differ.
fn check_same_length(len: usize) -> Result<()> {
    let Some(ctx) = init::current() else {
        return Ok(());
    };
    if ctx.world_size() == 1 {
        return Ok(());
    }
    let mine = Tensor::from_slice(&[len as i64]).to_device(ctx.device());
    let lens: Vec<i64> = ctx
        .process_group()
        .all_gather(&mine)?
        .iter()
        .map(|t| t.int64_value(&[0]))
        .collect();
    if lens.iter().any(|&l| l != lens[0]) {
        return Err(Error::InvalidInput(format!(
            "DataLoader: the ranks' datasets differ in length ({}), so they would run different numbers of steps and hang: build the same whole dataset on every rank (the loader gives each rank its share)",
            lens.iter()
                .enumerate()
                .map(|(r, l)| format!("rank {r}: {l}"))
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    Ok(())
}

enum Source<T> {
    Inline,
    Workers(Vec<Worker<T>>),
    Failed(Option<Error>),
}

struct Worker<T> {
    batches: Receiver<Result<T>>,
    thread: Option<JoinHandle<()>>,
}

/// Worker `w` reads batches `w, w + workers, …` into a channel of `prefetch` slots;
/// reading the channels round-robin restores the order.
fn spawn_workers<D: Dataset>(
    dataset: &D,
    batches: &[Vec<usize>],
    workers: usize,
    prefetch: usize,
    pin: Option<Device>,
) -> Vec<Worker<D::Item>> {
    (0..workers)
        .map(|w| {
            let (send, batches_rx) = sync_channel(prefetch);
            let dataset = dataset.clone();
            let mine: Vec<Vec<usize>> = batches.iter().skip(w).step_by(workers).cloned().collect();
            let thread = std::thread::spawn(move || {
                tch::set_num_threads(1);
                for indices in mine {
                    let batch = dataset.get_batch(&indices).map(|b| pinned(b, pin));
                    let failed = batch.is_err();
                    // The loop stopped early: the receiver is gone.
                    if send.send(batch).is_err() || failed {
                        return;
                    }
                }
            });
            Worker {
                batches: batches_rx,
                thread: Some(thread),
            }
        })
        .collect()
}

/// `batch` in page-locked host memory for `device`, when `pin` is that device.
fn pinned<B: Batch>(batch: B, pin: Option<Device>) -> B {
    match pin {
        Some(device) => batch.map_tensors(&mut |t| {
            if t.device() == Device::Cpu {
                t.pin_memory(device)
            } else {
                t
            }
        }),
        None => batch,
    }
}

/// One epoch of a [`DataLoader`]'s batches on this rank.
pub struct Batches<'a, D: Dataset> {
    loader: &'a DataLoader<D>,
    /// The epoch's batches left after `skipped` ones (resuming mid-epoch).
    batches: Vec<Vec<usize>>,
    skipped: usize,
    next: usize,
    /// Rows of this rank's epoch yielded so far.
    row: usize,
    pin: Option<Device>,
    source: Source<D::Item>,
    /// Rank 0's bar for this epoch.
    progress: Progress,
}

impl<D: Dataset> Iterator for Batches<'_, D> {
    type Item = Result<D::Item>;

    fn next(&mut self) -> Option<Result<D::Item>> {
        if let Source::Failed(e) = &mut self.source {
            return e.take().map(Err);
        }
        let Some(indices) = self.batches.get(self.next) else {
            crate::optim::set_end_of_data(false);
            // The epoch is over: finish the bar.
            self.progress = Progress::none();
            return None;
        };
        let batch = match &self.source {
            Source::Inline => self
                .loader
                .dataset
                .get_batch(indices)
                .map(|b| pinned(b, self.pin)),
            Source::Workers(workers) => {
                let worker = &workers[self.next % workers.len()];
                worker.batches.recv().unwrap_or_else(|_| {
                    Err(Error::InvalidInput(
                        "DataLoader: a worker thread stopped (it panicked: see its message above)"
                            .into(),
                    ))
                })
            }
            Source::Failed(_) => unreachable!("handled above"),
        };
        self.next += 1;
        self.progress.handed_out();
        if batch.is_err() {
            // Stop after an error.
            self.next = self.batches.len();
        }
        let device = self.loader.device;
        let batch = batch.map(|b| {
            if device == Device::Cpu {
                b
            } else {
                // Non-blocking from pinned memory: the copy overlaps with compute.
                b.map_tensors(&mut |t| t.to_device_(device, t.kind(), true, false))
            }
        });
        self.loader
            .position
            .set((self.loader.position.get().0, self.skipped + self.next));
        if let Some((ctx, number)) = &self.loader.slot {
            ctx.loops().update_loader(*number, self.loader.position());
        }
        if let Ok(b) = &batch {
            let rows = b.rows() as usize;
            self.loader.last_batch.set((self.row, rows));
            self.row += rows;
        }
        crate::optim::set_end_of_data(self.next == self.batches.len());
        Some(batch)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.batches.len() - self.next.min(self.batches.len());
        (left, Some(left))
    }
}

impl<D: Dataset> Drop for Batches<'_, D> {
    fn drop(&mut self) {
        crate::optim::set_end_of_data(false);
        if let Source::Workers(workers) = std::mem::replace(&mut self.source, Source::Inline) {
            for mut worker in workers {
                // Dropping the receiver makes a worker's next send fail and return.
                drop(worker.batches);
                if let Some(thread) = worker.thread.take() {
                    let _ = thread.join();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::data::TensorDataset;
    use tch::Kind;

    fn loader(n: i64, batch: usize) -> DataLoader<TensorDataset> {
        let xs = Tensor::arange(n, (Kind::Int64, Device::Cpu)).view([n, 1]);
        let ys = Tensor::arange(n, (Kind::Int64, Device::Cpu)) * 10;
        DataLoader::new(TensorDataset::new(&xs, &ys).unwrap(), batch).unwrap()
    }

    fn epoch(loader: &DataLoader<TensorDataset>) -> Vec<Vec<i64>> {
        loader
            .iter()
            .map(|b| {
                let (x, y) = b.unwrap();
                assert!(
                    y.equal(&(x.view([-1]) * 10)),
                    "inputs and targets stay paired"
                );
                Vec::<i64>::try_from(x.view([-1])).unwrap()
            })
            .collect()
    }

    #[test]
    fn workers_yield_the_same_batches_in_the_same_order() {
        let inline = loader(103, 8);
        for workers in [1, 2, 3] {
            let threaded = loader(103, 8).num_workers(workers).prefetch_factor(1);
            for e in 0..2 {
                inline.set_epoch(e);
                assert_eq!(
                    epoch(&inline),
                    epoch(&threaded),
                    "{workers} workers, epoch {e}"
                );
            }
        }
    }

    #[test]
    fn epochs_advance_and_cover_the_dataset() {
        let l = loader(10, 4);
        assert_eq!(l.len(), 3);
        let first = epoch(&l);
        assert_eq!(first.iter().map(Vec::len).collect::<Vec<_>>(), [4, 4, 2]);
        let mut all: Vec<i64> = first.concat();
        all.sort();
        assert_eq!(all, (0..10).collect::<Vec<_>>());
        assert_eq!(l.epoch(), 1);
        assert_ne!(first, epoch(&l), "the next loop reshuffles");
        // drop_last: floor(13 / 4) = 3 full batches; 12 samples make 3 full batches, the
        // last one kept; fewer samples than a batch make an empty epoch.
        for (n, steps) in [(10, 2), (13, 3), (12, 3), (3, 0)] {
            let dropped = loader(n, 4).drop_last(true);
            assert_eq!(dropped.len(), steps, "{n} samples, drop_last");
            assert_eq!(dropped.is_empty(), steps == 0, "{n} samples, drop_last");
            let batches = epoch(&dropped);
            assert_eq!(batches.len(), steps, "{n} samples, drop_last");
            assert!(batches.iter().all(|b| b.len() == 4), "{n}: {batches:?}");
        }
        assert!(
            !loader(3, 4).is_empty(),
            "one short batch without drop_last"
        );
    }

    /// A dataset that notes which threads read it.
    #[derive(Clone)]
    struct Threads(TensorDataset, Arc<Mutex<HashSet<std::thread::ThreadId>>>);

    impl Dataset for Threads {
        type Item = (Tensor, Tensor);
        fn len(&self) -> usize {
            self.0.len()
        }
        fn get(&self, index: usize) -> Result<Self::Item> {
            self.1.lock().unwrap().insert(std::thread::current().id());
            self.0.get(index)
        }
        fn get_batch(&self, indices: &[usize]) -> Result<Self::Item> {
            self.1.lock().unwrap().insert(std::thread::current().id());
            self.0.get_batch(indices)
        }
    }

    /// A dataset whose batch reads fail from sample `fail_from` on, counting them.
    #[derive(Clone)]
    struct Failing(TensorDataset, usize, Arc<Mutex<usize>>);

    impl Dataset for Failing {
        type Item = (Tensor, Tensor);
        fn len(&self) -> usize {
            self.0.len()
        }
        fn get(&self, index: usize) -> Result<Self::Item> {
            self.get_batch(&[index])
        }
        fn get_batch(&self, indices: &[usize]) -> Result<Self::Item> {
            *self.2.lock().unwrap() += 1;
            if indices.iter().any(|&i| i >= self.1) {
                return Err(Error::InvalidInput(format!(
                    "sample {indices:?} is unreadable"
                )));
            }
            self.0.get_batch(indices)
        }
    }

    #[test]
    fn a_worker_stops_reading_at_its_first_error() {
        let xs = Tensor::arange(40, (Kind::Int64, Device::Cpu)).view([40, 1]);
        let reads = Arc::new(Mutex::new(0));
        let data = Failing(TensorDataset::new(&xs, &xs).unwrap(), 8, reads.clone());
        let l = DataLoader::new(data, 4)
            .unwrap()
            .shuffle(false)
            .num_workers(1)
            .prefetch_factor(1);
        let mut batches = l.iter();
        assert!(batches.next().unwrap().is_ok());
        assert!(batches.next().unwrap().is_ok());
        let err = batches.next().unwrap().unwrap_err().to_string();
        assert!(err.contains("unreadable"), "{err}");
        // The worker had room to read on; it must not, though the loop still holds
        // the iterator.
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert_eq!(*reads.lock().unwrap(), 3, "batches read: 2 good, 1 failed");
    }

    #[test]
    fn workers_read_in_threads_of_their_own_and_none_reads_inline() {
        for workers in [0, 2] {
            let xs = Tensor::arange(40, (Kind::Int64, Device::Cpu)).view([40, 1]);
            let seen = Arc::new(Mutex::new(HashSet::new()));
            let data = Threads(TensorDataset::new(&xs, &xs).unwrap(), seen.clone());
            let l = DataLoader::new(data, 4).unwrap().num_workers(workers);
            assert_eq!(l.iter().count(), 10);
            let seen = seen.lock().unwrap();
            let here = seen.contains(&std::thread::current().id());
            if workers == 0 {
                assert_eq!(*seen, HashSet::from([std::thread::current().id()]));
            } else {
                assert!(!here && !seen.is_empty(), "{workers} workers: {seen:?}");
            }
        }
    }

    #[test]
    fn resume_continues_mid_epoch_with_the_same_batches() {
        for workers in [0, 2] {
            let straight = loader(50, 4).num_workers(workers);
            let _ = epoch(&straight);
            let second = epoch(&straight);

            let interrupted = loader(50, 4).num_workers(workers);
            let _ = epoch(&interrupted);
            assert_eq!(
                interrupted.position(),
                LoaderPosition {
                    epoch: 1,
                    samples_in_epoch: 0
                }
            );
            let mut it = interrupted.iter();
            for _ in 0..3 {
                let _batch = it.next().unwrap().unwrap();
            }
            drop(it);
            let pos = interrupted.position();
            assert_eq!(
                pos,
                LoaderPosition {
                    epoch: 1,
                    samples_in_epoch: 12
                }
            );

            let resumed = loader(50, 4).num_workers(workers);
            resumed.resume(pos);
            assert_eq!(epoch(&resumed), second[3..].to_vec(), "{workers} workers");
            assert_eq!(resumed.epoch(), 2);
        }
    }

    /// `size_hint` is exact: the batches left in this epoch, counting down to 0, and
    /// after a mid-epoch resume the rest of the epoch (the sharded loop's progress bar
    /// and `collect` rely on it).
    #[test]
    fn the_size_hint_is_the_batches_left() {
        let l = loader(10, 4);
        let mut it = l.iter();
        for left in (0..=3).rev() {
            assert_eq!(it.size_hint(), (left, Some(left)));
            assert_eq!(it.next().is_some(), left > 0);
        }
        assert_eq!(it.size_hint(), (0, Some(0)), "past the end");
        drop(it);
        let resumed = loader(10, 4);
        resumed.resume(LoaderPosition {
            epoch: 0,
            samples_in_epoch: 4,
        });
        assert_eq!(resumed.iter().size_hint(), (2, Some(2)));
    }

    #[test]
    fn stopping_early_stops_the_workers() {
        let l = loader(1000, 1).num_workers(2);
        for (i, b) in l.iter().enumerate() {
            let _batch = b.unwrap();
            if i == 3 {
                break;
            }
        }
        // Dropping the iterator joined the workers; the next epoch starts cleanly.
        assert_eq!(l.iter().count(), 1000);
    }

    #[test]
    fn gather_for_metrics_on_one_rank_is_the_identity_in_epoch_order() {
        let l = loader(10, 4).shuffle(false);
        let mut gathered = Vec::new();
        for b in &l {
            let (x, _) = b.unwrap();
            gathered.push(l.gather_for_metrics(&x).unwrap());
        }
        let all = Vec::<i64>::try_from(Tensor::cat(&gathered, 0).view([-1])).unwrap();
        assert_eq!(all, (0..10).collect::<Vec<_>>());
        let e = l.gather_for_metrics(&Tensor::zeros([3], tch::kind::FLOAT_CPU));
        assert!(e.unwrap_err().to_string().contains("3 rows"));
    }
}
