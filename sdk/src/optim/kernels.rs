//! The update: what each algorithm keeps per parameter, and one call of ATen's
//! multi-tensor (`_foreach_*`) or fused kernels per group of parameters that share a
//! device, a dtype, their options and their step count (`csrc/optim.cpp`).

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::ffi::optim::{self, AdamOptions, AdamState, KernelMode, RmsPropOptions, SgdOptions};
use crate::ffi::TensorArray;
pub use crate::settings::Implementation;

/// An optimizer's update rule and its options, as tch's configurations give them
/// (`nn::Sgd`, `nn::Adam`, `nn::AdamW`, `nn::RmsProp`), with libtorch's C++ meaning.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Algorithm {
    /// SGD with momentum (`momentum`, `dampening`), Nesterov momentum and L2 weight
    /// decay, as `torch.optim.SGD`.
    Sgd {
        momentum: f64,
        dampening: f64,
        weight_decay: f64,
        nesterov: bool,
    },
    /// Adam (`decoupled: false`, weight decay added to the gradient) or AdamW
    /// (`decoupled: true`, the parameters decayed by `lr · weight_decay` first), with
    /// AMSGrad, as `torch.optim.Adam` and `torch.optim.AdamW`.
    Adam {
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        amsgrad: bool,
        decoupled: bool,
    },
    /// RMSprop with momentum and the centered variant, as `torch.optim.RMSprop`.
    RmsProp {
        alpha: f64,
        eps: f64,
        weight_decay: f64,
        momentum: f64,
        centered: bool,
    },
}

impl Algorithm {
    /// The implementation an optimizer of this algorithm starts with: fused where
    /// libtorch has a fused kernel (SGD, Adam, AdamW), else foreach (RMSprop), the
    /// fastest update, and `torch.optim`'s own with the same option.
    pub fn preferred_implementation(&self) -> Implementation {
        match self {
            Algorithm::RmsProp { .. } => Implementation::Foreach,
            _ => Implementation::Fused,
        }
    }
}

/// The implementation that updates a parameter on `device` of dtype `kind` with
/// `implementation` asked for: as `torch.optim` defaults, a fused kernel serves
/// floating-point parameters on the CPU, CUDA and MPS; any other parameter falls back
/// to the foreach kernels.
fn serving(implementation: Implementation, device: Device, kind: Kind) -> Implementation {
    let floating = matches!(
        kind,
        Kind::Half | Kind::Float | Kind::Double | Kind::BFloat16
    );
    let device_served = matches!(device, Device::Cpu | Device::Cuda(_) | Device::Mps);
    match implementation {
        Implementation::Fused if !(floating && device_served) => Implementation::Foreach,
        other => other,
    }
}

/// The shim's `mode` for `implementation`.
fn shim_mode(implementation: Implementation) -> KernelMode {
    match implementation {
        Implementation::Tch => KernelMode::Tch,
        Implementation::Foreach => KernelMode::Foreach,
        Implementation::Fused => KernelMode::Fused,
    }
}

impl Algorithm {
    /// The name of the `torch.optim` class: `SGD`, `Adam`, `AdamW`, `RMSprop`.
    pub fn torch_name(&self) -> &'static str {
        match self {
            Algorithm::Sgd { .. } => "SGD",
            Algorithm::Adam {
                decoupled: false, ..
            } => "Adam",
            Algorithm::Adam {
                decoupled: true, ..
            } => "AdamW",
            Algorithm::RmsProp { .. } => "RMSprop",
        }
    }

    /// The per-parameter state tensors, named as `torch.optim`'s `state_dict` names
    /// them, in the order [`ParamState::tensors`] holds them.
    pub(crate) fn state_names(&self) -> &'static [&'static str] {
        match self {
            Algorithm::Sgd { .. } => &["momentum_buffer"],
            Algorithm::Adam { .. } => &["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
            Algorithm::RmsProp { .. } => &["square_avg", "momentum_buffer", "grad_avg"],
        }
    }

    /// Whether `torch.optim` keeps a `step` tensor per parameter (not SGD).
    pub(crate) fn has_step(&self) -> bool {
        !matches!(self, Algorithm::Sgd { .. })
    }

    /// Checks the options as libtorch's C++ optimizers do, with their messages.
    ///
    /// # Errors
    /// [`Error::Torch`] naming the first invalid option.
    pub(crate) fn check(&self, lr: f64) -> Result<()> {
        let invalid =
            |what: &str, value: f64| Err(Error::Torch(format!("Invalid {what}: {value}")));
        if lr.is_nan() || lr < 0.0 {
            return invalid("learning rate", lr);
        }
        match *self {
            Algorithm::Sgd {
                momentum,
                dampening,
                weight_decay,
                nesterov,
            } => {
                if momentum < 0.0 {
                    return invalid("momentum value", momentum);
                }
                if weight_decay < 0.0 {
                    return invalid("weight_decay value", weight_decay);
                }
                if nesterov && (momentum <= 0.0 || dampening != 0.0) {
                    return Err(Error::Torch(
                        "Nesterov momentum requires a momentum and zero dampening".into(),
                    ));
                }
            }
            Algorithm::Adam {
                beta1,
                beta2,
                eps,
                weight_decay,
                ..
            } => {
                if eps < 0.0 {
                    return invalid("epsilon value", eps);
                }
                if !(0.0..1.0).contains(&beta1) {
                    return invalid("beta parameter at index 0", beta1);
                }
                if !(0.0..1.0).contains(&beta2) {
                    return invalid("beta parameter at index 1", beta2);
                }
                if weight_decay < 0.0 {
                    return invalid("weight_decay value", weight_decay);
                }
            }
            Algorithm::RmsProp {
                alpha,
                eps,
                weight_decay,
                momentum,
                ..
            } => {
                for (what, value) in [
                    ("epsilon value", eps),
                    ("momentum value", momentum),
                    ("weight_decay value", weight_decay),
                    ("alpha value", alpha),
                ] {
                    if value < 0.0 {
                        return invalid(what, value);
                    }
                }
            }
        }
        Ok(())
    }

    /// Sets the momentum, as tch's `set_momentum`: SGD's and RMSprop's momentum,
    /// Adam's first beta.
    pub(crate) fn set_momentum(&mut self, value: f64) {
        match self {
            Algorithm::Sgd { momentum, .. } | Algorithm::RmsProp { momentum, .. } => {
                *momentum = value
            }
            Algorithm::Adam { beta1, .. } => *beta1 = value,
        }
    }

    /// Sets the weight decay.
    pub(crate) fn set_weight_decay(&mut self, value: f64) {
        match self {
            Algorithm::Sgd { weight_decay, .. }
            | Algorithm::Adam { weight_decay, .. }
            | Algorithm::RmsProp { weight_decay, .. } => *weight_decay = value,
        }
    }
}

/// A parameter group's options: its learning rate and update rule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Group {
    pub lr: f64,
    pub algorithm: Algorithm,
}

/// What the optimizer keeps for one parameter, created at its first update.
pub(crate) struct ParamState {
    /// Updates taken (`torch.optim`'s `step`).
    pub step: u64,
    /// The algorithm's tensors, by [`Algorithm::state_names`] (`None`: not kept,
    /// e.g. `max_exp_avg_sq` without AMSGrad).
    pub tensors: [Option<Tensor>; 3],
    /// The fused kernels' copy of `step`, a float32 scalar on the parameter's device
    /// (made at the first fused update; only those update it).
    pub step_tensor: Option<Tensor>,
}

impl ParamState {
    /// The bytes its tensors take.
    pub fn bytes(&self) -> usize {
        self.tensors
            .iter()
            .chain(std::iter::once(&self.step_tensor))
            .flatten()
            .map(|t| t.numel() * t.kind().elt_size_in_bytes())
            .sum()
    }
}

/// The state a parameter starts with: zeros for running averages (as libtorch's
/// `zeros_like`); SGD's momentum buffer is the first gradient, and RMSprop's starts at
/// zero whenever its momentum is set (both made by [`update`]).
fn initial_state(algorithm: &Algorithm, p: &Tensor) -> ParamState {
    let zeros = |keep: bool| keep.then(|| p.zeros_like());
    let tensors = match *algorithm {
        Algorithm::Sgd { .. } => [None, None, None],
        Algorithm::Adam { amsgrad, .. } => [zeros(true), zeros(true), zeros(amsgrad)],
        Algorithm::RmsProp { centered, .. } => [zeros(true), None, zeros(centered)],
    };
    ParamState {
        step: 0,
        tensors,
        step_tensor: None,
    }
}

/// A group of parameters updated by one call: same options, device, dtype,
/// implementation, step count, and for SGD whether their momentum buffers exist yet.
#[derive(PartialEq)]
struct Key {
    group: usize,
    device: Device,
    kind: Kind,
    implementation: Implementation,
    step: u64,
    first: bool,
}

/// State tensor `k` of each of `members` (none where it has none yet).
fn slot<'a>(members: &[usize], state: &'a [Option<ParamState>], k: usize) -> TensorArray<'a> {
    TensorArray::optional(members.iter().map(|&i| {
        let s = state[i].as_ref().expect("state made above");
        s.tensors[k].as_ref()
    }))
}

/// One update of every parameter that has a gradient (`params[i]` in group
/// `groups_of[i]`) and, with ZeRO, that this rank owns (`owned[i]`), creating state at
/// a parameter's first update, with one shim call per [`Key`].
///
/// A parameter that the fused kernels do not serve (its device or dtype) is updated by
/// the foreach kernels instead ([`Implementation::serving`]).
///
/// # Errors
/// [`Error::Torch`] when a kernel refuses the tensors.
pub(crate) fn update(
    params: &[Tensor],
    groups_of: &[usize],
    groups: &[Group],
    state: &mut [Option<ParamState>],
    implementation: Implementation,
    owned: Option<&[bool]>,
) -> Result<()> {
    let mut batches: Vec<(Key, Vec<usize>)> = Vec::new();
    for (i, p) in params.iter().enumerate() {
        // With ZeRO, another rank updates it.
        if owned.is_some_and(|o| !o[i]) || !p.grad().defined() {
            continue;
        }
        let group = groups_of[i];
        let algorithm = &groups[group].algorithm;
        let s = state[i].get_or_insert_with(|| initial_state(algorithm, p));
        // RMSprop's momentum buffers start at zero at the first update with momentum:
        // the first, or one after the momentum was set (where libtorch's C++ RMSprop
        // fails, having made none).
        if let Algorithm::RmsProp { momentum, .. } = *algorithm {
            if momentum > 0.0 && s.tensors[1].is_none() {
                s.tensors[1] = Some(p.zeros_like());
            }
        }
        let serving = serving(implementation, p.device(), p.kind());
        if serving == Implementation::Fused && s.step_tensor.is_none() {
            s.step_tensor = Some(Tensor::full([], s.step as f64, (Kind::Float, p.device())));
        }
        let key = Key {
            group,
            device: p.device(),
            kind: p.kind(),
            implementation: serving,
            step: s.step,
            first: matches!(algorithm, Algorithm::Sgd { momentum, .. } if *momentum != 0.0)
                && s.tensors[0].is_none(),
        };
        match batches.iter_mut().find(|(k, _)| *k == key) {
            Some((_, members)) => members.push(i),
            None => batches.push((key, vec![i])),
        }
    }
    for (key, members) in batches {
        let Group { lr, algorithm } = groups[key.group];
        let mode = shim_mode(key.implementation);
        let ps = TensorArray::of(members.iter().map(|&i| &params[i]));
        let done = match algorithm {
            Algorithm::Sgd {
                momentum,
                dampening,
                weight_decay,
                nesterov,
            } => {
                let options = SgdOptions {
                    lr,
                    momentum,
                    dampening,
                    weight_decay,
                    nesterov,
                    mode,
                };
                let made = if key.first {
                    optim::sgd_step(&ps, None, &options)
                } else {
                    optim::sgd_step(&ps, Some(&slot(&members, state, 0)), &options)
                };
                made.map(|made| {
                    for (&i, buf) in members.iter().zip(made) {
                        let s = state[i].as_mut().expect("state made above");
                        s.tensors[0] = Some(buf);
                    }
                })
            }
            Algorithm::Adam {
                beta1,
                beta2,
                eps,
                weight_decay,
                amsgrad,
                decoupled,
            } => {
                let steps = TensorArray::optional(members.iter().map(|&i| {
                    let s = state[i].as_ref().expect("state made above");
                    s.step_tensor.as_ref()
                }));
                let (m, v, vmax) = (
                    slot(&members, state, 0),
                    slot(&members, state, 1),
                    slot(&members, state, 2),
                );
                let adam_state = AdamState {
                    exp_avgs: &m,
                    exp_avg_sqs: &v,
                    max_exp_avg_sqs: &vmax,
                    steps: &steps,
                };
                let options = AdamOptions {
                    step: key.step as i64 + 1,
                    lr,
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                    amsgrad,
                    decoupled,
                    mode,
                };
                optim::adam_step(&ps, &adam_state, &options)
            }
            Algorithm::RmsProp {
                alpha,
                eps,
                weight_decay,
                momentum,
                centered,
            } => {
                let (sq, buf, avg) = (
                    slot(&members, state, 0),
                    slot(&members, state, 1),
                    slot(&members, state, 2),
                );
                let options = RmsPropOptions {
                    lr,
                    alpha,
                    eps,
                    weight_decay,
                    momentum,
                    centered,
                    mode,
                };
                optim::rmsprop_step(&ps, &sq, &buf, &avg, &options)
            }
        };
        done.map_err(|t| Error::Torch(t.message()))?;
        for &i in &members {
            state[i].as_mut().expect("state made above").step += 1;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_serves_floating_point_on_cpu_cuda_and_mps_and_foreach_takes_the_rest() {
        use Implementation::*;
        for kind in [Kind::Half, Kind::Float, Kind::Double, Kind::BFloat16] {
            for device in [Device::Cpu, Device::Cuda(1), Device::Mps] {
                assert_eq!(serving(Fused, device, kind), Fused, "{device:?} {kind:?}");
            }
            assert_eq!(serving(Fused, Device::Vulkan, kind), Foreach);
        }
        assert_eq!(serving(Fused, Device::Cpu, Kind::Int64), Foreach);
        assert_eq!(serving(Fused, Device::Cpu, Kind::ComplexFloat), Foreach);
        // Asked for, the others stay what they are.
        for other in [Foreach, Tch] {
            assert_eq!(serving(other, Device::Vulkan, Kind::Int64), other);
        }
    }

    #[test]
    fn implementations_are_named_as_the_option_spells_them() {
        for i in [
            Implementation::Fused,
            Implementation::Foreach,
            Implementation::Tch,
        ] {
            assert_eq!(i.to_string().parse::<Implementation>().unwrap(), i);
        }
        assert_eq!(Implementation::Fused.to_string(), "fused");
        assert!("apex".parse::<Implementation>().is_err());
    }

    /// libtorch's bounds, boundaries included: 0 is a valid learning rate, epsilon,
    /// beta, weight decay, momentum and alpha; below 0 (or a beta of 1) is not.
    #[test]
    fn options_are_checked_at_libtorchs_bounds() {
        let sgd = |momentum, dampening, weight_decay, nesterov| Algorithm::Sgd {
            momentum,
            dampening,
            weight_decay,
            nesterov,
        };
        let adam = |beta1, beta2, eps, weight_decay| Algorithm::Adam {
            beta1,
            beta2,
            eps,
            weight_decay,
            amsgrad: false,
            decoupled: false,
        };
        let rms = |alpha, eps, weight_decay, momentum| Algorithm::RmsProp {
            alpha,
            eps,
            weight_decay,
            momentum,
            centered: false,
        };
        let ok = |a: Algorithm, lr| assert!(a.check(lr).is_ok(), "{a:?} lr {lr}");
        let err = |a: Algorithm, lr, says: &str| {
            let e = a.check(lr).unwrap_err().to_string();
            assert!(e.contains(says), "{a:?} lr {lr}: {e}");
        };
        ok(sgd(0.0, 0.0, 0.0, false), 0.0);
        err(
            sgd(0.0, 0.0, 0.0, false),
            -1e-9,
            "Invalid learning rate: -0.000000001",
        );
        err(sgd(0.0, 0.0, 0.0, false), f64::NAN, "Invalid learning rate");
        err(
            sgd(-0.1, 0.0, 0.0, false),
            0.1,
            "Invalid momentum value: -0.1",
        );
        err(
            sgd(0.0, 0.0, -0.1, false),
            0.1,
            "Invalid weight_decay value: -0.1",
        );
        ok(sgd(0.9, 0.0, 0.0, true), 0.1);
        err(sgd(0.0, 0.0, 0.0, true), 0.1, "Nesterov momentum requires");
        err(sgd(0.9, 0.1, 0.0, true), 0.1, "Nesterov momentum requires");
        ok(adam(0.0, 0.0, 0.0, 0.0), 0.0);
        err(
            adam(0.9, 0.999, -1.0, 0.0),
            0.1,
            "Invalid epsilon value: -1",
        );
        err(
            adam(1.0, 0.999, 1e-8, 0.0),
            0.1,
            "Invalid beta parameter at index 0: 1",
        );
        err(
            adam(-0.1, 0.999, 1e-8, 0.0),
            0.1,
            "Invalid beta parameter at index 0",
        );
        err(
            adam(0.9, 1.0, 1e-8, 0.0),
            0.1,
            "Invalid beta parameter at index 1: 1",
        );
        err(
            adam(0.9, 0.999, 1e-8, -0.1),
            0.1,
            "Invalid weight_decay value: -0.1",
        );
        ok(rms(0.0, 0.0, 0.0, 0.0), 0.0);
        err(rms(-0.1, 1e-8, 0.0, 0.0), 0.1, "Invalid alpha value: -0.1");
        err(rms(0.99, -1.0, 0.0, 0.0), 0.1, "Invalid epsilon value: -1");
        err(
            rms(0.99, 1e-8, -0.1, 0.0),
            0.1,
            "Invalid weight_decay value: -0.1",
        );
        err(
            rms(0.99, 1e-8, 0.0, -0.1),
            0.1,
            "Invalid momentum value: -0.1",
        );
    }

    #[test]
    fn fused_where_libtorch_has_a_fused_kernel_else_foreach() {
        let sgd = Algorithm::Sgd {
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        };
        let adam = Algorithm::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            amsgrad: false,
            decoupled: true,
        };
        let rms = Algorithm::RmsProp {
            alpha: 0.99,
            eps: 1e-8,
            weight_decay: 0.0,
            momentum: 0.0,
            centered: false,
        };
        assert_eq!(sgd.preferred_implementation(), Implementation::Fused);
        assert_eq!(adam.preferred_implementation(), Implementation::Fused);
        assert_eq!(rms.preferred_implementation(), Implementation::Foreach);
    }
}
