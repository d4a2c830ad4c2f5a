use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[tch_distributed::distributed]
fn train() -> anyhow::Result<()> {
    let g_vs = nn::VarStore::new(Device::Cpu);
    let d_vs = nn::VarStore::new(Device::Cpu);
    let g = nn::linear(g_vs.root(), 3, 3, Default::default());
    let d = nn::linear(d_vs.root(), 3, 1, Default::default());
    let mut g_opt = nn::Adam::default().build(&g_vs, 1e-3)?;
    let mut d_opt = nn::Adam::default().build(&d_vs, 1e-3)?;
    let z = Tensor::randn([4, 3], (Kind::Float, Device::Cpu));
    let loss = d.forward(&g.forward(&z)).mean(Kind::Float);
    loss.backward();
    g_opt.step();
    d_opt.step();
    Ok(())
}

fn main() {}
