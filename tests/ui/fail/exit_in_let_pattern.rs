use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[tch_distributed::distributed]
fn train() -> anyhow::Result<()> {
    let xs = Tensor::rand([64, 2], (Kind::Float, Device::Cpu));
    let ys = xs.sum_dim_intlist(1, true, Kind::Float);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root(), 2, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    for (x, y) in Iter2::new(&xs, &ys, 8) {
        let loss = net.forward(&x).mse_loss(&y, tch::Reduction::Mean);
        opt.backward_step(&loss);
        let Some(_small) = Some(loss.double_value(&[])).filter(|v| *v < 0.1) else {
            break;
        };
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    train()
}
