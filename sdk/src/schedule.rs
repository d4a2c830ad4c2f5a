//! Learning-rate schedules: DeepSpeed's `WarmupLR`, `WarmupDecayLR` and
//! `WarmupCosineLR` (`deepspeed/runtime/lr_schedules.py`), and transformers'
//! constant, linear and cosine schedules with warmup (`transformers/optimization.py`),
//! with the same arithmetic ([`LrSchedule`]); an [`LrScheduler`] sets the rate they
//! give on an optimizer, the SDK's or tch's ([`ScheduledOptimizer`]), once per
//! optimizer step.

use std::f64::consts::PI;

use tch::nn;

use crate::error::{Error, Result};
use crate::optim::Optimizer;
use crate::settings::SchedulerBlock;

/// How DeepSpeed's schedules ramp the rate up during their warmup, as their
/// `warmup_type`, with `W = max(2, warmup_num_steps)` and `s` the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WarmupType {
    /// `"log"` (DeepSpeed's default): the fraction `ln(s + 1) / ln(W)` of the way up,
    /// computed as DeepSpeed does, `(1 / ln(W)) · ln(s + 1)`.
    Log,
    /// `"linear"`: the fraction `s / W` of the way up.
    Linear,
}

impl WarmupType {
    /// The fraction of the warmup done at step `s < w` (`w` being DeepSpeed's
    /// `max(2, warmup_num_steps)`): its `_get_gamma` during the warmup.
    fn gamma(self, s: u64, w: u64) -> f64 {
        match self {
            WarmupType::Log => (1.0 / (w as f64).ln()) * ((s + 1) as f64).ln(),
            WarmupType::Linear => s as f64 / w as f64,
        }
    }
}

/// A learning-rate schedule: the rate of each optimizer step as a function of the
/// optimizer steps taken before it, `s` (0 for the first), and of the optimizer's
/// learning rate `base_lr` (the one it was built with). [`lr`](Self::lr) computes it
/// in `f64` with the reference's own operations, in the same order, so that the values
/// are those of DeepSpeed's and transformers' Python to the last bit or two.
///
/// The constructors ([`warmup_lr`](Self::warmup_lr), …) give each schedule with its
/// reference's defaults; the variants' fields set the others. Step counts are
/// optimizer steps (one per accumulation cycle, not per micro-batch); rates are those
/// the optimizer takes (`lr`, in its units).
///
/// Past its total steps a decaying schedule stays at its last rate (0, or the
/// minimum), as the references' `max(0, …)` and `min(1, …)` give, except transformers'
/// cosine, which goes on along its cosine and climbs back, as transformers' does: give
/// it the run's length.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LrSchedule {
    /// As DeepSpeed's `WarmupLR`: from `warmup_min_lr` up to `warmup_max_lr` (the
    /// optimizer's rate when `None`) over `W = max(2, warmup_num_steps)` steps, then
    /// constant: `lr = min + (max − min)·γ`, with γ as [`WarmupType`] while `s < W`,
    /// then 1.
    WarmupLr {
        warmup_min_lr: f64,
        warmup_max_lr: Option<f64>,
        warmup_num_steps: u64,
        warmup_type: WarmupType,
    },
    /// As DeepSpeed's `WarmupDecayLR`: [`WarmupLr`](Self::WarmupLr), then down to
    /// `warmup_min_lr` at step `total_num_steps`, linearly:
    /// `γ = max(0, (T − s) / max(1, T − W))` once `s ≥ W`. (DeepSpeed's own default for
    /// `warmup_max_lr` is 0.001 here, its `WarmupLR`'s the optimizer's rate; `None` is
    /// the optimizer's rate for both.)
    WarmupDecayLr {
        total_num_steps: u64,
        warmup_min_lr: f64,
        warmup_max_lr: Option<f64>,
        warmup_num_steps: u64,
        warmup_type: WarmupType,
    },
    /// As DeepSpeed's `WarmupCosineLR`, in ratios of the optimizer's rate: from
    /// `warmup_min_ratio` up to 1 over `W = max(2, warmup_num_steps)` steps
    /// (`min + γ·(1 − min)`, γ as [`WarmupType`]), then down to `cos_min_ratio` at step
    /// `total_num_steps` along a half cosine:
    /// `cos_min + (1 − cos_min)·½(1 + cos(π·p))`, `p = min(1, (s − W + 1) / max(1, T − W))`.
    WarmupCosineLr {
        total_num_steps: u64,
        warmup_min_ratio: f64,
        warmup_num_steps: u64,
        cos_min_ratio: f64,
        warmup_type: WarmupType,
    },
    /// As transformers' `get_constant_schedule_with_warmup`: `s / max(1, W)` of the
    /// optimizer's rate while `s < W`, then the whole rate.
    ConstantWithWarmup { num_warmup_steps: u64 },
    /// As transformers' `get_linear_schedule_with_warmup`: `s / max(1, W)` of the
    /// optimizer's rate while `s < W`, then `max(0, (T − s) / max(1, T − W))` of it,
    /// down to 0 at step `T = num_training_steps`.
    LinearWithWarmup {
        num_warmup_steps: u64,
        num_training_steps: u64,
    },
    /// As transformers' `get_cosine_schedule_with_warmup`: `s / max(1, W)` of the
    /// optimizer's rate while `s < W`, then `max(0, ½(1 + cos(π·2·num_cycles·p)))` of
    /// it, `p = (s − W) / max(1, T − W)`: with `num_cycles` 0.5 (its default), a half
    /// cosine down to 0 at step `T = num_training_steps`.
    CosineWithWarmup {
        num_warmup_steps: u64,
        num_training_steps: u64,
        num_cycles: f64,
    },
}

/// DeepSpeed's warmup length: `max(2, warmup_num_steps)` (a warmup of one step would
/// divide by `ln(1) = 0`).
fn deepspeed_warmup(warmup_num_steps: u64) -> u64 {
    warmup_num_steps.max(2)
}

/// transformers' warmup fraction `float(s) / float(max(1, W))`.
fn transformers_warmup(s: u64, w: u64) -> f64 {
    s as f64 / w.max(1) as f64
}

impl LrSchedule {
    /// DeepSpeed's `WarmupLR(optimizer, warmup_num_steps=…, warmup_type=…)`: from 0 up
    /// to the optimizer's rate, then constant.
    pub fn warmup_lr(warmup_num_steps: u64, warmup_type: WarmupType) -> Self {
        LrSchedule::WarmupLr {
            warmup_min_lr: 0.0,
            warmup_max_lr: None,
            warmup_num_steps,
            warmup_type,
        }
    }

    /// DeepSpeed's `WarmupDecayLR(optimizer, total_num_steps, warmup_num_steps=…,
    /// warmup_type=…)`, up to the optimizer's rate: from 0 up to it, then linearly down
    /// to 0 at step `total_num_steps`.
    pub fn warmup_decay_lr(
        total_num_steps: u64,
        warmup_num_steps: u64,
        warmup_type: WarmupType,
    ) -> Self {
        LrSchedule::WarmupDecayLr {
            total_num_steps,
            warmup_min_lr: 0.0,
            warmup_max_lr: None,
            warmup_num_steps,
            warmup_type,
        }
    }

    /// DeepSpeed's `WarmupCosineLR(optimizer, total_num_steps, warmup_num_steps=…,
    /// warmup_type=…)`, with its defaults `warmup_min_ratio = 0` and
    /// `cos_min_ratio = 1e-4`.
    pub fn warmup_cosine_lr(
        total_num_steps: u64,
        warmup_num_steps: u64,
        warmup_type: WarmupType,
    ) -> Self {
        LrSchedule::WarmupCosineLr {
            total_num_steps,
            warmup_min_ratio: 0.0,
            warmup_num_steps,
            cos_min_ratio: 1e-4,
            warmup_type,
        }
    }

    /// transformers' `get_constant_schedule_with_warmup(optimizer, num_warmup_steps)`.
    pub fn constant_with_warmup(num_warmup_steps: u64) -> Self {
        LrSchedule::ConstantWithWarmup { num_warmup_steps }
    }

    /// transformers' `get_linear_schedule_with_warmup(optimizer, num_warmup_steps,
    /// num_training_steps)`.
    pub fn linear_with_warmup(num_warmup_steps: u64, num_training_steps: u64) -> Self {
        LrSchedule::LinearWithWarmup {
            num_warmup_steps,
            num_training_steps,
        }
    }

    /// transformers' `get_cosine_schedule_with_warmup(optimizer, num_warmup_steps,
    /// num_training_steps)`, with its default `num_cycles = 0.5`.
    pub fn cosine_with_warmup(num_warmup_steps: u64, num_training_steps: u64) -> Self {
        LrSchedule::CosineWithWarmup {
            num_warmup_steps,
            num_training_steps,
            num_cycles: 0.5,
        }
    }

    /// The reference's name for this schedule, for messages.
    fn name(&self) -> &'static str {
        match self {
            LrSchedule::WarmupLr { .. } => "WarmupLR",
            LrSchedule::WarmupDecayLr { .. } => "WarmupDecayLR",
            LrSchedule::WarmupCosineLr { .. } => "WarmupCosineLR",
            LrSchedule::ConstantWithWarmup { .. } => "constant schedule with warmup",
            LrSchedule::LinearWithWarmup { .. } => "linear schedule with warmup",
            LrSchedule::CosineWithWarmup { .. } => "cosine schedule with warmup",
        }
    }

    /// Checks the schedule's parameters: [`LrScheduler::new`] calls it.
    ///
    /// # Errors
    /// [`Error::Config`], naming the parameter and the fix, when:
    /// - a DeepSpeed schedule has `warmup_num_steps` 0 (DeepSpeed's own `ValueError`:
    ///   use 1, or a transformers schedule with no warmup);
    /// - a decaying schedule's total steps (`total_num_steps`, `num_training_steps`)
    ///   are not more than its warmup steps, so that it would never decay;
    /// - a rate, ratio or `num_cycles` is not finite, or is negative.
    pub fn check(&self) -> Result<()> {
        let name = self.name();
        let deepspeed_steps = |warmup_num_steps: u64| {
            if warmup_num_steps == 0 {
                return Err(Error::Config(format!(
                    "{name}: warmup_num_steps must be at least 1, as DeepSpeed requires (it \
                     warms up over max(2, warmup_num_steps) steps); for no warmup use \
                     LrSchedule::constant_with_warmup(0), linear_with_warmup(0, T) or \
                     cosine_with_warmup(0, T)"
                )));
            }
            Ok(())
        };
        let decay = |total_name: &str, total: u64, warmup_name: &str, warmup: u64| {
            if total <= warmup {
                return Err(Error::Config(format!(
                    "{name}: {total_name} ({total}) must be more than {warmup_name} \
                     ({warmup}), or the rate never decays: set {total_name} to the run's \
                     optimizer steps (steps per epoch × epochs, counting one step per \
                     accumulation cycle) or shorten the warmup"
                )));
            }
            Ok(())
        };
        let value = |what: &str, v: f64| {
            if !v.is_finite() || v < 0.0 {
                return Err(Error::Config(format!(
                    "{name}: {what} is {v}: it must be a finite number, 0 or more"
                )));
            }
            Ok(())
        };
        match *self {
            LrSchedule::WarmupLr {
                warmup_min_lr,
                warmup_max_lr,
                warmup_num_steps,
                ..
            } => {
                deepspeed_steps(warmup_num_steps)?;
                value("warmup_min_lr", warmup_min_lr)?;
                warmup_max_lr.map_or(Ok(()), |max| value("warmup_max_lr", max))
            }
            LrSchedule::WarmupDecayLr {
                total_num_steps,
                warmup_min_lr,
                warmup_max_lr,
                warmup_num_steps,
                ..
            } => {
                deepspeed_steps(warmup_num_steps)?;
                decay(
                    "total_num_steps",
                    total_num_steps,
                    "warmup_num_steps",
                    warmup_num_steps,
                )?;
                value("warmup_min_lr", warmup_min_lr)?;
                warmup_max_lr.map_or(Ok(()), |max| value("warmup_max_lr", max))
            }
            LrSchedule::WarmupCosineLr {
                total_num_steps,
                warmup_min_ratio,
                warmup_num_steps,
                cos_min_ratio,
                ..
            } => {
                deepspeed_steps(warmup_num_steps)?;
                decay(
                    "total_num_steps",
                    total_num_steps,
                    "warmup_num_steps",
                    warmup_num_steps,
                )?;
                value("warmup_min_ratio", warmup_min_ratio)?;
                value("cos_min_ratio", cos_min_ratio)
            }
            LrSchedule::ConstantWithWarmup { .. } => Ok(()),
            LrSchedule::LinearWithWarmup {
                num_warmup_steps,
                num_training_steps,
            } => decay(
                "num_training_steps",
                num_training_steps,
                "num_warmup_steps",
                num_warmup_steps,
            ),
            LrSchedule::CosineWithWarmup {
                num_warmup_steps,
                num_training_steps,
                num_cycles,
            } => {
                decay(
                    "num_training_steps",
                    num_training_steps,
                    "num_warmup_steps",
                    num_warmup_steps,
                )?;
                value("num_cycles", num_cycles)
            }
        }
    }

    /// The learning rate of the optimizer step that follows `step` steps (`step` 0 is
    /// the first), for an optimizer built with rate `base_lr`: DeepSpeed's `get_lr()`
    /// at `last_batch_iteration = step`, or `base_lr · lr_lambda(step)` as PyTorch's
    /// `LambdaLR` computes transformers' schedules. Pure arithmetic: every rank gets the
    /// same value from the same step. A schedule that [`check`](Self::check) refuses
    /// gives a number all the same.
    pub fn lr(&self, base_lr: f64, step: u64) -> f64 {
        let s = step;
        match *self {
            LrSchedule::WarmupLr {
                warmup_min_lr,
                warmup_max_lr,
                warmup_num_steps,
                warmup_type,
            } => {
                let w = deepspeed_warmup(warmup_num_steps);
                let delta = warmup_max_lr.unwrap_or(base_lr) - warmup_min_lr;
                let gamma = if s < w { warmup_type.gamma(s, w) } else { 1.0 };
                warmup_min_lr + delta * gamma
            }
            LrSchedule::WarmupDecayLr {
                total_num_steps,
                warmup_min_lr,
                warmup_max_lr,
                warmup_num_steps,
                warmup_type,
            } => {
                let (w, t) = (deepspeed_warmup(warmup_num_steps), total_num_steps);
                let delta = warmup_max_lr.unwrap_or(base_lr) - warmup_min_lr;
                let gamma = if s < w {
                    warmup_type.gamma(s, w)
                } else {
                    // float(T - s) / float(max(1.0, T - W)), T - W as Python's int.
                    let span = (t as f64 - w as f64).max(1.0);
                    f64::max(0.0, (t as f64 - s as f64) / span)
                };
                warmup_min_lr + delta * gamma
            }
            LrSchedule::WarmupCosineLr {
                total_num_steps,
                warmup_min_ratio,
                warmup_num_steps,
                cos_min_ratio,
                warmup_type,
            } => {
                let (w, t) = (deepspeed_warmup(warmup_num_steps), total_num_steps);
                let ratio = if s < w {
                    let ratio = warmup_type.gamma(s, w);
                    let delta = 1.0 - warmup_min_ratio;
                    warmup_min_ratio + ratio * delta
                } else {
                    let real_last_step = s as f64 - w as f64 + 1.0;
                    let real_total_steps = (t as f64 - w as f64).max(1.0);
                    let progress = f64::min(1.0, real_last_step / real_total_steps);
                    let delta = 1.0 - cos_min_ratio;
                    let ratio = (1.0 + (PI * progress).cos()) / 2.0;
                    f64::max(0.0, cos_min_ratio + delta * ratio)
                };
                base_lr * ratio
            }
            LrSchedule::ConstantWithWarmup { num_warmup_steps } => {
                let lambda = if s < num_warmup_steps {
                    transformers_warmup(s, num_warmup_steps)
                } else {
                    1.0
                };
                base_lr * lambda
            }
            LrSchedule::LinearWithWarmup {
                num_warmup_steps: w,
                num_training_steps: t,
            } => {
                let lambda = if s < w {
                    transformers_warmup(s, w)
                } else {
                    let span = (t as f64 - w as f64).max(1.0);
                    f64::max(0.0, (t as f64 - s as f64) / span)
                };
                base_lr * lambda
            }
            LrSchedule::CosineWithWarmup {
                num_warmup_steps: w,
                num_training_steps: t,
                num_cycles,
            } => {
                let lambda = if s < w {
                    transformers_warmup(s, w)
                } else {
                    let progress = (s as f64 - w as f64) / (t as f64 - w as f64).max(1.0);
                    f64::max(0.0, 0.5 * (1.0 + (PI * num_cycles * 2.0 * progress).cos()))
                };
                base_lr * lambda
            }
        }
    }
}

/// DeepSpeed's `scheduler` block (from the file at `path`) as a schedule: its
/// parameters given, DeepSpeed's defaults for those left out or `"auto"`
/// (`warmup_min_lr` 0, `warmup_max_lr` the optimizer's rate, `warmup_num_steps` 1000,
/// `warmup_type` log, `warmup_min_ratio` 0, `cos_min_ratio` 1e-4), checked.
///
/// # Errors
/// [`Error::Config`] naming the file when a decaying schedule has no
/// `total_num_steps`, which nothing else gives, and from [`LrSchedule::check`].
pub(crate) fn from_deepspeed(block: &SchedulerBlock, path: &std::path::Path) -> Result<LrSchedule> {
    let param = |key: &str| block.params.get(key).copied();
    let steps = |key: &str, default: u64| param(key).map_or(default, |v| v as u64);
    let warmup_type = match block.warmup_type.as_deref() {
        Some("linear") => WarmupType::Linear,
        _ => WarmupType::Log,
    };
    let total = || {
        param("total_num_steps").map(|v| v as u64).ok_or_else(|| {
            Error::Config(format!(
                "{}: scheduler {} needs params.total_num_steps (the run's optimizer steps): \
                 give the number, \"auto\" has nothing to take it from here",
                path.display(),
                block.kind
            ))
        })
    };
    let schedule = match block.kind.as_str() {
        "WarmupDecayLR" => LrSchedule::WarmupDecayLr {
            total_num_steps: total()?,
            warmup_min_lr: param("warmup_min_lr").unwrap_or(0.0),
            warmup_max_lr: param("warmup_max_lr"),
            warmup_num_steps: steps("warmup_num_steps", 1000),
            warmup_type,
        },
        "WarmupCosineLR" => LrSchedule::WarmupCosineLr {
            total_num_steps: total()?,
            warmup_min_ratio: param("warmup_min_ratio").unwrap_or(0.0),
            warmup_num_steps: steps("warmup_num_steps", 1000),
            cos_min_ratio: param("cos_min_ratio").unwrap_or(1e-4),
            warmup_type,
        },
        _ => LrSchedule::WarmupLr {
            warmup_min_lr: param("warmup_min_lr").unwrap_or(0.0),
            warmup_max_lr: param("warmup_max_lr"),
            warmup_num_steps: steps("warmup_num_steps", 1000),
            warmup_type,
        },
    };
    schedule.check()?;
    Ok(schedule)
}

/// An optimizer whose learning rate an [`LrScheduler`] sets: the SDK's [`Optimizer`]
/// (which `#[distributed]` builds) and tch's `nn::Optimizer`, so that the same
/// training code schedules either.
pub trait ScheduledOptimizer {
    /// Sets the learning rate of every parameter group.
    ///
    /// # Errors
    /// The optimizer's own (the SDK's [`Optimizer::set_lr`]); none for tch's.
    fn set_lr(&mut self, lr: f64) -> Result<()>;

    /// The optimizer steps it has taken, when it counts them: the SDK's
    /// [`Optimizer::steps_taken`] (updates only: not the micro-batches of an
    /// accumulation cycle, nor the steps its loss scaler skipped); `None` for tch's,
    /// whose steps the scheduler counts by the calls to [`LrScheduler::step`].
    fn steps_taken(&self) -> Option<u64>;
}

impl ScheduledOptimizer for Optimizer {
    fn set_lr(&mut self, lr: f64) -> Result<()> {
        Optimizer::set_lr(self, lr)
    }

    fn steps_taken(&self) -> Option<u64> {
        Some(Optimizer::steps_taken(self))
    }
}

impl ScheduledOptimizer for nn::Optimizer {
    fn set_lr(&mut self, lr: f64) -> Result<()> {
        nn::Optimizer::set_lr(self, lr);
        Ok(())
    }

    fn steps_taken(&self) -> Option<u64> {
        None
    }
}

/// Sets an optimizer's learning rate from an [`LrSchedule`], once per optimizer step,
/// as PyTorch's `LambdaLR` and DeepSpeed's schedulers do: built over the optimizer (it
/// sets the rate of the first step, or of the step a resumed run is at), then
/// [`step`](Self::step) after each optimizer step.
///
/// ```no_run
/// # fn main() -> tch_distributed::Result<()> {
/// use tch::nn::{self, OptimizerConfig};
/// use tch_distributed::{LrSchedule, LrScheduler, Optimizer};
/// let vs = nn::VarStore::new(tch::Device::Cpu);
/// let mut opt = Optimizer::new(&nn::Adam::default(), &vs, 3e-4)?;
/// let mut sched = LrScheduler::new(&mut opt, LrSchedule::linear_with_warmup(100, 1000), 3e-4)?;
/// # let loss = tch::Tensor::from(0.0f32);
/// // each micro-batch:
/// opt.backward_step(&loss)?;
/// sched.step(&mut opt)?; // after the optimizer's step
/// # Ok(()) }
/// ```
///
/// Where the schedule stands is the optimizer's own count of steps when it keeps one
/// (the SDK's [`Optimizer::steps_taken`]): calling `step` once per micro-batch, or
/// again, changes nothing until the optimizer has stepped, and a step that the fp16
/// loss scaler skipped does not advance the schedule (as DeepSpeed's engine and
/// Accelerate's `AcceleratedScheduler`). The count goes into checkpoints
/// ([`TrainState::optimizer_steps`](crate::TrainState::optimizer_steps)) and comes back
/// with [`Checkpointer::load_state`](crate::Checkpointer::load_state), so that a
/// resumed run takes the same rates, bit for bit: build the scheduler after loading.
/// With tch's `nn::Optimizer`, which keeps no count, each call to `step` is one step
/// and [`resume`](Self::resume) restores the position.
///
/// Every rank computes the same rate from the same count: no communication, and no
/// scaling by the number of processes (Accelerate's `AcceleratedScheduler` steps the
/// schedule once per process, unless `split_batches`, so that a schedule written for one
/// process ends `num_processes` times sooner; here a schedule is written in optimizer
/// steps, whatever the world size).
///
/// DeepSpeed's schedulers start at `last_batch_iteration = −1` (the rate `warmup_min_lr`,
/// or 0 for `WarmupCosineLR`) and are stepped after each optimizer step, so that
/// DeepSpeed's step `s` takes their value at `s − 1`; this scheduler, as PyTorch's
/// `LambdaLR`, gives step `s` the value at `s` ([`LrSchedule::lr`] at `step = s`), one
/// step further along the warmup.
#[derive(Clone, Debug)]
pub struct LrScheduler {
    schedule: LrSchedule,
    base_lr: f64,
    /// The optimizer steps taken: the next step's rate is `schedule.lr(base_lr, position)`.
    position: u64,
}

impl LrScheduler {
    /// A scheduler of `opt`'s learning rate by `schedule`, from `base_lr`, the rate
    /// the optimizer was built with (the schedules' "optimizer's rate"); sets the rate
    /// of `opt`'s next step: the schedule's first, or with the SDK's [`Optimizer`] the
    /// one at its [`steps_taken`](Optimizer::steps_taken) (a run resumed from a
    /// checkpoint). Returns it with that rate set.
    ///
    /// # Errors
    /// [`Error::Config`] from [`LrSchedule::check`] (a schedule that cannot work, e.g.
    /// total steps not above the warmup), or for a `base_lr` that is negative or not
    /// finite; the optimizer's errors from setting the rate.
    pub fn new(
        opt: &mut impl ScheduledOptimizer,
        schedule: LrSchedule,
        base_lr: f64,
    ) -> Result<Self> {
        schedule.check()?;
        if !base_lr.is_finite() || base_lr < 0.0 {
            return Err(Error::Config(format!(
                "learning-rate schedule: the optimizer's learning rate is {base_lr}: it must \
                 be a finite number, 0 or more"
            )));
        }
        let mut scheduler = LrScheduler {
            schedule,
            base_lr,
            position: opt.steps_taken().unwrap_or(0),
        };
        scheduler.apply(opt)?;
        Ok(scheduler)
    }

    /// Sets `opt`'s rate to the schedule's at the current position.
    fn apply(&mut self, opt: &mut impl ScheduledOptimizer) -> Result<f64> {
        let lr = self.lr();
        opt.set_lr(lr)?;
        Ok(lr)
    }

    /// Moves to the next optimizer step and sets its rate on `opt`; returns the rate.
    /// Call it after each optimizer step (`opt.step()`, or the backward step that
    /// stepped), as PyTorch's `scheduler.step()`. With the SDK's [`Optimizer`] the
    /// position is the optimizer's count of steps, so that a call in the middle of an
    /// accumulation cycle, or a second call, sets the same rate again; with tch's, each
    /// call is one step.
    ///
    /// # Errors
    /// The optimizer's errors from setting the rate ([`Optimizer::set_lr`]'s).
    pub fn step(&mut self, opt: &mut impl ScheduledOptimizer) -> Result<f64> {
        self.position = match opt.steps_taken() {
            Some(taken) => taken,
            None => self.position + 1,
        };
        self.apply(opt)
    }

    /// Puts the scheduler at `position` optimizer steps and sets that step's rate on
    /// `opt`: a resume with tch's `nn::Optimizer`, from a position the program saved
    /// itself ([`position`](Self::position)). The SDK's [`Optimizer`] comes back from a
    /// checkpoint with its count, which [`new`](Self::new) reads.
    ///
    /// # Errors
    /// [`Error::Usage`] when `opt` counts its own steps and `position` is not its
    /// count (restore the optimizer's count instead, with
    /// [`Checkpointer::load_state`](crate::Checkpointer::load_state) or
    /// [`Optimizer::set_steps_taken`]); the optimizer's errors from setting the rate.
    pub fn resume(&mut self, opt: &mut impl ScheduledOptimizer, position: u64) -> Result<f64> {
        if let Some(taken) = opt.steps_taken().filter(|&t| t != position) {
            return Err(Error::Usage(format!(
                "LrScheduler::resume at step {position}, but the optimizer has taken {taken} \
                 steps and the schedule follows its count: restore the optimizer's count \
                 (Checkpointer::load_state does, or Optimizer::set_steps_taken)"
            )));
        }
        self.position = position;
        self.apply(opt)
    }

    /// The optimizer steps taken as of the last call: the next step's rate is the
    /// schedule's at this position.
    pub fn position(&self) -> u64 {
        self.position
    }

    /// The rate of the next optimizer step: the schedule's at [`position`](Self::position).
    pub fn lr(&self) -> f64 {
        self.schedule.lr(self.base_lr, self.position)
    }

    /// The schedule.
    pub fn schedule(&self) -> &LrSchedule {
        &self.schedule
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::nn::OptimizerConfig;

    const BASE: f64 = 0.1;

    /// DeepSpeed's `scheduler` block read into a schedule: each `type`, with
    /// `warmup_type` left out (log, DeepSpeed's default), `log` and `linear`, the
    /// parameters given kept and DeepSpeed's defaults for the rest; a decaying type
    /// without `total_num_steps` is an error naming the file.
    #[test]
    fn a_deepspeed_scheduler_block_gives_its_type_with_its_parameters() {
        let path = std::path::Path::new("ds_config.json");
        let block =
            |kind: &str, warmup_type: Option<&str>, params: &[(&str, f64)]| SchedulerBlock {
                kind: kind.into(),
                params: params.iter().map(|&(k, v)| (k.to_string(), v)).collect(),
                warmup_type: warmup_type.map(Into::into),
            };
        for (text, warmup_type) in [
            (None, WarmupType::Log),
            (Some("log"), WarmupType::Log),
            (Some("linear"), WarmupType::Linear),
        ] {
            let read = |kind, params: &[(&str, f64)]| {
                from_deepspeed(&block(kind, text, params), path).unwrap()
            };
            assert_eq!(
                read("WarmupLR", &[("warmup_num_steps", 10.0)]),
                LrSchedule::WarmupLr {
                    warmup_min_lr: 0.0,
                    warmup_max_lr: None,
                    warmup_num_steps: 10,
                    warmup_type,
                }
            );
            assert_eq!(
                read(
                    "WarmupDecayLR",
                    &[
                        ("total_num_steps", 2000.0),
                        ("warmup_min_lr", 0.01),
                        ("warmup_max_lr", 0.5)
                    ]
                ),
                LrSchedule::WarmupDecayLr {
                    total_num_steps: 2000,
                    warmup_min_lr: 0.01,
                    warmup_max_lr: Some(0.5),
                    warmup_num_steps: 1000,
                    warmup_type,
                }
            );
            assert_eq!(
                read(
                    "WarmupCosineLR",
                    &[("total_num_steps", 100.0), ("warmup_num_steps", 5.0)]
                ),
                LrSchedule::WarmupCosineLr {
                    total_num_steps: 100,
                    warmup_min_ratio: 0.0,
                    warmup_num_steps: 5,
                    cos_min_ratio: 1e-4,
                    warmup_type,
                }
            );
        }
        for kind in ["WarmupDecayLR", "WarmupCosineLR"] {
            let e = from_deepspeed(&block(kind, None, &[]), path).unwrap_err();
            assert!(
                matches!(&e, Error::Config(m) if m.starts_with(&format!(
                    "ds_config.json: scheduler {kind} needs params.total_num_steps"
                ))),
                "{e:?}"
            );
        }
    }

    /// The first steps, the end of the warmup and past the end.
    #[test]
    fn deepspeed_warmup_starts_at_the_minimum_and_reaches_the_maximum() {
        for warmup_type in [WarmupType::Log, WarmupType::Linear] {
            let s = LrSchedule::WarmupLr {
                warmup_min_lr: 0.01,
                warmup_max_lr: None,
                warmup_num_steps: 10,
                warmup_type,
            };
            assert_eq!(s.lr(BASE, 0), 0.01, "{warmup_type:?}");
            assert!(s.lr(BASE, 5) > 0.01 && s.lr(BASE, 5) < BASE);
            assert_eq!(s.lr(BASE, 10), 0.01 + (BASE - 0.01));
            assert_eq!(s.lr(BASE, 1_000_000), s.lr(BASE, 10));
        }
        // Log: the ninth step is ln(10)/ln(10) of the way, the top, to the rounding of
        // DeepSpeed's `(1 / ln(W)) · ln(s + 1)` (0.09999999999999999, as in Python).
        let log = LrSchedule::warmup_lr(10, WarmupType::Log);
        assert_eq!(log.lr(BASE, 9), BASE * ((1.0 / 10f64.ln()) * 10f64.ln()));
        assert!((log.lr(BASE, 9) - BASE).abs() < 1e-16);
        // Linear: 9/10 of the way.
        let linear = LrSchedule::warmup_lr(10, WarmupType::Linear);
        assert_eq!(linear.lr(BASE, 9), BASE * 0.9);
        // An explicit maximum replaces the optimizer's rate.
        let max = LrSchedule::WarmupLr {
            warmup_min_lr: 0.0,
            warmup_max_lr: Some(1.0),
            warmup_num_steps: 4,
            warmup_type: WarmupType::Linear,
        };
        assert_eq!(max.lr(BASE, 2), 0.5);
    }

    /// DeepSpeed warms up over `max(2, warmup_num_steps)`: 1 is 2 (`ln(1)` would be
    /// 0), and 0 is refused as DeepSpeed refuses it.
    #[test]
    fn deepspeed_warmup_of_one_step_is_two_and_of_none_an_error() {
        for warmup_type in [WarmupType::Log, WarmupType::Linear] {
            let one = LrSchedule::warmup_lr(1, warmup_type);
            let two = LrSchedule::warmup_lr(2, warmup_type);
            for step in 0..5 {
                assert_eq!(one.lr(BASE, step), two.lr(BASE, step));
                assert!(one.lr(BASE, step).is_finite());
            }
            assert_eq!(one.lr(BASE, 0), 0.0);
            assert_eq!(one.lr(BASE, 2), BASE);
            let e = LrSchedule::warmup_lr(0, warmup_type).check().unwrap_err();
            assert!(
                matches!(&e, Error::Config(m) if m.starts_with("WarmupLR: warmup_num_steps must be at least 1")),
                "{e}"
            );
        }
        assert_eq!(LrSchedule::warmup_lr(1, WarmupType::Log).lr(BASE, 1), BASE);
        assert_eq!(
            LrSchedule::warmup_lr(1, WarmupType::Linear).lr(BASE, 1),
            BASE * 0.5
        );
    }

    #[test]
    fn deepspeed_decay_ends_at_the_minimum_and_stays_there() {
        let s = LrSchedule::WarmupDecayLr {
            total_num_steps: 20,
            warmup_min_lr: 0.01,
            warmup_max_lr: None,
            warmup_num_steps: 10,
            warmup_type: WarmupType::Linear,
        };
        assert_eq!(s.lr(BASE, 0), 0.01);
        assert_eq!(s.lr(BASE, 10), 0.01 + (BASE - 0.01) * 1.0);
        assert_eq!(s.lr(BASE, 15), 0.01 + (BASE - 0.01) * 0.5);
        assert_eq!(s.lr(BASE, 20), 0.01);
        assert_eq!(s.lr(BASE, 30), 0.01);
        // One warmup step: W = 2, the decay over T − 2 steps.
        let one = LrSchedule::warmup_decay_lr(6, 1, WarmupType::Log);
        assert_eq!(one.lr(BASE, 2), BASE);
        assert_eq!(one.lr(BASE, 4), BASE * 0.5);
    }

    #[test]
    fn deepspeed_cosine_starts_at_the_min_ratio_and_ends_at_cos_min_ratio() {
        let s = LrSchedule::WarmupCosineLr {
            total_num_steps: 20,
            warmup_min_ratio: 0.1,
            warmup_num_steps: 10,
            cos_min_ratio: 1e-4,
            warmup_type: WarmupType::Linear,
        };
        assert_eq!(s.lr(BASE, 0), BASE * 0.1);
        // p = (s − W + 1) / (T − W): the first step after the warmup is already 1/10
        // down, and the last (T − 1) at the bottom.
        let p = 1.0 / 10.0;
        let down = 1e-4 + (1.0 - 1e-4) * ((1.0 + (PI * p).cos()) / 2.0);
        assert_eq!(s.lr(BASE, 10), BASE * down);
        assert_eq!(s.lr(BASE, 19), BASE * 1e-4);
        assert_eq!(s.lr(BASE, 500), BASE * 1e-4, "past the end: the floor");
    }

    #[test]
    fn transformers_schedules_at_their_edges() {
        let constant = LrSchedule::constant_with_warmup(4);
        assert_eq!(constant.lr(BASE, 0), 0.0);
        assert_eq!(constant.lr(BASE, 2), BASE * 0.5);
        assert_eq!(constant.lr(BASE, 4), BASE);
        // No warmup: the whole rate from the first step.
        assert_eq!(LrSchedule::constant_with_warmup(0).lr(BASE, 0), BASE);
        assert_eq!(LrSchedule::linear_with_warmup(0, 10).lr(BASE, 0), BASE);
        assert_eq!(LrSchedule::cosine_with_warmup(0, 10).lr(BASE, 0), BASE);

        let linear = LrSchedule::linear_with_warmup(4, 12);
        assert_eq!(linear.lr(BASE, 4), BASE);
        assert_eq!(linear.lr(BASE, 8), BASE * 0.5);
        assert_eq!(linear.lr(BASE, 12), 0.0);
        assert_eq!(linear.lr(BASE, 100), 0.0, "past the end: 0, not negative");

        let cosine = LrSchedule::cosine_with_warmup(4, 12);
        assert_eq!(cosine.lr(BASE, 4), BASE);
        assert!((cosine.lr(BASE, 8) - BASE * 0.5).abs() < 1e-17);
        assert!(cosine.lr(BASE, 12) < 1e-17);
        // Past the end a half cycle climbs again, as transformers' does.
        assert!(cosine.lr(BASE, 16) > 0.0);
        // 1.5 cycles go below 0 on the way: max(0, …).
        let waves = LrSchedule::CosineWithWarmup {
            num_warmup_steps: 0,
            num_training_steps: 12,
            num_cycles: 1.5,
        };
        assert_eq!(waves.lr(BASE, 4), 0.0);
    }

    #[test]
    fn schedules_that_cannot_work_are_refused_with_the_fix() {
        for (s, starts) in [
            (
                LrSchedule::linear_with_warmup(100, 100),
                "linear schedule with warmup: num_training_steps (100) must be more than num_warmup_steps (100)",
            ),
            (
                LrSchedule::cosine_with_warmup(100, 50),
                "cosine schedule with warmup: num_training_steps (50) must be more than num_warmup_steps (100)",
            ),
            (
                LrSchedule::warmup_decay_lr(10, 10, WarmupType::Log),
                "WarmupDecayLR: total_num_steps (10) must be more than warmup_num_steps (10)",
            ),
            (
                LrSchedule::warmup_cosine_lr(5, 10, WarmupType::Log),
                "WarmupCosineLR: total_num_steps (5) must be more than warmup_num_steps (10)",
            ),
        ] {
            match s.check() {
                Err(Error::Config(m)) => {
                    assert!(m.starts_with(starts), "{m}");
                    assert!(m.contains("set "), "names the fix: {m}");
                }
                other => panic!("{s:?}: {other:?}"),
            }
        }
        let nan = LrSchedule::WarmupLr {
            warmup_min_lr: f64::NAN,
            warmup_max_lr: None,
            warmup_num_steps: 10,
            warmup_type: WarmupType::Log,
        };
        assert!(nan
            .check()
            .unwrap_err()
            .to_string()
            .contains("warmup_min_lr is NaN"));
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let _ = vs.root().zeros("w", &[1]);
        let mut opt = Optimizer::new(&nn::Sgd::default(), &vs, 0.1).unwrap();
        let e = LrScheduler::new(&mut opt, LrSchedule::linear_with_warmup(1, 1), 0.1);
        assert!(matches!(e, Err(Error::Config(_))));
        let e = LrScheduler::new(&mut opt, LrSchedule::constant_with_warmup(1), -1.0);
        assert!(matches!(e, Err(Error::Config(_))));
    }

    /// A model of one weight whose gradient is always 1, so that SGD's update is
    /// `-lr`: the weight after each step tells which rate the step took.
    fn one_weight() -> (nn::VarStore, tch::Tensor) {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let w = vs.root().zeros("w", &[1]);
        (vs, w)
    }

    fn weight(w: &tch::Tensor) -> f64 {
        w.double_value(&[0])
    }

    /// With the SDK's optimizer under accumulation, the scheduler follows the
    /// optimizer's steps whatever the calls: per micro-batch, twice.
    #[test]
    fn with_the_sdk_optimizer_micro_batches_do_not_advance_the_schedule() {
        let (vs, w) = one_weight();
        let mut opt = Optimizer::new(&nn::Sgd::default(), &vs, 1.0)
            .unwrap()
            .accumulate(4);
        let schedule = LrSchedule::linear_with_warmup(2, 8);
        let mut sched = LrScheduler::new(&mut opt, schedule, 1.0).unwrap();
        assert_eq!((sched.position(), sched.lr()), (0, 0.0));
        let mut before = weight(&w);
        for step in 0..6u64 {
            for _ in 0..4 {
                // Each micro-batch's loss is 4·w, divided by the 4 accumulation steps.
                let loss = (&w * 4.0).sum(tch::Kind::Float);
                opt.backward_step(&loss).unwrap();
                sched.step(&mut opt).unwrap();
                sched.step(&mut opt).unwrap();
            }
            let after = weight(&w);
            // The gradient of the cycle is 4 (4 micro-batches of 1): the update is 4·lr(step).
            let expected = 4.0 * schedule.lr(1.0, step);
            assert!(
                ((before - after) - expected).abs() < 1e-6,
                "step {step}: {} ≠ {expected}",
                before - after
            );
            before = after;
            assert_eq!(opt.steps_taken(), step + 1);
            assert_eq!(sched.position(), step + 1);
        }
    }

    /// With tch's optimizer, each call is a step, and `resume` restores a position.
    #[test]
    fn with_tch_optimizer_each_call_is_a_step() {
        let (vs, w) = one_weight();
        let mut opt = nn::Sgd::default().build(&vs, 1.0).unwrap();
        let schedule = LrSchedule::cosine_with_warmup(3, 10);
        let mut sched = LrScheduler::new(&mut opt, schedule, 1.0).unwrap();
        let mut rates = Vec::new();
        for _ in 0..6 {
            let before = weight(&w);
            opt.backward_step(&w.sum(tch::Kind::Float));
            rates.push(before - weight(&w));
            sched.step(&mut opt).unwrap();
        }
        let expected: Vec<f64> = (0..6).map(|s| schedule.lr(1.0, s)).collect();
        for (got, want) in rates.iter().zip(&expected) {
            assert!((got - want).abs() < 1e-6, "{rates:?} ≠ {expected:?}");
        }
        assert_eq!(sched.position(), 6);
        let mut again = LrScheduler::new(&mut opt, schedule, 1.0).unwrap();
        assert_eq!(again.resume(&mut opt, 6).unwrap(), schedule.lr(1.0, 6));
        assert_eq!(again.position(), 6);
    }

    /// The SDK's optimizer's count decides: a resume elsewhere is refused.
    #[test]
    fn resume_against_the_sdk_optimizer_count_is_refused() {
        let (vs, _) = one_weight();
        let mut opt = Optimizer::new(&nn::Sgd::default(), &vs, 1.0).unwrap();
        opt.set_steps_taken(5);
        let schedule = LrSchedule::linear_with_warmup(2, 8);
        let mut sched = LrScheduler::new(&mut opt, schedule, 1.0).unwrap();
        assert_eq!(sched.position(), 5, "starts at the optimizer's count");
        assert_eq!(sched.lr(), schedule.lr(1.0, 5));
        assert!(matches!(sched.resume(&mut opt, 3), Err(Error::Usage(_))));
        assert_eq!(sched.resume(&mut opt, 5).unwrap(), schedule.lr(1.0, 5));
    }
}
