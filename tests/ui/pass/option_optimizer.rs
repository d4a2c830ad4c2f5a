// `optimizer = "tch"`: the optimizers the function builds keep tch's own arithmetic
// (libtorch's C++ optimizers, in multi-tensor kernels), so that one process gives the
// plain tch program's results to the bit; "fused" (the default for SGD, Adam and
// AdamW) and "foreach" are torch.optim's.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

// ANCHOR: train
#[tch_distributed::distributed(optimizer = "tch")]
fn train(xs: &Tensor) -> anyhow::Result<Vec<f32>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root(), 3, 1, Default::default());
    let mut opt = nn::Adam::default().build(&vs, 0.1)?;
    for _ in 0..5 {
        opt.backward_step(&net.forward(xs).square().mean(Kind::Float));
    }
    Ok(Vec::try_from(net.ws.view([-1]))?)
}
// ANCHOR_END: train

fn plain(xs: &Tensor) -> anyhow::Result<Vec<f32>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root(), 3, 1, Default::default());
    let mut opt = nn::Adam::default().build(&vs, 0.1)?;
    for _ in 0..5 {
        opt.backward_step(&net.forward(xs).square().mean(Kind::Float));
    }
    Ok(Vec::try_from(net.ws.view([-1]))?)
}

fn main() -> anyhow::Result<()> {
    let xs = Tensor::linspace(-1.0, 1.0, 12, (Kind::Float, Device::Cpu)).view([4, 3]);
    tch::manual_seed(1);
    let ours = train(&xs)?;
    tch::manual_seed(1);
    assert_eq!(ours, plain(&xs)?, "tch's arithmetic, bit for bit");
    Ok(())
}
