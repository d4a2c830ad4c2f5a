use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

// An optimizer handed in by `&mut`: its step averages the gradients over the ranks.
#[tch_distributed::distributed]
fn train(vs: &nn::VarStore, opt: &mut nn::Optimizer) -> anyhow::Result<()> {
    let net = nn::linear(vs.root(), 2, 1, Default::default());
    let ctx = tch_distributed::current().unwrap();
    let loss = net.forward(&Tensor::ones([1, 2], (Kind::Float, Device::Cpu))).sum(Kind::Float);
    opt.zero_grad();
    loss.backward();
    if ctx.is_main_process() {
        opt.step();
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let mut opt = nn::OptimizerConfig::build(nn::Sgd::default(), &vs, 0.1)?;
    train(&vs, &mut opt)
}
