//! The guide's "before": a training function in plain single-GPU `tch`.
//! `data_parallel.rs` is the same file with `#[distributed]` added.
//!
//! `single_gpu [OUT]` trains a small classifier on synthetic data and writes the
//! weights to `OUT` (default `model.safetensors`).

use anyhow::Result;
use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

// ANCHOR: train
fn train(xs: &Tensor, ys: &Tensor, out: &str) -> Result<()> {
    let device = Device::cuda_if_available();
    let vs = nn::VarStore::new(device);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "l1", 16, 64, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "l2", 64, 4, Default::default()));
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
    for epoch in 1..=3 {
        let (mut loss_sum, mut batches) = (0.0, 0);
        for (bx, by) in Iter2::new(xs, ys, 32).shuffle().to_device(device) {
            let loss = net.forward(&bx).cross_entropy_for_logits(&by);
            opt.backward_step(&loss);
            loss_sum += loss.double_value(&[]);
            batches += 1;
        }
        println!(
            "epoch {epoch}: {batches} batches, mean loss {:.4}",
            loss_sum / batches as f64
        );
    }
    vs.save(out)?;
    Ok(())
}
// ANCHOR_END: train

// ANCHOR: main
fn main() -> Result<()> {
    tch::manual_seed(0);
    // 512 samples of 16 features; the label is the largest of the first 4.
    let xs = Tensor::randn([512, 16], (Kind::Float, Device::Cpu));
    let ys = xs.narrow(1, 0, 4).argmax(1, false);
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "model.safetensors".into());
    train(&xs, &ys, &out)
}
// ANCHOR_END: main
