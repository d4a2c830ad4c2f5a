// `bucket_cap_mb = 0.5`: the DDP bucket size in MiB (PyTorch's `bucket_cap_mb`).
use tch::nn::{self, OptimizerConfig};
use tch::Device;

// ANCHOR: train
#[tch_distributed::distributed(bucket_cap_mb = 0.5)]
fn train() -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let _net = nn::linear(vs.root(), 4, 2, Default::default());
    let _opt = nn::Sgd::default().build(&vs, 0.1)?;
    Ok(())
}
// ANCHOR_END: train

fn main() -> anyhow::Result<()> {
    train()
}
