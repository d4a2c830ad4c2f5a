//! The largest batch size that fits: `find_executable_batch_size` starts at 256 samples
//! per rank and halves on out of memory, every rank together. `find_batch_size`.

use tch::nn::{self, Module};
use tch::{Kind, Tensor};
use tch_distributed::{DdpOptions, DistributedDataParallel, Optimizer};

/// Trains a small regression for 20 steps at `batch_size` samples per rank; returns the
/// last loss. Everything that depends on the batch size is built here.
fn train(batch_size: usize) -> anyhow::Result<f64> {
    let ctx = tch_distributed::current().expect("joined in main");
    if batch_size > 32 {
        // Stands in for activations that outgrow the GPU above 32 samples: petabytes,
        // which the allocator refuses (tch's method panics with its error).
        let _ = Tensor::empty([batch_size as i64, 1 << 46], (Kind::Float, ctx.device()));
    }
    tch::manual_seed(0);
    let vs = nn::VarStore::new(ctx.device());
    let net = nn::linear(vs.root(), 2, 1, Default::default());
    let ddp = DistributedDataParallel::new(&vs, ctx.process_group(), DdpOptions::default())?;
    let mut opt = Optimizer::new(&nn::Sgd::default(), &vs, 0.1)?.distributed(ddp);
    let mut loss = 0.0;
    for _ in 0..20 {
        let x = Tensor::rand([batch_size as i64, 2], (Kind::Float, ctx.device()));
        let y = x.sum_dim_intlist(1, true, Kind::Float) * 3.0;
        let l = net.forward(&x).mse_loss(&y, tch::Reduction::Mean);
        opt.backward_step(&l)?;
        loss = l.double_value(&[]);
    }
    Ok(loss)
}

fn main() -> anyhow::Result<()> {
    let ctx = tch_distributed::init()?;
    // ANCHOR: find
    let mut fitted = 0;
    let loss = tch_distributed::find_executable_batch_size(256, |batch_size| {
        fitted = batch_size;
        train(batch_size)
    })?;
    // ANCHOR_END: find
    if ctx.is_main_process() {
        println!("trained at batch size {fitted} per rank: loss {loss:.4}");
    }
    Ok(())
}
