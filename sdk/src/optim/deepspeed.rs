//! DeepSpeed's `optimizer` block (the `deepspeed` setting's file) applied to the
//! optimizer that `.build` makes, as DeepSpeed builds the optimizer its configuration
//! names: its `type` decides between Adam and AdamW (or is SGD), and each of its
//! `params` given (not `"auto"`) replaces the program's option; `"auto"` keeps the
//! program's, as the HF integration fills `"auto"` from the training arguments.

use std::path::Path;

use super::kernels::Algorithm;
use super::Optimizer;
use crate::error::{Error, Result};
use crate::settings::OptimizerBlock;

impl Optimizer {
    /// Applies `block`, read from the DeepSpeed file at `path`, to every parameter
    /// group and to the options new groups start from.
    ///
    /// # Errors
    /// [`Error::Config`] naming the file's type and the program's when they are not the
    /// same kind of optimizer (Adam or AdamW against SGD or RMSprop): DeepSpeed would
    /// build the file's, here the program builds it; and naming a parameter the kind
    /// does not take (`betas` for SGD, `momentum` for Adam).
    pub(crate) fn apply_deepspeed(&mut self, block: &OptimizerBlock, path: &Path) -> Result<()> {
        let mismatch = |what: &str| {
            Error::Config(format!(
                "{}: optimizer.type = \"{}\", and the program builds {what}: give the file the \
                 program's optimizer (or \"auto\" params), or build the file's in the program",
                path.display(),
                block.kind
            ))
        };
        let not_taken = |param: &str| {
            Error::Config(format!(
                "{}: optimizer.params.{param}: {} takes no {param}: remove it (or write \"auto\")",
                path.display(),
                block.kind
            ))
        };
        let adam = matches!(block.kind.as_str(), "adam" | "adamw");
        let apply = |algorithm: &mut Algorithm| -> Result<()> {
            match algorithm {
                Algorithm::Adam {
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                    decoupled,
                    ..
                } if adam => {
                    if block.momentum.is_some() {
                        return Err(not_taken("momentum"));
                    }
                    // DeepSpeed's Adam is AdamW unless `adam_w_mode` is false.
                    *decoupled = block.kind == "adamw" || block.adam_w_mode.unwrap_or(true);
                    if let Some((b1, b2)) = block.betas {
                        (*beta1, *beta2) = (b1, b2);
                    }
                    *eps = block.eps.unwrap_or(*eps);
                    *weight_decay = block.weight_decay.unwrap_or(*weight_decay);
                    Ok(())
                }
                Algorithm::Sgd {
                    momentum,
                    weight_decay,
                    ..
                } if block.kind == "sgd" => {
                    if block.betas.is_some() {
                        return Err(not_taken("betas"));
                    }
                    if block.eps.is_some() {
                        return Err(not_taken("eps"));
                    }
                    *momentum = block.momentum.unwrap_or(*momentum);
                    *weight_decay = block.weight_decay.unwrap_or(*weight_decay);
                    Ok(())
                }
                Algorithm::Adam { decoupled, .. } => {
                    Err(mismatch(if *decoupled { "AdamW" } else { "Adam" }))
                }
                Algorithm::Sgd { .. } => Err(mismatch("SGD")),
                Algorithm::RmsProp { .. } => Err(mismatch("RMSprop")),
            }
        };
        apply(&mut self.defaults.algorithm)?;
        for group in &mut self.groups {
            apply(&mut group.algorithm)?;
        }
        if let Some(lr) = block.lr {
            self.set_lr(lr)?;
            self.defaults.lr = lr;
        }
        self.defaults.algorithm.check(self.defaults.lr)
    }
}

impl Optimizer {
    /// Sets the rate of each step to `rate(s)`, `s` the [`steps_taken`](Self::steps_taken)
    /// before it (so micro-batches and skipped steps do not move it), from the next
    /// step on, as DeepSpeed's engine steps its configuration's scheduler; a resumed
    /// optimizer continues where its count stands.
    ///
    /// # Errors
    /// [`Error::Usage`] for a group number, from setting the rate (none here).
    pub(crate) fn schedule_lr(&mut self, rate: Box<dyn Fn(u64) -> f64 + Send>) -> Result<()> {
        self.set_lr(rate(self.steps_taken))?;
        self.schedule = Some(rate);
        Ok(())
    }

    /// The rate new parameter groups start from: the program's, or the DeepSpeed
    /// file's `lr`.
    pub(crate) fn base_lr(&self) -> f64 {
        self.defaults.lr
    }
}

#[cfg(test)]
mod tests {
    use tch::nn::{self, Module};
    use tch::{Device, Kind, Tensor};

    use super::*;

    /// Two steps of `opt` on a fixed linear model and batch: the weights after.
    fn trained(config: impl FnOnce(&nn::VarStore) -> Optimizer) -> Vec<f32> {
        // Fixed values, not libtorch's global generator: the unit tests that run
        // alongside this one draw from it too (on tch 0.26's leg one did, between a
        // seed and the draws after it).
        let vs = nn::VarStore::new(Device::Cpu);
        let mut net = nn::linear(vs.root(), 4, 3, Default::default());
        tch::no_grad(|| {
            net.ws
                .copy_(&(Tensor::arange(12, tch::kind::FLOAT_CPU).view([3, 4]) * 0.37).sin());
            if let Some(bs) = net.bs.as_mut() {
                bs.copy_(&(Tensor::arange(3, tch::kind::FLOAT_CPU) * 0.5).cos());
            }
        });
        let xs = (Tensor::arange(32, tch::kind::FLOAT_CPU).view([8, 4]) * 0.11).cos();
        let mut opt = config(&vs);
        for _ in 0..2 {
            let loss = net.forward(&xs).square().mean(Kind::Float);
            opt.backward_step(&loss).unwrap();
        }
        Vec::<f32>::try_from(net.ws.flatten(0, -1)).unwrap()
    }

    fn block(kind: &str) -> OptimizerBlock {
        OptimizerBlock {
            kind: kind.into(),
            lr: Some(0.05),
            betas: Some((0.8, 0.99)),
            eps: Some(1e-6),
            weight_decay: Some(0.1),
            ..OptimizerBlock::default()
        }
    }

    /// The weights after [`trained`] with Adam (or, `decoupled`, AdamW) built directly
    /// with [`block`]'s params.
    fn built_with_the_blocks_params(decoupled: bool) -> Vec<f32> {
        trained(|vs| {
            if decoupled {
                let config = nn::AdamW {
                    eps: 1e-6,
                    ..nn::adamw(0.8, 0.99, 0.1)
                };
                Optimizer::new(&config, vs, 0.05).unwrap()
            } else {
                let config = nn::Adam {
                    eps: 1e-6,
                    ..nn::adam(0.8, 0.99, 0.1)
                };
                Optimizer::new(&config, vs, 0.05).unwrap()
            }
        })
    }

    /// The file's params over the program's Adam train as the optimizer built with them,
    /// bit for bit, and `adam_w_mode` decides between Adam and AdamW for `type: Adam`
    /// only (DeepSpeed's default is AdamW); `type: AdamW` is decoupled whatever it says.
    /// With a weight decay, where the two differ.
    #[test]
    fn the_files_optimizer_replaces_the_programs_options() {
        let from_file = |kind: &str, adam_w_mode: Option<bool>| {
            trained(|vs| {
                let mut opt = Optimizer::new(&nn::Adam::default(), vs, 0.001).unwrap();
                let block = OptimizerBlock {
                    adam_w_mode,
                    ..block(kind)
                };
                opt.apply_deepspeed(&block, Path::new("ds_config.json"))
                    .unwrap();
                opt
            })
        };
        let (adam, adam_w) = (
            built_with_the_blocks_params(false),
            built_with_the_blocks_params(true),
        );
        assert_ne!(adam, adam_w, "a weight decay where Adam and AdamW differ");
        assert_eq!(from_file("adamw", None), adam_w);
        assert_eq!(from_file("adamw", Some(false)), adam_w);
        assert_eq!(from_file("adam", None), adam_w);
        assert_eq!(from_file("adam", Some(true)), adam_w);
        assert_eq!(from_file("adam", Some(false)), adam);
    }

    /// "auto" params (none given) keep the program's options and rate.
    #[test]
    fn auto_params_keep_the_programs() {
        let auto = trained(|vs| {
            let mut opt = Optimizer::new(&nn::Adam::default(), vs, 0.001).unwrap();
            let block = OptimizerBlock {
                kind: "adam".into(),
                adam_w_mode: Some(false),
                ..OptimizerBlock::default()
            };
            opt.apply_deepspeed(&block, Path::new("ds_config.json"))
                .unwrap();
            opt
        });
        let program = trained(|vs| Optimizer::new(&nn::Adam::default(), vs, 0.001).unwrap());
        assert_eq!(auto, program);
    }

    /// An SGD block over the program's SGD replaces its momentum, weight decay and rate.
    #[test]
    fn an_sgd_block_applies_to_the_programs_sgd() {
        let from_file = trained(|vs| {
            let mut opt = Optimizer::new(&nn::Sgd::default(), vs, 0.001).unwrap();
            let block = OptimizerBlock {
                kind: "sgd".into(),
                lr: Some(0.05),
                momentum: Some(0.9),
                weight_decay: Some(0.1),
                ..OptimizerBlock::default()
            };
            opt.apply_deepspeed(&block, Path::new("ds_config.json"))
                .unwrap();
            opt
        });
        let direct = trained(|vs| {
            let config = nn::Sgd {
                momentum: 0.9,
                wd: 0.1,
                ..Default::default()
            };
            Optimizer::new(&config, vs, 0.05).unwrap()
        });
        let program = trained(|vs| Optimizer::new(&nn::Sgd::default(), vs, 0.001).unwrap());
        assert_eq!(from_file, direct);
        assert_ne!(from_file, program);
    }

    #[test]
    fn another_kind_of_optimizer_is_an_error_naming_both() {
        let sgd = |vs: &nn::VarStore| Optimizer::new(&nn::Sgd::default(), vs, 0.1);
        let adam = |vs: &nn::VarStore| Optimizer::new(&nn::Adam::default(), vs, 0.1);
        let cases: [(&dyn Fn(&nn::VarStore) -> Result<Optimizer>, &str, &str); 2] =
            [(&sgd, "adamw", "SGD"), (&adam, "sgd", "Adam")];
        for (program, kind, builds) in cases {
            let vs = nn::VarStore::new(Device::Cpu);
            let _ = nn::linear(vs.root(), 2, 2, Default::default());
            let e = program(&vs)
                .unwrap()
                .apply_deepspeed(&block(kind), Path::new("ds.json"))
                .unwrap_err()
                .to_string();
            let expected =
                format!("ds.json: optimizer.type = \"{kind}\", and the program builds {builds}");
            assert!(e.contains(&expected), "{e}");
        }
    }
}
