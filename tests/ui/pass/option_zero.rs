// `zero = 1`: ZeRO stage 1, the optimizer's state sharded over the ranks (each keeps and
// updates its share of the parameters, then the owners broadcast them), as PyTorch's
// ZeroRedundancyOptimizer. One process holds everything: the same run as without it.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

// ANCHOR: train
#[tch_distributed::distributed(zero = 1)]
fn train() -> anyhow::Result<usize> {
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let net = nn::linear(vs.root(), 3, 2, Default::default());
    let mut opt = nn::Adam::default().build(&vs, 1e-3)?;
    let xs = Tensor::ones([4, 3], (Kind::Float, vs.device()));
    opt.backward_step(&net.forward(&xs).square().mean(Kind::Float));
    // On N ranks, about 1/N of Adam's 8 bytes per parameter on each.
    Ok(opt.state_bytes())
}
// ANCHOR_END: train

fn main() -> anyhow::Result<()> {
    assert_eq!(train()?, 8 * (3 * 2 + 2) + 2 * 4, "one process: the whole state");
    Ok(())
}
