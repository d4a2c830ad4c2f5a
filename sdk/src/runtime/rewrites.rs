//! What the rewritten calls run: the optimizer `.build` makes, the backward steps
//! (with the gradients of optimizers the function did not build averaged by a DDP
//! built at their first step), `loss.backward()`, `vs.save`/`vs.load`, autocast, the
//! device.

use std::path::Path;

use tch::nn::VarStore;
use tch::{Device, TchError, Tensor};

use crate::amp::{Autocast, GradScaler, MixedPrecision};
use crate::ddp::{DdpOptions, DistributedDataParallel};
use crate::init;
use crate::optim::{Optimizer, OptimizerKind};

use super::{context, fail, fail_with_source};

/// `Device::cuda_if_available()` / `Device::Cuda(i)` → this rank's device, in place
/// of the one the single-GPU code asked for.
pub fn device(_requested: Device) -> Device {
    context().device()
}

/// `println!` and friends run on rank 0 only.
pub fn is_main_process() -> bool {
    init::current().map(|c| c.is_main_process()).unwrap_or(true)
}

/// `<config>.build(&vs, lr)`: the SDK's [`Optimizer`] (tch's configuration, its state
/// held as tensors for checkpoints, its update in the attribute's `optimizer`
/// implementation) over `vs`, stepping through a DDP of `vs`, with the attribute's
/// accumulation and, for fp16, a loss scaler.
pub fn build(config: &impl OptimizerKind, vs: &VarStore, lr: f64) -> Result<Optimizer, TchError> {
    let ctx = context();
    let options = ctx.settings();
    let ddp_options = DdpOptions {
        find_unused_parameters: options.find_unused_parameters.unwrap_or(false),
        static_graph: options.static_graph.unwrap_or(false),
        ..bucket_options(&ctx)
    };
    // Failing to wrap the model ends the program with the cause and the fix: returned
    // through the caller's `?`, tch's error type would print it as an "Internal torch
    // error".
    let stage = options.zero.unwrap_or(0);
    let mut opt = Optimizer::new(config, vs, lr)
        .map_err(|e| TchError::Torch(format!("tch-distributed: building the optimizer: {e}")))?
        .accumulate(options.grad_accum.unwrap_or(1));
    // ZeRO stages 2 and 3 reduce-scatter the gradients themselves; the others average
    // them through DDP.
    if stage < 2 {
        let ddp = DistributedDataParallel::new(vs, ctx.process_group(), ddp_options)
            .unwrap_or_else(|e| {
                fail_with_source("wrapping the model in DistributedDataParallel", &e)
            });
        opt = opt.distributed(ddp);
    }
    crate::record::model_built(vs);
    if stage > 0 {
        opt = opt
            .zero(stage)
            .unwrap_or_else(|e| fail_with_source("sharding the model (the run's zero)", &e));
    }
    if let Some(implementation) = options.optimizer {
        opt = opt
            .with_implementation(implementation)
            .unwrap_or_else(|e| fail("the attribute's optimizer", e));
    }
    let deepspeed = ctx.deepspeed();
    if let Some(ds) = deepspeed {
        if let Some(block) = &ds.optimizer {
            opt.apply_deepspeed(block, &ds.path)
                .unwrap_or_else(|e| fail("the DeepSpeed file's optimizer", e));
        }
        if let Some(block) = &ds.scheduler {
            // The rate of each step, relative to the optimizer's (the program's, or the
            // file's `lr`), as PyTorch's LambdaLR gives it.
            let base = opt.base_lr();
            crate::schedule::from_deepspeed(block, &ds.path)
                .and_then(|schedule| opt.schedule_lr(Box::new(move |s| schedule.lr(base, s))))
                .unwrap_or_else(|e| fail("the DeepSpeed file's scheduler", e));
        }
    }
    if let Some(max) = options.gradient_clipping {
        opt = opt.clip_norm_at_step(max);
    }
    if ctx.mixed_precision() == MixedPrecision::Fp16 {
        let mut scaler = GradScaler::new();
        if let Some(scaling) = deepspeed.map(|ds| ds.loss_scaling) {
            if let Some(power) = scaling.initial_scale_power {
                scaler = scaler.init_scale(2f64.powi(power as i32));
            }
            if let Some(window) = scaling.loss_scale_window {
                scaler = scaler.growth_interval(window as i64);
            }
        }
        opt = opt.grad_scaler(scaler);
    }
    Ok(opt)
}

/// DDP's defaults with the run's `bucket_cap_mb` and `comm_hook`: as PyTorch's DDP, a
/// `bucket_cap_mb` given explicitly also caps the first bucket.
fn bucket_options(ctx: &init::Context) -> DdpOptions {
    let defaults = DdpOptions::default();
    let settings = ctx.settings();
    let cap = settings.bucket_cap_mb;
    DdpOptions {
        bucket_cap_mb: cap.unwrap_or(defaults.bucket_cap_mb),
        first_bucket_cap_mb: cap.unwrap_or(defaults.first_bucket_cap_mb),
        comm_hook: settings.comm_hook.unwrap_or_default(),
        ..defaults
    }
}

/// A `let` whose value comes from a forward pass: autocast while it is evaluated, in
/// the mixed precision the run resolved at the function's entry (from the attribute,
/// `tchrun --mixed-precision`, `TCH_DISTRIBUTED_MIXED_PRECISION` or the configuration
/// file). The macro writes the guard whatever the attribute says; with precision `no`
/// it does nothing (no FFI call, no autocast state touched).
pub fn autocast() -> Autocast {
    match init::current_precision() {
        None | Some((_, MixedPrecision::No)) => Autocast::off(),
        Some((device, precision)) => {
            Autocast::enter(device, precision).unwrap_or_else(|e| fail("autocast", e))
        }
    }
}

/// The optimizer's methods that return a `Result` in the SDK and nothing in tch:
/// the value, or a panic that names the call.
pub fn or_fail<T>(r: crate::Result<T>, what: &str) -> T {
    r.unwrap_or_else(|e| fail_with_source(what, &e))
}

/// The backward steps of tch's optimizer and of the SDK's (the one `build` gives),
/// with tch's signatures.
///
/// Called with method syntax (`opt.__tchd_backward_step(&loss)`), so that the receiver
/// is borrowed as the user's `opt.backward_step(&loss)` borrows it: an owned optimizer,
/// a `&mut` argument, a field, or through a `Box`.
pub trait Steps {
    fn __tchd_backward_step(&mut self, loss: &Tensor);
    fn __tchd_backward_step_clip(&mut self, loss: &Tensor, max: f64);
    fn __tchd_backward_step_clip_norm(&mut self, loss: &Tensor, max: f64);
}

/// An optimizer the function did not build (a struct field, a `&mut` argument, one a
/// helper returns): tch's steps, with the gradients averaged over the ranks by the
/// DDP that `#[distributed]` keeps for it (see [`SyncBeforeStep`]), before clipping.
impl Steps for tch::nn::Optimizer {
    fn __tchd_backward_step(&mut self, loss: &Tensor) {
        self.zero_grad();
        backward_through(&self.trainable_variables(), loss);
        self.sync_before_step();
        self.step();
    }
    fn __tchd_backward_step_clip(&mut self, loss: &Tensor, max: f64) {
        self.zero_grad();
        backward_through(&self.trainable_variables(), loss);
        self.sync_before_step();
        self.clip_grad_value(max);
        self.step();
    }
    fn __tchd_backward_step_clip_norm(&mut self, loss: &Tensor, max: f64) {
        self.zero_grad();
        backward_through(&self.trainable_variables(), loss);
        self.sync_before_step();
        self.clip_grad_norm(max);
        self.step();
    }
}

impl Steps for Optimizer {
    fn __tchd_backward_step(&mut self, loss: &Tensor) {
        self.attribute_backward_step(loss, |_| Ok(()), "backward_step");
    }
    fn __tchd_backward_step_clip(&mut self, loss: &Tensor, max: f64) {
        self.attribute_backward_step(loss, |o| o.clip_grad_value(max), "backward_step_clip");
    }
    fn __tchd_backward_step_clip_norm(&mut self, loss: &Tensor, max: f64) {
        self.attribute_backward_step(
            loss,
            |o| o.clip_grad_norm(max).map(drop),
            "backward_step_clip_norm",
        );
    }
}

impl Optimizer {
    /// The SDK optimizer's backward step under the attribute: as
    /// [`Optimizer::backward_step`]; built outside the function (stepping through no
    /// DDP), it gets one at the end of its first cycle ([`SyncBeforeStep`]).
    fn attribute_backward_step(
        &mut self,
        loss: &Tensor,
        before_step: impl FnOnce(&mut Optimizer) -> crate::Result<()>,
        what: &str,
    ) {
        or_fail(self.zero_grad(), what);
        if or_fail(Optimizer::backward(self, loss), what) {
            self.sync_before_step();
            or_fail(before_step(self), what);
            or_fail(self.step(), what);
        }
    }
}

/// What must come before the step of an optimizer the function did not build: tch's,
/// or the SDK's when it steps through no DDP. Behind references and boxes too, so
/// that `opt.step()` is found whatever holds the optimizer.
///
/// On several ranks its gradients are averaged by a DDP over its trainable variables
/// (the c10d Reducer, as for an optimizer the function built), built at its first
/// step, after that step's backward pass: the DDP adopts rank 0's parameters, as DDP
/// does when it wraps a model, and averages that step's gradients through a backward
/// pass of `Σ p·g` (whose gradient is each variable's `g`). From then on, the
/// Reducer averages the gradients while the backward pass runs: the SDK's optimizer
/// steps through the DDP as one built with it does; for tch's, the Reducer is
/// prepared after each step for the next backward pass (`loss.backward()` or the
/// rewritten `backward_step`).
pub trait SyncBeforeStep {
    /// Builds the DDP the first time; nothing in a world of one, or for an SDK
    /// optimizer that steps through a DDP.
    fn sync_before_step(&self);
}

impl SyncBeforeStep for tch::nn::Optimizer {
    fn sync_before_step(&self) {
        let Some(ctx) = several_ranks() else { return };
        let variables = self.trainable_variables();
        ctx.with_optimizer_ddp(key(&variables), |slot| {
            let ddp = match slot {
                Some(ddp) => {
                    check_covered(ddp, &variables);
                    &*ddp
                }
                None => &*slot.insert(first_step(&ctx, &variables)),
            };
            ddp.prepare_next_backward()
                .unwrap_or_else(|e| fail_unaveraged(&e));
        });
    }
}

impl SyncBeforeStep for Optimizer {
    fn sync_before_step(&self) {
        // Stepping through a DDP, or sharded (ZeRO stage 2 or 3), which averages itself.
        if self.ddp().is_some() || self.zero_stage().is_some_and(|s| s > 1) {
            return;
        }
        let Some(ctx) = several_ranks() else { return };
        self.distributed_from_now(first_step(&ctx, &self.trainable_variables()));
    }
}

impl<T: SyncBeforeStep + ?Sized> SyncBeforeStep for &T {
    fn sync_before_step(&self) {
        (**self).sync_before_step()
    }
}

impl<T: SyncBeforeStep + ?Sized> SyncBeforeStep for &mut T {
    fn sync_before_step(&self) {
        (**self).sync_before_step()
    }
}

impl<T: SyncBeforeStep + ?Sized> SyncBeforeStep for Box<T> {
    fn sync_before_step(&self) {
        (**self).sync_before_step()
    }
}

const UNAVERAGED: &str = "averaging the gradients of an optimizer the function did not build";

/// The job, when it has several ranks.
fn several_ranks() -> Option<init::Context> {
    init::current().filter(|c| c.world_size() > 1)
}

/// The key of an optimizer's DDP: its first variable's data.
fn key(variables: &[Tensor]) -> usize {
    variables.first().map_or(0, |v| crate::ffi::tensor_key(v))
}

/// `variables`, named by their index for errors (`variable 3`).
fn numbered(variables: &[Tensor]) -> Vec<(String, Tensor)> {
    variables
        .iter()
        .enumerate()
        .map(|(i, v)| (format!("variable {i}"), v.shallow_clone()))
        .collect()
}

/// Whether `variable` has a gradient now.
fn has_gradient(variable: &Tensor) -> bool {
    variable.grad().defined()
}

/// A backward pass of `loss` for tch's optimizer over `variables`: through its DDP
/// once it has one (which averages the gradients while backward runs), else plain.
fn backward_through(variables: &[Tensor], loss: &Tensor) {
    let ran = several_ranks().and_then(|ctx| {
        ctx.with_optimizer_ddp(key(variables), |slot| {
            slot.as_ref().map(|ddp| ddp.backward(loss))
        })
    });
    match ran {
        Some(r) => r.unwrap_or_else(|e| fail_unaveraged(&e)),
        None => or_fail(loss.f_backward().map_err(Into::into), "backward"),
    }
}

/// The first step of an optimizer over `variables` that steps through no DDP, after
/// its backward pass: the DDP over the variables that got a gradient, with rank 0's
/// parameters adopted and this step's gradients averaged through it.
fn first_step(ctx: &init::Context, variables: &[Tensor]) -> DistributedDataParallel {
    same_gradients_everywhere(ctx, variables);
    // The Reducer needs no loss to prepare: no graph walk, no static graph.
    let ddp = DistributedDataParallel::over_variables(
        &numbered(variables),
        has_gradient,
        ctx.process_group(),
        bucket_options(ctx),
    )
    .unwrap_or_else(|e| fail_with_source(UNAVERAGED, &e));
    crate::record::optimizer_stepped(variables);
    let grads: Vec<(&Tensor, Tensor)> = variables
        .iter()
        .filter(|v| has_gradient(v))
        .map(|v| (v, v.grad().detach().copy()))
        .collect();
    let params: Vec<Tensor> = grads.iter().map(|(v, _)| v.shallow_clone()).collect();
    or_fail(crate::optim::set_grads_to_none(&params), UNAVERAGED);
    let surrogate = grads
        .iter()
        .map(|(v, g)| (*v * g).sum(v.kind()))
        .reduce(|a, b| a + b)
        .expect("over_variables refuses no variables");
    ddp.backward(&surrogate)
        .unwrap_or_else(|e| fail_unaveraged(&e));
    ddp
}

/// Ends the program, on every rank, when the ranks do not have gradients for the same
/// variables at the optimizer's first step (a layer that some ranks did not use): its
/// DDP is built over those that have one.
fn same_gradients_everywhere(ctx: &init::Context, variables: &[Tensor]) {
    let defined: Vec<i64> = variables
        .iter()
        .map(|v| v.grad().defined() as i64)
        .collect();
    let mut fewest = Tensor::from_slice(&defined);
    let mut most = fewest.copy();
    let pg = ctx.process_group();
    or_fail(pg.all_reduce(&mut fewest, crate::ReduceOp::Min), UNAVERAGED);
    or_fail(pg.all_reduce(&mut most, crate::ReduceOp::Max), UNAVERAGED);
    if let Some(i) = Vec::<i64>::try_from(&(most - fewest))
        .unwrap_or_default()
        .iter()
        .position(|d| *d != 0)
    {
        fail(
            UNAVERAGED,
            format!(
                "variable {i} of the optimizer has a gradient on some ranks and none on \
                 others at its first step (a layer not used on every rank): use every \
                 layer in every step, or build the optimizer inside the function, whose \
                 DDP handles it (find_unused_parameters = true)"
            ),
        );
    }
}

/// Ends the program when a variable outside `ddp` (one that had no gradient at the
/// optimizer's first step) has one now: its gradient would not be averaged.
fn check_covered(ddp: &DistributedDataParallel, variables: &[Tensor]) {
    let covered = ddp.variable_count();
    let outside = variables.iter().filter(|v| has_gradient(v)).count();
    if outside > covered {
        fail(
            UNAVERAGED,
            format!(
                "{} of the optimizer's variables have a gradient now but had none at its \
                 first step, so its DDP does not average them: use every layer from the \
                 first step, or build the optimizer inside the function, whose DDP \
                 handles layers used in some steps only (find_unused_parameters = true)",
                outside - covered
            ),
        );
    }
}

/// A failure of an optimizer's DDP: variables that got no gradient on some ranks get
/// the fixes that apply to an optimizer the function did not build.
fn fail_unaveraged(e: &crate::Error) -> ! {
    match e {
        crate::Error::UnusedParameters { variables, .. } => fail(
            UNAVERAGED,
            format!(
                "{} of the optimizer got no gradient in the last backward pass on some \
                 ranks (a layer not used on every rank, or not in every step): use every \
                 layer in every step, or build the optimizer inside the function, whose \
                 DDP handles it (find_unused_parameters = true)",
                variables.join(", ")
            ),
        ),
        e => fail_with_source(UNAVERAGED, e),
    }
}

/// `loss.backward()` in a function that built one optimizer: through it, so that the
/// gradients are averaged (and accumulated, and scaled) as its steps expect.
pub fn backward(opt: &mut Optimizer, loss: &Tensor) {
    or_fail(opt.backward(loss), "backward");
}

/// `vs.save(path)` on a `VarStore`: rank 0 writes atomically between barriers.
pub fn save(vs: &VarStore, path: impl AsRef<Path>) -> Result<(), TchError> {
    crate::checkpoint::save_var_store(&context(), vs, path)
        .map_err(|e| TchError::Torch(e.to_string()))
}

/// `vs.root()` on a `VarStore`: the store becomes known to the run (a `fully_shard`
/// unit under it is sharded when it is declared, at ZeRO stage 3).
pub fn root(vs: &VarStore) -> tch::nn::Path<'_> {
    if let Some(ctx) = init::current() {
        ctx.units().know_store(&vs.variables_);
    }
    vs.root()
}

/// `vs.load_partial(path)` on a `VarStore`: every rank loads what the file has after a
/// barrier; returns the names of the variables it lacks.
pub fn load_partial(vs: &mut VarStore, path: impl AsRef<Path>) -> Result<Vec<String>, TchError> {
    crate::checkpoint::load_var_store_partial(&context(), vs, path.as_ref())
        .map_err(|e| TchError::Torch(e.to_string()))
}

/// `vs.load(path)` on a `VarStore`: every rank loads after a barrier.
pub fn load(vs: &mut VarStore, path: impl AsRef<Path>) -> Result<(), TchError> {
    crate::checkpoint::load_var_store(&context(), vs, path)
        .map_err(|e| TchError::Torch(e.to_string()))
}
