// `mixed_precision = "bf16"`: a `let` that runs a forward pass does so under autocast
// (the loss in the same statement too); the parameters stay float32.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

// ANCHOR: train
#[tch_distributed::distributed(mixed_precision = "bf16")]
fn train() -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let net = nn::linear(vs.root(), 3, 1, Default::default());
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
    let xs = Tensor::ones([4, 3], (Kind::Float, vs.device()));
    let output = net.forward(&xs);
    assert_eq!(output.kind(), Kind::BFloat16);
    let loss = xs.apply(&net).square().mean(Kind::Float);
    opt.backward_step(&loss);
    assert_eq!(net.ws.kind(), Kind::Float);
    assert_eq!((&xs * 2.0).kind(), Kind::Float, "outside the forward `let`s: off");
    Ok(())
}
// ANCHOR_END: train

fn main() -> anyhow::Result<()> {
    train()
}
