//! Mixed precision: autocast and `GradScaler`, with the semantics of PyTorch's.

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::ffi;
use crate::init;
use crate::precision::onednn_off_because;
use crate::process_group::ReduceOp;
pub use crate::settings::{MixedPrecision, MixedPrecisionMode};

/// Runs `f` (the forward pass) under libtorch's autocast for `device`'s type at
/// `precision`, as `torch.autocast(device_type, dtype)`: eligible ops (matmuls,
/// convolutions) run in the low precision, the parameters stay float32. Nests, and
/// restores the previous setting when `f` returns or panics.
///
/// # Errors
/// [`Error::Torch`] when libtorch rejects the setting.
pub fn autocast<T>(device: Device, precision: MixedPrecision, f: impl FnOnce() -> T) -> Result<T> {
    let _autocast = Autocast::enter(device, precision)?;
    Ok(f())
}

/// Autocast while this guard lives (the form of [`autocast`] without a closure):
/// entering turns it on for `device`'s type at `precision` (nothing for
/// [`MixedPrecision::No`]), dropping restores the previous setting.
#[must_use = "autocast ends when the guard is dropped"]
pub struct Autocast {
    restore: Option<(i32, ffi::amp::AutocastState)>,
}

impl Autocast {
    /// A guard that leaves autocast as it is: [`Autocast::enter`] with
    /// [`MixedPrecision::No`], without a device.
    pub(crate) fn off() -> Self {
        Autocast { restore: None }
    }

    /// Turns autocast on until the guard drops.
    ///
    /// # Errors
    /// [`Error::Torch`] when libtorch rejects the setting.
    pub fn enter(device: Device, precision: MixedPrecision) -> Result<Self> {
        // c10::ScalarType codes.
        let dtype_code = match precision {
            MixedPrecision::No => return Ok(Autocast { restore: None }),
            MixedPrecision::Fp16 => 5,
            MixedPrecision::Bf16 => 15,
        };
        let device_type = i32::from(device.is_cuda());
        if device_type == 0 && onednn_off_because(precision).is_some() {
            // Once per process: later entries find it done.
            static ONEDNN_OFF: std::sync::OnceLock<std::result::Result<(), String>> =
                std::sync::OnceLock::new();
            ONEDNN_OFF
                .get_or_init(|| ffi::amp::set_onednn_enabled(false))
                .clone()
                .map_err(Error::Torch)?;
        }
        let previous = ffi::amp::autocast_enter(device_type, dtype_code).map_err(Error::Torch)?;
        Ok(Autocast {
            restore: Some((device_type, previous)),
        })
    }
}

impl init::Context {
    /// Autocast in the run's [mixed precision](init::Context::mixed_precision) on this
    /// rank's device while the guard lives, as Accelerate's `accelerator.autocast()`:
    /// what `#[distributed]` puts around each `let` that runs a forward pass, for a
    /// forward pass the attribute cannot see (inside a function of your own). With
    /// precision `no` it does nothing.
    ///
    /// # Errors
    /// [`Error::Torch`] when libtorch rejects the setting.
    pub fn autocast(&self) -> Result<Autocast> {
        Autocast::enter(self.device(), self.mixed_precision())
    }
}

impl Drop for Autocast {
    fn drop(&mut self) {
        if let Some((device_type, previous)) = self.restore {
            let _ = ffi::amp::autocast_exit(device_type, previous);
        }
    }
}

/// Loss scaling for fp16 training, as PyTorch's `torch.amp.GradScaler`, on libtorch's
/// own kernels (`_amp_foreach_non_finite_check_and_unscale_`,
/// `_amp_update_scale_`):
///
/// - the loss is multiplied by the scale (initially 2^16) before backward;
/// - [`step`](Self::step) unscales the gradients and skips the optimizer step when one
///   holds an inf or NaN. In a job of several ranks the found-inf flag is
///   all-reduced, so every rank skips the same steps;
/// - [`update`](Self::update) halves the scale after a skipped step, and doubles it
///   after 2,000 clean steps in a row;
/// - after [`max_consecutive_skips`](Self::max_consecutive_skips) skipped steps in a
///   row (default 100) `update` returns an error instead of training on silently.
///
/// ```no_run
/// # fn main() -> tch_distributed::Result<()> {
/// # let vs = tch::nn::VarStore::new(tch::Device::Cpu);
/// # let mut opt = tch_distributed::Optimizer::new(&tch::nn::Sgd::default(), &vs, 0.1)?;
/// # let loss = tch::Tensor::from(1.0f32);
/// let mut scaler = tch_distributed::GradScaler::new();
/// opt.zero_grad()?;
/// scaler.scale(&loss).backward();
/// scaler.unscale(&opt)?;          // optional: to clip the true gradients
/// opt.clip_grad_norm(1.0);
/// scaler.step(&mut opt)?;         // skipped when the gradients overflowed
/// scaler.update()?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct GradScaler {
    /// float32 [1].
    scale: Tensor,
    /// int32 [1]: clean steps since the last change of scale.
    growth_tracker: Tensor,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: i64,
    max_consecutive_skips: usize,
    /// This step's found-inf flag (float32 [1]), once unscaled.
    found_inf: Option<Tensor>,
    skipped_in_a_row: usize,
}

impl Default for GradScaler {
    fn default() -> Self {
        Self::new()
    }
}

impl GradScaler {
    /// PyTorch's defaults: scale 2^16, growth ×2 every 2,000 clean steps, backoff ×0.5.
    pub fn new() -> Self {
        GradScaler {
            scale: Tensor::from_slice(&[65536.0f32]),
            growth_tracker: Tensor::zeros([1], (Kind::Int, Device::Cpu)),
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            max_consecutive_skips: 100,
            found_inf: None,
            skipped_in_a_row: 0,
        }
    }

    /// The initial scale.
    pub fn init_scale(mut self, scale: f64) -> Self {
        self.scale = Tensor::from_slice(&[scale as f32]).to_device(self.scale.device());
        self
    }

    /// The factor the scale grows by after `growth_interval` clean steps (default 2).
    pub fn growth_factor(mut self, factor: f64) -> Self {
        self.growth_factor = factor;
        self
    }

    /// The factor the scale shrinks by after a skipped step (default 0.5).
    pub fn backoff_factor(mut self, factor: f64) -> Self {
        self.backoff_factor = factor;
        self
    }

    /// Clean steps in a row before the scale grows (default 2,000).
    pub fn growth_interval(mut self, steps: i64) -> Self {
        self.growth_interval = steps;
        self
    }

    /// Skipped steps in a row after which `update` fails (default 100).
    pub fn max_consecutive_skips(mut self, steps: usize) -> Self {
        self.max_consecutive_skips = steps.max(1);
        self
    }

    /// The current scale.
    pub fn scale_value(&self) -> f64 {
        self.scale.double_value(&[0])
    }

    fn move_to(&mut self, device: Device) {
        if self.scale.device() != device {
            self.scale = self.scale.to_device(device);
            self.growth_tracker = self.growth_tracker.to_device(device);
        }
    }

    /// `loss × scale`, to call `backward` on.
    pub fn scale(&mut self, loss: &Tensor) -> Tensor {
        self.move_to(loss.device());
        loss * &self.scale
    }

    /// [`unscale`](Self::unscale) of the gradients of `variables` (an optimizer's).
    pub(crate) fn unscale_gradients(&mut self, variables: &[Tensor]) -> Result<()> {
        if self.found_inf.is_some() {
            return Err(Error::Usage(
                "GradScaler::unscale was already called for this step: call it once, between backward and step".into(),
            ));
        }
        let grads: Vec<Tensor> = variables
            .iter()
            .map(Tensor::grad)
            .filter(Tensor::defined)
            .collect();
        let device = grads
            .first()
            .map(Tensor::device)
            .unwrap_or(self.scale.device());
        self.move_to(device);
        let inv_scale = self
            .scale
            .to_kind(Kind::Double)
            .reciprocal()
            .to_kind(Kind::Float);
        // The variables of one VarStore share its device. One kernel call per dtype,
        // as PyTorch groups them; each sets `found` when its gradients overflowed.
        let found = Tensor::zeros([1], (Kind::Float, device));
        let mut groups: Vec<(Kind, Vec<Tensor>)> = Vec::new();
        for g in grads {
            match groups.iter_mut().find(|(k, _)| *k == g.kind()) {
                Some((_, v)) => v.push(g),
                None => groups.push((g.kind(), vec![g])),
            }
        }
        for (_, group) in &groups {
            ffi::amp::unscale(&ffi::TensorArray::new(group), &found, &inv_scale)
                .map_err(|e| Error::Torch(format!("unscaling the gradients: {e}")))?;
        }
        if let Some(ctx) = init::current().filter(|c| c.world_size() > 1) {
            let mut flag = found.to_device(ctx.device());
            ctx.process_group().all_reduce(&mut flag, ReduceOp::Max)?;
            self.found_inf = Some(flag.to_device(device));
        } else {
            self.found_inf = Some(found);
        }
        Ok(())
    }

    /// Whether this step's gradients held an inf or NaN on any rank, unscaling the
    /// gradients of `variables()` first unless [`unscale`](Self::unscale) already did
    /// this step.
    pub(crate) fn overflowed(&mut self, variables: impl FnOnce() -> Vec<Tensor>) -> Result<bool> {
        if self.found_inf.is_none() {
            self.unscale_gradients(&variables())?;
        }
        Ok(self
            .found_inf
            .as_ref()
            .is_some_and(|f| f.double_value(&[0]) > 0.0))
    }

    /// Updates the scale for the next step from this step's found-inf flag: ×0.5
    /// after an overflow, ×2 after `growth_interval` clean steps in a row.
    ///
    /// # Errors
    /// [`Error::Usage`] when called before `step`, and with
    /// [`Error::Diverged`] when `max_consecutive_skips` steps in a row have overflowed.
    pub fn update(&mut self) -> Result<()> {
        let found = self.found_inf.take().ok_or_else(|| {
            Error::Usage("GradScaler::update before step: call step (or unscale) first".into())
        })?;
        let overflow = found.double_value(&[0]) > 0.0;
        let _ = self.scale.f_internal_amp_update_scale_(
            &self.growth_tracker,
            &found,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )?;
        self.skipped_in_a_row = if overflow {
            self.skipped_in_a_row + 1
        } else {
            0
        };
        if self.skipped_in_a_row >= self.max_consecutive_skips {
            return Err(Error::Diverged {
                skipped: self.skipped_in_a_row,
                scale: self.scale_value(),
            });
        }
        Ok(())
    }

    /// The state a checkpoint keeps: the scale and the clean steps since it changed.
    pub fn state(&self) -> (f64, i64) {
        (self.scale_value(), self.growth_tracker.int64_value(&[0]))
    }

    /// Restores a state from [`state`](Self::state).
    pub fn load_state(&mut self, (scale, growth_tracker): (f64, i64)) {
        let device = self.scale.device();
        self.scale = Tensor::from_slice(&[scale as f32]).to_device(device);
        self.growth_tracker = Tensor::from_slice(&[growth_tracker as i32]).to_device(device);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::nn::{self, Module};

    #[test]
    fn bf16_autocast_on_the_cpu_casts_the_matmul_not_the_parameters() {
        let vs = nn::VarStore::new(Device::Cpu);
        let lin = nn::linear(vs.root(), 4, 3, Default::default());
        let x = Tensor::ones([2, 4], (Kind::Float, Device::Cpu));
        let y = autocast(Device::Cpu, MixedPrecision::Bf16, || lin.forward(&x)).unwrap();
        assert_eq!(y.kind(), Kind::BFloat16);
        assert!(vs
            .trainable_variables()
            .iter()
            .all(|v| v.kind() == Kind::Float));
        assert_eq!(
            lin.forward(&x).kind(),
            Kind::Float,
            "restored after the closure"
        );
        let nested = autocast(Device::Cpu, MixedPrecision::Bf16, || {
            let _inner = autocast(Device::Cpu, MixedPrecision::Bf16, || lin.forward(&x)).unwrap();
            lin.forward(&x)
        })
        .unwrap();
        assert_eq!(
            nested.kind(),
            Kind::BFloat16,
            "still on after a nested exit"
        );
        assert_eq!(lin.forward(&x).kind(), Kind::Float);
        let no = autocast(Device::Cpu, MixedPrecision::No, || lin.forward(&x)).unwrap();
        assert_eq!(no.kind(), Kind::Float);
    }
}
