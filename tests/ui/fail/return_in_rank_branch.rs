use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[tch_distributed::distributed]
fn train() -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root(), 2, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    let ctx = tch_distributed::current().unwrap();
    if ctx.world_size() > 1 && ctx.rank() == 1 {
        // Rank 1 leaves; the others wait for it in their first backward step.
        return Ok(());
    }
    for _ in 0..10 {
        let loss = net.forward(&Tensor::ones([1, 2], (Kind::Float, Device::Cpu))).sum(Kind::Float);
        opt.backward_step(&loss);
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    train()
}
