//! Worker for the GradScaler test, under `tchrun` with 2 ranks: rank 1's gradient
//! holds an inf (no DDP all-reduce spreads it), and every rank must skip the step.
//! With `TCHD_TEST_DEVICE=cuda` the parameter and its gradients are on the rank's CUDA
//! device (and the line says `on Cuda(…)`).

use tch::nn::{self, VarStore};
use tch::{Device, Kind, Tensor};
use tch_distributed::{GradScaler, Optimizer};

fn main() -> anyhow::Result<()> {
    let ctx = tch_distributed::init()?;
    let device = tch_distributed_tests::test_device(ctx.device());
    let vs = VarStore::new(device);
    let p = vs.root().var_copy("p", &Tensor::from_slice(&[1.0f32, 2.0]));
    let mut opt = Optimizer::new(&nn::Sgd::default(), &vs, 0.1)?;
    let mut scaler = GradScaler::new();
    let g = if ctx.rank() == 1 {
        [f32::INFINITY, 1.0]
    } else {
        [1.0, 1.0]
    };
    opt.zero_grad()?;
    scaler
        .scale(&(&p * Tensor::from_slice(&g).to_device(device)).sum(Kind::Float))
        .backward();
    let stepped = scaler.step(&mut opt)?;
    scaler.update()?;
    println!(
        "rank {}: stepped {stepped}, scale {}",
        ctx.rank(),
        scaler.scale_value()
    );
    if device.is_cuda() {
        let values = Vec::<f32>::try_from(p.to_device(Device::Cpu))?;
        println!("rank {}: on {device:?}, p {values:?}", ctx.rank());
    }
    Ok(())
}
