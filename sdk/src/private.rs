//! Runtime support for the code `#[distributed]` generates. Not public API: it may
//! change in any release. The macro emits calls to `::tch_distributed::__private::…`
//! only.

use std::cell::{Cell, RefCell};
use std::path::Path;

use tch::nn::{Optimizer, VarStore};
use tch::{Device, TchError, Tensor};

use crate::ddp::{DdpOptions, DistributedDataParallel};
use crate::env::LaunchEnv;
use crate::init::{self, Context, InitOptions};
use crate::process_group::Backend;

pub use crate::error::Error;

/// The attribute's options, as validated by the macro.
#[derive(Clone, Debug, Default)]
pub struct Options {
    pub backend: Option<&'static str>,
    pub nproc_per_node: Option<usize>,
    pub bucket_cap_mb: Option<f64>,
    pub find_unused_parameters: bool,
    pub timeout_secs: Option<f64>,
}

thread_local! {
    static OPTIONS: RefCell<Options> = RefCell::new(Options::default());
    static DDPS: RefCell<Vec<(usize, DistributedDataParallel)>> = const { RefCell::new(Vec::new()) };
    static DEPTH: Cell<usize> = const { Cell::new(0) };
}

fn fail(what: &str, e: impl std::fmt::Display) -> ! {
    panic!("tch-distributed: {what}: {e}")
}

/// How many ranks to start when the program runs without a launcher:
/// `TCH_DISTRIBUTED_NPROC` wins over the attribute's `nproc_per_node`.
fn self_launch_ranks(options: &Options) -> usize {
    match std::env::var("TCH_DISTRIBUTED_NPROC") {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            fail(
                "TCH_DISTRIBUTED_NPROC",
                format!("{v:?} is not a positive number of processes"),
            )
        }),
        Err(_) => options.nproc_per_node.unwrap_or(1),
    }
}

/// Function entry: joins the job (or, with no launcher and more than one rank
/// asked for, launches the ranks and exits with their result), then prints the
/// banner on rank 0. Returns a guard whose drop is the exit barrier.
pub fn enter(options: Options) -> Session {
    let depth = DEPTH.with(|d| d.replace(d.get() + 1));
    if depth > 0 {
        // A #[distributed] function called from another: already joined.
        return Session { outermost: false };
    }
    let env = LaunchEnv::from_env().unwrap_or_else(|e| fail("reading the launch environment", e));
    if env.is_none() {
        let ranks = self_launch_ranks(&options);
        if ranks > 1 {
            std::process::exit(self_launch(ranks));
        }
    }
    let init_options = InitOptions {
        backend: options
            .backend
            .map(|b| Backend::parse(b).unwrap_or_else(|e| fail("backend", e))),
        timeout: options.timeout_secs.map(std::time::Duration::from_secs_f64),
        device: None,
    };
    OPTIONS.with(|o| *o.borrow_mut() = options);
    let ctx =
        init::init_with(init_options).unwrap_or_else(|e| fail("joining the process group", e));
    if ctx.world_size() > 1 {
        // Every rank draws the same random numbers (initial weights, shuffles) unless
        // the program seeds them itself, so sharded shuffles stay disjoint.
        let mut seed = Tensor::from_slice(&[rand_seed()]);
        if let Err(e) = ctx.process_group().broadcast(&mut seed, 0) {
            fail("sharing the random seed", e)
        }
        tch::manual_seed(seed.int64_value(&[0]));
    }
    if ctx.is_main_process() {
        let bucket = OPTIONS.with(|o| o.borrow().bucket_cap_mb);
        println!(
            "{}, bucket cap {} MiB",
            ctx.banner(),
            bucket.unwrap_or(DdpOptions::default().bucket_cap_mb)
        );
    }
    Session { outermost: true }
}

fn rand_seed() -> i64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    (nanos as i64 ^ (std::process::id() as i64) << 32) & i64::MAX
}

fn self_launch(ranks: usize) -> i32 {
    let exe = std::env::current_exe()
        .unwrap_or_else(|e| fail("finding this program to launch its ranks", e));
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let config = crate::launch::LaunchConfig {
        nproc_per_node: ranks,
        ..Default::default()
    };
    eprintln!(
        "tch-distributed: no launcher environment; starting {ranks} ranks of {}",
        exe.display()
    );
    crate::launch::launch(&config, exe.as_os_str(), &args)
        .unwrap_or_else(|e| fail("launching ranks", e))
}

/// Guard of a `#[distributed]` function's body. `finish` runs on every normal
/// return; a panic or an early `?` skips it.
pub struct Session {
    outermost: bool,
}

impl Session {
    /// The exit barrier: every rank waits for the others, so that all finish
    /// together. A rank whose function returned an `Err` (`failed`) leaves at once
    /// instead: the others may be inside a collective that it will never join, and
    /// its exit is what lets the launcher stop them.
    pub fn finish(&self, failed: bool) {
        if !self.outermost || failed {
            return;
        }
        if let Some(ctx) = init::current() {
            if let Err(e) = ctx.barrier() {
                eprintln!(
                    "tch-distributed: exit barrier failed on rank {}: {e}",
                    ctx.rank()
                );
            }
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    }
}

fn context() -> Context {
    init::current()
        .unwrap_or_else(|| fail("internal", "no context: the function entry did not run"))
}

/// `Device::cuda_if_available()` / `Device::Cuda(i)` → this rank's device, in place
/// of the one the single-GPU code asked for.
pub fn device(_requested: Device) -> Device {
    context().device()
}

/// `println!` and friends run on rank 0 only.
pub fn is_main_process() -> bool {
    init::current().map(|c| c.is_main_process()).unwrap_or(true)
}

fn key_of(vars: &[Tensor]) -> usize {
    vars.first().map(|t| t.data_ptr() as usize).unwrap_or(0)
}

/// `<config>.build(&vs, lr)`: the model exists now; wrap `vs` in DDP.
pub fn wrap_optimizer(
    built: Result<Optimizer, TchError>,
    vs: &VarStore,
) -> Result<Optimizer, TchError> {
    let opt = built?;
    let ctx = context();
    let options = OPTIONS.with(|o| o.borrow().clone());
    let defaults = DdpOptions::default();
    let ddp_options = DdpOptions {
        bucket_cap_mb: options.bucket_cap_mb.unwrap_or(defaults.bucket_cap_mb),
        find_unused_parameters: options.find_unused_parameters,
        ..defaults
    };
    let ddp = DistributedDataParallel::new(vs, ctx.process_group(), ddp_options)
        .map_err(|e| TchError::Torch(format!("tch-distributed: wrapping the model in DDP: {e}")))?;
    let key = key_of(&vs.trainable_variables());
    DDPS.with(|d| {
        let mut d = d.borrow_mut();
        d.retain(|(k, _)| *k != key);
        d.push((key, ddp));
    });
    Ok(opt)
}

/// Runs `with` on the DDP wrapping `opt`'s variables, or `without` when none does.
fn step(
    opt: &mut Optimizer,
    what: &str,
    with: impl FnOnce(&DistributedDataParallel, &mut Optimizer) -> crate::Result<()>,
    without: impl FnOnce(&mut Optimizer),
) {
    let key = key_of(&opt.trainable_variables());
    DDPS.with(|d| match d.borrow().iter().find(|(k, _)| *k == key) {
        Some((_, ddp)) => or_fail(with(ddp, opt), what),
        None => without(opt),
    })
}

fn or_fail(r: crate::Result<()>, what: &str) {
    if let Err(e) = r {
        fail(what, e)
    }
}

/// `opt.backward_step(&loss)`.
pub fn backward_step(opt: &mut Optimizer, loss: &Tensor) {
    step(
        opt,
        "backward_step",
        |ddp, opt| ddp.backward_step(opt, loss),
        |opt| opt.backward_step(loss),
    )
}

/// `opt.backward_step_clip(&loss, max)`.
pub fn backward_step_clip(opt: &mut Optimizer, loss: &Tensor, max: f64) {
    step(
        opt,
        "backward_step_clip",
        |ddp, opt| ddp.backward_step_clip(opt, loss, max),
        |opt| opt.backward_step_clip(loss, max),
    )
}

/// `opt.backward_step_clip_norm(&loss, max)`.
pub fn backward_step_clip_norm(opt: &mut Optimizer, loss: &Tensor, max: f64) {
    step(
        opt,
        "backward_step_clip_norm",
        |ddp, opt| ddp.backward_step_clip_norm(opt, loss, max),
        |opt| opt.backward_step_clip_norm(loss, max),
    )
}

/// `loss.backward()`: through the most recently built DDP, if any.
pub fn backward(loss: &Tensor) {
    DDPS.with(|d| match d.borrow().last() {
        Some((_, ddp)) => or_fail(ddp.backward(loss), "backward"),
        None => loss.backward(),
    })
}

/// `vs.save(path)` on a `VarStore`: rank 0 writes atomically between barriers.
pub fn save(vs: &VarStore, path: impl AsRef<Path>) -> Result<(), TchError> {
    crate::checkpoint::save_var_store(&context(), vs, path)
        .map_err(|e| TchError::Torch(e.to_string()))
}

/// `vs.load(path)` on a `VarStore`: every rank loads after a barrier.
pub fn load(vs: &mut VarStore, path: impl AsRef<Path>) -> Result<(), TchError> {
    crate::checkpoint::load_var_store(&context(), vs, path)
        .map_err(|e| TchError::Torch(e.to_string()))
}

/// Type-directed dispatch for the rewrites that must leave other types alone
/// ("autoref specialization"): `(&Probe::new(x)).method()` resolves to the impl on
/// `Probe<Known>` when `x: Known`, else to the fallback on `&Probe<T>`.
pub struct Probe<T>(Cell<Option<T>>);

impl<T> Probe<T> {
    pub fn new(value: T) -> Self {
        Probe(Cell::new(Some(value)))
    }
    fn take(&self) -> T {
        self.0.take().expect("probe used once")
    }
}

/// Loops over the data iterators tch users write: each rank gets its own batches.
pub trait ShardKnown {
    type Iter;
    fn __tchd_iter(&self) -> Self::Iter;
}
/// Loops over anything else: untouched.
pub trait ShardOther {
    type Iter;
    fn __tchd_iter(&self) -> Self::Iter;
}

impl ShardKnown for Probe<tch::data::TextDataIter> {
    type Iter = Sharded<tch::data::TextDataIter>;
    fn __tchd_iter(&self) -> Self::Iter {
        Sharded::new(self.take())
    }
}
impl ShardKnown for Probe<tch::data::Iter2> {
    type Iter = Sharded<tch::data::Iter2>;
    fn __tchd_iter(&self) -> Self::Iter {
        Sharded::new(self.take())
    }
}
impl<'a> ShardKnown for Probe<&'a mut tch::data::Iter2> {
    type Iter = Sharded<&'a mut tch::data::Iter2>;
    fn __tchd_iter(&self) -> Self::Iter {
        Sharded::new(self.take())
    }
}
impl<T: IntoIterator> ShardOther for &Probe<T> {
    type Iter = T;
    fn __tchd_iter(&self) -> T {
        self.take()
    }
}

/// An iterator split across ranks, batch by batch, as Accelerate's `even_batches`
/// data loader: batches are dealt round-robin (rank `r` gets batches `r`,
/// `r + world_size`, …), and a final incomplete round is completed with the first
/// batches of the epoch, so every rank yields `ceil(batches / world_size)` batches
/// and no rank waits on a collective that the others never reach. The shards are
/// disjoint except for those `world_size - batches % world_size` repeated batches,
/// and together they cover the epoch. Every rank must see the same sequence of
/// batches (the same data and shuffle seed; `#[distributed]` seeds every rank alike).
pub struct Sharded<I: Iterator> {
    inner: I,
    rank: usize,
    world_size: usize,
    /// The first batches of the epoch (at most `rank` of them, all dealt to lower
    /// ranks), kept to complete a final incomplete round.
    first: Vec<I::Item>,
    /// How many batches `inner` has yielded.
    seen: usize,
    done: bool,
    /// The seed libtorch's generators get when the loop ends (see `Drop`).
    reseed: Option<i64>,
}

impl<I: Iterator> Sharded<I> {
    pub fn new(inner: I) -> Self {
        let (rank, world_size) = init::current()
            .map(|c| (c.rank(), c.world_size()))
            .unwrap_or((0, 1));
        Self::for_rank(inner, rank, world_size)
    }

    fn for_rank(inner: I, rank: usize, world_size: usize) -> Self {
        // Drawn while every rank's generator is in the same state (as at the start
        // of the function), so every rank draws the same seed.
        let reseed = (world_size > 1).then(|| {
            Tensor::randint(i64::MAX, [1], (tch::Kind::Int64, Device::Cpu)).int64_value(&[0])
        });
        Sharded {
            inner,
            rank,
            world_size,
            first: Vec::new(),
            seen: 0,
            done: false,
            reseed,
        }
    }
}

impl<I: Iterator> Iterator for Sharded<I> {
    type Item = I::Item;
    fn next(&mut self) -> Option<I::Item> {
        if self.done {
            return None;
        }
        let mut got = 0;
        for i in 0..self.world_size {
            let Some(item) = self.inner.next() else {
                break;
            };
            self.seen += 1;
            got += 1;
            if i == self.rank {
                return self.skip_rest(i, item);
            }
            if self.seen <= self.rank {
                self.first.push(item);
            }
        }
        self.done = true;
        if got == 0 || self.first.is_empty() {
            // The epoch ended on a round boundary (or was empty).
            return None;
        }
        // An incomplete round: this rank takes one of the epoch's first batches,
        // as the ranks after the last real batch do in turn.
        let k = (self.rank - got) % self.seen;
        Some(self.first.swap_remove(k))
    }
}

/// During the loop, the ranks' random generators drift apart whenever they draw
/// different amounts (dropout on a smaller last batch). The next shuffle must be the
/// same on every rank, so when the loop ends every rank reseeds libtorch's
/// generators with the seed they all drew when the loop started.
impl<I: Iterator> Drop for Sharded<I> {
    fn drop(&mut self) {
        if let Some(seed) = self.reseed {
            tch::manual_seed(seed);
        }
    }
}

impl<I: Iterator> Sharded<I> {
    /// Consumes the rest of the round after this rank's batch at position `i`.
    fn skip_rest(&mut self, i: usize, mine: I::Item) -> Option<I::Item> {
        for _ in i + 1..self.world_size {
            if self.inner.next().is_none() {
                break;
            }
            self.seen += 1;
        }
        Some(mine)
    }
}

/// Whether the function's return value is an `Err`.
pub trait ExitKnown {
    fn __tchd_failed(&self) -> bool;
}
pub trait ExitOther {
    fn __tchd_failed(&self) -> bool;
}
impl<T, E> ExitKnown for Probe<&Result<T, E>> {
    fn __tchd_failed(&self) -> bool {
        self.take().is_err()
    }
}
impl<T> ExitOther for &Probe<T> {
    fn __tchd_failed(&self) -> bool {
        false
    }
}

/// The `VarStore` behind `vs.save(…)`'s receiver, if it is one.
pub trait VarStoreRefKnown<'a> {
    fn __tchd_var_store(&self) -> Option<&'a VarStore>;
}
pub trait VarStoreRefOther<'a> {
    fn __tchd_var_store(&self) -> Option<&'a VarStore>;
}
impl<'a> VarStoreRefKnown<'a> for Probe<&'a VarStore> {
    fn __tchd_var_store(&self) -> Option<&'a VarStore> {
        Some(self.take())
    }
}
impl<'a, 'b: 'a> VarStoreRefKnown<'a> for Probe<&'a &'b VarStore> {
    fn __tchd_var_store(&self) -> Option<&'a VarStore> {
        Some(*self.take())
    }
}
impl<'a, T> VarStoreRefOther<'a> for &Probe<T> {
    fn __tchd_var_store(&self) -> Option<&'a VarStore> {
        None
    }
}

/// The `VarStore` behind `vs.load(…)`'s receiver, if it is one.
pub trait VarStoreMutKnown<'a> {
    fn __tchd_var_store_mut(&self) -> Option<&'a mut VarStore>;
}
pub trait VarStoreMutOther<'a> {
    fn __tchd_var_store_mut(&self) -> Option<&'a mut VarStore>;
}
impl<'a> VarStoreMutKnown<'a> for Probe<&'a mut VarStore> {
    fn __tchd_var_store_mut(&self) -> Option<&'a mut VarStore> {
        Some(self.take())
    }
}
impl<'a, T> VarStoreMutOther<'a> for &Probe<T> {
    fn __tchd_var_store_mut(&self) -> Option<&'a mut VarStore> {
        None
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
