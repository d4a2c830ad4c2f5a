// `mixed_precision = "bf16"`: a `let` that runs a forward pass does so under autocast
// (the loss in the same statement too, and a closure the statement calls); the
// parameters stay float32.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

// ANCHOR: train
#[tch_distributed::distributed(mixed_precision = "bf16")]
fn train() -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let net = nn::linear(vs.root(), 3, 1, Default::default());
    let blocks = [nn::linear(vs.root(), 3, 3, Default::default())];
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
    let xs = Tensor::ones([4, 3], (Kind::Float, vs.device()));
    let output = net.forward(&xs);
    assert_eq!(output.kind(), Kind::BFloat16);
    let loss = xs.apply(&net).square().mean(Kind::Float);
    // A forward pass in a closure that the `let` runs: under autocast too.
    let hidden = blocks.iter().fold(xs.shallow_clone(), |h, block| block.forward(&h));
    assert_eq!(hidden.kind(), Kind::BFloat16);
    opt.backward_step(&loss);
    let by_hand = squared_error(&net, &xs)?;
    assert_eq!(by_hand.kind(), Kind::Float, "the loss in float32, the forward in bf16");
    assert_eq!(net.ws.kind(), Kind::Float);
    let gram = xs.matmul(&xs.tr());
    assert_eq!(gram.kind(), Kind::Float, "a `let` without a forward pass: off");
    Ok(())
}
// ANCHOR_END: train

// A forward pass inside a function of one's own, which the attribute cannot see: the
// function enters the run's autocast itself.
fn squared_error(net: &nn::Linear, xs: &Tensor) -> anyhow::Result<Tensor> {
    let _autocast = tch_distributed::current().expect("inside the job").autocast()?;
    let output = net.forward(xs);
    assert_eq!(output.kind(), Kind::BFloat16);
    Ok(output.square().mean(Kind::Float))
}

fn main() -> anyhow::Result<()> {
    train()
}
