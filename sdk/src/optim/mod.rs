//! `Optimizer`: the SDK's optimizer over a `VarStore`, with tch's API and
//! configurations (`nn::Sgd`, `nn::Adam`, `nn::AdamW`, `nn::RmsProp`), its state held
//! as tensors in `torch.optim`'s layout, its updates in ATen's multi-tensor or fused
//! kernels ([`kernels`]), and the DDP it steps through.

use std::cell::{Cell, OnceCell};
use std::sync::{Arc, Mutex};

use tch::nn::{self, VarStore, Variables};
use tch::Tensor;

use crate::amp::GradScaler;
use crate::ddp::DistributedDataParallel;
use crate::error::{Error, Result};
use crate::ffi;

mod deepspeed;
mod kernels;
mod scaler;
mod state;
mod zero;

pub use kernels::{Algorithm, Implementation};
use kernels::{Group, ParamState};

thread_local! {
    /// Set while the batch just yielded is the last of its data loader's epoch (the
    /// SDK's loaders and sharded loops set and clear it), as Accelerate's
    /// `GradientState.end_of_dataloader`: an accumulation cycle ends there.
    static END_OF_DATA: Cell<bool> = const { Cell::new(false) };
}

/// Marks whether the batch just yielded is the last of its epoch.
pub(crate) fn set_end_of_data(last: bool) {
    END_OF_DATA.with(|e| e.set(last));
}

/// Sets the gradients of `params` to none (undefined), as `zero_grad(set_to_none=True)`.
///
/// # Errors
/// [`Error::Torch`] from libtorch.
pub(crate) fn set_grads_to_none(params: &[Tensor]) -> Result<()> {
    ffi::optim::zero_grad(&ffi::TensorArray::new(params)).map_err(|t| Error::Torch(t.message()))
}

/// An optimizer configuration of tch (`nn::Sgd`, `nn::Adam`, `nn::AdamW`,
/// `nn::RmsProp`) that the SDK can build: its update rule and options.
pub trait OptimizerKind {
    /// The update rule, with this configuration's options.
    fn algorithm(&self) -> Algorithm;
}

impl OptimizerKind for nn::Sgd {
    fn algorithm(&self) -> Algorithm {
        Algorithm::Sgd {
            momentum: self.momentum,
            dampening: self.dampening,
            weight_decay: self.wd,
            nesterov: self.nesterov,
        }
    }
}

impl OptimizerKind for nn::Adam {
    fn algorithm(&self) -> Algorithm {
        Algorithm::Adam {
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.wd,
            amsgrad: self.amsgrad,
            decoupled: false,
        }
    }
}

impl OptimizerKind for nn::AdamW {
    fn algorithm(&self) -> Algorithm {
        Algorithm::Adam {
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.wd,
            amsgrad: self.amsgrad,
            decoupled: true,
        }
    }
}

impl OptimizerKind for nn::RmsProp {
    fn algorithm(&self) -> Algorithm {
        Algorithm::RmsProp {
            alpha: self.alpha,
            eps: self.eps,
            weight_decay: self.wd,
            momentum: self.momentum,
            centered: self.centered,
        }
    }
}

impl OptimizerKind for Algorithm {
    fn algorithm(&self) -> Algorithm {
        *self
    }
}

/// A gradient-descent optimizer over a `VarStore`'s trainable variables, with the
/// methods and configurations of `tch::nn::Optimizer`, plus:
///
/// - its updates run ATen's fused kernel for the whole update of a group (SGD, Adam,
///   AdamW: `torch.optim`'s `fused=True`, bit for bit), or one multi-tensor
///   (`_foreach_*`) kernel per operation (RMSprop: `foreach=True`); never a loop of
///   per-parameter kernels. [`with_implementation`](Self::with_implementation) picks
///   another, among them tch's own arithmetic for results that are the plain tch
///   program's to the bit;
/// - its state (moments, momentum buffers, step counts, the parameter groups' options)
///   is tensors it owns, saved and loaded in `torch.optim`'s `state_dict` layout
///   ([`state`](Self::state), [`load_state`](Self::load_state)), so PyTorch can load
///   it; [`state_bytes`](Self::state_bytes) says how much memory it takes;
/// - in a job of several ranks, the backward steps go through the
///   [`DistributedDataParallel`] it holds ([`distributed`](Self::distributed)), so the
///   gradients it steps on are averaged over the ranks;
/// - gradient accumulation ([`accumulate`](Self::accumulate)) and fp16 loss scaling
///   ([`grad_scaler`](Self::grad_scaler)) with the semantics of Accelerate's
///   `AcceleratedOptimizer`: [`backward`](Self::backward) divides and scales the loss,
///   and [`step`](Self::step) and [`zero_grad`](Self::zero_grad) do nothing in the
///   middle of an accumulation cycle.
///
/// A training step is either `opt.backward_step(&loss)?` or, spelled out,
/// `opt.zero_grad()?; opt.backward(&loss)?; opt.clip_grad_norm(1.0)?; opt.step()?;`.
pub struct Optimizer {
    variables: Arc<Mutex<Variables>>,
    /// The options new parameter groups start from (tch's `defaults`).
    defaults: Group,
    /// The parameter groups' options, by group number (tch's `Var::group`).
    groups: Vec<Group>,
    /// The variables the optimizer holds (the store's first `params.len()` trainable
    /// variables), with their group numbers and state, in the store's order.
    params: Vec<Tensor>,
    /// Each parameter's gradient accumulator as it joined the optimizer, held (see
    /// [`refuse_converted`](Self::refuse_converted)).
    accumulators: ffi::optim::GradAccumulators,
    groups_of: Vec<usize>,
    state: Vec<Option<ParamState>>,
    implementation: Implementation,
    /// How the gradients are averaged and the state is held over the ranks.
    mode: Mode,
    /// The usage error that the next call returns: a DDP given to a sharded optimizer.
    refused: Option<Error>,
    /// Micro-batches per optimizer step, and how many of the current cycle are done.
    accumulation_steps: usize,
    micro_step: usize,
    /// The next micro-step ends its cycle early (the data ran out).
    sync_next: bool,
    /// The last backward ended a cycle: the gradients are complete and `step` steps.
    cycle_complete: bool,
    scaler: Option<GradScaler>,
    /// The run's `gradient_clipping`: each step clips the gradients' global norm to it.
    clip_norm_at_step: Option<f64>,
    /// The updates made ([`steps_taken`](Optimizer::steps_taken)).
    steps_taken: u64,
    /// The rate of the step after `s` steps taken, which each step sets (the DeepSpeed
    /// file's `scheduler`: see [`schedule_lr`](Self::schedule_lr)).
    schedule: Option<Box<dyn Fn(u64) -> f64 + Send>>,
}

/// How an [`Optimizer`] averages the gradients and holds its state over the ranks: one
/// of these, never two.
enum Mode {
    /// Every rank holds the whole state and steps on whole gradients, averaged by the
    /// DDP when there is one: set by [`Optimizer::distributed`], or by `#[distributed]`
    /// at the first step of an optimizer the function did not build (none in a
    /// process of its own).
    Replicated(OnceCell<DistributedDataParallel>),
    /// ZeRO stage 1: the gradients as [`Mode::Replicated`] (averaged by the DDP), the
    /// state of this rank's rows of each parameter only ([`Optimizer::zero`]).
    Zero1 {
        zero: zero::Zero,
        ddp: OnceCell<DistributedDataParallel>,
    },
    /// ZeRO stages 2 and 3: the parameters, gradients and state sharded, the gradients
    /// reduce-scattered by the sharding itself (no DDP).
    Sharded(crate::shard::Sharding),
}

/// The error for a DDP and ZeRO stage `stage` (2 or 3) on one optimizer.
fn sharded_with_ddp(stage: u8) -> Error {
    Error::Usage(format!(
        "ZeRO stage {stage} reduce-scatters the gradients itself: build the optimizer \
         without a DistributedDataParallel (no .distributed(ddp))"
    ))
}

impl Mode {
    /// The DDP the gradients are averaged by, if any.
    fn ddp(&self) -> Option<&DistributedDataParallel> {
        match self {
            Mode::Replicated(ddp) | Mode::Zero1 { ddp, .. } => ddp.get(),
            Mode::Sharded(_) => None,
        }
    }

    /// The sharding at ZeRO stages 2 and 3.
    fn sharding(&self) -> Option<&crate::shard::Sharding> {
        match self {
            Mode::Sharded(sharding) => Some(sharding),
            Mode::Replicated(_) | Mode::Zero1 { .. } => None,
        }
    }

    /// The rows of each parameter at ZeRO stage 1.
    fn zero1(&self) -> Option<&zero::Zero> {
        match self {
            Mode::Zero1 { zero, .. } => Some(zero),
            Mode::Replicated(_) | Mode::Sharded(_) => None,
        }
    }
}

impl Optimizer {
    /// Builds `config` with learning rate `lr` over `vs`'s trainable variables, as
    /// `config.build(&vs, lr)` does in tch: one parameter group per `Var::group`,
    /// each starting with `config`'s options.
    ///
    /// # Errors
    /// [`Error::Torch`] when an option is out of range, with libtorch's
    /// own reason (e.g. `Invalid learning rate: -1` for Adam, `Nesterov momentum
    /// requires a momentum and zero dampening` for SGD).
    pub fn new(config: &impl OptimizerKind, vs: &VarStore, lr: f64) -> Result<Self> {
        let algorithm = config.algorithm();
        algorithm.check(lr)?;
        let defaults = Group { lr, algorithm };
        let mut opt = Optimizer {
            variables: vs.variables_.clone(),
            defaults,
            // tch's optimizer starts with one (empty) group.
            groups: vec![defaults],
            params: Vec::new(),
            accumulators: ffi::optim::GradAccumulators::new()
                .map_err(|t| Error::Torch(t.message()))?,
            groups_of: Vec::new(),
            state: Vec::new(),
            implementation: algorithm.preferred_implementation(),
            mode: Mode::Replicated(OnceCell::new()),
            refused: None,
            accumulation_steps: 1,
            micro_step: 0,
            sync_next: false,
            cycle_complete: false,
            scaler: None,
            clip_norm_at_step: None,
            steps_taken: 0,
            schedule: None,
        };
        opt.add_missing_variables()?;
        Ok(opt)
    }

    /// Runs the updates with `implementation`: ATen's fused kernels as `torch.optim`'s
    /// `fused=True` (the default for SGD, Adam and AdamW), `torch.optim`'s
    /// `foreach=True` arithmetic (RMSprop's default), or libtorch's C++ arithmetic,
    /// tch's, for results that are the plain tch program's to the bit. See
    /// [`Implementation`].
    ///
    /// # Errors
    /// [`Error::Usage`] for [`Implementation::Fused`] with RMSprop, which
    /// has no fused kernel.
    pub fn with_implementation(mut self, implementation: Implementation) -> Result<Self> {
        if implementation == Implementation::Fused
            && matches!(self.defaults.algorithm, Algorithm::RmsProp { .. })
        {
            return Err(Error::Usage(
                "RMSprop has no fused kernel in libtorch (torch.optim.RMSprop has no fused \
                 option): use Implementation::Foreach, one multi-tensor kernel per operation"
                    .into(),
            ));
        }
        self.implementation = implementation;
        Ok(self)
    }

    /// ZeRO, in a job of several ranks (in a world of one it changes nothing):
    ///
    /// - **stage 1** (DeepSpeed's ZeRO-1; PyTorch's `ZeroRedundancyOptimizer` shards
    ///   whole parameters instead): every parameter is cut on dim 0 as at stages 2 and
    ///   3 (`torch.chunk`'s `ceil(rows / world_size)` rows a rank); each rank keeps the
    ///   state of its rows of every parameter, exactly `1/N` of the state, and updates
    ///   them, then every rank broadcasts its rows to the others (one
    ///   `broadcast_coalesced` per rank, in place). DDP's gradient averaging is
    ///   unchanged: every rank still has every gradient.
    /// - **stage 2**, as FSDP2's `fully_shard(reshard_after_forward=False)` (DeepSpeed's
    ///   ZeRO-2): every parameter is cut on dim 0 into `world_size` chunks (padded, so
    ///   exactly `1/N` each); each rank keeps its chunk of every parameter, of its
    ///   gradient and of its state. Gradients are reduce-scattered (averaged) during
    ///   backward, one collective per unit (see [`fully_shard`](crate::fully_shard))
    ///   once its gradients are all accumulated, and the full gradients are dropped;
    ///   the step updates the chunks; the parameters are all-gathered after it. No DDP
    ///   is involved: build the optimizer without [`distributed`](Self::distributed).
    /// - **stage 3**, as FSDP2's `fully_shard` (ZeRO-3): stage 2, and the parameters of
    ///   each unit hold memory only around the unit's forward and backward passes
    ///   (all-gathered before each, freed after each). Outside them a unit's variables
    ///   hold no data: read them through the unit's forward pass or a checkpoint.
    ///   Variables that no unit claims (the root unit) stay gathered, as at stage 2.
    ///
    /// The parameters after each step are those of DDP, up to rounding (the average
    /// is taken in another order). Every rank gets rank 0's variables and buffers at
    /// stages 2 and 3, as DDP's construction gives them.
    ///
    /// # Errors
    /// [`Error::Usage`] for a stage other than 1, 2 and 3, for stages 2
    /// and 3 on an optimizer that steps through a DDP, or on one already at stage 2 or
    /// 3; with [`Error::Collective`] when the ranks' models differ.
    ///
    /// # Panics
    /// Only if the variable store's lock was poisoned by a panic in another thread.
    pub fn zero(mut self, stage: u8) -> Result<Self> {
        if !(1..=3).contains(&stage) {
            return Err(Error::Usage(format!(
                "ZeRO stage {stage}: use 1 (optimizer state), 2 (and gradients) or 3 (and \
                 parameters) sharded"
            )));
        }
        let Some(ctx) = crate::init::current().filter(|c| c.world_size() > 1) else {
            return Ok(self);
        };
        let ddp = match std::mem::replace(&mut self.mode, Mode::Replicated(OnceCell::new())) {
            Mode::Replicated(ddp) | Mode::Zero1 { ddp, .. } => ddp,
            Mode::Sharded(sharding) => {
                let was = sharding.stage();
                self.mode = Mode::Sharded(sharding);
                return Err(Error::Usage(format!(
                    "ZeRO stage {stage} asked of an optimizer already at stage {was}: call \
                     .zero(stage) once"
                )));
            }
        };
        if stage == 1 {
            let zero = zero::Zero::new(ctx);
            self.mode = Mode::Zero1 { zero, ddp };
            self.repartition();
            return Ok(self);
        }
        if ddp.get().is_some() {
            self.mode = Mode::Replicated(ddp);
            return Err(sharded_with_ddp(stage));
        }
        let (params, all) = {
            let v = self.variables.lock().expect("variable store lock");
            crate::shard::named(&self.params, &v.named_variables)
        };
        self.mode = Mode::Sharded(crate::shard::Sharding::new(
            ctx.process_group(),
            ctx.mesh(),
            stage,
            params,
            &all,
            ctx.units(),
            crate::shard::Policy::of(&ctx),
        )?);
        Ok(self)
    }

    /// Which dim-0 chunk of every parameter this rank's state holds, at ZeRO stages 1
    /// to 3: `(rank, world_size)`, the rows `torch.chunk` gives rank `rank` of
    /// `world_size`.
    pub(crate) fn dim0_shard(&self) -> Option<(usize, usize)> {
        match &self.mode {
            Mode::Sharded(sharding) => Some(sharding.rank_and_world_size()),
            Mode::Zero1 { zero, .. } => Some(zero.rank_and_world_size()),
            Mode::Replicated(_) => None,
        }
    }

    /// At ZeRO stages 1 to 3, the state shard this rank writes in a checkpoint, by its
    /// place among the ranks the state is cut for ([`dim0_shard`](Self::dim0_shard)):
    /// `Some(None)` for a rank whose shard another rank writes (hybrid sharding's
    /// later shard groups hold the first one's shards); `None` without ZeRO.
    pub(crate) fn state_shard(&self) -> Option<Option<usize>> {
        let (rank, _) = self.dim0_shard()?;
        Some(match &self.mode {
            Mode::Sharded(sharding) if !sharding.first_replica() => None,
            _ => Some(rank),
        })
    }

    /// What the sharded parameters' collectives did so far, at ZeRO stages 2 and 3.
    pub fn sharding_stats(&self) -> Option<crate::ShardingStats> {
        self.mode.sharding().map(|sharding| sharding.stats())
    }

    /// The ZeRO stage, when the state is sharded over several ranks.
    pub fn zero_stage(&self) -> Option<u8> {
        match &self.mode {
            Mode::Sharded(sharding) => Some(sharding.stage()),
            Mode::Zero1 { .. } => Some(1),
            Mode::Replicated(_) => None,
        }
    }

    /// The tensors whose gradients the step updates from: the trainable variables, or
    /// at ZeRO stages 2 and 3 this rank's shards of them.
    pub(crate) fn stepped_tensors(&self) -> Vec<Tensor> {
        match self.mode.sharding() {
            Some(sharding) => sharding.shards(),
            None => self.trainable_variables(),
        }
    }

    /// At ZeRO stages 2 and 3, the gradients of the cycle complete on the shards.
    pub(crate) fn finish_gradients(&self) -> Result<()> {
        match self.mode.sharding() {
            Some(sharding) => sharding.finish_gradients(),
            None => Ok(()),
        }
    }

    /// With ZeRO stage 1, cuts the parameters not cut yet (added since) and keeps this
    /// rank's rows of any state they have.
    fn repartition(&mut self) {
        let Mode::Zero1 { zero, .. } = &mut self.mode else {
            return;
        };
        let cut = zero.cut();
        zero.partition(&self.params);
        for i in cut..self.params.len() {
            let Some(state) = self.state[i].as_mut() else {
                continue;
            };
            if zero.rows(i, &self.params[i]).is_none() {
                self.state[i] = None;
                continue;
            }
            for t in state.tensors.iter_mut().flatten() {
                *t = zero
                    .rows(i, t)
                    .expect("rows of a tensor of the parameter's shape")
                    .copy();
            }
        }
    }

    /// Clips the gradients' global L2 norm to `max` at each step, before the update
    /// (the run's `gradient_clipping`, as DeepSpeed's engine and the HF Trainer's
    /// `max_grad_norm` do), as [`clip_grad_norm`](Self::clip_grad_norm) would.
    pub(crate) fn clip_norm_at_step(mut self, max: f64) -> Self {
        self.clip_norm_at_step = Some(max);
        self
    }

    /// Which kernels run the updates.
    pub fn implementation(&self) -> Implementation {
        self.implementation
    }

    /// The bytes of optimizer state this process holds (moments, momentum buffers,
    /// step counts): for Adam, 8 bytes per float32 parameter that has been updated
    /// (two float32 tensors of its shape), plus 4 per parameter tensor for the fused
    /// kernels' step count.
    pub fn state_bytes(&self) -> usize {
        self.state.iter().flatten().map(ParamState::bytes).sum()
    }

    /// Steps through `ddp`: backward steps all-reduce the gradients first. Over several
    /// ranks, trainable variables created on the store after this point are an error
    /// ([`Error::Usage`]) at the optimizer's next call: DDP would not average their
    /// gradients. At ZeRO stage 1 the DDP averages the gradients as without it; at
    /// stages 2 and 3, which reduce-scatter the gradients themselves, `ddp` is not used
    /// and the optimizer's next call is an [`Error::Usage`] saying so.
    pub fn distributed(mut self, ddp: DistributedDataParallel) -> Self {
        match &mut self.mode {
            Mode::Replicated(slot) | Mode::Zero1 { ddp: slot, .. } => *slot = OnceCell::from(ddp),
            Mode::Sharded(sharding) => self.refused = Some(sharded_with_ddp(sharding.stage())),
        }
        self
    }

    /// Gradient accumulation, as Accelerate's `gradient_accumulation_steps`: each
    /// backward step is one micro-batch; the loss is divided by `steps`; the first
    /// `steps - 1` micro-batches of a cycle run under DDP's `no_sync` (no
    /// all-reduce), and the last all-reduces the accumulated gradients, steps and
    /// starts the next cycle. The effective batch is per-rank batch × `steps` × world
    /// size. When the data ends mid-cycle the last micro-batch still steps (its loss
    /// is still divided by `steps`, as in Accelerate): the SDK's
    /// [`DataLoader`](crate::DataLoader) and sharded loops say when a batch is the
    /// last of its epoch; with other iterators call [`sync_next`](Self::sync_next)
    /// before the last micro-batch.
    pub fn accumulate(mut self, steps: usize) -> Self {
        self.accumulation_steps = steps.max(1);
        self
    }

    /// fp16 loss scaling, as `torch.amp.GradScaler` in a training loop:
    /// [`backward`](Self::backward) multiplies the loss by the scale; clipping
    /// unscales the gradients first; [`step`](Self::step) unscales them if clipping
    /// did not, skips the update when a gradient on any rank is inf or NaN, and
    /// updates the scale. The scaler's state goes into checkpoints with the
    /// optimizer ([`Checkpointer`](crate::Checkpointer)).
    pub fn grad_scaler(mut self, scaler: GradScaler) -> Self {
        self.scaler = Some(scaler);
        self
    }

    /// The loss scaler, if fp16 training uses one.
    pub fn scaler(&self) -> Option<&GradScaler> {
        self.scaler.as_ref()
    }

    /// The loss scaler, mutably (to restore its state).
    pub fn scaler_mut(&mut self) -> Option<&mut GradScaler> {
        self.scaler.as_mut()
    }

    /// Micro-batches per optimizer step ([`accumulate`](Self::accumulate); 1 without
    /// accumulation).
    pub fn accumulation_steps(&self) -> usize {
        self.accumulation_steps
    }

    /// The micro-batches of the accumulation cycle in progress whose gradients no
    /// step used yet (0 at a cycle's end, and always without accumulation): what a
    /// checkpoint saved now must keep with those gradients.
    pub fn micro_batches_accumulated(&self) -> usize {
        self.micro_step
    }

    /// This rank's gradients of the cycle in progress, by name: every trainable
    /// variable's that has one, whole at every ZeRO stage (its own micro-batches'
    /// sum, not yet averaged over the ranks: under DDP's `no_sync`, and FSDP2's
    /// `set_requires_gradient_sync(False)` at stages 2 and 3).
    pub(crate) fn accumulated_gradients(&self) -> Vec<(String, Tensor)> {
        state::param_names(self)
            .into_iter()
            .zip(&self.params)
            .map(|(name, p)| (name, p.grad()))
            .filter(|(_, g)| g.defined())
            .collect()
    }

    /// Whether each rank resumes an accumulation cycle with its own gradients (bit for
    /// bit) rather than the ranks' mean: not under a DDP that finds unused parameters,
    /// whose Reducer leaves as it is, unaveraged, a gradient that no rank's last
    /// micro-batch of the cycle produced (it counts the micro-batches before, under
    /// `no_sync`, as uses, which a resumed run's Reducer never saw). With the mean on
    /// every rank, such a gradient is the same on every rank, and the others average
    /// to the same value up to rounding.
    pub(crate) fn resumes_cycle_with_own_gradients(&self) -> bool {
        !self
            .mode
            .ddp()
            .is_some_and(|ddp| ddp.options().find_unused_parameters)
    }

    /// Resumes an accumulation cycle of which `done` micro-batches were accumulated
    /// into `grads` (by name, as [`accumulated_gradients`](Self::accumulated_gradients)
    /// gives them): each trainable variable's gradient becomes its entry (none when
    /// it has none), and the next backward passes go on with the cycle.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] (its path filled in by the caller) naming a gradient of
    /// no trainable variable or of another shape than its variable, before any
    /// gradient is set; [`Error::Torch`] when one cannot be set.
    pub(crate) fn resume_cycle(&mut self, done: usize, grads: &[(String, Tensor)]) -> Result<()> {
        self.add_missing_variables()?;
        let names = state::param_names(self);
        let place: std::collections::HashMap<&str, usize> = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.as_str(), i))
            .collect();
        let mut given: Vec<Option<&Tensor>> = vec![None; self.params.len()];
        for (name, grad) in grads {
            let unfit = match place.get(name.as_str()) {
                None => Some("the optimizer has no such trainable variable".to_string()),
                Some(&i) if grad.size() != self.params[i].size() => Some(format!(
                    "its shape is {:?}, the variable's {:?}",
                    grad.size(),
                    self.params[i].size()
                )),
                Some(&i) => {
                    given[i] = Some(grad);
                    None
                }
            };
            if let Some(why) = unfit {
                return Err(crate::error::checkpoint(
                    None,
                    format!("the accumulated gradient of `{name}` does not fit: {why}"),
                ));
            }
        }
        for (p, grad) in self.params.iter().zip(given) {
            match grad {
                Some(g) => crate::shard::set_grad(p, &g.to_device(p.device()).to_kind(p.kind()))?,
                None => set_grads_to_none(std::slice::from_ref(p))?,
            }
        }
        self.micro_step = done;
        self.cycle_complete = false;
        Ok(())
    }

    /// Makes the next backward step end its accumulation cycle: it all-reduces and
    /// steps even if the cycle is not full.
    pub fn sync_next(&mut self) {
        self.sync_next = true;
    }

    /// Whether the next backward step will all-reduce and step (Accelerate's
    /// `sync_gradients`): always without accumulation.
    pub fn is_sync_step(&self) -> bool {
        self.sync_next
            || self.micro_step + 1 >= self.accumulation_steps
            || END_OF_DATA.with(Cell::get)
    }

    /// Makes this optimizer step through `ddp` from now on, if it steps through none
    /// yet (one it has stays): `#[distributed]`, at the first step of an optimizer the
    /// function did not build.
    pub(crate) fn distributed_from_now(&self, ddp: DistributedDataParallel) {
        if let Mode::Replicated(slot) | Mode::Zero1 { ddp: slot, .. } = &self.mode {
            let _ = slot.set(ddp);
        }
    }

    /// The DDP this optimizer steps through, if any.
    pub fn ddp(&self) -> Option<&DistributedDataParallel> {
        self.mode.ddp()
    }

    /// Variables created after the optimizer join it, as in tch: in the store's order,
    /// each in its group (new groups start from the defaults).
    ///
    /// # Errors
    /// [`Error::Usage`] when it steps through DDP over several ranks:
    /// DDP averages the gradients of the variables that existed when it wrapped the
    /// model, so new ones would train apart on each rank; once, after a DDP was given
    /// to a sharded optimizer ([`distributed`](Self::distributed)).
    fn add_missing_variables(&mut self) -> Result<()> {
        if let Some(refused) = self.refused.take() {
            return Err(refused);
        }
        let first_new = {
            let v = self.variables.lock().expect("variable store lock");
            let before = self.params.len();
            let new = v.trainable_variables.len().saturating_sub(before);
            if new > 0 && self.averages_over_ranks() {
                let late: std::collections::HashSet<usize> = v.trainable_variables[before..]
                    .iter()
                    .map(|var| crate::ffi::tensor_key(&var.tensor))
                    .collect();
                let mut names: Vec<&str> = v
                    .named_variables
                    .iter()
                    .filter(|(_, t)| late.contains(&crate::ffi::tensor_key(t)))
                    .map(|(n, _)| n.as_str())
                    .collect();
                names.sort_unstable();
                return Err(Error::Usage(format!(
                    "{new} trainable variable(s) were created on the VarStore after its \
                     optimizer was built ({}): DistributedDataParallel averages the gradients \
                     of the variables that existed when it wrapped the model, so these would \
                     train apart on each rank. Build the whole model before the optimizer",
                    names.join(", ")
                )));
            }
            for var in v.trainable_variables.iter().skip(before) {
                while self.groups.len() <= var.group {
                    self.groups.push(self.defaults);
                }
                self.params.push(var.tensor.shallow_clone());
                self.groups_of.push(var.group);
                self.state.push(None);
            }
            (self.params.len() > before).then_some(before)
        };
        if let Some(before) = first_new {
            self.accumulators
                .add(&ffi::TensorArray::new(&self.params[before..]))
                .map_err(|t| Error::Torch(t.message()))?;
            self.repartition();
        }
        Ok(())
    }

    /// Whether the gradients are averaged over several ranks (by DDP's Reducer or the
    /// sharding's hooks on the variables' gradient accumulators).
    fn averages_over_ranks(&self) -> bool {
        match &self.mode {
            Mode::Sharded(_) => true,
            mode => mode
                .ddp()
                .is_some_and(|d| d.process_group().world_size() > 1),
        }
    }

    /// Refuses a variable converted since it joined the optimizer (`vs.double()`,
    /// `vs.half()` and back with `vs.float()`, `vs.set_device(…)`, a `vs.load` of a file
    /// in another dtype, after the build), when the gradients are averaged over ranks:
    /// libtorch gives a variable converted with `set_data` a new gradient accumulator,
    /// and the hooks that average its gradient stay on the old one, so it would train
    /// apart on each rank, as under PyTorch's DDP after `model.half()`. It compares
    /// each variable's accumulator with the one it had when it joined (held since), so
    /// a conversion there and back shows as well as one that stays.
    ///
    /// # Errors
    /// [`Error::Usage`] naming the variable, its dtype and device now, and the fix.
    fn refuse_converted(&self) -> Result<()> {
        if !self.averages_over_ranks() {
            return Ok(());
        }
        let converted = self
            .accumulators
            .first_changed(&ffi::TensorArray::new(&self.params))
            .map_err(|t| Error::Torch(t.message()))?;
        let Some(i) = converted else {
            return Ok(());
        };
        let p = &self.params[i];
        let name = &state::param_names(self)[i];
        Err(Error::Usage(format!(
            "variable `{name}` was converted after its optimizer was built (it is {:?} on \
             {:?} now; `vs.double()`, `vs.half()` then `vs.float()`, `vs.set_device(…)`, or \
             `vs.load` of a file in another dtype, which takes the file's): libtorch gave it \
             a new gradient accumulator, without the hooks that average its gradient over \
             the ranks, so it would train apart on each rank. Convert or load the model \
             before building the optimizer",
            p.kind(),
            p.device()
        )))
    }

    /// Zeroes (sets to none) the gradients of the tracked variables; in the middle of
    /// an accumulation cycle, does nothing.
    ///
    /// # Errors
    /// [`Error::Usage`] when trainable variables were created after the optimizer over several ranks (see [`distributed`](Self::distributed)); [`Error::Torch`] from libtorch.
    pub fn zero_grad(&mut self) -> Result<()> {
        if self.micro_step > 0 {
            return Ok(());
        }
        self.add_missing_variables()?;
        set_grads_to_none(&self.params)
    }

    /// One update of the parameters from their gradients (those without a gradient
    /// are left alone, as in tch).
    fn update(&mut self) -> Result<()> {
        self.add_missing_variables()?;
        // What the kernels step: the shards (stages 2 and 3), this rank's rows of each
        // parameter (stage 1: none of some), or the parameters.
        let (stepped, owned) = match &self.mode {
            Mode::Sharded(sharding) => (sharding.shards(), None),
            Mode::Zero1 { zero, .. } => {
                let views = zero.views(&self.params)?;
                let owned: Vec<bool> = views.iter().map(Option::is_some).collect();
                let stepped = views
                    .into_iter()
                    .zip(&self.params)
                    .map(|(view, p)| view.unwrap_or_else(|| p.shallow_clone()))
                    .collect();
                (stepped, Some(owned))
            }
            Mode::Replicated(_) => (
                self.params.iter().map(Tensor::shallow_clone).collect(),
                None,
            ),
        };
        kernels::update(
            &stepped,
            &self.groups_of,
            &self.groups,
            &mut self.state,
            self.implementation,
            owned.as_deref(),
        )?;
        match self.mode.zero1() {
            Some(zero) => zero.share(&self.params),
            None => Ok(()),
        }
    }

    /// One optimizer step on the current gradients, once the last
    /// [`backward`](Self::backward) ended an accumulation cycle (always, without
    /// accumulation or when no backward ran through this optimizer). With a
    /// [`grad_scaler`](Self::grad_scaler) it unscales the gradients, skips the update
    /// when one on any rank is inf or NaN, and updates the scale.
    ///
    /// Returns whether the parameters were updated. Errors: [`Error::Torch`] from
    /// libtorch; from the scaler, [`Error::Diverged`] after too many skipped steps in a
    /// row and [`Error::Collective`] when its all-reduce fails.
    ///
    /// # Errors
    /// [`Error::Torch`] from libtorch; from the scaler, [`Error::Diverged`] after too many skipped steps in a row and [`Error::Collective`] when its all-reduce fails.
    pub fn step(&mut self) -> Result<bool> {
        if let Some(max) = self.clip_norm_at_step {
            if self.cycle_complete || self.micro_step == 0 {
                self.clip_grad_norm(max)?;
            }
        }
        if !std::mem::take(&mut self.cycle_complete) && self.micro_step > 0 {
            return Ok(false);
        }
        self.finish_gradients()?;
        let stepped = match self.scaler.take() {
            None => self.update().map(|()| true),
            Some(mut scaler) => {
                let stepped = (|| {
                    let clean = !scaler.overflowed(|| self.stepped_tensors())?;
                    if clean {
                        self.update()?;
                    }
                    scaler.update()?;
                    Ok(clean)
                })();
                self.scaler = Some(scaler);
                stepped
            }
        }?;
        if let Some(sharding) = self.mode.sharding() {
            sharding.after_step()?;
        }
        if stepped {
            self.steps_taken += 1;
            if let Some(lr) = self.schedule.as_ref().map(|rate| rate(self.steps_taken)) {
                self.set_lr(lr)?;
            }
        }
        Ok(stepped)
    }

    /// The optimizer steps taken: the updates of the parameters, one per accumulation
    /// cycle (the micro-batches in between are not steps), without the steps that the
    /// fp16 loss scaler skipped (on which DeepSpeed's engine does not step its
    /// learning-rate scheduler either). The same on every rank. An [`LrScheduler`](crate::LrScheduler)
    /// reads it, and checkpoints keep it
    /// ([`TrainState::optimizer_steps`](crate::TrainState::optimizer_steps)).
    pub fn steps_taken(&self) -> u64 {
        self.steps_taken
    }

    /// Sets the count of [`steps_taken`](Self::steps_taken), for a resume:
    /// [`Checkpointer::load_state`](crate::Checkpointer::load_state) does it from the
    /// checkpoint; a program that saves the optimizer's [`state`](Self::state) itself
    /// restores the count it saved with it.
    pub fn set_steps_taken(&mut self, steps: u64) {
        self.steps_taken = steps;
    }

    /// With a [`grad_scaler`](Self::grad_scaler), divides this cycle's complete
    /// gradients by the scale (once), so that they can be clipped or inspected.
    fn unscale_for_clipping(&mut self) -> Result<()> {
        if self.cycle_complete {
            self.finish_gradients()?;
            if let Some(mut scaler) = self.scaler.take() {
                let r = scaler.overflowed(|| self.stepped_tensors());
                self.scaler = Some(scaler);
                r?;
            }
        }
        Ok(())
    }

    /// Clips every gradient element to `[-max, max]`, as tch's `clip_grad_value`
    /// (after unscaling them, with a [`grad_scaler`](Self::grad_scaler)).
    ///
    /// # Errors
    /// [`Error::Torch`] from libtorch; as [`step`](Self::step) when the scaler unscales.
    pub fn clip_grad_value(&mut self, max: f64) -> Result<()> {
        self.unscale_for_clipping()?;
        for var in self.stepped_tensors() {
            let mut grad = var.grad();
            if grad.defined() {
                let _ = grad.f_clamp_(-max, max)?;
            }
        }
        Ok(())
    }

    /// Scales the gradients so that their global L2 norm is at most `max`, with tch's
    /// arithmetic (`max / (norm + 1e-6)`); returns the norm before clipping. Under
    /// DDP the gradients are the averaged ones, so every rank clips alike; with a
    /// [`grad_scaler`](Self::grad_scaler) they are unscaled first, as PyTorch's AMP
    /// recipe does with `scaler.unscale_`.
    ///
    /// # Errors
    /// [`Error::Torch`] from libtorch; [`Error::Collective`] when the sharded norm's all-reduce fails; as [`step`](Self::step) when the scaler unscales.
    pub fn clip_grad_norm(&mut self, max: f64) -> Result<f64> {
        self.unscale_for_clipping()?;
        if let Some(sharding) = self.mode.sharding() {
            return sharding.clip_grad_norm(max);
        }
        Ok(tch::no_grad(|| {
            let grads: Vec<Tensor> = self
                .trainable_variables()
                .iter()
                .map(Tensor::grad)
                .filter(Tensor::defined)
                .collect();
            if grads.is_empty() {
                return 0.0;
            }
            let norms: Vec<Tensor> = grads.iter().map(|g| g.norm()).collect();
            let total = Tensor::stack(&norms, 0).norm().double_value(&[]);
            let coef = max / (total + 1e-6);
            if coef < 1.0 {
                for mut g in grads {
                    let _ = g.g_mul_scalar_(coef);
                }
            }
            total
        }))
    }

    /// One micro-batch's backward, as `loss.backward()` under Accelerate: the loss is
    /// divided by the accumulation steps and multiplied by the loss scale, and under
    /// DDP the gradients are all-reduced only on the cycle's last micro-batch (the
    /// others run under `no_sync`). Gradients add up until
    /// [`zero_grad`](Self::zero_grad). Returns whether this micro-batch ends the cycle.
    ///
    /// # Errors
    /// Those of [`DistributedDataParallel::backward`], or [`Error::Torch`];
    /// [`Error::Usage`] over several ranks for a variable created after the optimizer
    /// was built, or converted to another dtype or device since.
    pub fn backward(&mut self, loss: &Tensor) -> Result<bool> {
        self.add_missing_variables()?;
        self.refuse_converted()?;
        let last = self.is_sync_step();
        let divided;
        let mut loss = if self.accumulation_steps > 1 {
            divided = loss / self.accumulation_steps as f64;
            &divided
        } else {
            loss
        };
        let scaled;
        if let Some(scaler) = &mut self.scaler {
            scaled = scaler.scale(loss);
            loss = &scaled;
        }
        match &self.mode {
            Mode::Sharded(sharding) => {
                sharding.begin_backward(loss, last)?;
                // A hook's own failure (a collective) is the cause, not autograd's text.
                loss.f_backward()
                    .map_err(|e| sharding.take_failure().unwrap_or(Error::from(e)))?
            }
            mode => match mode.ddp() {
                Some(ddp) if last => ddp.backward(loss)?,
                Some(ddp) => {
                    let _local = ddp.no_sync();
                    ddp.backward(loss)?
                }
                None => loss.f_backward()?,
            },
        }
        if last {
            self.micro_step = 0;
            self.sync_next = false;
        } else {
            self.micro_step += 1;
        }
        self.cycle_complete = last;
        Ok(last)
    }

    /// [`zero_grad`](Self::zero_grad), [`backward`](Self::backward) (averaging the
    /// gradients under DDP), [`step`](Self::step), as tch's `backward_step`; with
    /// [`accumulate`](Self::accumulate), one micro-batch of that. Returns whether the
    /// parameters were updated.
    ///
    /// # Errors
    /// As [`zero_grad`](Self::zero_grad), [`backward`](Self::backward) and [`step`](Self::step).
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<bool> {
        self.backward_then_step(loss, |_| Ok(()))
    }

    /// [`backward_step`](Self::backward_step) with the gradients clipped to
    /// `[-max, max]` before the step.
    ///
    /// # Errors
    /// As [`backward_step`](Self::backward_step) and [`clip_grad_value`](Self::clip_grad_value).
    pub fn backward_step_clip(&mut self, loss: &Tensor, max: f64) -> Result<bool> {
        self.backward_then_step(loss, |opt| opt.clip_grad_value(max))
    }

    /// [`backward_step`](Self::backward_step) with the gradients' global norm clipped
    /// to `max` before the step (on the averaged, accumulated, unscaled gradients, so
    /// every rank clips by the same norm).
    ///
    /// # Errors
    /// As [`backward_step`](Self::backward_step) and [`clip_grad_norm`](Self::clip_grad_norm).
    pub fn backward_step_clip_norm(&mut self, loss: &Tensor, max: f64) -> Result<bool> {
        self.backward_then_step(loss, |opt| opt.clip_grad_norm(max).map(drop))
    }

    /// Zero, backward; at the end of an accumulation cycle, `before_step` (clipping)
    /// then the step.
    fn backward_then_step(
        &mut self,
        loss: &Tensor,
        before_step: impl FnOnce(&mut Self) -> Result<()>,
    ) -> Result<bool> {
        self.zero_grad()?;
        if !self.backward(loss)? {
            return Ok(false);
        }
        before_step(self)?;
        self.step()
    }

    /// The options of parameter group `group`.
    ///
    /// # Errors
    /// [`Error::Usage`] when there is no such group.
    fn group_mut(&mut self, group: usize) -> Result<&mut Group> {
        self.add_missing_variables()?;
        let count = self.groups.len();
        self.groups.get_mut(group).ok_or_else(|| {
            Error::Usage(format!(
                "no parameter group {group}: the optimizer has {count} (groups come from \
                 the variables' `group` in the VarStore)"
            ))
        })
    }

    /// Sets an option of the defaults (for groups made later) and of every group.
    fn set_all(&mut self, set: impl Fn(&mut Group)) -> Result<()> {
        self.add_missing_variables()?;
        set(&mut self.defaults);
        self.groups.iter_mut().for_each(set);
        Ok(())
    }

    /// Sets the learning rate of every parameter group.
    ///
    /// # Errors
    /// [`Error::Usage`] when trainable variables were created after the optimizer over several ranks (see [`distributed`](Self::distributed)).
    pub fn set_lr(&mut self, lr: f64) -> Result<()> {
        self.set_all(|g| g.lr = lr)
    }

    /// Sets the learning rate of parameter group `group`.
    ///
    /// # Errors
    /// [`Error::Usage`] when there is no such group.
    pub fn set_lr_group(&mut self, group: usize, lr: f64) -> Result<()> {
        self.group_mut(group)?.lr = lr;
        Ok(())
    }

    /// Sets the momentum of every parameter group, as tch's `set_momentum`: SGD's and
    /// RMSprop's momentum, Adam's and AdamW's first beta.
    ///
    /// # Errors
    /// As [`set_lr`](Self::set_lr).
    pub fn set_momentum(&mut self, momentum: f64) -> Result<()> {
        self.set_all(|g| g.algorithm.set_momentum(momentum))
    }

    /// Sets the momentum of parameter group `group` (SGD, RMSprop; Adam's first
    /// beta), as tch's `set_momentum_group`.
    ///
    /// # Errors
    /// [`Error::Usage`] when there is no such group.
    pub fn set_momentum_group(&mut self, group: usize, momentum: f64) -> Result<()> {
        self.group_mut(group)?.algorithm.set_momentum(momentum);
        Ok(())
    }

    /// Sets the weight decay of every parameter group.
    ///
    /// # Errors
    /// As [`set_lr`](Self::set_lr).
    pub fn set_weight_decay(&mut self, weight_decay: f64) -> Result<()> {
        self.set_all(|g| g.algorithm.set_weight_decay(weight_decay))
    }

    /// Sets the weight decay of parameter group `group`, as tch's
    /// `set_weight_decay_group` (minGPT's no-decay group for biases and norms).
    ///
    /// # Errors
    /// [`Error::Usage`] when there is no such group.
    pub fn set_weight_decay_group(&mut self, group: usize, weight_decay: f64) -> Result<()> {
        self.group_mut(group)?
            .algorithm
            .set_weight_decay(weight_decay);
        Ok(())
    }

    /// The trainable variables, in the order the optimizer holds them.
    ///
    /// # Panics
    /// Only if the variable store's lock was poisoned by a panic in another thread.
    pub fn trainable_variables(&self) -> Vec<Tensor> {
        let v = self.variables.lock().expect("variable store lock");
        v.trainable_variables
            .iter()
            .map(|var| var.tensor.shallow_clone())
            .collect()
    }

    /// The optimizer's state in `torch.optim`'s `state_dict` layout, as safetensors
    /// bytes: per-parameter tensors `state.{i}.{name}` (`exp_avg`, `exp_avg_sq`,
    /// `momentum_buffer`, `square_avg`, …, and `step`, a float32 scalar, for Adam,
    /// AdamW and RMSprop), `i` the parameter's place in the optimizer (the store's
    /// trainable variables, in order), and the parameter groups' options as
    /// `param_groups` JSON in the file's metadata. PyTorch loads it with
    /// `safetensors.torch.load_file` and `torch.optim.*.load_state_dict` (see the
    /// checkpoints chapter of the book).
    ///
    /// # Errors
    /// [`Error::Checkpoint`] when the tensors cannot be serialized.
    pub fn state(&mut self) -> Result<Vec<u8>> {
        self.add_missing_variables()?;
        state::to_safetensors(self)
    }

    /// Restores a state from [`state`](Self::state): the per-parameter tensors (moved
    /// to each parameter's device) and the groups' options (learning rates, momentum,
    /// weight decay, …).
    ///
    /// # Errors
    /// [`Error::Checkpoint`] when the bytes are not such a state, when it is
    /// another algorithm's (an SGD state into Adam), or when its parameters' count or
    /// shapes differ from this optimizer's, naming the first that differs.
    pub fn load_state(&mut self, bytes: &[u8]) -> Result<()> {
        self.load_state_shards(&[bytes])
    }

    /// Restores a state saved in shards, as the ranks of a ZeRO run save it (each
    /// rank's [`state`](Self::state) holds its rows of every parameter's state, numbered
    /// as in the whole, or, as stage 1 used to write it, the whole state of the
    /// parameters it owned): together they give every parameter's state. This optimizer keeps what
    /// it holds: every parameter's state, or with [`zero`](Self::zero) its own share,
    /// whatever the world size that saved them.
    ///
    /// # Errors
    /// As [`load_state`](Self::load_state).
    pub fn load_state_shards(&mut self, shards: &[&[u8]]) -> Result<()> {
        self.add_missing_variables()?;
        state::from_safetensors(self, shards)?;
        self.repartition();
        Ok(())
    }

    /// Restores a state that tch-distributed 0.1 saved in libtorch's optimizer archive
    /// (a checkpoint's `optimizer.pt`), for an optimizer of the same kind over
    /// variables of the same shapes in the same groups. The groups' options are this
    /// optimizer's, not the archive's.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] when the bytes are not such an archive.
    pub fn load_libtorch_archive(&mut self, bytes: &[u8]) -> Result<()> {
        self.add_missing_variables()?;
        state::from_libtorch_archive(self, bytes)
    }
}

impl std::fmt::Debug for Optimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.debug_struct("Optimizer")
            .field("algorithm", &self.defaults.algorithm)
            .field("variables", &self.params.len())
            .field("implementation", &self.implementation)
            .field("distributed", &self.mode.ddp().is_some())
            .field("zero_stage", &self.zero_stage())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::nn::{Module, OptimizerConfig};
    use tch::{Device, Kind};

    /// A linear model with fixed weights and inputs (no global RNG: tests run in
    /// parallel threads).
    fn fixture() -> (VarStore, nn::Linear, Tensor) {
        let vs = VarStore::new(Device::Cpu);
        let net = nn::linear(vs.root(), 3, 2, Default::default());
        tch::no_grad(|| {
            for (i, mut v) in vs.trainable_variables().into_iter().enumerate() {
                let n = v.numel() as i64;
                let values = Tensor::linspace(-0.5, 0.5 + i as f64, n, (Kind::Float, Device::Cpu));
                v.copy_(&values.view(v.size().as_slice()));
            }
        });
        let xs = Tensor::linspace(-2.0, 3.0, 24, (Kind::Float, Device::Cpu)).view([8, 3]);
        (vs, net, xs)
    }

    fn loss(net: &nn::Linear, xs: &Tensor) -> Tensor {
        (net.forward(xs) - 1.0).square().mean(Kind::Float)
    }

    /// A cycle's gradients as a checkpoint gives them back: set on their variables by
    /// name (in the variable's dtype), the next backward pass adds to them and steps at
    /// the cycle's end; a gradient of another shape, or of no variable, is an error
    /// before anything is set.
    #[test]
    fn a_resumed_cycle_goes_on_from_its_gradients_and_refuses_ones_that_do_not_fit() {
        let (vs, net, xs) = fixture();
        let mut opt = Optimizer::new(&nn::Sgd::default(), &vs, 0.1)
            .unwrap()
            .accumulate(3);
        for _ in 0..2 {
            assert!(!opt.backward_step(&loss(&net, &xs)).unwrap());
        }
        let saved = opt.accumulated_gradients();
        assert_eq!((saved.len(), opt.micro_batches_accumulated()), (2, 2));

        let (other, net2, _) = fixture();
        let mut resumed = Optimizer::new(&nn::Sgd::default(), &other, 0.1)
            .unwrap()
            .accumulate(3);
        let wrong = [(
            saved[0].0.clone(),
            Tensor::zeros([5], (Kind::Double, Device::Cpu)),
        )];
        let e = resumed.resume_cycle(2, &wrong).unwrap_err().to_string();
        assert!(e.contains("does not fit: its shape is [5]"), "{e}");
        let stray = [(
            "nowhere".to_string(),
            Tensor::zeros([1], (Kind::Float, Device::Cpu)),
        )];
        let e = resumed.resume_cycle(2, &stray).unwrap_err().to_string();
        assert!(
            e.contains("`nowhere` does not fit: the optimizer has no such"),
            "{e}"
        );
        assert_eq!(resumed.micro_batches_accumulated(), 0, "nothing resumed");

        let doubled: Vec<(String, Tensor)> = saved
            .iter()
            .map(|(n, g)| (n.clone(), g.to_kind(Kind::Double)))
            .collect();
        resumed.resume_cycle(2, &doubled).unwrap();
        assert_eq!(resumed.micro_batches_accumulated(), 2);
        for ((_, want), got) in saved.iter().zip(resumed.params.iter().map(Tensor::grad)) {
            assert_eq!(got.kind(), Kind::Float);
            assert!(got.equal(want));
        }
        // The third micro-batch ends both cycles on the same gradients.
        assert!(opt.backward_step(&loss(&net, &xs)).unwrap());
        assert!(resumed.backward_step(&loss(&net2, &xs)).unwrap());
        assert_eq!(params(&vs), params(&other));
    }

    fn params(vs: &VarStore) -> Vec<Vec<f32>> {
        vs.trainable_variables()
            .iter()
            .map(|t| Vec::<f32>::try_from(t.view([-1])).unwrap())
            .collect()
    }

    /// The SDK's optimizer with tch's arithmetic, to compare with tch's bits.
    fn ours(kind: &str, vs: &VarStore) -> Optimizer {
        let opt = match kind {
            "sgd" => Optimizer::new(
                &nn::Sgd {
                    momentum: 0.9,
                    ..Default::default()
                },
                vs,
                0.1,
            ),
            _ => Optimizer::new(&nn::Adam::default(), vs, 0.01),
        };
        opt.unwrap()
            .with_implementation(Implementation::Tch)
            .unwrap()
    }

    #[test]
    fn steps_are_bit_identical_to_tch() {
        for kind in ["sgd", "adam"] {
            let (vs, net, xs) = fixture();
            let mut opt = ours(kind, &vs);
            for _ in 0..5 {
                opt.backward_step(&loss(&net, &xs)).unwrap();
            }
            let (tvs, tnet, _) = fixture();
            let mut topt = match kind {
                "sgd" => nn::Sgd {
                    momentum: 0.9,
                    ..Default::default()
                }
                .build(&tvs, 0.1),
                _ => nn::Adam::default().build(&tvs, 0.01),
            }
            .unwrap();
            for _ in 0..5 {
                topt.backward_step(&loss(&tnet, &xs));
            }
            assert_eq!(params(&vs), params(&tvs), "{kind}");
        }
    }

    /// Two linear layers, the second in parameter group 1, with fixed weights.
    fn two_groups() -> (VarStore, nn::Linear, nn::Linear, Tensor) {
        let vs = VarStore::new(Device::Cpu);
        let a = nn::linear(vs.root() / "a", 3, 4, Default::default());
        let b = nn::linear(vs.root().set_group(1) / "b", 4, 2, Default::default());
        tch::no_grad(|| {
            for (i, mut v) in vs.trainable_variables().into_iter().enumerate() {
                let n = v.numel() as i64;
                let values =
                    Tensor::linspace(-0.7, 0.3 + i as f64 / 4.0, n, (Kind::Float, Device::Cpu));
                v.copy_(&values.view(v.size().as_slice()));
            }
        });
        let xs = Tensor::linspace(-2.0, 3.0, 24, (Kind::Float, Device::Cpu)).view([8, 3]);
        (vs, a, b, xs)
    }

    /// 20 steps of tch's optimizer built from `config` and of ours, with the second
    /// group's learning rate halved and, from step 10, another weight decay and (with
    /// `momentum`) momentum for every group: the parameters must be the same bits.
    fn same_as_tch<C>(config: C, lr: f64, momentum: bool)
    where
        C: nn::OptimizerConfig + OptimizerKind + Copy + std::fmt::Debug,
    {
        let loss = |a: &nn::Linear, b: &nn::Linear, xs: &Tensor| {
            (b.forward(&a.forward(xs).tanh()) - 1.0)
                .square()
                .mean(Kind::Float)
        };
        let theirs = {
            let (vs, a, b, xs) = two_groups();
            let mut opt = config.build(&vs, lr).unwrap();
            opt.set_lr_group(1, lr / 2.0);
            for i in 0..20 {
                if i == 10 {
                    opt.set_weight_decay(1e-3);
                    if momentum {
                        opt.set_momentum(0.5);
                    }
                }
                opt.backward_step(&loss(&a, &b, &xs));
            }
            params(&vs)
        };
        let ours = {
            let (vs, a, b, xs) = two_groups();
            let mut opt = Optimizer::new(&config, &vs, lr)
                .unwrap()
                .with_implementation(Implementation::Tch)
                .unwrap();
            opt.set_lr_group(1, lr / 2.0).unwrap();
            for i in 0..20 {
                if i == 10 {
                    opt.set_weight_decay(1e-3).unwrap();
                    if momentum {
                        opt.set_momentum(0.5).unwrap();
                    }
                }
                opt.backward_step(&loss(&a, &b, &xs)).unwrap();
            }
            params(&vs)
        };
        assert_eq!(ours, theirs, "{config:?}");
        assert_ne!(ours, params(&two_groups().0), "{config:?} trained");
    }

    #[test]
    fn every_algorithm_and_option_is_bit_identical_to_tch() {
        // SGD's momentum set from 0 starts its buffers then, in both.
        same_as_tch(nn::Sgd::default(), 0.1, true);
        let nesterov = nn::Sgd {
            momentum: 0.9,
            dampening: 0.0,
            wd: 1e-3,
            nesterov: true,
        };
        same_as_tch(nesterov, 0.05, true);
        let dampened = nn::Sgd {
            momentum: 0.5,
            dampening: 0.1,
            wd: 0.0,
            nesterov: false,
        };
        same_as_tch(dampened, 0.05, true);
        // Adam's "momentum" is its first beta.
        same_as_tch(
            nn::Adam {
                wd: 1e-2,
                amsgrad: true,
                ..Default::default()
            },
            0.01,
            true,
        );
        same_as_tch(nn::Adam::default(), 0.01, false);
        same_as_tch(nn::AdamW::default(), 0.01, true);
        same_as_tch(
            nn::AdamW {
                amsgrad: true,
                ..Default::default()
            },
            0.01,
            false,
        );
        let rms = nn::RmsProp {
            momentum: 0.9,
            centered: true,
            wd: 1e-3,
            ..Default::default()
        };
        same_as_tch(rms, 0.01, true);
        // tch's RMSprop fails when momentum is set after a start without it (libtorch
        // made no buffer); ours starts one (checked below), so not compared here.
        same_as_tch(nn::RmsProp::default(), 0.01, false);
    }

    #[test]
    fn a_grad_scaler_inside_clips_unscaled_gradients_and_skips_overflows() {
        let step = |opt: &mut Optimizer, loss: &Tensor| {
            opt.zero_grad().unwrap();
            opt.backward(loss).unwrap();
            let norm = opt.clip_grad_norm(1e9).unwrap();
            (norm, opt.step().unwrap())
        };
        let (vs, net, xs) = fixture();
        let mut plain = ours("sgd", &vs);
        let (svs, snet, _) = fixture();
        let mut scaled = ours("sgd", &svs).grad_scaler(GradScaler::new());
        let (norm, stepped) = step(&mut plain, &loss(&net, &xs));
        let (scaled_norm, scaled_stepped) = step(&mut scaled, &loss(&snet, &xs));
        assert!(stepped && scaled_stepped);
        // The scale is a power of two: unscaling is exact.
        assert_eq!(norm, scaled_norm, "clipping sees the unscaled gradients");
        assert_eq!(params(&vs), params(&svs));
        assert_eq!(scaled.scaler().unwrap().scale_value(), 65536.0);

        let before = params(&svs);
        let overflow = loss(&snet, &xs) * f64::INFINITY;
        let (_, stepped) = step(&mut scaled, &overflow);
        assert!(!stepped, "an inf gradient skips the step");
        assert_eq!(params(&svs), before);
        assert_eq!(
            scaled.scaler().unwrap().scale_value(),
            32768.0,
            "and halves the scale"
        );
    }

    /// The spelled-out step (`zero_grad`, `backward`, `step` on every micro-batch)
    /// under `accumulate(4)` updates once per cycle, and that update is one plain tch
    /// SGD step on the whole batch (the micro-batches' mean losses, divided by 4, add
    /// up to the whole batch's mean loss). A short cycle that the data loader ends
    /// (`set_end_of_data`) steps after its last micro-batch.
    #[test]
    fn spelled_out_accumulation_steps_once_per_cycle_as_one_step_on_the_whole_batch() {
        let (vs, net, xs) = fixture();
        let mut opt = Optimizer::new(&nn::Sgd::default(), &vs, 0.1)
            .unwrap()
            .with_implementation(Implementation::Tch)
            .unwrap()
            .accumulate(4);
        let start = params(&vs);
        for (i, micro) in xs.chunk(4, 0).iter().enumerate() {
            opt.zero_grad().unwrap();
            assert_eq!(opt.backward(&loss(&net, micro)).unwrap(), i == 3);
            assert_eq!(
                opt.step().unwrap(),
                i == 3,
                "micro-batch {i} steps only at the end"
            );
            if i < 3 {
                assert_eq!(params(&vs), start, "no update inside the cycle ({i})");
            }
        }
        let (tvs, tnet, _) = fixture();
        let mut whole = nn::Sgd::default().build(&tvs, 0.1).unwrap();
        whole.backward_step(&loss(&tnet, &xs));
        let close = |a: &[Vec<f32>], b: &[Vec<f32>]| {
            let shape = |v: &[Vec<f32>]| v.iter().map(Vec::len).collect::<Vec<_>>();
            shape(a) == shape(b)
                && a.iter()
                    .flatten()
                    .zip(b.iter().flatten())
                    .all(|(x, y)| (x - y).abs() <= 1e-6)
        };
        assert_ne!(params(&vs), start);
        assert!(
            close(&params(&vs), &params(&tvs)),
            "{:?} vs {:?}",
            params(&vs),
            params(&tvs)
        );

        // The data ends after two micro-batches: the second ends the cycle.
        let after_first_cycle = params(&vs);
        let micro = xs.chunk(4, 0);
        opt.zero_grad().unwrap();
        assert!(!opt.backward(&loss(&net, &micro[0])).unwrap());
        assert!(!opt.step().unwrap());
        set_end_of_data(true);
        opt.zero_grad().unwrap();
        let ended = opt.backward(&loss(&net, &micro[1])).unwrap();
        set_end_of_data(false);
        assert!(ended, "the end of the data ends the cycle");
        assert!(opt.step().unwrap());
        assert_ne!(params(&vs), after_first_cycle);
    }

    /// A backward pass that did not go through the optimizer (`loss.backward()`, as
    /// in a plain tch program) is followed by a step on its gradients: plain SGD's
    /// `p - lr * g`, with or without accumulation configured.
    #[test]
    fn a_step_after_a_backward_outside_the_optimizer_updates() {
        for accumulation in [1, 3] {
            let (vs, net, xs) = fixture();
            let mut opt = Optimizer::new(&nn::Sgd::default(), &vs, 0.1)
                .unwrap()
                .accumulate(accumulation);
            let start = params(&vs);
            opt.zero_grad().unwrap();
            loss(&net, &xs).backward();
            let grads: Vec<Vec<f32>> = vs
                .trainable_variables()
                .iter()
                .map(|t| Vec::<f32>::try_from(t.grad().view([-1])).unwrap())
                .collect();
            assert!(opt.step().unwrap(), "accumulate({accumulation}): it steps");
            for ((p, p0), g) in params(&vs).iter().zip(&start).zip(&grads) {
                for ((x, x0), gx) in p.iter().zip(p0).zip(g) {
                    assert!(
                        (x - (x0 - 0.1 * gx)).abs() <= 1e-7,
                        "{x} vs {x0} - 0.1 * {gx}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_variable_without_a_gradient_is_left_alone_with_no_state() {
        // As in tch and torch.optim: a parameter the loss does not use is skipped,
        // and gets no state, with every kernel implementation.
        for implementation in [
            Implementation::Fused,
            Implementation::Foreach,
            Implementation::Tch,
        ] {
            let (vs, net, xs) = fixture();
            let unused = vs.root().var("unused", &[4], nn::Init::Const(0.5));
            let mut opt = Optimizer::new(&nn::Adam::default(), &vs, 0.1)
                .unwrap()
                .with_implementation(implementation)
                .unwrap();
            let used = opt.state_bytes();
            assert_eq!(
                used, 0,
                "{implementation:?}: no state before the first step"
            );
            opt.zero_grad().unwrap();
            loss(&net, &xs).backward();
            assert!(!unused.grad().defined());
            assert!(opt.step().unwrap(), "{implementation:?}: it steps");
            assert_eq!(
                Vec::<f32>::try_from(&unused).unwrap(),
                [0.5; 4],
                "{implementation:?}: the unused variable moved"
            );
            // Adam's two moments (and the step count) for the linear layer's 8
            // elements, nothing for the unused variable's 4.
            let with_state = opt.state_bytes();
            assert!(
                with_state >= 2 * 8 * 4 && with_state < 2 * 12 * 4,
                "{implementation:?}: {with_state} bytes of state"
            );
        }
    }

    #[test]
    fn debug_shows_the_rule_the_variables_and_the_kernels() {
        let (vs, _, _) = fixture();
        let opt = ours("sgd", &vs);
        let shown = format!("{opt:?}");
        for part in [
            "Optimizer",
            "Sgd",
            "momentum: 0.9",
            "variables: 2",
            "Tch",
            "distributed: false",
        ] {
            assert!(shown.contains(part), "{part:?} not in {shown}");
        }
    }

    #[test]
    fn a_state_before_the_first_step_round_trips() {
        let (vs, _, _) = fixture();
        let mut opt = ours("adam", &vs);
        let empty = opt.state().unwrap();
        assert_eq!(opt.state_bytes(), 0);
        opt.set_lr(0.5).unwrap();
        opt.load_state(&empty).unwrap();
        assert_eq!(opt.groups[0].lr, 0.01, "the saved learning rate is back");
    }

    #[test]
    fn state_round_trips_and_resumes_exactly() {
        for kind in ["sgd", "adam"] {
            // 10 steps straight == 5 steps, save, reload into a fresh optimizer, 5 more.
            let (vs, net, xs) = fixture();
            let mut straight = ours(kind, &vs);
            for _ in 0..10 {
                straight.backward_step(&loss(&net, &xs)).unwrap();
            }
            let (rvs, rnet, _) = fixture();
            let mut first = ours(kind, &rvs);
            for _ in 0..5 {
                first.backward_step(&loss(&rnet, &xs)).unwrap();
            }
            let state = first.state().unwrap();
            drop(first);
            let mut resumed = ours(kind, &rvs);
            resumed.load_state(&state).unwrap();
            for _ in 0..5 {
                resumed.backward_step(&loss(&rnet, &xs)).unwrap();
            }
            assert_eq!(params(&vs), params(&rvs), "{kind}: resumed bit for bit");
            assert!(resumed.load_state(b"not a state").is_err());
        }
    }
}
