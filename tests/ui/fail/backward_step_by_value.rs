// A type error in a call the attribute rewrites points at the user's code: here the
// loss is passed by value where tch takes `&Tensor`.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[tch_distributed::distributed]
fn train() -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root(), 2, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    let x = Tensor::ones([4, 2], (Kind::Float, Device::Cpu));
    let loss = net.forward(&x).mean(Kind::Float);
    opt.backward_step(loss);
    Ok(())
}

fn main() -> anyhow::Result<()> {
    train()
}
