// `comm_hook = "bf16"`: DDP all-reduces the gradients in bf16 (PyTorch's
// bf16_compress_hook).
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

// ANCHOR: train
#[tch_distributed::distributed(comm_hook = "bf16")]
fn train() -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root(), 4, 2, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    let x = Tensor::ones([8, 4], (Kind::Float, Device::Cpu));
    opt.backward_step(&net.forward(&x).mean(Kind::Float));
    Ok(())
}
// ANCHOR_END: train

fn main() -> anyhow::Result<()> {
    train()
}
