//! Worker for the parity test against PyTorch's DDP: plain single-GPU tch code plus
//! `#[distributed]`.
//!
//! `parity_worker DIR` (under `tchrun --nproc-per-node 2`) trains the MLP
//! `l1: Linear(8, 32) → tanh → l2: Linear(32, 4)` on `DIR/data.safetensors` (`x`: 64 × 8,
//! `y`: 64 × 4) from the weights in `DIR/init.safetensors`, once with each optimizer:
//! SGD (lr 0.05, momentum 0.9), Adam, AdamW and RMSprop (lr 0.01, tch's defaults, which
//! are PyTorch's but for AdamW's weight decay: 0.01 in both), 100 steps each: 25
//! epochs of the 8 batches of 8 rows in order (no shuffle), rank `r` taking batches `r`,
//! `r + 2`, … of each epoch (the attribute's sharding of `Iter2`). After steps 1, 10 and
//! 100 it saves the model to `DIR/rust-{sgd,adam,adamw,rmsprop}-{step}.safetensors`
//! (rank 0 writes).

use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

/// Rows per batch; the data has 8 batches, so each of 2 ranks takes 4 per epoch.
const BATCH: i64 = 8;
const EPOCHS: usize = 25;
const SAVED_STEPS: [usize; 3] = [1, 10, 100];

#[tch_distributed::distributed]
fn train(dir: &str, prefix: &str) -> anyhow::Result<()> {
    let device = Device::cuda_if_available();
    let data: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(format!("{dir}/data.safetensors"))?
            .into_iter()
            .collect();
    let (xs, ys) = (&data["x"], &data["y"]);
    for kind in ["sgd", "adam", "adamw", "rmsprop"] {
        let mut vs = nn::VarStore::new(device);
        let net = nn::seq()
            .add(nn::linear(vs.root() / "l1", 8, 32, Default::default()))
            .add_fn(|x| x.tanh())
            .add(nn::linear(vs.root() / "l2", 32, 4, Default::default()));
        vs.load(format!("{dir}/init.safetensors"))?;
        let mut opt = match kind {
            "sgd" => nn::Sgd {
                momentum: 0.9,
                ..Default::default()
            }
            .build(&vs, 0.05)?,
            "adam" => nn::Adam::default().build(&vs, 0.01)?,
            "adamw" => nn::AdamW::default().build(&vs, 0.01)?,
            _ => nn::RmsProp::default().build(&vs, 0.01)?,
        };
        let mut step = 0;
        for _epoch in 0..EPOCHS {
            for (bx, by) in Iter2::new(xs, ys, BATCH) {
                let loss = net
                    .forward(&bx.to_device(device))
                    .mse_loss(&by.to_device(device), tch::Reduction::Mean);
                opt.backward_step(&loss);
                step += 1;
                if SAVED_STEPS.contains(&step) {
                    vs.save(format!("{dir}/{prefix}-{kind}-{step}.safetensors"))?;
                }
            }
        }
        println!("{kind}: {step} steps");
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    let dir = std::env::args()
        .nth(1)
        .expect("usage: parity_worker DIR [PREFIX]");
    let prefix = std::env::args().nth(2).unwrap_or_else(|| "rust".into());
    train(&dir, &prefix)
}
