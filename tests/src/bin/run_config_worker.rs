//! Worker for the run configuration's precedence (`tests/run_config.rs`): a
//! `#[distributed]` function whose attribute sets `backend`, `nproc_per_node`,
//! `timeout`, `mixed_precision`, `grad_accum`, `optimizer` and `zero`, each to a value
//! that the tests tell apart from those they give by flag, environment variable and
//! configuration file. It runs 12 backward steps of a one-layer model and prints
//! (rank 0) how many of them all-reduced (12 / K with K micro-batches per optimizer
//! step), then the optimizer's implementation and ZeRO stage.

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[tch_distributed::distributed(
    backend = "nccl",
    nproc_per_node = 3,
    timeout = 600,
    mixed_precision = "bf16",
    grad_accum = 2,
    optimizer = "tch",
    zero = 1
)]
fn train() -> anyhow::Result<()> {
    let device = Device::cuda_if_available();
    let vs = nn::VarStore::new(device);
    let net = nn::linear(vs.root(), 2, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.01)?;
    let xs = Tensor::ones([4, 2], (Kind::Float, device));
    for _ in 0..12 {
        let loss = net.forward(&xs).mean(Kind::Float);
        opt.backward_step(&loss);
    }
    let stats = opt.ddp().expect("the optimizer steps through DDP").stats();
    println!(
        "synced {} local {}",
        stats.synced_backward_passes, stats.local_backward_passes
    );
    println!(
        "optimizer {} zero {:?}",
        opt.implementation(),
        opt.zero_stage()
    );
    Ok(())
}

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    train()
}
