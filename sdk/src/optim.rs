//! `Optimizer`: libtorch's own `torch::optim` optimizers, as `tch::nn::Optimizer` runs
//! them, with their state reachable for checkpoints and the DDP they step through.

use std::cell::Cell;
use std::sync::{Arc, Mutex};

use tch::nn::{self, VarStore, Variables};
use tch::Tensor;

use crate::amp::GradScaler;
use crate::ddp::DistributedDataParallel;
use crate::error::{Error, Result};
use crate::ffi;

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

/// An optimizer configuration of tch (`nn::Sgd`, `nn::Adam`, `nn::AdamW`,
/// `nn::RmsProp`) that the SDK can build: the same libtorch optimizer as
/// `OptimizerConfig::build`, created through torch-sys.
pub trait OptimizerKind {
    /// A new libtorch optimizer with no parameters.
    #[doc(hidden)]
    fn create(&self, lr: f64) -> *mut torch_sys::C_optimizer;
}

impl OptimizerKind for nn::Sgd {
    fn create(&self, lr: f64) -> *mut torch_sys::C_optimizer {
        unsafe {
            torch_sys::ato_sgd(
                lr,
                self.momentum,
                self.dampening,
                self.wd,
                self.nesterov as i32,
            )
        }
    }
}

impl OptimizerKind for nn::Adam {
    fn create(&self, lr: f64) -> *mut torch_sys::C_optimizer {
        unsafe { torch_sys::ato_adam(lr, self.beta1, self.beta2, self.wd, self.eps, self.amsgrad) }
    }
}

impl OptimizerKind for nn::AdamW {
    fn create(&self, lr: f64) -> *mut torch_sys::C_optimizer {
        unsafe { torch_sys::ato_adamw(lr, self.beta1, self.beta2, self.wd, self.eps, self.amsgrad) }
    }
}

impl OptimizerKind for nn::RmsProp {
    fn create(&self, lr: f64) -> *mut torch_sys::C_optimizer {
        unsafe {
            torch_sys::ato_rms_prop(
                lr,
                self.alpha,
                self.eps,
                self.wd,
                self.momentum,
                self.centered as i32,
            )
        }
    }
}

/// torch-sys's error convention: the last error, if any, as `Err` (libtorch's message,
/// without C++ frames unless `TORCH_SHOW_CPP_STACKTRACES=1`).
fn torch_sys_result() -> Result<()> {
    let ptr = unsafe { torch_sys::get_and_reset_last_err() };
    if ptr.is_null() {
        return Ok(());
    }
    let msg = unsafe { std::ffi::CStr::from_ptr(ptr) }
        .to_string_lossy()
        .into_owned();
    unsafe { libc::free(ptr as *mut libc::c_void) };
    Err(Error::Torch(crate::error::without_cpp_frames(&msg)))
}

/// A gradient-descent optimizer over a `VarStore`'s trainable variables, with the
/// methods of `tch::nn::Optimizer` and the same arithmetic (it is the same libtorch
/// optimizer, fed the variables in the same order), plus:
///
/// - in a job of several ranks, the backward steps go through the
///   [`DistributedDataParallel`] it holds ([`distributed`](Self::distributed)), so the
///   gradients it steps on are averaged over the ranks;
/// - its state (moments, step counts, learning rates) can be saved and loaded
///   ([`state`](Self::state), [`load_state`](Self::load_state)), with libtorch's own
///   optimizer serialization;
/// - gradient accumulation ([`accumulate`](Self::accumulate)) and fp16 loss scaling
///   ([`grad_scaler`](Self::grad_scaler)) with the semantics of Accelerate's
///   `AcceleratedOptimizer`: [`backward`](Self::backward) divides and scales the loss,
///   and [`step`](Self::step) and [`zero_grad`](Self::zero_grad) do nothing in the
///   middle of an accumulation cycle.
///
/// A training step is either `opt.backward_step(&loss)?` or, spelled out,
/// `opt.zero_grad()?; opt.backward(&loss)?; opt.clip_grad_norm(1.0)?; opt.step()?;`.
pub struct Optimizer {
    raw: *mut torch_sys::C_optimizer,
    variables: Arc<Mutex<Variables>>,
    in_optimizer: usize,
    ddp: Option<DistributedDataParallel>,
    /// Micro-batches per optimizer step, and how many of the current cycle are done.
    accumulation_steps: usize,
    micro_step: usize,
    /// The next micro-step ends its cycle early (the data ran out).
    sync_next: bool,
    /// The last backward ended a cycle: the gradients are complete and `step` steps.
    cycle_complete: bool,
    scaler: Option<GradScaler>,
}

// The libtorch optimizer is used from one thread at a time (`&mut self`).
unsafe impl Send for Optimizer {}

impl Optimizer {
    /// Builds `config` with learning rate `lr` over `vs`'s trainable variables, as
    /// `config.build(&vs, lr)` does in tch.
    ///
    /// Errors with [`Error::Torch`] when libtorch rejects the options, with its own
    /// reason (e.g. `Invalid learning rate: -1` for Adam, `Nesterov momentum requires a
    /// momentum and zero dampening` for SGD).
    pub fn new(config: &impl OptimizerKind, vs: &VarStore, lr: f64) -> Result<Self> {
        let raw = config.create(lr);
        torch_sys_result()?;
        let mut opt = Optimizer {
            raw,
            variables: vs.variables_.clone(),
            in_optimizer: 0,
            ddp: None,
            accumulation_steps: 1,
            micro_step: 0,
            sync_next: false,
            cycle_complete: false,
            scaler: None,
        };
        opt.add_missing_variables()?;
        Ok(opt)
    }

    /// Steps through `ddp`: backward steps all-reduce the gradients first.
    pub fn distributed(mut self, ddp: DistributedDataParallel) -> Self {
        self.ddp = Some(ddp);
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

    /// The DDP this optimizer steps through, if any.
    pub fn ddp(&self) -> Option<&DistributedDataParallel> {
        self.ddp.as_ref()
    }

    /// Variables created after the optimizer join it, as in tch.
    fn add_missing_variables(&mut self) -> Result<()> {
        let v = self.variables.lock().expect("variable store lock");
        for var in &v.trainable_variables[self.in_optimizer.min(v.trainable_variables.len())..] {
            unsafe {
                torch_sys::ato_add_parameters(self.raw, var.tensor.as_ptr() as *mut _, var.group)
            };
            torch_sys_result()?;
        }
        self.in_optimizer = v.trainable_variables.len();
        Ok(())
    }

    /// Runs a torch-sys optimizer function on the libtorch optimizer.
    fn raw_call(&self, f: unsafe extern "C" fn(*mut torch_sys::C_optimizer)) -> Result<()> {
        unsafe { f(self.raw) };
        torch_sys_result()
    }

    /// [`raw_call`](Self::raw_call) after adding variables created since the last
    /// call, as tch does.
    fn call(&mut self, f: unsafe extern "C" fn(*mut torch_sys::C_optimizer)) -> Result<()> {
        self.add_missing_variables()?;
        self.raw_call(f)
    }

    /// Zeroes (sets to none) the gradients of the tracked variables; in the middle of
    /// an accumulation cycle, does nothing.
    pub fn zero_grad(&mut self) -> Result<()> {
        if self.micro_step > 0 {
            return Ok(());
        }
        self.call(torch_sys::ato_zero_grad)
    }

    /// One optimizer step on the current gradients, once the last
    /// [`backward`](Self::backward) ended an accumulation cycle (always, without
    /// accumulation or when no backward ran through this optimizer). With a
    /// [`grad_scaler`](Self::grad_scaler) it unscales the gradients, skips the update
    /// when one on any rank is inf or NaN, and updates the scale.
    ///
    /// Returns whether the parameters were updated. Errors: [`Error::Torch`] from
    /// libtorch; from the scaler, [`Error::Config`] after too many skipped steps in a
    /// row and [`Error::Collective`] when its all-reduce fails.
    pub fn step(&mut self) -> Result<bool> {
        if !std::mem::take(&mut self.cycle_complete) && self.micro_step > 0 {
            return Ok(false);
        }
        let Some(mut scaler) = self.scaler.take() else {
            self.call(torch_sys::ato_step)?;
            return Ok(true);
        };
        let stepped = (|| {
            let clean = !scaler.overflowed(self)?;
            if clean {
                self.call(torch_sys::ato_step)?;
            }
            scaler.update()?;
            Ok(clean)
        })();
        self.scaler = Some(scaler);
        stepped
    }

    /// With a [`grad_scaler`](Self::grad_scaler), divides this cycle's complete
    /// gradients by the scale (once), so that they can be clipped or inspected.
    fn unscale_for_clipping(&mut self) -> Result<()> {
        if self.cycle_complete {
            if let Some(mut scaler) = self.scaler.take() {
                let r = scaler.overflowed(self);
                self.scaler = Some(scaler);
                r?;
            }
        }
        Ok(())
    }

    /// Clips every gradient element to `[-max, max]`, as tch's `clip_grad_value`
    /// (after unscaling them, with a [`grad_scaler`](Self::grad_scaler)).
    pub fn clip_grad_value(&mut self, max: f64) -> Result<()> {
        self.unscale_for_clipping()?;
        for var in self.trainable_variables() {
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
    pub fn clip_grad_norm(&mut self, max: f64) -> Result<f64> {
        self.unscale_for_clipping()?;
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
    /// Errors: those of [`DistributedDataParallel::backward`], or [`Error::Torch`].
    pub fn backward(&mut self, loss: &Tensor) -> Result<bool> {
        self.add_missing_variables()?;
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
        match &self.ddp {
            Some(ddp) if last => ddp.backward(loss)?,
            Some(ddp) => {
                let _local = ddp.no_sync();
                ddp.backward(loss)?
            }
            None => loss.f_backward()?,
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
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<bool> {
        self.backward_then_step(loss, |_| Ok(()))
    }

    /// [`backward_step`](Self::backward_step) with the gradients clipped to
    /// `[-max, max]` before the step.
    pub fn backward_step_clip(&mut self, loss: &Tensor, max: f64) -> Result<bool> {
        self.backward_then_step(loss, |opt| opt.clip_grad_value(max))
    }

    /// [`backward_step`](Self::backward_step) with the gradients' global norm clipped
    /// to `max` before the step (on the averaged, accumulated, unscaled gradients, so
    /// every rank clips by the same norm).
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

    /// Sets the learning rate of every parameter group.
    pub fn set_lr(&mut self, lr: f64) -> Result<()> {
        unsafe { torch_sys::ato_set_learning_rate(self.raw, lr) };
        torch_sys_result()
    }

    /// Sets the learning rate of parameter group `group`.
    pub fn set_lr_group(&mut self, group: usize, lr: f64) -> Result<()> {
        unsafe { torch_sys::ato_set_learning_rate_group(self.raw, group, lr) };
        torch_sys_result()
    }

    /// Sets the momentum of every parameter group (SGD, RMSprop).
    pub fn set_momentum(&mut self, momentum: f64) -> Result<()> {
        unsafe { torch_sys::ato_set_momentum(self.raw, momentum) };
        torch_sys_result()
    }

    /// Sets the momentum of parameter group `group` (SGD, RMSprop), as tch's
    /// `set_momentum_group`.
    pub fn set_momentum_group(&mut self, group: usize, momentum: f64) -> Result<()> {
        unsafe { torch_sys::ato_set_momentum_group(self.raw, group, momentum) };
        torch_sys_result()
    }

    /// Sets the weight decay of every parameter group.
    pub fn set_weight_decay(&mut self, weight_decay: f64) -> Result<()> {
        unsafe { torch_sys::ato_set_weight_decay(self.raw, weight_decay) };
        torch_sys_result()
    }

    /// Sets the weight decay of parameter group `group`, as tch's
    /// `set_weight_decay_group` (minGPT's no-decay group for biases and norms).
    pub fn set_weight_decay_group(&mut self, group: usize, weight_decay: f64) -> Result<()> {
        unsafe { torch_sys::ato_set_weight_decay_group(self.raw, group, weight_decay) };
        torch_sys_result()
    }

    /// The trainable variables, in the order the optimizer holds them.
    pub fn trainable_variables(&self) -> Vec<Tensor> {
        let v = self.variables.lock().expect("variable store lock");
        v.trainable_variables
            .iter()
            .map(|var| var.tensor.shallow_clone())
            .collect()
    }

    /// The optimizer's state (per-parameter moments and step counts, the parameter
    /// groups' options such as the learning rate) in libtorch's optimizer archive
    /// format, as `torch::save(optimizer, …)` writes it in C++.
    pub fn state(&mut self) -> Result<Vec<u8>> {
        self.add_missing_variables()?;
        let mut data = std::ptr::null_mut();
        let mut len = 0;
        ffi::check(unsafe { ffi::tdc_optimizer_save(self.raw as *mut _, &mut data, &mut len) })
            .map_err(|e| Error::Torch(format!("saving the optimizer state: {e}")))?;
        let bytes = unsafe { std::slice::from_raw_parts(data, len).to_vec() };
        unsafe { libc::free(data as *mut libc::c_void) };
        Ok(bytes)
    }

    /// Restores a state from [`state`](Self::state), for an optimizer of the same kind
    /// over variables of the same shapes in the same order.
    ///
    /// Errors with [`Error::Torch`] when the bytes are not such a state.
    pub fn load_state(&mut self, state: &[u8]) -> Result<()> {
        self.add_missing_variables()?;
        ffi::check(unsafe {
            ffi::tdc_optimizer_load(self.raw as *mut _, state.as_ptr(), state.len())
        })
        .map_err(|e| Error::Torch(format!("loading the optimizer state: {e}")))
    }
}

impl Drop for Optimizer {
    fn drop(&mut self) {
        unsafe { torch_sys::ato_free(self.raw) };
    }
}

impl std::fmt::Debug for Optimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.debug_struct("Optimizer")
            .field("variables", &self.in_optimizer)
            .field("distributed", &self.ddp.is_some())
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

    fn params(vs: &VarStore) -> Vec<Vec<f32>> {
        vs.trainable_variables()
            .iter()
            .map(|t| Vec::<f32>::try_from(t.view([-1])).unwrap())
            .collect()
    }

    fn ours(kind: &str, vs: &VarStore) -> Optimizer {
        match kind {
            "sgd" => Optimizer::new(
                &nn::Sgd {
                    momentum: 0.9,
                    ..Default::default()
                },
                vs,
                0.1,
            ),
            _ => Optimizer::new(&nn::Adam::default(), vs, 0.01),
        }
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
