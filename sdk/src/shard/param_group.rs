//! One unit's parameters, sharded: FSDP2's `FSDPParamGroup` on the parameter side,
//! with its names (`unshard`, `reshard`, `reshard_after_forward`, `param_dtype`) and an
//! explicit [`ShardedState`]. The unit owns its members' dim-0 shards (one flat tensor
//! per rank, see [`layout`](super::layout)), all-gathers them into the members' own
//! memory before a pass (unshard) and frees that memory after it (reshard), and knows
//! how many of its passes'
//! backward work is still to come. It lives as long as the run (the run's context
//! keeps it): an optimizer steps its shards while it lives, and a unit whose optimizer
//! is gone keeps gathering around its passes, so the model stays usable.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tch::{Device, Kind, Tensor};

use super::hooks::{self, Hook};
use super::layout::{layout, Piece};
use super::offload::{self, Placement};
use super::param::FsdpParam;
use super::policy::Policy;
use crate::error::{Error, Result};
use crate::process_group::{Pending, ProcessGroup};
use crate::unit_registry::ShardedParameters;

/// Counters of a unit's all-gathers, which its optimizer's
/// [`ShardingStats`](super::ShardingStats) add up.
#[derive(Default)]
pub(crate) struct GatherCounts {
    pub all_gathers: AtomicU64,
    pub prefetched_all_gathers: AtomicU64,
    pub all_gather_bytes: AtomicU64,
}

/// An all-gather started and not waited for (FSDP2's `AllGatherResult`).
pub(crate) struct AllGatherResult {
    pending: Pending,
    /// Its output, one chunk per rank (views of one buffer).
    chunks: Vec<Tensor>,
    /// The members it gathers.
    members: std::ops::Range<usize>,
    /// Its input (the shard, or its low-precision copy), alive until it completes.
    _input: Tensor,
}

/// A unit's parameters and their shard (see the module's documentation).
pub(crate) struct UnitParams {
    group: ProcessGroup,
    /// Under mixed precision, the dtype fp32 units are all-gathered in for their
    /// passes (bf16 or fp16, FSDP2's `MixedPrecisionPolicy(param_dtype=…)`); exact
    /// gathers (a save, the end of the run) are in the parameters' own dtype.
    param_dtype: Option<Kind>,
    /// The most bytes one all-gather's buffer holds, but for a member alone (the run's
    /// bucket cap).
    gather_bytes: usize,
    /// Where the shard is kept (the `offload` setting), and the members' device.
    pub placement: Placement,
    pub device: Device,
    pub counts: GatherCounts,
    state: Mutex<Unit>,
}

/// The mutable part of [`UnitParams`].
pub(crate) struct Unit {
    /// The members, in their order in the shard.
    pub members: Vec<FsdpParam>,
    /// This rank's flat shard of the members (padded chunks, one after another): what
    /// the optimizer steps, in host memory when offloaded ([`Placement`]).
    pub shard: Tensor,
    /// With [`Placement::HostAndDevice`], the shard's copy on the device that the
    /// all-gathers read, and whether it holds the shard's values (not since a step or
    /// a load wrote the shard: see [`shard_written`](Self::shard_written)).
    device_shard: Option<Tensor>,
    device_fresh: bool,
    /// Whether the members hold every rank's values, or an all-gather of them is on
    /// its way.
    pub state: ShardedState,
    /// Resharded (the members' memory freed) after each forward and backward pass: a
    /// stage-3 unit, FSDP2's `reshard_after_forward=True`; otherwise kept unsharded.
    pub reshard_after_forward: bool,
    /// The backward work of this unit's passes that has not run yet: the gradients of
    /// their inputs (counted only for units with frozen members, whose weights the
    /// inputs' gradients read after every member's gradient is accumulated), and
    /// whether the unit's gradients of this backward pass are all accumulated. A
    /// resharding unit is freed after its backward pass once both are done.
    pub inputs_pending: usize,
    pub grads_done: bool,
    /// Inside one of the unit's forward passes (never resharded then).
    pub in_pass: bool,
}

/// Where a unit's parameters stand, as FSDP2's `ShardedState`, with the all-gather in
/// flight as a state of its own.
pub(crate) enum ShardedState {
    /// This rank holds its shard alone: the members' memory is freed, or holds values
    /// older than the shard (after a step or a load), to be all-gathered again.
    Sharded,
    /// An all-gather was started ahead of the unit's pass (FSDP's prefetch) and not
    /// waited for; the members are as in `Sharded` until it is.
    Unsharding(AllGatherResult),
    /// The members hold every rank's values: in `param_dtype` when `rounded` (for a
    /// pass under mixed precision), else exactly the shards' values.
    Unsharded { rounded: bool },
}

impl ShardedState {
    /// The members hold every rank's values.
    pub fn is_unsharded(&self) -> bool {
        matches!(self, ShardedState::Unsharded { .. })
    }

    /// The members hold every rank's values exactly (not rounded to `param_dtype`).
    pub fn is_exact(&self) -> bool {
        matches!(self, ShardedState::Unsharded { rounded: false })
    }
}

impl UnitParams {
    /// Puts back in the unit's dtype and device the members that the program converted
    /// while they were whole (`vs.double()`, `vs.set_device(…)` inside
    /// [`summon_full_params`](super::summon_full_params)), and says which: the shard,
    /// the optimizer's state and the gathers stay in the dtype and device the unit was
    /// sharded in, so a conversion would otherwise be undone at the next gather
    /// without a word (the model training in its old dtype).
    fn undo_conversions(&self, unit: &mut Unit) -> Option<Error> {
        let kind = unit.shard.kind();
        let mut first = None;
        for m in &mut unit.members {
            let now = (m.unsharded.kind(), m.unsharded.device());
            if now == (kind, self.device) {
                continue;
            }
            let back = tch::no_grad(|| m.unsharded.to_device(self.device).to_kind(kind));
            m.unsharded.set_data(&back);
            first.get_or_insert((m.name.clone(), now));
        }
        let (name, (to_kind, to_device)) = first?;
        Some(Error::Usage(format!(
            "variable `{name}` was converted to {to_kind:?} on {to_device:?} while gathered \
             whole: it is sharded by ZeRO stage 3 (fully_shard) as {kind:?} on {:?}, and its \
             shard and optimizer state stay so. Give the VarStore its dtype and device before \
             the model is built (`VarStore::new(device)`, then `vs.set_kind(kind)`, then the \
             layers); the conversion was undone",
            self.device
        )))
    }

    /// Shards `params` (named `names`, whole and holding every rank's agreed values)
    /// over `group`: this rank keeps its rows of each, where `policy` offloads them.
    /// With `reshard_after_forward`, the members' memory is freed now, and after each
    /// of the unit's passes. The policy's bucket cap caps an all-gather's buffer (see
    /// [`runs`](Self::runs)).
    ///
    /// # Errors
    /// [`Error::Usage`] for members of different dtypes or devices, or one
    /// that is not a whole contiguous tensor; [`Error::Torch`] when a storage cannot
    /// be freed.
    pub fn new(
        group: &ProcessGroup,
        names: Vec<String>,
        params: Vec<Tensor>,
        policy: &Policy,
        reshard_after_forward: bool,
    ) -> Result<UnitParams> {
        let (rank, world) = (group.rank(), group.world_size());
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
        let options = match params.first() {
            Some(p) => (p.kind(), p.device()),
            None => (Kind::Float, tch::Device::Cpu),
        };
        for (name, p) in names.iter().zip(&params) {
            if (p.kind(), p.device()) != options {
                return Err(Error::Usage(format!(
                    "variable `{name}` is {:?} on {:?}, and `{}` of the same fully sharded unit \
                     is {:?} on {:?}: a unit's variables are gathered in one buffer. Give them \
                     one dtype and device, or put them in different units (fully_shard)",
                    p.kind(),
                    p.device(),
                    names[0],
                    options.0,
                    options.1
                )));
            }
        }
        let shapes: Vec<Vec<i64>> = params.iter().map(Tensor::size).collect();
        let (pieces, len) = layout(&shapes, world);
        let placement = Placement::of(policy.offload, options.1);
        let shard = match placement {
            Placement::Device => Tensor::zeros([len], options),
            Placement::HostAndDevice | Placement::Host => {
                offload::host_zeros(len, options.0, options.1)
            }
        };
        let device_shard =
            (placement == Placement::HostAndDevice).then(|| Tensor::zeros([len], options));
        let members = names
            .into_iter()
            .zip(params)
            .zip(pieces)
            .map(|((name, param), piece)| FsdpParam::new(name, param, piece, &shard))
            .collect();
        let mut unit = Unit {
            members,
            shard,
            device_shard,
            device_fresh: false,
            state: ShardedState::Unsharded { rounded: false },
            reshard_after_forward,
            inputs_pending: 0,
            grads_done: true,
            in_pass: false,
        };
        unit.cut(rank);
        let me = UnitParams {
            group: group.clone(),
            param_dtype: policy.param_dtype,
            gather_bytes: policy.bucket_bytes,
            placement,
            device: options.1,
            counts: GatherCounts::default(),
            state: Mutex::new(unit),
        };
        {
            let mut unit = me.lock();
            if reshard_after_forward {
                free_unsharded(&mut unit)?;
            } else if policy.param_dtype.is_some() {
                // A unit that stays unsharded holds the rounded parameters from the
                // start, as after each step.
                me.mark_sharded(&mut unit)?;
                me.unshard_locked(&mut unit, false)?;
            }
        }
        Ok(me)
    }

    pub fn lock(&self) -> MutexGuard<'_, Unit> {
        self.state.lock().expect("unit lock")
    }

    /// All-gathers the unit for a pass (in `param_dtype` under mixed precision), or
    /// waits for the all-gather prefetched for it: FSDP2's `unshard`.
    pub fn unshard(&self) -> Result<()> {
        self.unshard_locked(&mut self.lock(), false)
    }

    /// Starts the unit's all-gather (for a pass) if it is sharded, not unsharded nor
    /// being unsharded: FSDP's prefetch.
    pub fn prefetch(&self) -> Result<()> {
        let mut unit = self.lock();
        if matches!(unit.state, ShardedState::Sharded) && !unit.members.is_empty() {
            let members = 0..unit.members.len();
            let gathering = self.start_all_gather(&mut unit, false, members)?;
            unit.state = ShardedState::Unsharding(gathering);
        }
        Ok(())
    }

    /// Waits for a prefetched all-gather that no pass used, before a step changes the
    /// shard it reads; what it gathered is dropped.
    pub fn settle(&self) -> Result<()> {
        let mut unit = self.lock();
        match std::mem::replace(&mut unit.state, ShardedState::Sharded) {
            ShardedState::Unsharding(gathering) => gathering.pending.wait(),
            state => {
                unit.state = state;
                Ok(())
            }
        }
    }

    /// Marks the members as older than the shard (after a step or a load changed it),
    /// so that the next [`unshard`](Self::unshard) all-gathers them again; an all-gather
    /// in flight is waited for and dropped.
    ///
    /// # Errors
    /// [`Error::Collective`] when the all-gather in flight fails.
    pub fn mark_sharded(&self, unit: &mut Unit) -> Result<()> {
        match std::mem::replace(&mut unit.state, ShardedState::Sharded) {
            ShardedState::Unsharding(gathering) => gathering.pending.wait(),
            _ => Ok(()),
        }
    }

    /// Frees the members' memory (a unit that reshards after forward, after a pass):
    /// FSDP2's `reshard`.
    pub fn reshard(&self) -> Result<()> {
        free_unsharded(&mut self.lock())
    }

    /// [`reshard`](Self::reshard) with the lock held.
    pub fn reshard_locked(&self, unit: &mut Unit) -> Result<()> {
        free_unsharded(unit)
    }

    /// Runs the unit's forward pass on `input` between its gather and, if it
    /// reshards, its reshard, for a unit no optimizer steps (sharded when it was
    /// declared, or whose optimizer is gone); the output's gradient gathers it again
    /// before the unit's backward pass, after which it stays gathered until its next
    /// pass.
    ///
    /// # Errors
    /// [`Error::Collective`] when the gather fails.
    pub fn around_forward(
        self: &Arc<Self>,
        input: &Tensor,
        forward: impl FnOnce(&Tensor) -> Tensor,
    ) -> Result<Tensor> {
        self.unshard()?;
        let reshard_after_forward = {
            let mut unit = self.lock();
            unit.in_pass = true;
            unit.reshard_after_forward
        };
        let out = forward(input);
        self.lock().in_pass = false;
        if reshard_after_forward {
            if out.requires_grad() {
                let me = self.clone();
                let unshard: Arc<Hook> = Arc::new(move |_| me.unshard().is_ok());
                hooks::on_gradient(&out, &unshard, 0)?;
            }
            self.reshard()?;
        }
        Ok(out)
    }

    /// The unit's gradients of this backward pass are all accumulated: it is
    /// resharded if nothing else of its backward pass is to come.
    pub fn grads_done(&self) -> Result<()> {
        let mut unit = self.lock();
        unit.grads_done = true;
        after_backward(&mut unit)
    }

    /// `input` for a pass of the unit, as a view of its own whose gradient, once
    /// computed, tells the unit that its pass's backward work is done (or, if the
    /// pass's graph is dropped before, that none is to come).
    ///
    /// # Errors
    /// [`Error::Torch`] when the hook cannot be set.
    pub fn watch_input(self: &Arc<Self>, input: &Tensor) -> Result<Tensor> {
        let view = input.alias();
        self.lock().inputs_pending += 1;
        let watch = InputWatch {
            unit: self.clone(),
            done: AtomicBool::new(false),
        };
        let hook: Arc<Hook> = Arc::new(move |_| watch.done().is_ok());
        hooks::on_gradient(&view, &hook, 0)?;
        Ok(view)
    }

    /// Starts the all-gather of members `members` of the unit (their chunks are one
    /// contiguous range of the shard: one collective) into a buffer: in `param_dtype`
    /// under mixed precision, unless `exact`.
    fn start_all_gather(
        &self,
        unit: &mut Unit,
        exact: bool,
        members: std::ops::Range<usize>,
    ) -> Result<AllGatherResult> {
        let world = self.group.world_size();
        let start = unit.members[members.start].piece.offset;
        let last = &unit.members[members.end - 1].piece;
        let end = last.offset + last.chunk_len();
        let len = end - start;
        let low = self
            .param_dtype
            .filter(|_| !exact && unit.shard.kind() == Kind::Float);
        let range = self.gather_input(unit, start, len)?;
        let input = match low {
            Some(kind) => range.to_kind(kind),
            None => range,
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
        Ok(AllGatherResult {
            pending,
            chunks,
            members,
            _input: input,
        })
    }

    /// Elements `start..start + len` of the shard on the members' device, as an
    /// all-gather's input: the shard itself, or its copy on the device (refreshed first
    /// if the shard was written since), or a copy made now ([`Placement`]).
    ///
    /// # Errors
    /// [`Error::Torch`] when a copy fails.
    fn gather_input(&self, unit: &mut Unit, start: i64, len: i64) -> Result<Tensor> {
        match (self.placement, &unit.device_shard) {
            (Placement::HostAndDevice, Some(copy)) => {
                if !unit.device_fresh {
                    offload::copy(copy, &unit.shard)?;
                    unit.device_fresh = true;
                }
                Ok(copy.narrow(0, start, len))
            }
            (Placement::Host, _) => {
                offload::to_device(&unit.shard.narrow(0, start, len), self.device)
            }
            _ => Ok(unit.shard.narrow(0, start, len)),
        }
    }

    /// The members in runs whose all-gather buffer (every rank's chunks) holds at most
    /// `gather_bytes` (a member alone may hold more): a big unit, such as the root of a
    /// model with no units, is gathered a bucket at a time rather than whole at once.
    fn runs(&self, unit: &Unit, exact: bool) -> Vec<std::ops::Range<usize>> {
        let world = self.group.world_size();
        let elt = match self
            .param_dtype
            .filter(|_| !exact && unit.shard.kind() == Kind::Float)
        {
            Some(kind) => kind.elt_size_in_bytes(),
            None => unit.shard.kind().elt_size_in_bytes(),
        };
        let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
        let mut bytes = 0;
        for (j, member) in unit.members.iter().enumerate() {
            let size = member.piece.chunk_len() as usize * elt * world;
            match runs.last_mut() {
                Some(run) if bytes + size <= self.gather_bytes => run.end = j + 1,
                _ => {
                    runs.push(j..j + 1);
                    bytes = 0;
                }
            }
            bytes += size;
        }
        runs
    }

    /// All-gathers the unit's shard (or waits for the all-gather prefetched for it)
    /// into its members' memory, a run of members at a time (see [`runs`](Self::runs));
    /// `exact`: in their own dtype under mixed precision too (a rounded unit is
    /// all-gathered again). An unsharded unit is left as it is.
    pub fn unshard_locked(&self, unit: &mut Unit, exact: bool) -> Result<()> {
        let rounded = self.param_dtype.is_some() && unit.shard.kind() == Kind::Float;
        let done = match unit.state {
            ShardedState::Unsharded { rounded } => !(exact && rounded),
            _ => false,
        };
        if done || unit.members.is_empty() {
            return Ok(());
        }
        match std::mem::replace(&mut unit.state, ShardedState::Sharded) {
            ShardedState::Unsharding(gathering) if !exact => {
                self.counts
                    .prefetched_all_gathers
                    .fetch_add(1, Ordering::Relaxed);
                copy_out(unit, gathering)?;
            }
            other => {
                if let ShardedState::Unsharding(gathering) = other {
                    gathering.pending.wait()?;
                }
                for run in self.runs(unit, exact) {
                    let gathering = self.start_all_gather(unit, exact, run)?;
                    copy_out(unit, gathering)?;
                }
            }
        }
        self.counts.all_gathers.fetch_add(1, Ordering::Relaxed);
        unit.state = ShardedState::Unsharded {
            rounded: rounded && !exact,
        };
        Ok(())
    }
}

/// Waits for `gathering` and copies every rank's rows of its members into their
/// memory (FSDP2's `foreach_all_gather_copy_out`).
fn copy_out(unit: &Unit, gathering: AllGatherResult) -> Result<()> {
    let AllGatherResult {
        pending,
        chunks,
        members,
        ..
    } = gathering;
    pending.wait()?;
    let base = unit.members[members.start].piece.offset;
    unit.members[members]
        .iter()
        .try_for_each(|member| member.copy_out(&chunks, base))
}

impl Unit {
    /// The member whose [`tensor_key`](crate::ffi::tensor_key) is `key`.
    pub fn member(&self, key: usize) -> Option<usize> {
        self.members
            .iter()
            .position(|m| crate::ffi::tensor_key(&m.unsharded) == key)
    }

    /// Copies this rank's rows of the (gathered) members into the shard; the padding
    /// stays zero.
    pub fn cut(&mut self, rank: usize) {
        for member in &self.members {
            member.cut(&self.shard, rank);
        }
        self.shard_written();
    }

    /// The shard was written (by a step, a load or [`cut`](Self::cut)): a copy of it
    /// on the device is refreshed before the next all-gather reads it.
    pub fn shard_written(&mut self) {
        self.device_fresh = false;
    }
}

/// A pass's input whose gradient the unit waits for (see
/// [`UnitParams::watch_input`]): done when the gradient is computed, or when the hook
/// is dropped with the pass's graph before that.
struct InputWatch {
    unit: Arc<UnitParams>,
    done: AtomicBool,
}

impl InputWatch {
    fn done(&self) -> Result<()> {
        if self.done.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let mut unit = self.unit.lock();
        unit.inputs_pending = unit.inputs_pending.saturating_sub(1);
        after_backward(&mut unit)
    }
}

impl Drop for InputWatch {
    fn drop(&mut self) {
        if let Err(e) = self.done() {
            crate::log::warn(format_args!(
                "resharding a unit after its backward pass: {e}"
            ));
        }
    }
}

/// Reshards a resharding unit once its backward work is done: its gradients are
/// accumulated and its passes' inputs have their gradients.
fn after_backward(unit: &mut Unit) -> Result<()> {
    if unit.reshard_after_forward
        && unit.state.is_unsharded()
        && unit.grads_done
        && unit.inputs_pending == 0
        && !unit.in_pass
    {
        free_unsharded(unit)?;
    }
    Ok(())
}

/// Frees the members' memory (FSDP2's `free_unsharded_param`): until the next
/// all-gather, reading one is an error that says why and what to do. An all-gather
/// in flight stays in flight.
fn free_unsharded(unit: &mut Unit) -> Result<()> {
    for member in &unit.members {
        member.free_unsharded()?;
    }
    if unit.state.is_unsharded() {
        unit.state = ShardedState::Sharded;
    }
    Ok(())
}

impl ShardedParameters for UnitParams {
    /// The unit gathered exactly (in the parameters' own dtype, under mixed precision
    /// too) around `f`, which reads (a save) or writes (a load, `writeback`) the
    /// parameters; after a write the shard is cut from them. Then the unit is as it
    /// was: freed, or gathered again (rounded, under mixed precision).
    fn with_full_parameters(
        &self,
        writeback: bool,
        f: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        self.settle()?;
        let before = {
            let mut unit = self.lock();
            let before = match unit.state {
                ShardedState::Unsharded { rounded } => Some(rounded),
                _ => None,
            };
            self.unshard_locked(&mut unit, true)?;
            before
        };
        let r = f();
        let mut unit = self.lock();
        let converted = self.undo_conversions(&mut unit);
        if writeback && r.is_ok() && converted.is_none() {
            unit.cut(self.group.rank());
        }
        match before {
            None => free_unsharded(&mut unit)?,
            Some(true) => {
                self.mark_sharded(&mut unit)?;
                self.unshard_locked(&mut unit, false)?;
            }
            Some(false) => {}
        }
        match converted {
            Some(e) => Err(e),
            None => r,
        }
    }

    /// The members whole and exact for good: gathered in their own dtype and no
    /// longer resharded (what the run leaves once the function returns).
    fn make_whole(&self) -> Result<()> {
        self.settle()?;
        let mut unit = self.lock();
        self.unshard_locked(&mut unit, true)?;
        unit.reshard_after_forward = false;
        Ok(())
    }

    fn whole(&self, key: usize) -> Result<Option<Tensor>> {
        let mut unit = self.lock();
        let Some(j) = unit.member(key) else {
            return Ok(None);
        };
        let (param, piece) = (
            unit.members[j].unsharded.shallow_clone(),
            unit.members[j].piece.clone(),
        );
        if unit.state.is_exact() {
            return Ok(Some(param));
        }
        // The member's chunk alone, from every rank.
        let world = self.group.world_size();
        let len = piece.chunk_len();
        let input = self.gather_input(&mut unit, piece.offset, len)?;
        let buffer = input.new_empty([world as i64 * len], (input.kind(), input.device()));
        let chunks: Vec<Tensor> = (0..world)
            .map(|r| buffer.narrow(0, r as i64 * len, len))
            .collect();
        self.group.all_gather_start(&chunks, &input)?.wait()?;
        let whole = Tensor::empty(param.size().as_slice(), (param.kind(), param.device()));
        let alone = Piece {
            offset: 0,
            ..piece.clone()
        };
        tch::no_grad(|| {
            for (r, chunk) in chunks.iter().enumerate() {
                if let Some(part) = alone.rows_in_shard(chunk, r) {
                    alone.rows_in_full(&whole, r).expect("rows").copy_(&part);
                }
            }
        });
        Ok(Some(whole))
    }

    fn load_rows(
        &self,
        key: usize,
        rows: &mut dyn FnMut(i64, i64) -> Result<Tensor>,
    ) -> Result<bool> {
        let mut unit = self.lock();
        let Some(j) = unit.member(key) else {
            return Ok(false);
        };
        let piece = unit.members[j].piece.clone();
        let rank = self.group.rank();
        let (first, count) = piece.rows_of(rank);
        if count > 0 {
            let values = rows(first, count)?;
            tch::no_grad(|| -> Result<()> {
                piece
                    .rows_in_shard(&unit.shard, rank)
                    .expect("rows")
                    .f_copy_(&values.reshape([count, piece.row_len]))?;
                Ok(())
            })?;
            unit.shard_written();
        }
        Ok(true)
    }

    fn holds(&self, key: usize) -> bool {
        self.lock().member(key).is_some()
    }

    fn after_load(&self) -> Result<()> {
        self.settle()?;
        let mut unit = self.lock();
        if let ShardedState::Unsharded { rounded } = unit.state {
            // The members hold the values before the load: all-gathered again.
            self.mark_sharded(&mut unit)?;
            self.unshard_locked(&mut unit, !rounded)?;
        }
        Ok(())
    }
}
