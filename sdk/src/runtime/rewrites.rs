//! What the rewritten calls run: the optimizer `.build` makes, the backward steps
//! (with the gradients of optimizers the function did not build averaged before the
//! update), `loss.backward()`, `vs.save`/`vs.load`, autocast, the device.

use std::cell::RefCell;
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
    let defaults = DdpOptions::default();
    // As PyTorch's DDP: a `bucket_cap_mb` given explicitly also caps the first bucket.
    let ddp_options = DdpOptions {
        bucket_cap_mb: options.bucket_cap_mb.unwrap_or(defaults.bucket_cap_mb),
        first_bucket_cap_mb: options
            .bucket_cap_mb
            .unwrap_or(defaults.first_bucket_cap_mb),
        find_unused_parameters: options.find_unused_parameters.unwrap_or(false),
        static_graph: options.static_graph.unwrap_or(false),
        ..defaults
    };
    // Failing to wrap the model ends the program with the cause and the fix: returned
    // through the caller's `?`, tch's error type would print it as an "Internal torch
    // error".
    let ddp = DistributedDataParallel::new(vs, ctx.process_group(), ddp_options)
        .unwrap_or_else(|e| fail_with_source("wrapping the model in DistributedDataParallel", &e));
    crate::record::model_built(vs);
    let mut opt = Optimizer::new(config, vs, lr)
        .map_err(|e| TchError::Torch(format!("tch-distributed: building the optimizer: {e}")))?
        .distributed(ddp)
        .accumulate(options.grad_accum.unwrap_or(1));
    if options.zero == Some(1) {
        opt = opt
            .zero(1)
            .unwrap_or_else(|e| fail("the attribute's zero", e));
    }
    if let Some(implementation) = options.optimizer {
        opt = opt
            .with_implementation(implementation)
            .unwrap_or_else(|e| fail("the attribute's optimizer", e));
    }
    if ctx.precision().0 == MixedPrecision::Fp16 {
        opt = opt.grad_scaler(GradScaler::new());
    }
    Ok(opt)
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
/// helper returns): tch's steps with the gradients averaged over the ranks before the
/// update (and before clipping), and rank 0's parameters adopted at its first step
/// ([`sync_before_step`]).
impl Steps for tch::nn::Optimizer {
    fn __tchd_backward_step(&mut self, loss: &Tensor) {
        self.zero_grad();
        loss.backward();
        self.sync_before_step();
        self.step();
    }
    fn __tchd_backward_step_clip(&mut self, loss: &Tensor, max: f64) {
        self.zero_grad();
        loss.backward();
        self.sync_before_step();
        self.clip_grad_value(max);
        self.step();
    }
    fn __tchd_backward_step_clip_norm(&mut self, loss: &Tensor, max: f64) {
        self.zero_grad();
        loss.backward();
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
    /// [`Optimizer::backward_step`], and, when it steps through no DDP (built outside
    /// the function), with the gradients averaged before `before_step`.
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

/// An optimizer whose gradients the function must average itself before it steps:
/// tch's, and the SDK's when it steps through no DDP. Behind references and boxes
/// too, so that `opt.step()` is found whatever holds the optimizer.
pub trait SyncBeforeStep {
    /// On several ranks: adopts rank 0's parameters the first time (as DDP does when
    /// it is built), then averages the gradients over the ranks. Nothing in a world of
    /// one, or for an SDK optimizer with a DDP (which averaged them during backward).
    fn sync_before_step(&self);
}

impl SyncBeforeStep for tch::nn::Optimizer {
    fn sync_before_step(&self) {
        average_gradients(&self.trainable_variables());
    }
}

impl SyncBeforeStep for Optimizer {
    fn sync_before_step(&self) {
        if self.ddp().is_none() {
            average_gradients(&self.trainable_variables());
        }
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

thread_local! {
    /// The optimizers (by their first variable's storage) whose parameters were made
    /// rank 0's already.
    static ADOPTED: RefCell<std::collections::HashSet<usize>> = RefCell::default();
}

/// Averages the gradients of `variables` over the ranks (one all-reduce per device and
/// dtype, of the gradients flattened into one buffer); the first time for these
/// variables, first broadcasts rank 0's values of them. Ends the program with an
/// `Error:` line naming the fix when the ranks do not have gradients for the same
/// variables (a layer that some ranks did not use), or when a collective fails.
fn average_gradients(variables: &[Tensor]) {
    let Some(ctx) = init::current().filter(|c| c.world_size() > 1) else {
        return;
    };
    let what = "averaging the gradients of an optimizer the function did not build";
    crate::ddp::count_gradient_average();
    let pg = ctx.process_group();
    let key = variables.first().map_or(0, |v| v.data_ptr() as usize);
    if ADOPTED.with(|a| a.borrow_mut().insert(key)) {
        or_fail(pg.broadcast_coalesced(variables, 1 << 20, 0), what);
        crate::record::optimizer_stepped(variables);
    }
    let defined: Vec<i64> = variables
        .iter()
        .map(|v| v.grad().defined() as i64)
        .collect();
    let mut agreed = Tensor::from_slice(&defined);
    let mut all = agreed.copy();
    or_fail(pg.all_reduce(&mut agreed, crate::ReduceOp::Min), what);
    or_fail(pg.all_reduce(&mut all, crate::ReduceOp::Max), what);
    if !agreed.equal(&all) {
        let i = Vec::<i64>::try_from(&(all - &agreed))
            .unwrap_or_default()
            .iter()
            .position(|d| *d != 0)
            .unwrap_or(0);
        fail(
            what,
            format!(
                "variable {i} of the optimizer has a gradient on some ranks and none on \
                 others (a layer not used on every rank): use every layer in every \
                 step, or build the optimizer inside the function, whose DDP handles it \
                 (find_unused_parameters = true)"
            ),
        );
    }
    tch::no_grad(|| {
        let mut groups: Vec<Vec<Tensor>> = Vec::new();
        for g in variables.iter().map(Tensor::grad).filter(Tensor::defined) {
            match groups
                .iter_mut()
                .find(|group| group[0].device() == g.device() && group[0].kind() == g.kind())
            {
                Some(group) => group.push(g),
                None => groups.push(vec![g]),
            }
        }
        for grads in groups {
            let flat: Vec<Tensor> = grads.iter().map(|g| g.reshape([-1])).collect();
            let mut buffer = Tensor::cat(&flat, 0);
            or_fail(pg.all_reduce(&mut buffer, crate::ReduceOp::Avg), what);
            let mut offset = 0;
            for mut g in grads {
                let n = g.numel() as i64;
                g.copy_(&buffer.narrow(0, offset, n).view_as(&g));
                offset += n;
            }
        }
    });
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

/// `vs.load(path)` on a `VarStore`: every rank loads after a barrier.
pub fn load(vs: &mut VarStore, path: impl AsRef<Path>) -> Result<(), TchError> {
    crate::checkpoint::load_var_store(&context(), vs, path)
        .map_err(|e| TchError::Torch(e.to_string()))
}
