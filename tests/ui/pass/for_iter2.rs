// `for` over `Iter2` (shuffled, moved to the device, smaller last batch kept): one
// process sees every sample once per epoch.
use tch::data::Iter2;
use tch::{Device, Kind, Tensor};

// ANCHOR: train
#[tch_distributed::distributed]
fn train() -> anyhow::Result<usize> {
    let xs = Tensor::arange(10, (Kind::Int64, Device::Cpu));
    let ys = xs.copy();
    let mut seen = 0;
    for (bx, _by) in Iter2::new(&xs, &ys, 3)
        .shuffle()
        .to_device(Device::cuda_if_available())
        .return_smaller_last_batch()
    {
        seen += bx.size()[0] as usize;
    }
    let mut iter = Iter2::new(&xs, &ys, 5);
    for (bx, _) in &mut iter {
        seen += bx.size()[0] as usize;
    }
    Ok(seen)
}
// ANCHOR_END: train

fn main() -> anyhow::Result<()> {
    assert_eq!(train()?, 20);
    Ok(())
}
