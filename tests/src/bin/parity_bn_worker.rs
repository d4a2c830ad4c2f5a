//! Worker for the BatchNorm parity test against PyTorch's DDP (`broadcast_buffers=True`):
//! plain single-GPU tch code plus `#[distributed]`.
//!
//! `parity_bn_worker DIR` (under `tchrun --nproc-per-node 2`) trains the convnet
//! `c1: Conv2d(1, 4, 3) → bn1: BatchNorm2d(4) → relu → c2: Conv2d(4, 8, 3) →
//! bn2: BatchNorm2d(8) → relu → flatten → l: Linear(128, 4)` in train mode on
//! `DIR/data.safetensors` (`x`: 80 × 1 × 8 × 8 images, `y`: 80 class indices in 0..4)
//! from the weights and running statistics in `DIR/init.safetensors`, with SGD (lr
//! 0.05, momentum 0.9) on the cross-entropy loss, 10 steps: 2 epochs of the 10 batches
//! of 8 images in order (no shuffle), rank `r` taking batches `r`, `r + 2`, … of each
//! epoch (the attribute's sharding of `Iter2`). Then it saves the model (parameters and
//! running statistics) to `DIR/rust.safetensors` (rank 0 writes), runs the model in
//! evaluation mode (batch norm normalizing with the running statistics) on all 80
//! images, and each rank `r` writes its own copy of the VarStore to
//! `DIR/rust-rank{r}.safetensors` and the logits to `DIR/rust-eval-rank{r}.safetensors`.

use tch::data::Iter2;
use tch::nn::{self, ModuleT, OptimizerConfig};
use tch::{Device, Tensor};

/// Images per batch; the data has 10 batches, so each of 2 ranks takes 5 per epoch.
const BATCH: i64 = 8;
const EPOCHS: usize = 2;

#[tch_distributed::distributed]
fn train(dir: &str) -> anyhow::Result<()> {
    let device = Device::cuda_if_available();
    let data: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(format!("{dir}/data.safetensors"))?
            .into_iter()
            .collect();
    let (xs, ys) = (&data["x"], &data["y"]);
    let mut vs = nn::VarStore::new(device);
    let root = vs.root();
    let net = nn::seq_t()
        .add(nn::conv2d(&root / "c1", 1, 4, 3, Default::default()))
        .add(nn::batch_norm2d(&root / "bn1", 4, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::conv2d(&root / "c2", 4, 8, 3, Default::default()))
        .add(nn::batch_norm2d(&root / "bn2", 8, Default::default()))
        .add_fn(|x| x.relu())
        .add_fn(|x| x.flatten(1, -1))
        .add(nn::linear(&root / "l", 8 * 4 * 4, 4, Default::default()));
    vs.load(format!("{dir}/init.safetensors"))?;
    let mut opt = nn::Sgd {
        momentum: 0.9,
        ..Default::default()
    }
    .build(&vs, 0.05)?;
    let mut step = 0;
    for _epoch in 0..EPOCHS {
        for (bx, by) in Iter2::new(xs, ys, BATCH) {
            let loss = net
                .forward_t(&bx.to_device(device), true)
                .cross_entropy_for_logits(&by.to_device(device));
            opt.backward_step(&loss);
            step += 1;
        }
    }
    vs.save(format!("{dir}/rust.safetensors"))?;
    // Evaluation: the running statistics normalize (every rank's are rank 0's).
    let logits = tch::no_grad(|| net.forward_t(&xs.to_device(device), false));
    save_own_copy(dir, &vs, &logits)?;
    println!("bn: {step} steps");
    Ok(())
}

/// Every rank writes its own variables (the test checks that rank 1's equal rank 0's)
/// and its evaluation logits.
fn save_own_copy(dir: &str, vs: &nn::VarStore, logits: &Tensor) -> anyhow::Result<()> {
    let rank = tch_distributed::current().map_or(0, |c| c.rank());
    Tensor::write_safetensors(
        &[("logits", logits.to_device(Device::Cpu).contiguous())],
        format!("{dir}/rust-eval-rank{rank}.safetensors"),
    )?;
    let variables: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .map(|(name, t)| (name, t.to_device(Device::Cpu).contiguous()))
        .collect();
    Tensor::write_safetensors(&variables, format!("{dir}/rust-rank{rank}.safetensors"))?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    let dir = std::env::args()
        .nth(1)
        .expect("usage: parity_bn_worker DIR");
    train(&dir)
}
