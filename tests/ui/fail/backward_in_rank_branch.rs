use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[tch_distributed::distributed]
fn train() -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root(), 2, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    // A local computed from the rank is rank-dependent too.
    let is_main = tch_distributed::current().unwrap().rank() == 0;
    for step in 0..10 {
        let loss = net.forward(&Tensor::ones([1, 2], (Kind::Float, Device::Cpu))).sum(Kind::Float);
        if is_main && step % 2 == 0 {
            opt.backward_step(&loss);
        }
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    train()
}
