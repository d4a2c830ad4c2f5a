//! Worker for `tests/tests/grad_scaler.rs`: the fp16 loss scaler's state through a
//! checkpoint, and the error after too many skipped steps in a row.
//!
//! - `scaler_worker resume OUT CKPT STEPS [SAVE_AT]` (under `tchrun`, 2 ranks): one
//!   parameter `p` (2 values), SGD (lr 0.5) with a `GradScaler` (initial scale 8, growth
//!   every 3 clean steps), resumed from the newest checkpoint in `CKPT` when there is
//!   one. Step `i` (1-based) trains on `loss = Σ p · GRADS[i - 1]`, so the scaled
//!   gradient is `scale · GRADS[i - 1]`: the huge entry `H = 2^122` overflows float32
//!   at a scale of 64 or more (2^128), not below, so which steps are skipped depends
//!   on the scale. Each rank appends one line per step to `OUT/steps{rank}.txt`:
//!   `step S stepped B scale X tracker T p [..]`, and after a resume the line
//!   `resumed at step S scaler (X, T)`. With `SAVE_AT`, a checkpoint is written
//!   after that step.
//! - `scaler_worker diverge CLEAN_AT` (one process): `#[distributed(mixed_precision =
//!   "fp16")]`, a linear model whose input holds an inf on every step but step
//!   `CLEAN_AT` (0: none), up to 300 steps; prints `step S` after each step. The
//!   scaler must stop the run with its error after 100 skipped steps in a row.

use std::io::Write as _;

use tch::nn::{self, Module, OptimizerConfig, VarStore};
use tch::{Device, Kind, Tensor};
use tch_distributed::{Checkpointer, GradScaler, Optimizer, TrainState};

/// `H = 2^122`: `H × 32 = 2^127` is finite in float32, `H × 64 = 2^128` is not.
const H: f32 = f32::from_bits((127 + 122) << 23);

/// The gradient of each step's loss with respect to `p` (the same on every rank).
const GRADS: [[f32; 2]; 12] = [
    [0.5, -0.25],
    [0.5, -0.25],
    [0.5, -0.25],
    [0.5, -0.25],
    [0.5, H],
    [0.5, -0.25],
    [0.5, -0.25],
    [0.5, -0.25],
    [0.5, -0.25],
    [0.5, H],
    [0.5, H],
    [0.5, -0.25],
];

fn resume(out: &str, ckpt: &str, steps: u64, save_at: Option<u64>) -> anyhow::Result<()> {
    let ctx = tch_distributed::init()?;
    let rank = ctx.rank();
    let mut vs = VarStore::new(Device::Cpu);
    let p = vs.root().var_copy("p", &Tensor::from_slice(&[1.0f32, 2.0]));
    let mut opt = Optimizer::new(&nn::Sgd::default(), &vs, 0.5)?
        .grad_scaler(GradScaler::new().init_scale(8.0).growth_interval(3));
    let checkpoints = Checkpointer::new(ckpt);
    let mut log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(format!("{out}/steps{rank}.txt"))?;
    let mut step = 0;
    if let Some(state) = checkpoints.load_state(&mut vs, &mut opt)? {
        step = state.step;
        let scaler = opt.scaler().expect("the optimizer has a scaler").state();
        writeln!(log, "resumed at step {step} scaler {scaler:?}")?;
    }
    while step < steps {
        let g = Tensor::from_slice(&GRADS[step as usize]);
        let loss = (&p * g).sum(Kind::Float);
        let stepped = opt.backward_step(&loss)?;
        step += 1;
        let (scale, tracker) = opt.scaler().expect("the optimizer has a scaler").state();
        let values = Vec::<f32>::try_from(&p)?;
        writeln!(
            log,
            "step {step} stepped {stepped} scale {scale} tracker {tracker} p {values:?}"
        )?;
        if save_at == Some(step) {
            let state = TrainState {
                step,
                ..Default::default()
            };
            checkpoints.save_state(&vs, &mut opt, &state)?;
        }
    }
    Ok(())
}

#[tch_distributed::distributed(mixed_precision = "fp16")]
fn diverge(clean_at: i64) -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let net = nn::linear(vs.root(), 2, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    let bad = Tensor::from_slice(&[f32::INFINITY, 1.0]).view([1, 2]);
    let good = Tensor::from_slice(&[1.0f32, 1.0]).view([1, 2]);
    for step in 1..=300 {
        let x = if step == clean_at { &good } else { &bad };
        let loss = net.forward(&x.to_device(vs.device())).sum(Kind::Float);
        opt.backward_step(&loss);
        println!("step {step}");
    }
    Ok(())
}

/// The modes, as the module's docs give them.
#[derive(clap::Parser)]
enum Mode {
    Resume {
        out: String,
        ckpt: String,
        steps: u64,
        save_at: Option<u64>,
    },
    Diverge {
        clean_at: i64,
    },
}

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    match <Mode as clap::Parser>::parse() {
        Mode::Resume {
            out,
            ckpt,
            steps,
            save_at,
        } => resume(&out, &ckpt, steps, save_at),
        Mode::Diverge { clean_at } => diverge(clean_at),
    }
}
