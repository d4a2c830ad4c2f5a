// `grad_accum = 2`: the optimizer accumulates 2 micro-batches per step, in both
// spellings of a step; `opt.step()` and `opt.zero_grad()` do nothing mid-cycle.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[tch_distributed::distributed(grad_accum = 2)]
fn train() -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let net = nn::linear(vs.root(), 3, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    let xs = Tensor::ones([4, 3], (Kind::Float, vs.device()));
    let before = net.ws.copy();
    let loss = net.forward(&xs).square().mean(Kind::Float);
    opt.backward_step(&loss);
    assert!(net.ws.equal(&before), "first micro-batch: no step");
    let loss = net.forward(&xs).square().mean(Kind::Float);
    opt.backward_step(&loss);
    assert!(!net.ws.equal(&before), "second: the step");

    let before = net.ws.copy();
    for _ in 0..2 {
        opt.zero_grad();
        net.forward(&xs).square().mean(Kind::Float).backward();
        opt.step();
    }
    assert!(!net.ws.equal(&before));
    opt.set_lr(0.01);
    Ok(())
}

fn main() -> anyhow::Result<()> {
    train()
}
