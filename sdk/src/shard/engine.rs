//! The sharded parameters of one optimizer: ZeRO stages 2 and 3 with FSDP2's
//! semantics. Each unit's parameters are cut on dim 0 into exact `1/world_size`
//! shards (see [`layout`](super::layout)); the optimizer steps the shards; gradients
//! are reduce-scattered, one collective per unit, as soon as a unit's gradients are
//! all accumulated (a hook on each parameter's gradient accumulator, as c10d's
//! Reducer); parameters are all-gathered after the step (stage 2, and stage 3's root
//! unit), or around each forward and backward pass of a unit (stage 3).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use tch::Tensor;

use super::hooks::{self, GradHooks, Hook};
use super::layout::{layout, Piece};
use crate::error::{Error, Result};
use crate::process_group::{Pending, ProcessGroup, ReduceOp};
use crate::unit_registry::{ShardedParameters, Units};

/// DDP's broadcast bucket: the parameters and buffers rank 0 sends at the start.
const BROADCAST_BYTES: usize = 25 << 20;

/// Counters of the collectives of a fully sharded optimizer (ZeRO stages 2 and 3),
/// for tests and benchmarks ([`Optimizer::sharding_stats`](crate::Optimizer::sharding_stats)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShardingStats {
    /// All-gathers of a unit's shards into its parameters (after each step at stage 2
    /// and for stage 3's root; around each forward and backward pass of a stage-3
    /// unit), the prefetched ones included.
    pub all_gathers: u64,
    /// Those started ahead, during the compute of the unit before (FSDP's prefetch).
    pub prefetched_all_gathers: u64,
    /// Reduce-scatters of a unit's gradients (one per unit and cycle).
    pub reduce_scatters: u64,
    /// Those run at the step rather than in the backward pass, where they overlap the
    /// compute: the backward pass left their unit, or one before it in the order the
    /// reduce-scatters keep, incomplete: no hook ran for a variable that the loss's
    /// graph reaches (an autograd node that accumulates gradients itself rather than
    /// along its edges). 0 whenever the graph shows its parameters, checkpointed blocks
    /// included.
    pub reduce_scatters_at_step: u64,
    /// Bytes this rank sent into its all-gathers: its shards, in the gathers' dtype
    /// (under mixed precision, bf16 or fp16 rather than the parameters' fp32).
    pub all_gather_bytes: u64,
}

/// The sharded parameters of one optimizer (see the module's documentation).
pub(crate) struct Sharding {
    inner: Arc<Inner>,
    /// The units' views (their chunks), in the optimizer's order: see `shards`.
    shards: Vec<Tensor>,
    hooks: GradHooks,
}

pub(crate) struct Inner {
    group: ProcessGroup,
    stage: u8,
    /// The optimizer's parameters (full), in its order.
    params: Vec<Tensor>,
    /// Which unit holds each parameter, and where in it.
    unit_of: Vec<(usize, usize)>,
    /// Unit 0 is the root: the parameters no declared unit claims.
    units: Vec<Mutex<Unit>>,
    /// Whether this backward pass reduce-scatters (not a micro-batch inside an
    /// accumulation cycle, which keeps its full gradients, as FSDP2's
    /// `set_requires_gradient_sync(False)`).
    sync: AtomicBool,
    /// Where this cycle's reduce-scatters stand (see [`Order`]).
    order: Mutex<Order>,
    /// The units in the order of their first forward pass (the same on every rank),
    /// for the prefetch: the all-gather of the unit whose pass comes next starts
    /// before a unit's compute, as FSDP's forward and backward prefetch.
    forward_order: Mutex<Vec<usize>>,
    /// [`ShardingStats`]' counters.
    counts: Counts,
    /// Under mixed precision, the dtype fp32 units are all-gathered in (bf16 or fp16,
    /// as FSDP2's `MixedPrecisionPolicy(param_dtype=…)`): the forward and backward
    /// passes compute with the parameters rounded to it, the optimizer steps the fp32
    /// shards. `None`: the parameters' own dtype.
    low: Option<tch::Kind>,
    /// The first failure inside a hook, which fails the backward pass.
    failure: Mutex<Option<Error>>,
    /// The hook that gathers a unit before its backward pass.
    gather_hook: Arc<Hook>,
}

// The tensors are handles: what writes through them (gather, free, reduce-scatter,
// the step) runs under the unit's lock or on the optimizer's `&mut self`, and
// libtorch's tensors may be used from several threads otherwise (as the Reducer's
// hooks run on autograd's threads).
unsafe impl Sync for Inner {}
unsafe impl Send for Inner {}

/// The reduce-scatters of a cycle run in one fixed order on every rank: the declared
/// units from the last to the first (the order of a backward pass when they were
/// declared in the forward's order), then the root, as the Reducer launches its
/// buckets in order. A unit complete early (all its gradients accumulated) waits for
/// those before it, so that a unit that is complete on one rank and not on another
/// (a member without a gradient there) cannot pair one rank's collective with
/// another unit's: the incomplete ones run at the step, in the same order.
struct Order {
    /// How many units of the order were reduce-scattered in this cycle (all of them
    /// once the gradients are finished, until the step is over).
    next: usize,
    /// The units whose gradients were all accumulated in this cycle.
    complete: Vec<bool>,
}

/// [`ShardingStats`], counted as the collectives run.
#[derive(Default)]
struct Counts {
    all_gathers: AtomicU64,
    prefetched_all_gathers: AtomicU64,
    reduce_scatters: AtomicU64,
    reduce_scatters_at_step: AtomicU64,
    all_gather_bytes: AtomicU64,
}

/// An all-gather started and not waited for.
struct Gathering {
    pending: Pending,
    /// Its output, one chunk per rank (views of one buffer).
    chunks: Vec<Tensor>,
    /// Its input (the shard, or its low-precision copy), alive until it completes.
    _input: Tensor,
}

struct Unit {
    /// The unit's parameters (places in the optimizer) and their pieces.
    members: Vec<usize>,
    pieces: Vec<Piece>,
    /// This rank's flat shard of the unit's parameters.
    shard: Tensor,
    /// This rank's flat shard of their gradients (`shard`'s length), then one flag
    /// per member: after the reduce-scatter, above zero when some rank had a gradient
    /// for that member in this cycle.
    grad: Tensor,
    /// Per member, its chunk of `shard` in the parameter's shape with `chunk_rows`
    /// rows; its `.grad` is its chunk of `grad` (`grads`), or none in a cycle where no
    /// rank had a gradient for it (the optimizer skips it, as DDP leaves such a
    /// variable's gradient undefined). The optimizer steps these.
    views: Vec<Tensor>,
    grads: Vec<Tensor>,
    /// Per member, whether this backward pass accumulated its gradient.
    ready: Vec<bool>,
    /// The full parameters hold the shards' values.
    gathered: bool,
    /// An all-gather of `shard` started ahead of the unit's pass (prefetched).
    gathering: Option<Gathering>,
    /// Freed after each forward and backward pass (stage 3, not the root).
    reshard: bool,
}

impl Sharding {
    /// Shards `params` (the optimizer's, with their names) over `group` at `stage`
    /// (2 or 3), in the units declared in `registry` that claim some of them, and
    /// registers itself there. Under mixed precision, `low` (bf16 or fp16) is the
    /// dtype fp32 units are all-gathered and computed in. Every rank gets rank 0's values of `all` (the store's
    /// variables and buffers, in an order every rank agrees on) first, as DDP's
    /// construction does.
    ///
    /// Errors: [`Error::Collective`] when the ranks' models differ or a collective
    /// fails; [`Error::Usage`] for a parameter that is not a whole contiguous tensor or
    /// a unit that mixes dtypes or devices.
    pub fn new(
        group: &ProcessGroup,
        stage: u8,
        params: Vec<(String, Tensor)>,
        all: &[Tensor],
        registry: &Units,
        low: Option<tch::Kind>,
    ) -> Result<Sharding> {
        let declared = registry.declared();
        group.verify_same_shapes(all)?;
        group.broadcast_coalesced(all, BROADCAST_BYTES, 0)?;
        if params.iter().any(|(_, p)| p.device() == tch::Device::Cpu) {
            return_freed_memory();
        }
        let (names, params): (Vec<String>, Vec<Tensor>) = params.into_iter().unzip();
        for (name, p) in names.iter().zip(&params) {
            let whole = hooks::storage_bytes(p)? == p.numel() * p.kind().elt_size_in_bytes();
            if !p.is_contiguous() || !whole {
                return Err(Error::Usage(format!(
                    "variable `{name}` shares its memory with another tensor (a view or a slice \
                     of a bigger one): ZeRO stages 2 and 3 shard whole, contiguous variables. \
                     Create it on the VarStore as a variable of its own"
                )));
            }
        }
        // Each parameter goes to the declared unit with the longest prefix of its
        // name (a nested unit claims its own), else to the root.
        let claims: Vec<Option<usize>> = names
            .iter()
            .map(|name| {
                declared
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| name.starts_with(&s.prefix))
                    .max_by_key(|(_, s)| s.prefix.len())
                    .map(|(i, _)| i)
            })
            .collect();
        let mut used: Vec<usize> = claims.iter().flatten().copied().collect();
        used.sort_unstable();
        used.dedup();
        let mut unit_members: Vec<(Option<usize>, Vec<usize>)> = vec![(None, Vec::new())];
        for &slot in &used {
            unit_members.push((Some(slot), Vec::new()));
        }
        for (i, claim) in claims.iter().enumerate() {
            let u = match claim {
                None => 0,
                Some(slot) => 1 + used.iter().position(|s| s == slot).expect("listed above"),
            };
            unit_members[u].1.push(i);
        }
        let (rank, world) = (group.rank(), group.world_size());
        let mut unit_of = vec![(0, 0); params.len()];
        let mut units = Vec::new();
        for (u, (_, members)) in unit_members.iter().enumerate() {
            for (j, &i) in members.iter().enumerate() {
                unit_of[i] = (u, j);
            }
            let reshard = stage == 3 && u > 0;
            units.push(Mutex::new(Unit::new(
                members, &params, &names, rank, world, reshard,
            )?));
        }
        let inner = Arc::new_cyclic(|me: &Weak<Inner>| {
            let me = me.clone();
            let gather_hook: Arc<Hook> = Arc::new(move |u| match me.upgrade() {
                Some(inner) => inner.kept(inner.gather_ahead(u, false)),
                None => true,
            });
            Inner {
                group: group.clone(),
                stage,
                params,
                unit_of,
                units,
                sync: AtomicBool::new(true),
                forward_order: Mutex::new(Vec::new()),
                counts: Default::default(),
                low,
                order: Mutex::new(Order {
                    next: 0,
                    complete: vec![false; unit_members.len()],
                }),
                failure: Mutex::new(None),
                gather_hook,
            }
        });
        for (u, (slot, _)) in unit_members.iter().enumerate() {
            if let Some(slot) = slot {
                let engine: Arc<dyn std::any::Any + Send + Sync> = inner.clone();
                declared[*slot].bind(Arc::downgrade(&engine), u);
            }
        }
        let engine: Arc<dyn ShardedParameters> = inner.clone();
        registry.add_engine(Arc::downgrade(&engine));
        for u in 0..inner.units.len() {
            let mut unit = inner.unit(u);
            if unit.reshard {
                inner.free_locked(&mut unit)?;
            } else if low.is_some() {
                // The units that stay gathered hold the rounded parameters from the
                // start, as after each step.
                unit.gathered = false;
                inner.gather_locked(&mut unit, false)?;
            }
        }
        let weak = Arc::downgrade(&inner);
        let ready: Arc<Hook> = Arc::new(move |i| match weak.upgrade() {
            Some(inner) => inner.kept(inner.grad_ready(i)),
            None => true,
        });
        let hooks = GradHooks::new(&inner.params, &ready)?;
        let shards = (0..inner.params.len())
            .map(|i| {
                let (u, j) = inner.unit_of[i];
                inner.unit(u).views[j].shallow_clone()
            })
            .collect();
        Ok(Sharding {
            inner,
            shards,
            hooks,
        })
    }

    /// What the collectives did so far.
    pub fn stats(&self) -> ShardingStats {
        let c = &self.inner.counts;
        let load = |n: &AtomicU64| n.load(Ordering::Relaxed);
        ShardingStats {
            all_gathers: load(&c.all_gathers),
            prefetched_all_gathers: load(&c.prefetched_all_gathers),
            reduce_scatters: load(&c.reduce_scatters),
            reduce_scatters_at_step: load(&c.reduce_scatters_at_step),
            all_gather_bytes: load(&c.all_gather_bytes),
        }
    }

    /// The ZeRO stage (2 or 3).
    pub fn stage(&self) -> u8 {
        self.inner.stage
    }

    /// The shards the optimizer steps, one per parameter in its order, each with its
    /// gradient's shard as `.grad`.
    pub fn shards(&self) -> Vec<Tensor> {
        self.shards.iter().map(Tensor::shallow_clone).collect()
    }

    /// This rank and the world size the shards are cut for.
    pub fn rank_and_world_size(&self) -> (usize, usize) {
        (self.inner.group.rank(), self.inner.group.world_size())
    }

    /// Parameter `i`'s shaped chunk `t` (a state tensor of it) without its padding:
    /// this rank's rows only (none for a rank past the end).
    pub fn unpadded(&self, i: usize, t: &Tensor) -> Tensor {
        let (u, j) = self.inner.unit_of[i];
        let (_, rows) = self.inner.unit(u).pieces[j].rows_of(self.inner.group.rank());
        t.narrow(0, 0, rows)
    }

    /// This rank's chunk of `full` (a tensor of parameter `i`'s shape), padded with
    /// zeros to the chunk's rows.
    pub fn chunk(&self, i: usize, full: &Tensor) -> Tensor {
        let (u, j) = self.inner.unit_of[i];
        let piece = Piece {
            offset: 0,
            ..self.inner.unit(u).pieces[j].clone()
        };
        let rank = self.inner.group.rank();
        let chunk = full.new_zeros([piece.chunk_len()], (full.kind(), full.device()));
        if let Some(mine) = piece.rows_in_full(full, rank) {
            tch::no_grad(|| {
                piece
                    .rows_in_shard(&chunk, rank)
                    .expect("rows")
                    .copy_(&mine)
            });
        }
        chunk.reshape(piece.chunk_shape().as_slice())
    }

    /// Before a backward pass from `loss`: whether it reduce-scatters the gradients
    /// (the last micro-batch of an accumulation cycle) or keeps them (the others).
    /// The members outside `loss`'s autograd graph get no gradient in it: they count
    /// as ready from the start, as the Reducer marks unused parameters ready, so that
    /// a unit is complete at the same point on every rank whichever of its members a
    /// rank's loss leaves out (a unit none of whose members are in the graph is
    /// complete now).
    ///
    /// Errors: [`Error::Torch`] when the graph cannot be searched; [`Error::Collective`]
    /// when a reduce-scatter this completes fails.
    pub fn begin_backward(&self, loss: &Tensor, sync: bool) -> Result<()> {
        let inner = &self.inner;
        let reachable = self.hooks.reachable(std::slice::from_ref(loss))?;
        inner.sync.store(sync, Ordering::SeqCst);
        for u in 0..inner.units.len() {
            let complete = {
                let mut guard = inner.unit(u);
                let unit = &mut *guard;
                for (ready, &i) in unit.ready.iter_mut().zip(&unit.members) {
                    *ready = !reachable[i];
                }
                !unit.members.is_empty() && !unit.ready.contains(&false)
            };
            if complete {
                inner.complete(u)?;
            }
        }
        Ok(())
    }

    /// The failure that made a backward pass fail inside a hook, if one did.
    pub fn take_failure(&self) -> Option<Error> {
        self.inner.failure.lock().expect("failure lock").take()
    }

    /// Before a step: the units whose gradients no hook reduce-scattered in this cycle
    /// (some member got no gradient, or an earlier unit of the [`Order`] did not) are
    /// reduce-scattered now, in that order on every rank, a missing gradient counting
    /// as zero (as DDP's `find_unused_parameters`).
    pub fn finish_gradients(&self) -> Result<()> {
        self.inner.settle()?;
        let mut order = self.inner.order.lock().expect("order lock");
        let n = self.inner.units.len();
        for position in order.next..n {
            let mut unit = self.inner.unit(n - 1 - position);
            unit.ready.fill(false);
            if !unit.members.is_empty() {
                self.inner.reduce(&mut unit)?;
                let at_step = &self.inner.counts.reduce_scatters_at_step;
                at_step.fetch_add(1, Ordering::Relaxed);
                if unit.reshard {
                    self.inner.free_locked(&mut unit)?;
                }
            }
        }
        order.next = n;
        Ok(())
    }

    /// After a step: the next cycle reduce-scatters again, and the units that stay
    /// gathered (every unit at stage 2, the root at stage 3) all-gather the updated
    /// shards into their parameters.
    pub fn after_step(&self) -> Result<()> {
        {
            let mut order = self.inner.order.lock().expect("order lock");
            order.next = 0;
            order.complete.fill(false);
        }
        for u in 0..self.inner.units.len() {
            let mut unit = self.inner.unit(u);
            if !unit.reshard {
                unit.gathered = false;
                self.inner.gather_locked(&mut unit, false)?;
            }
        }
        Ok(())
    }

    /// The gradients' global L2 norm over the shards (one all-reduce of the sum of
    /// squares), as FSDP2's `clip_grad_norm_`, and scales them by `max / (norm +
    /// 1e-6)` when that is below 1 (tch's arithmetic). Returns the norm.
    pub fn clip_grad_norm(&self, max: f64) -> Result<f64> {
        let grads: Vec<Tensor> = (0..self.inner.units.len())
            .map(|u| {
                let unit = self.inner.unit(u);
                unit.grad.narrow(0, 0, unit.shard.numel() as i64)
            })
            .filter(|g| g.numel() > 0)
            .collect();
        let Some(first) = grads.first() else {
            return Ok(0.0);
        };
        let mut squares = tch::no_grad(|| {
            let total = first.zeros_like().sum(tch::Kind::Double);
            grads.iter().fold(total, |acc, g| {
                acc + g.to_kind(tch::Kind::Double).square().sum(tch::Kind::Double)
            })
        });
        self.inner.group.all_reduce(&mut squares, ReduceOp::Sum)?;
        let total = squares.double_value(&[]).sqrt();
        let coef = max / (total + 1e-6);
        if coef < 1.0 {
            tch::no_grad(|| {
                for mut g in grads {
                    let _ = g.g_mul_scalar_(coef);
                }
            });
        }
        Ok(total)
    }
}

/// Makes glibc give freed tensors' memory back to the system, so that what sharding
/// frees leaves the resident set: a fixed mmap threshold of 64 KiB (glibc otherwise
/// raises it up to 32 MiB as large blocks are freed, after which they are reused from
/// its heap and stay resident). A threshold the user set (`MALLOC_MMAP_THRESHOLD_`)
/// stays.
fn return_freed_memory() {
    if !crate::protocol::malloc_mmap_threshold_set() {
        // SAFETY: mallopt only sets an allocator parameter.
        unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 10) };
    }
}

impl Unit {
    #[allow(clippy::too_many_arguments)]
    fn new(
        members: &[usize],
        params: &[Tensor],
        names: &[String],
        rank: usize,
        world: usize,
        reshard: bool,
    ) -> Result<Unit> {
        let shapes: Vec<Vec<i64>> = members.iter().map(|&i| params[i].size()).collect();
        let (pieces, len) = layout(&shapes, world);
        let options = match members.first() {
            Some(&i) => (params[i].kind(), params[i].device()),
            None => (tch::Kind::Float, tch::Device::Cpu),
        };
        for &i in members {
            if (params[i].kind(), params[i].device()) != options {
                return Err(Error::Usage(format!(
                    "variable `{}` is {:?} on {:?}, and `{}` of the same fully sharded unit is \
                     {:?} on {:?}: a unit's variables are gathered in one buffer. Give them one \
                     dtype and device, or put them in different units (fully_shard)",
                    names[i],
                    params[i].kind(),
                    params[i].device(),
                    names[members[0]],
                    options.0,
                    options.1
                )));
            }
        }
        let shard = Tensor::zeros([len], options);
        let grad = Tensor::zeros([len + members.len() as i64], options);
        let (mut views, mut grads) = (Vec::new(), Vec::new());
        tch::no_grad(|| -> Result<()> {
            for piece in &pieces {
                let view = shard.narrow(0, piece.offset, piece.chunk_len());
                let view = view.view(piece.chunk_shape().as_slice());
                let grad_view = grad
                    .narrow(0, piece.offset, piece.chunk_len())
                    .view(piece.chunk_shape().as_slice());
                hooks::set_grad(&view, &grad_view)?;
                views.push(view);
                grads.push(grad_view);
            }
            Ok(())
        })?;
        let unit = Unit {
            members: members.to_vec(),
            pieces,
            shard,
            grad,
            views,
            grads,
            ready: vec![false; members.len()],
            gathered: true,
            gathering: None,
            reshard,
        };
        unit.cut(params, rank);
        Ok(unit)
    }

    /// Copies this rank's rows of the unit's (gathered) parameters into its shard; the
    /// padding stays zero.
    fn cut(&self, params: &[Tensor], rank: usize) {
        tch::no_grad(|| {
            for (&i, piece) in self.members.iter().zip(&self.pieces) {
                if let Some(mine) = piece.rows_in_full(&params[i], rank) {
                    let mut shard = piece.rows_in_shard(&self.shard, rank).expect("rows");
                    shard.copy_(&mine);
                }
            }
        });
    }
}

impl ShardedParameters for Inner {
    /// Every unit gathered exactly (in the parameters' own dtype, under mixed
    /// precision too) around `f`, which reads (a save) or writes (a load) the
    /// parameters; after a load the shards are cut from them. Then every unit is as
    /// it was: freed, or gathered again (rounded, under mixed precision).
    fn with_full_parameters(&self, loaded: bool, f: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        self.settle()?;
        let rounded = self.low.is_some();
        let mut before = Vec::new();
        for u in 0..self.units.len() {
            let mut unit = self.unit(u);
            before.push(unit.gathered);
            unit.gathered &= !rounded;
            self.gather_locked(&mut unit, true)?;
        }
        let r = f();
        if loaded && r.is_ok() {
            self.recut()?;
        }
        for (u, gathered) in before.into_iter().enumerate() {
            let mut unit = self.unit(u);
            if !gathered {
                self.free_locked(&mut unit)?;
            } else if rounded {
                unit.gathered = false;
                self.gather_locked(&mut unit, false)?;
            }
        }
        r
    }
}

impl Inner {
    fn unit(&self, u: usize) -> MutexGuard<'_, Unit> {
        self.units[u].lock().expect("unit lock")
    }

    /// Keeps a hook's failure for the caller of `backward`: whether it went well.
    fn kept(&self, r: Result<()>) -> bool {
        match r {
            Ok(()) => true,
            Err(e) => {
                self.failure.lock().expect("failure lock").get_or_insert(e);
                false
            }
        }
    }

    /// Runs a unit's forward pass between its gather and, at stage 3, its reshard; the
    /// output's gradient gathers it again before the unit's backward pass.
    pub fn around_forward(&self, u: usize, forward: impl FnOnce() -> Tensor) -> Result<Tensor> {
        self.gather_ahead(u, true)?;
        let out = forward();
        if self.unit(u).reshard {
            if out.requires_grad() {
                hooks::on_gradient(&out, &self.gather_hook, u)?;
            }
            self.free(u)?;
        }
        Ok(out)
    }

    /// Cuts every unit's shard again from its gathered parameters (after a load).
    pub fn recut(&self) -> Result<()> {
        let rank = self.group.rank();
        for u in 0..self.units.len() {
            self.unit(u).cut(&self.params, rank);
        }
        Ok(())
    }

    fn gather(&self, u: usize) -> Result<()> {
        self.gather_locked(&mut self.unit(u), false)
    }

    /// Gathers unit `u` for a forward (`forward`) or a backward pass, and starts the
    /// all-gather of the unit whose pass comes next, so that it runs during this
    /// unit's compute: the next unit of the forward order in a forward pass, the
    /// previous one in a backward pass (FSDP's prefetch, one unit ahead).
    fn gather_ahead(&self, u: usize, forward: bool) -> Result<()> {
        self.gather(u)?;
        let next = {
            let mut order = self.forward_order.lock().expect("forward order lock");
            match order.iter().position(|&v| v == u) {
                Some(at) if forward => order.get(at + 1).copied(),
                Some(at) => at.checked_sub(1).map(|before| order[before]),
                // A unit's first forward pass gives it its place, last: none follows yet.
                None => {
                    if forward {
                        order.push(u);
                    }
                    None
                }
            }
        };
        match next {
            Some(next) => self.prefetch(next),
            None => Ok(()),
        }
    }

    /// Starts unit `u`'s all-gather if it is neither gathered nor being gathered.
    fn prefetch(&self, u: usize) -> Result<()> {
        let mut unit = self.unit(u);
        if !unit.gathered && unit.gathering.is_none() && !unit.members.is_empty() {
            unit.gathering = Some(self.start_gather(&unit, false)?);
        }
        Ok(())
    }

    /// Starts the all-gather of the unit's shards (one collective) into a buffer:
    /// in the low precision under mixed precision, unless `exact`.
    fn start_gather(&self, unit: &Unit, exact: bool) -> Result<Gathering> {
        let world = self.group.world_size();
        let len = unit.shard.numel() as i64;
        let low = self
            .low
            .filter(|_| !exact && unit.shard.kind() == tch::Kind::Float);
        let input = match low {
            Some(kind) => unit.shard.to_kind(kind),
            None => unit.shard.shallow_clone(),
        };
        let buffer = input.new_empty([world as i64 * len], (input.kind(), input.device()));
        let chunks: Vec<Tensor> = (0..world)
            .map(|r| buffer.narrow(0, r as i64 * len, len))
            .collect();
        let pending = self.group.all_gather_start(&chunks, &input)?;
        let bytes = len as usize * input.kind().elt_size_in_bytes();
        self.counts
            .all_gather_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
        Ok(Gathering {
            pending,
            chunks,
            _input: input,
        })
    }

    /// Waits for the prefetched all-gathers that no pass used (a unit the forward
    /// order expected and this step skipped), before a step changes the shards they
    /// read: what they gathered is dropped.
    fn settle(&self) -> Result<()> {
        for u in 0..self.units.len() {
            let gathering = self.unit(u).gathering.take();
            if let Some(gathering) = gathering {
                gathering.pending.wait()?;
            }
        }
        Ok(())
    }

    /// All-gathers the unit's shards (one collective, or the one prefetched) into its
    /// parameters' memory; `exact`: in their own dtype under mixed precision too (no
    /// prefetched gather is pending then).
    fn gather_locked(&self, unit: &mut Unit, exact: bool) -> Result<()> {
        if unit.gathered || unit.members.is_empty() {
            return Ok(());
        }
        let Gathering {
            pending, chunks, ..
        } = match unit.gathering.take() {
            Some(gathering) => {
                self.counts
                    .prefetched_all_gathers
                    .fetch_add(1, Ordering::Relaxed);
                gathering
            }
            None => self.start_gather(unit, exact)?,
        };
        pending.wait()?;
        self.counts.all_gathers.fetch_add(1, Ordering::Relaxed);
        tch::no_grad(|| -> Result<()> {
            for (&i, piece) in unit.members.iter().zip(&unit.pieces) {
                let full = hooks::storage_alias(&self.params[i])?;
                for (r, chunk) in chunks.iter().enumerate() {
                    if let Some(part) = piece.rows_in_shard(chunk, r) {
                        piece.rows_in_full(&full, r).expect("rows").copy_(&part);
                    }
                }
            }
            Ok(())
        })?;
        unit.gathered = true;
        Ok(())
    }

    fn free(&self, u: usize) -> Result<()> {
        self.free_locked(&mut self.unit(u))
    }

    fn free_locked(&self, unit: &mut Unit) -> Result<()> {
        for &i in &unit.members {
            hooks::free_storage(&self.params[i])?;
        }
        unit.gathered = false;
        Ok(())
    }

    /// Parameter `i`'s gradient was accumulated: once all of its unit's are, the unit
    /// is [`complete`](Self::complete).
    fn grad_ready(&self, i: usize) -> Result<()> {
        let (u, j) = self.unit_of[i];
        {
            let mut unit = self.unit(u);
            unit.ready[j] = true;
            if unit.ready.contains(&false) {
                return Ok(());
            }
        }
        self.complete(u)
    }

    /// Unit `u`'s gradients of this backward pass are all accumulated: it frees its
    /// parameters (stage 3) and, unless the cycle goes on, it reduce-scatters its
    /// gradients, and so do the complete units after it in the [`Order`], up to the
    /// first that is not.
    fn complete(&self, u: usize) -> Result<()> {
        {
            let mut unit = self.unit(u);
            unit.ready.fill(false);
            if unit.reshard {
                self.free_locked(&mut unit)?;
            }
        }
        if !self.sync.load(Ordering::SeqCst) {
            return Ok(());
        }
        let mut order = self.order.lock().expect("order lock");
        order.complete[u] = true;
        let n = self.units.len();
        while order.next < n && order.complete[n - 1 - order.next] {
            let mut unit = self.unit(n - 1 - order.next);
            self.reduce(&mut unit)?;
            order.next += 1;
        }
        Ok(())
    }

    /// Reduce-scatters (averages) the unit's full gradients into its gradient shard
    /// (one collective, which also tells every rank which members had a gradient on
    /// some rank), then drops the full gradients. A member no rank had a gradient for
    /// gets none on its shard for this step.
    fn reduce(&self, unit: &mut Unit) -> Result<()> {
        let world = self.group.world_size();
        let (len, stride) = (unit.shard.numel() as i64, unit.grad.numel() as i64);
        // Only the padding, and the pieces of members without a gradient, are zeroed:
        // the rest is written below.
        let buffer = unit.grad.new_empty(
            [world as i64 * stride],
            (unit.grad.kind(), unit.grad.device()),
        );
        let chunks: Vec<Tensor> = (0..world)
            .map(|r| buffer.narrow(0, r as i64 * stride, stride))
            .collect();
        tch::no_grad(|| {
            let had: Vec<f32> = unit
                .members
                .iter()
                .map(|&i| {
                    if self.params[i].grad().defined() {
                        1.0
                    } else {
                        0.0
                    }
                })
                .collect();
            // The flags, after every rank's chunk (one copy, broadcast over the ranks).
            let flags = Tensor::from_slice(&had).to_device(buffer.device());
            buffer
                .view([world as i64, stride])
                .narrow(1, len, stride - len)
                .copy_(&flags);
            for (&i, piece) in unit.members.iter().zip(&unit.pieces) {
                let g = self.params[i].grad();
                for (r, chunk) in chunks.iter().enumerate() {
                    let (_, rows) = piece.rows_of(r);
                    let written = if g.defined() { rows * piece.row_len } else { 0 };
                    let mut padding =
                        chunk.narrow(0, piece.offset + written, piece.chunk_len() - written);
                    let _ = padding.zero_();
                    let src = g.defined().then(|| piece.rows_in_full(&g, r)).flatten();
                    if let Some(src) = src {
                        piece.rows_in_shard(chunk, r).expect("rows").copy_(&src);
                    }
                }
            }
        });
        self.group
            .reduce_scatter_into(&unit.grad, &chunks, ReduceOp::Avg)?;
        self.counts.reduce_scatters.fetch_add(1, Ordering::Relaxed);
        // For the sharded loop's check that its steps averaged gradients.
        self.group.count_gradient_average();
        let had = Vec::<f64>::try_from(
            unit.grad
                .narrow(0, len, stride - len)
                .to_kind(tch::Kind::Double),
        )?;
        for ((view, grad), had) in unit.views.iter().zip(&unit.grads).zip(had) {
            match had > 0.0 {
                true => hooks::set_grad(view, grad)?,
                false => hooks::clear_grad(view)?,
            }
        }
        for &i in &unit.members {
            hooks::clear_grad(&self.params[i])?;
        }
        Ok(())
    }
}

/// The names of `params` among the store's named variables (by their data), and the
/// store's variables and buffers in name order (every rank's order).
pub(crate) fn named(
    params: &[Tensor],
    named: &HashMap<String, Tensor>,
) -> (Vec<(String, Tensor)>, Vec<Tensor>) {
    let by_data: HashMap<usize, &String> = named
        .iter()
        .map(|(n, t)| (t.data_ptr() as usize, n))
        .collect();
    let params = params
        .iter()
        .map(|p| {
            let name = by_data
                .get(&(p.data_ptr() as usize))
                .map_or_else(String::new, |n| (*n).clone());
            (name, p.shallow_clone())
        })
        .collect();
    let mut all: Vec<(&String, &Tensor)> = named.iter().collect();
    all.sort_by(|a, b| a.0.cmp(b.0));
    (
        params,
        all.into_iter().map(|(_, t)| t.shallow_clone()).collect(),
    )
}
