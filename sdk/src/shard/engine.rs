//! The sharded parameters of one optimizer: ZeRO stages 2 and 3 with FSDP2's
//! semantics. The parameters are grouped in units ([`UnitParams`]: the `fully_shard`
//! units, and the root for the rest), each cut on dim 0 into exact `1/world_size`
//! shards (see [`layout`](super::layout)); the optimizer steps the shards. Gradients
//! are reduce-scattered in buckets, as soon as a bucket's gradients are all accumulated
//! (a hook on each parameter's gradient accumulator, as c10d's Reducer): one bucket per
//! unit, and the root's gradients in buckets of at most the bucket cap, in the order
//! the backward pass makes them (DeepSpeed ZeRO-2's `reduce_bucket_size`). Parameters
//! are all-gathered after the step (stage 2, and stage 3's root), or around each
//! forward and backward pass of a unit (stage 3).
//!
//! Frozen variables (`requires_grad` off when the optimizer is built) are never
//! stepped and never reduce-scattered; at stage 3 those of a unit are sharded with it
//! (they take memory too, as in FSDP2), elsewhere they stay whole.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use tch::{Device, Kind, Tensor};

use super::collectives::{agree_used, reduce_scatter, Bucket, Order};
use super::hooks::{self, GradHooks, Hook};
use super::layout::{layout, Piece};
use super::offload;
use super::param_group::UnitParams;
use super::policy::Policy;
use crate::error::{Error, Result};
use crate::ffi::tensor::SyncTensors;
use crate::ffi::tensor_key;
use crate::mesh::Mesh;
use crate::process_group::{ProcessGroup, ReduceOp};
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
    /// Reduce-scatters of gradients: one per bucket and cycle (one bucket per unit;
    /// the root's gradients in buckets of at most the bucket cap).
    pub reduce_scatters: u64,
    /// Those run at the step rather than in the backward pass, where they overlap the
    /// compute: the backward pass left their bucket, or one before it in the order the
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
    /// What the optimizer steps, one per parameter in its order: see `shards`.
    shards: Vec<Tensor>,
    hooks: GradHooks,
}

pub(crate) struct Inner {
    /// Every rank of the job: the start's broadcast and the agreement on which
    /// members had a gradient.
    group: ProcessGroup,
    /// The ranks the parameters are sharded over: the job's, or hybrid sharding's
    /// shard group ([`Mesh`]).
    shard: ProcessGroup,
    /// Hybrid sharding's replicate group, across which each gradient shard is
    /// all-reduced after its reduce-scatter.
    replicate: Option<ProcessGroup>,
    stage: u8,
    /// The parameters' device: that of the collectives' tensors.
    device: Device,
    /// Whether some unit keeps its shard in host memory (the `offload` setting).
    offloaded: bool,
    /// The optimizer's parameters (whole), in its order (read from autograd's threads
    /// too: see [`SyncTensors`]).
    params: SyncTensors,
    /// Per parameter, its unit and its place among the unit's members; none for a
    /// frozen variable that stays whole.
    unit_of: Vec<Option<(usize, usize)>>,
    /// Per parameter, its gradient bucket and its place in it; none for a frozen one.
    bucket_of: Vec<Option<(usize, usize)>>,
    /// The parameters whose gradients are hooked (the trainable ones), in the hooks'
    /// order.
    hooked: Vec<usize>,
    /// The parameters that were frozen when the optimizer was built.
    frozen: Vec<usize>,
    /// Unit 0 is the root: the parameters no declared unit claims.
    units: Vec<Arc<UnitParams>>,
    /// Per unit, whether it has frozen members: the gradients of its passes' inputs
    /// then read their weights after the unit's own gradients are accumulated, so it
    /// is resharded after those too.
    frozen_members: Vec<bool>,
    /// The gradient buckets, in the order they are reduce-scattered on every rank.
    buckets: Vec<Mutex<Bucket>>,
    /// Per unit, its bucket (a declared unit has at most one).
    bucket_of_unit: Vec<Option<usize>>,
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
    reduce_scatters: AtomicU64,
    reduce_scatters_at_step: AtomicU64,
    /// The first failure inside a hook, which fails the backward pass.
    failure: Mutex<Option<Error>>,
    /// The hook that gathers a unit before its backward pass.
    unshard_hook: Arc<Hook>,
}

/// The parameters of an optimizer that fall into one unit.
struct Claim {
    /// The unit's slot among the declared units (none for the root).
    slot: Option<usize>,
    /// The members (places in the optimizer).
    members: Vec<usize>,
    /// The unit's parameters, when they were sharded before.
    before: Option<Arc<UnitParams>>,
}

impl Sharding {
    /// Shards `params` (the optimizer's, with their names) over `group` at `stage`
    /// (2 or 3), or over `mesh`'s shard group and replicated across its replicate
    /// group (hybrid sharding), in the units declared in `registry` that claim some of them (or
    /// that were sharded already, as `fully_shard` does in a stage-3 job), and
    /// registers the units there, with the run's `policy`: under mixed precision, the
    /// dtype fp32 units are all-gathered and computed in; the bucket cap of the root's
    /// gradient buckets; what is offloaded to host memory. Every rank gets rank 0's values of `all` (the
    /// store's variables and buffers, in an order every rank agrees on) first, as
    /// DDP's construction does, but those sharded before (agreed then).
    ///
    /// # Errors
    /// [`Error::Collective`] when the ranks' models differ or a collective fails;
    /// [`Error::Usage`] for a parameter that is not a whole contiguous tensor or a
    /// unit that mixes dtypes or devices.
    pub fn new(
        group: &ProcessGroup,
        mesh: Option<&Mesh>,
        stage: u8,
        params: Vec<(String, Tensor)>,
        all: &[Tensor],
        registry: &Units,
        policy: Policy,
    ) -> Result<Sharding> {
        let bucket_bytes = policy.bucket_bytes;
        let declared = registry.declared();
        let shard = mesh.map_or(group, |m| &m.shard);
        let (names, params): (Vec<String>, Vec<Tensor>) = params.into_iter().unzip();
        let claims = claim(&declared, &names, &params, stage);
        group.verify_same_shapes(all)?;
        let presharded: std::collections::HashSet<usize> = claims
            .iter()
            .filter(|claim| claim.before.is_some())
            .flat_map(|claim| claim.members.iter().map(|&i| tensor_key(&params[i])))
            .collect();
        let agreed: Vec<Tensor> = all
            .iter()
            .filter(|t| !presharded.contains(&tensor_key(t)))
            .map(Tensor::shallow_clone)
            .collect();
        if !agreed.is_empty() {
            group.broadcast_coalesced(&agreed, BROADCAST_BYTES, 0)?;
        }
        if params.iter().any(|p| p.device() == tch::Device::Cpu) {
            crate::host_memory::return_freed_memory();
        }
        if stage == 3 && claims.len() == 1 && group.rank() == 0 {
            crate::log::warn(
                "ZeRO stage 3 with no fully_shard unit: the parameters stay whole on every \
                 rank (the optimizer state and the gradients are sharded, as at stage 2). \
                 Wrap the model's blocks in tch_distributed::fully_shard(block, &path) to \
                 shard the parameters too",
            );
        }
        let mut unit_of = vec![None; params.len()];
        let mut units = Vec::new();
        let mut frozen_members = Vec::new();
        for (u, claim) in claims.into_iter().enumerate() {
            let Claim {
                slot,
                members,
                before,
            } = claim;
            let reshard_after_forward = stage == 3 && u > 0;
            let unit = match before {
                Some(unit) => {
                    // Sharded when it was declared: kept gathered from now on at stage 2.
                    let mut state = unit.lock();
                    if !reshard_after_forward && state.reshard_after_forward {
                        state.reshard_after_forward = false;
                        unit.unshard_locked(&mut state, false)?;
                    }
                    drop(state);
                    unit
                }
                None => {
                    let unit = Arc::new(UnitParams::new(
                        shard,
                        members.iter().map(|&i| names[i].clone()).collect(),
                        members.iter().map(|&i| params[i].shallow_clone()).collect(),
                        &policy,
                        reshard_after_forward,
                    )?);
                    registry.add_sharded(unit.clone() as Arc<dyn ShardedParameters>);
                    if let Some(slot) = slot {
                        declared[slot].set_params(unit.clone());
                    }
                    unit
                }
            };
            for (j, &i) in members.iter().enumerate() {
                unit_of[i] = Some((u, j));
            }
            frozen_members.push(members.iter().any(|&i| !params[i].requires_grad()));
            units.push((slot, unit));
        }
        // The buckets, in the reduce-scatters' order: the declared units' from the
        // last to the first, then the root's.
        let trainable = |u: usize| -> Vec<usize> {
            let mut members: Vec<(usize, usize)> = unit_of
                .iter()
                .enumerate()
                .filter_map(|(i, place)| match place {
                    Some((v, j)) if *v == u && params[i].requires_grad() => Some((*j, i)),
                    _ => None,
                })
                .collect();
            members.sort_unstable();
            members.into_iter().map(|(_, i)| i).collect()
        };
        let mut groups: Vec<(usize, Vec<usize>)> = (1..units.len())
            .rev()
            .map(|u| (u, trainable(u)))
            .filter(|(_, members)| !members.is_empty())
            .collect();
        let mut root: Vec<(usize, Vec<usize>)> = Vec::new();
        let mut bytes = 0;
        for i in trainable(0).into_iter().rev() {
            let size = params[i].numel() * params[i].kind().elt_size_in_bytes();
            match root.last_mut() {
                Some((_, members)) if bytes + size <= bucket_bytes.max(1) => members.push(i),
                _ => {
                    root.push((0, vec![i]));
                    bytes = 0;
                }
            }
            bytes += size;
        }
        groups.extend(root);
        let world = shard.world_size();
        let mut bucket_of = vec![None; params.len()];
        let mut bucket_of_unit = vec![None; units.len()];
        let mut buckets = Vec::new();
        for (b, (u, members)) in groups.into_iter().enumerate() {
            let unit = units[u].1.lock();
            let shapes: Vec<Vec<i64>> = members.iter().map(|&i| params[i].size()).collect();
            let (pieces, len) = layout(&shapes, world);
            let grad = Tensor::zeros([len], (unit.shard.kind(), unit.shard.device()));
            let mut views = Vec::new();
            let mut grads = Vec::new();
            for (k, (&i, piece)) in members.iter().zip(&pieces).enumerate() {
                bucket_of[i] = Some((b, k));
                let (_, j) = unit_of[i].expect("in a unit");
                let view = unit.members[j].sharded.shallow_clone();
                let grad_view = grad
                    .narrow(0, piece.offset, piece.chunk_len())
                    .view(piece.chunk_shape().as_slice());
                hooks::set_grad(&view, &grad_view)?;
                views.push(view);
                grads.push(grad_view);
            }
            bucket_of_unit[u] = Some(b);
            buckets.push(Mutex::new(Bucket {
                unit: u,
                ready: vec![false; members.len()],
                used: vec![false; members.len()],
                members,
                pieces,
                views,
                grad,
                grads,
            }));
        }
        // A unit without trainable members has no gradients to wait for.
        for (u, (_, unit)) in units.iter().enumerate() {
            unit.lock().grads_done = bucket_of_unit[u].is_none();
        }
        let hooked: Vec<usize> = (0..params.len())
            .filter(|&i| params[i].requires_grad())
            .collect();
        let frozen: Vec<usize> = (0..params.len())
            .filter(|&i| !params[i].requires_grad())
            .collect();
        let n_buckets = buckets.len();
        let device = params.first().map_or(Device::Cpu, Tensor::device);
        let offloaded = units.iter().any(|(_, unit)| unit.placement.offloaded());
        let slots: Vec<Option<usize>> = units.iter().map(|(slot, _)| *slot).collect();
        let inner = Arc::new_cyclic(|me: &Weak<Inner>| {
            let me = me.clone();
            let unshard_hook: Arc<Hook> = Arc::new(move |u| match me.upgrade() {
                Some(inner) => inner.kept(inner.unshard_ahead(u, false)),
                None => true,
            });
            Inner {
                group: group.clone(),
                shard: shard.clone(),
                replicate: mesh.map(|m| m.replicate.clone()),
                stage,
                device,
                offloaded,
                unit_of,
                bucket_of,
                frozen,
                units: units.into_iter().map(|(_, unit)| unit).collect(),
                frozen_members,
                buckets,
                bucket_of_unit,
                sync: AtomicBool::new(true),
                order: Mutex::new(Order {
                    next: 0,
                    complete: vec![false; n_buckets],
                    finished: false,
                }),
                forward_order: Mutex::new(Vec::new()),
                reduce_scatters: AtomicU64::new(0),
                reduce_scatters_at_step: AtomicU64::new(0),
                failure: Mutex::new(None),
                unshard_hook,
                hooked,
                params: params.into(),
            }
        });
        for (u, slot) in slots.iter().enumerate() {
            if let Some(slot) = slot {
                let engine: Arc<dyn std::any::Any + Send + Sync> = inner.clone();
                declared[*slot].bind(Arc::downgrade(&engine), u);
            }
        }
        let weak = Arc::downgrade(&inner);
        let ready: Arc<Hook> = Arc::new(move |h| match weak.upgrade() {
            Some(inner) => inner.kept(inner.grad_ready(inner.hooked[h])),
            None => true,
        });
        let hooked: Vec<Tensor> = inner
            .hooked
            .iter()
            .map(|&i| inner.params[i].shallow_clone())
            .collect();
        let hooks = GradHooks::new(&hooked, &ready)?;
        let shards = (0..inner.params.len())
            .map(|i| match inner.unit_of[i] {
                Some((u, j)) => inner.units[u].lock().members[j].sharded.shallow_clone(),
                // A frozen variable that stays whole: it never has a gradient.
                None => inner.params[i].shallow_clone(),
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
        let inner = &self.inner;
        let load = |n: &AtomicU64| n.load(Ordering::Relaxed);
        let mut stats = ShardingStats {
            reduce_scatters: load(&inner.reduce_scatters),
            reduce_scatters_at_step: load(&inner.reduce_scatters_at_step),
            ..Default::default()
        };
        for unit in &inner.units {
            stats.all_gathers += load(&unit.counts.all_gathers);
            stats.prefetched_all_gathers += load(&unit.counts.prefetched_all_gathers);
            stats.all_gather_bytes += load(&unit.counts.all_gather_bytes);
        }
        stats
    }

    /// The ZeRO stage (2 or 3).
    pub fn stage(&self) -> u8 {
        self.inner.stage
    }

    /// What the optimizer steps, one per parameter in its order: the shards, each with
    /// its gradient's shard as `.grad`, and the frozen variables that stay whole.
    pub fn shards(&self) -> Vec<Tensor> {
        self.shards.iter().map(Tensor::shallow_clone).collect()
    }

    /// This rank and the world size the shards are cut for: its place in the shard
    /// group and the group's size (the job's, but under hybrid sharding).
    pub fn rank_and_world_size(&self) -> (usize, usize) {
        (self.inner.shard.rank(), self.inner.shard.world_size())
    }

    /// Whether this rank's shards are the first copy of them: under hybrid sharding,
    /// whether it is in the first shard group (the others hold the same shards); any
    /// rank otherwise. A checkpoint's state is written once per shard.
    pub fn first_replica(&self) -> bool {
        self.inner
            .replicate
            .as_ref()
            .map_or(true, |r| r.rank() == 0)
    }

    /// Parameter `i`'s piece: its place in its unit, or (a frozen variable that stays
    /// whole) its own dim-0 chunks.
    fn piece(&self, i: usize) -> Piece {
        let piece = match self.inner.unit_of[i] {
            Some((u, j)) => self.inner.units[u].lock().members[j].piece.clone(),
            None => {
                let shape = self.inner.params[i].size();
                layout(&[shape], self.inner.shard.world_size()).0.remove(0)
            }
        };
        Piece { offset: 0, ..piece }
    }

    /// Parameter `i`'s shaped chunk `t` (a state tensor of it) without its padding:
    /// this rank's rows only (none for a rank past the end).
    pub fn unpadded(&self, i: usize, t: &Tensor) -> Tensor {
        let (_, rows) = self.piece(i).rows_of(self.inner.shard.rank());
        t.narrow(0, 0, rows)
    }

    /// This rank's chunk of `full` (a tensor of parameter `i`'s shape), padded with
    /// zeros to the chunk's rows.
    /// The chunk is where the optimizer steps parameter `i` (host memory, offloaded).
    pub fn chunk(&self, i: usize, full: &Tensor) -> Tensor {
        let full = full.to_device(self.shards[i].device());
        let piece = self.piece(i);
        let rank = self.inner.shard.rank();
        let chunk = full.new_zeros([piece.chunk_len()], (full.kind(), full.device()));
        if let Some(mine) = piece.rows_in_full(&full, rank) {
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
    /// a bucket is complete at the same point on every rank whichever of its members
    /// a rank's loss leaves out (a bucket none of whose members are in the graph is
    /// complete now).
    ///
    /// # Errors
    /// [`Error::Usage`] when a variable frozen at the optimizer's build requires a
    /// gradient now; [`Error::Torch`] when the graph cannot be searched;
    /// [`Error::Collective`] when a reduce-scatter this completes fails.
    pub fn begin_backward(&self, loss: &Tensor, sync: bool) -> Result<()> {
        let inner = &self.inner;
        if let Some(&i) = inner
            .frozen
            .iter()
            .find(|&&i| inner.params[i].requires_grad())
        {
            let name = match inner.unit_of[i] {
                Some((u, j)) => inner.units[u].lock().members[j].name.clone(),
                None => format!("number {i}"),
            };
            return Err(Error::Usage(format!(
                "variable `{name}` was frozen (requires_grad off) when its sharded optimizer \
                 was built and requires a gradient now: ZeRO shards, reduce-scatters and \
                 steps the variables that were trainable at the build, so it would train \
                 apart on each rank. Set requires_grad before building the optimizer, or \
                 build a new optimizer after unfreezing"
            )));
        }
        let reachable = self.hooks.reachable(std::slice::from_ref(loss))?;
        let hook_of: HashMap<usize, usize> = inner
            .hooked
            .iter()
            .enumerate()
            .map(|(h, &i)| (i, h))
            .collect();
        inner.sync.store(sync, Ordering::SeqCst);
        for b in 0..inner.buckets.len() {
            let complete = {
                let mut guard = inner.bucket(b);
                let bucket = &mut *guard;
                for (ready, i) in bucket.ready.iter_mut().zip(&bucket.members) {
                    *ready = !reachable[hook_of[i]];
                }
                !bucket.ready.contains(&false)
            };
            if complete {
                inner.complete(b)?;
            }
        }
        Ok(())
    }

    /// The failure that made a backward pass fail inside a hook, if one did.
    pub fn take_failure(&self) -> Option<Error> {
        self.inner.failure.lock().expect("failure lock").take()
    }

    /// Before a step: the buckets whose gradients no hook reduce-scattered in this
    /// cycle (some member got no gradient, or an earlier bucket of the [`Order`] did
    /// not) are reduce-scattered now, in that order on every rank, a missing gradient
    /// counting as zero (as DDP's `find_unused_parameters`); once a cycle, the ranks
    /// agree on which members had a gradient ([`agree_used`]); a stage-3 unit still
    /// gathered after the backward pass is freed.
    ///
    /// # Errors
    /// [`Error::Collective`] when a collective fails.
    pub fn finish_gradients(&self) -> Result<()> {
        let inner = &self.inner;
        for unit in &inner.units {
            unit.settle()?;
        }
        let mut order = inner.order.lock().expect("order lock");
        for b in order.next..inner.buckets.len() {
            let mut bucket = inner.bucket(b);
            bucket.ready.fill(false);
            inner.reduce(&mut bucket)?;
            inner
                .reduce_scatters_at_step
                .fetch_add(1, Ordering::Relaxed);
        }
        order.next = inner.buckets.len();
        if !order.finished {
            agree_used(&inner.group, &inner.buckets, inner.device)?;
            if inner.offloaded {
                // The gradient shards' copies to the host, before the CPU reads them.
                offload::wait_for_copies(inner.device);
            }
            order.finished = true;
        }
        for unit in &inner.units {
            let mut state = unit.lock();
            if state.reshard_after_forward && state.state.is_unsharded() && !state.in_pass {
                unit.reshard_locked(&mut state)?;
            }
        }
        Ok(())
    }

    /// After a step: the next cycle reduce-scatters again, and the units that stay
    /// gathered (every unit at stage 2, the root at stage 3) all-gather the updated
    /// shards into their parameters.
    ///
    /// # Errors
    /// [`Error::Collective`] when a gather fails.
    pub fn after_step(&self) -> Result<()> {
        {
            let mut order = self.inner.order.lock().expect("order lock");
            order.next = 0;
            order.complete.fill(false);
            order.finished = false;
        }
        for unit in &self.inner.units {
            let mut state = unit.lock();
            state.shard_written();
            if !state.reshard_after_forward {
                // The step changed the shard: all-gathered again (after any all-gather
                // still in flight, of the shard before).
                unit.mark_sharded(&mut state)?;
                unit.unshard_locked(&mut state, false)?;
            }
        }
        Ok(())
    }

    /// The gradients' global L2 norm over the shards (one all-reduce of the sum of
    /// squares over the shard group, whose shards make the whole), as FSDP2's
    /// `clip_grad_norm_`, and scales them by `max / (norm +
    /// 1e-6)` when that is below 1 (tch's arithmetic). Returns the norm.
    ///
    /// # Errors
    /// [`Error::Collective`] when the all-reduce fails.
    pub fn clip_grad_norm(&self, max: f64) -> Result<f64> {
        let grads: Vec<Tensor> = (0..self.inner.buckets.len())
            .map(|b| self.inner.bucket(b).grad.shallow_clone())
            .filter(|g| g.numel() > 0)
            .collect();
        let Some(first) = grads.first() else {
            return Ok(0.0);
        };
        let squares = tch::no_grad(|| {
            let total = first.zeros_like().sum(Kind::Double);
            grads.iter().fold(total, |acc, g| {
                acc + g.to_kind(Kind::Double).square().sum(Kind::Double)
            })
        });
        // On the collectives' device (the gradients may be offloaded to the host).
        let mut squares = squares.to_device(self.inner.device);
        self.inner.shard.all_reduce(&mut squares, ReduceOp::Sum)?;
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

/// Which optimizer parameters go to which unit: a unit sharded before (by
/// `fully_shard` in a stage-3 job) keeps its members, if they are this optimizer's;
/// every other parameter goes to the declared unit with the longest prefix of its name
/// (a nested unit claims its own), else to the root (unit 0). At stage 2, frozen
/// variables go to no unit (they stay whole, and nothing of theirs is sharded); at
/// stage 3 a declared unit's frozen variables are sharded with it, and the root's stay
/// whole.
fn claim(
    declared: &[Arc<crate::unit_registry::Slot>],
    names: &[String],
    params: &[Tensor],
    stage: u8,
) -> Vec<Claim> {
    let place: HashMap<usize, usize> = params
        .iter()
        .enumerate()
        .map(|(i, p)| (tensor_key(p), i))
        .collect();
    let mut taken = vec![false; params.len()];
    let mut units = vec![Claim {
        slot: None,
        members: Vec::new(),
        before: None,
    }];
    let mut open = Vec::new();
    for (s, slot) in declared.iter().enumerate() {
        let before = slot.params().and_then(|p| p.downcast::<UnitParams>().ok());
        match before {
            Some(unit) => {
                let members: Option<Vec<usize>> = unit
                    .lock()
                    .members
                    .iter()
                    .map(|m| place.get(&tensor_key(&m.unsharded)).copied())
                    .collect();
                // A unit of another store's variables is another optimizer's.
                if let Some(members) = members.filter(|m| !m.is_empty()) {
                    for &i in &members {
                        taken[i] = true;
                    }
                    units.push(Claim {
                        slot: Some(s),
                        members,
                        before: Some(unit),
                    });
                }
            }
            None => open.push(s),
        }
    }
    let mut claimed: Vec<Vec<usize>> = vec![Vec::new(); open.len()];
    for (i, name) in names.iter().enumerate() {
        let trainable = params[i].requires_grad();
        if taken[i] || (!trainable && stage < 3) {
            continue;
        }
        let unit = open
            .iter()
            .enumerate()
            .filter(|(_, &s)| name.starts_with(&declared[s].prefix))
            .max_by_key(|(_, &s)| declared[s].prefix.len())
            .map(|(k, _)| k);
        match unit {
            Some(k) => claimed[k].push(i),
            None if trainable => units[0].members.push(i),
            None => {}
        }
    }
    for (k, members) in claimed.into_iter().enumerate() {
        if !members.is_empty() {
            units.push(Claim {
                slot: Some(open[k]),
                members,
                before: None,
            });
        }
    }
    units
}

impl Inner {
    fn bucket(&self, b: usize) -> MutexGuard<'_, Bucket> {
        self.buckets[b].lock().expect("bucket lock")
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

    /// Runs a unit's forward pass on `input` between its gather and, at stage 3, its
    /// reshard; the output's gradient gathers it again before the unit's backward
    /// pass. A unit with frozen members and an input that requires a gradient is
    /// resharded after its backward pass only once the input's gradient is computed
    /// (the frozen weights are read for it), as FSDP2's post-backward hook on the
    /// inputs.
    pub fn around_forward(
        &self,
        u: usize,
        input: &Tensor,
        forward: impl FnOnce(&Tensor) -> Tensor,
    ) -> Result<Tensor> {
        self.unshard_ahead(u, true)?;
        let unit = &self.units[u];
        let reshard_after_forward = {
            let mut state = unit.lock();
            if self.bucket_of_unit[u].is_some() {
                state.grads_done = false;
            }
            state.in_pass = true;
            state.reshard_after_forward
        };
        let watch = reshard_after_forward && self.frozen_members[u] && input.requires_grad();
        let input = match watch {
            true => unit.watch_input(input)?,
            false => input.shallow_clone(),
        };
        let out = forward(&input);
        unit.lock().in_pass = false;
        if reshard_after_forward {
            if out.requires_grad() {
                hooks::on_gradient(&out, &self.unshard_hook, u)?;
            }
            unit.reshard()?;
        }
        Ok(out)
    }

    /// Gathers unit `u` for a forward (`forward`) or a backward pass, and starts the
    /// all-gather of the unit whose pass comes next, so that it runs during this
    /// unit's compute: the next unit of the forward order in a forward pass, the
    /// previous one in a backward pass (FSDP's prefetch, one unit ahead).
    fn unshard_ahead(&self, u: usize, forward: bool) -> Result<()> {
        self.units[u].unshard()?;
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
            Some(next) => self.units[next].prefetch(),
            None => Ok(()),
        }
    }

    /// Parameter `i`'s gradient was accumulated: once all of its bucket's are, the
    /// bucket is [`complete`](Self::complete).
    fn grad_ready(&self, i: usize) -> Result<()> {
        let (b, k) = self.bucket_of[i].expect("a trainable parameter");
        {
            let mut bucket = self.bucket(b);
            bucket.ready[k] = true;
            if bucket.ready.contains(&false) {
                return Ok(());
            }
        }
        self.complete(b)
    }

    /// Bucket `b`'s gradients of this backward pass are all accumulated: a stage-3
    /// unit's is resharded (when its inputs' gradients are done too) and, unless the
    /// cycle goes on, the bucket is reduce-scattered, and so are the complete buckets
    /// after it in the [`Order`], up to the first that is not.
    fn complete(&self, b: usize) -> Result<()> {
        let u = {
            let mut bucket = self.bucket(b);
            bucket.ready.fill(false);
            bucket.unit
        };
        self.units[u].grads_done()?;
        if !self.sync.load(Ordering::SeqCst) {
            return Ok(());
        }
        let mut order = self.order.lock().expect("order lock");
        order.complete[b] = true;
        let n = self.buckets.len();
        while order.next < n && order.complete[order.next] {
            let mut bucket = self.bucket(order.next);
            self.reduce(&mut bucket)?;
            order.next += 1;
        }
        Ok(())
    }

    /// Reduce-scatters bucket `bucket` over the shard group (see [`reduce_scatter`])
    /// and, under hybrid sharding, all-reduces (averages) its shard across the
    /// replicate group, as FSDP2's HSDP; an offloaded unit's shard is reduced on the
    /// device and copied to the host without waiting (see [`offload`]); counts it.
    fn reduce(&self, bucket: &mut Bucket) -> Result<()> {
        let unit = &self.units[bucket.unit];
        let offloaded = unit.placement.offloaded();
        let mut out = match offloaded {
            true => Tensor::empty(
                [bucket.grad.numel() as i64],
                (bucket.grad.kind(), unit.device),
            ),
            false => bucket.grad.shallow_clone(),
        };
        reduce_scatter(&self.shard, &self.params, bucket, &out)?;
        if let Some(replicate) = &self.replicate {
            replicate.all_reduce(&mut out, ReduceOp::Avg)?;
        }
        if offloaded {
            offload::copy(&bucket.grad, &out)?;
        }
        // For the sharded loop's check that its steps averaged gradients.
        self.group.count_gradient_average();
        self.reduce_scatters.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// The names of `params` among the store's named variables, and the store's variables
/// and buffers in name order (every rank's order).
pub(crate) fn named(
    params: &[Tensor],
    named: &HashMap<String, Tensor>,
) -> (Vec<(String, Tensor)>, Vec<Tensor>) {
    let by_key: HashMap<usize, &String> = named.iter().map(|(n, t)| (tensor_key(t), n)).collect();
    let params = params
        .iter()
        .map(|p| {
            let name = by_key
                .get(&tensor_key(p))
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
