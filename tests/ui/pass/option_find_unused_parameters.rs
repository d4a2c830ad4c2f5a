// `find_unused_parameters = true`: parameters the forward pass did not use get a zero
// gradient instead of stalling the all-reduce (PyTorch's `find_unused_parameters`).
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

// ANCHOR: train
#[tch_distributed::distributed(find_unused_parameters = true)]
fn train() -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let used = nn::linear(vs.root() / "used", 4, 1, Default::default());
    let _unused = nn::linear(vs.root() / "unused", 4, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    let loss = used.forward(&Tensor::ones([2, 4], (Kind::Float, Device::Cpu))).sum(Kind::Float);
    opt.backward_step(&loss);
    Ok(())
}
// ANCHOR_END: train

fn main() -> anyhow::Result<()> {
    train()
}
