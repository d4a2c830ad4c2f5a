// `.build(&vs, lr)` wraps the model in DDP; every optimizer step form goes through it.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

// ANCHOR: train
#[tch_distributed::distributed]
fn train() -> anyhow::Result<Vec<f32>> {
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let net = nn::linear(vs.root(), 3, 1, Default::default());
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
    let xs = Tensor::ones([4, 3], (Kind::Float, vs.device()));
    let loss = |net: &nn::Linear| net.forward(&xs).square().mean(Kind::Float);
    opt.backward_step(&loss(&net));
    opt.backward_step_clip(&loss(&net), 0.5);
    opt.backward_step_clip_norm(&loss(&net), 1.0);
    opt.zero_grad();
    loss(&net).backward();
    opt.step();
    Ok(Vec::<f32>::try_from(net.ws.view([-1]))?)
}
// ANCHOR_END: train

fn main() -> anyhow::Result<()> {
    tch::manual_seed(0);
    let first = train()?;
    tch::manual_seed(0);
    assert_eq!(first, train()?, "one process: deterministic like plain tch");
    Ok(())
}
