// `for` over `Iter2` (shuffled, moved to the device, smaller last batch kept) in a
// training loop: one process sees every sample once per epoch.
use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

// ANCHOR: train
#[tch_distributed::distributed]
fn train() -> anyhow::Result<usize> {
    let xs = Tensor::arange(10, (Kind::Float, Device::Cpu)).view([10, 1]);
    let ys = xs.copy();
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let net = nn::linear(vs.root(), 1, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 1e-3)?;
    let mut seen = 0;
    for (bx, by) in Iter2::new(&xs, &ys, 3)
        .shuffle()
        .to_device(vs.device())
        .return_smaller_last_batch()
    {
        opt.backward_step(&net.forward(&bx).mse_loss(&by, tch::Reduction::Mean));
        seen += bx.size()[0] as usize;
    }
    let mut iter = Iter2::new(&xs, &ys, 5);
    for (bx, by) in &mut iter {
        let (bx, by) = (bx.to_device(vs.device()), by.to_device(vs.device()));
        opt.backward_step(&net.forward(&bx).mse_loss(&by, tch::Reduction::Mean));
        seen += bx.size()[0] as usize;
    }
    Ok(seen)
}
// ANCHOR_END: train

fn main() -> anyhow::Result<()> {
    assert_eq!(train()?, 20);
    Ok(())
}
