//! Worker for the gradient-accumulation test.
//!
//! - `accumulation_worker OUT accum` (under tchrun, 2 ranks): rank r trains on samples
//!   `6r..6r+6` as 3 micro-batches of 2 with `accumulate(3)`, then one more
//!   micro-batch after `sync_next()` (data ending mid-cycle). It prints which
//!   micro-steps stepped and the DDP counters, and writes the parameters after the
//!   first optimizer step to `OUT/params{rank}-accum.safetensors`.
//! - `accumulation_worker OUT spelled` (under tchrun, 2 ranks): the same 3
//!   micro-batches with the training step spelled out (`zero_grad`, `backward`, `step`
//!   on each), which
//!   must step on the third only; it prints which stepped and writes the parameters
//!   to `OUT/params{rank}-spelled.safetensors`.
//! - `accumulation_worker OUT big` (one process): one step on all 12 samples at once, to
//!   `OUT/params-big.safetensors` (and the parameters before it to
//!   `OUT/init.safetensors`).
//! - `accumulation_worker OUT clip` (under tchrun, 2 ranks, or one process for all 12
//!   samples): prints the global gradient norm that `clip_grad_norm` sees after the
//!   averaging backward, and the clipped norm.

use tch::nn::{self, Module, VarStore};
use tch::{Device, Kind, Tensor};
use tch_distributed::{DdpOptions, DistributedDataParallel, Optimizer};

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    let args: Vec<String> = std::env::args().collect();
    let (out, mode) = (&args[1], args[2].as_str());
    let ctx = tch_distributed::init()?;
    let xs = Tensor::linspace(-1.0, 2.0, 48, (Kind::Float, Device::Cpu)).view([12, 4]);
    let ys = xs.sum_dim_intlist(1, true, Kind::Float).cos();
    let vs = VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root(), 4, 1, Default::default());
    tch::no_grad(|| {
        for (i, mut v) in vs.trainable_variables().into_iter().enumerate() {
            let n = v.numel() as i64;
            let values = Tensor::linspace(-0.3, 0.4 + i as f64, n, (Kind::Float, Device::Cpu));
            v.copy_(&values.view(v.size().as_slice()));
        }
    });
    let loss = |x: &Tensor, y: &Tensor| net.forward(x).mse_loss(y, tch::Reduction::Mean);
    match mode {
        "clip" => {
            let ddp =
                DistributedDataParallel::new(&vs, ctx.process_group(), DdpOptions::default())?;
            let mut opt = Optimizer::new(&nn::Sgd::default(), &vs, 0.1)?.distributed(ddp);
            let (world, rank) = (ctx.world_size() as i64, ctx.rank() as i64);
            let n = 12 / world;
            let (x, y) = (xs.narrow(0, n * rank, n), ys.narrow(0, n * rank, n));
            opt.zero_grad()?;
            opt.ddp().unwrap().backward(&loss(&x, &y))?;
            let norm = opt.clip_grad_norm(0.05)?;
            let clipped: f64 = tch::no_grad(|| {
                let norms: Vec<Tensor> = opt
                    .trainable_variables()
                    .iter()
                    .map(|v| v.grad().norm())
                    .collect();
                Tensor::stack(&norms, 0).norm().double_value(&[])
            });
            println!("rank {rank}: norm {norm:?} clipped {clipped:?}");
        }
        "big" => {
            vs.save(format!("{out}/init.safetensors"))?;
            let mut opt = Optimizer::new(&nn::Sgd::default(), &vs, 0.1)?;
            opt.backward_step(&loss(&xs, &ys))?;
            vs.save(format!("{out}/params-big.safetensors"))?;
        }
        "spelled" => {
            let ddp =
                DistributedDataParallel::new(&vs, ctx.process_group(), DdpOptions::default())?;
            let mut opt = Optimizer::new(&nn::Sgd::default(), &vs, 0.1)?
                .distributed(ddp)
                .accumulate(3);
            let rank = ctx.rank() as i64;
            let mut stepped = Vec::new();
            for m in 0..3 {
                let (x, y) = (
                    xs.narrow(0, 6 * rank + 2 * m, 2),
                    ys.narrow(0, 6 * rank + 2 * m, 2),
                );
                opt.zero_grad()?;
                opt.backward(&loss(&x, &y))?;
                stepped.push(opt.step()?);
            }
            vs.save(format!("{out}/params{rank}-spelled.safetensors"))?;
            println!("rank {rank}: spelled out, stepped {stepped:?}");
        }
        _ => {
            let ddp =
                DistributedDataParallel::new(&vs, ctx.process_group(), DdpOptions::default())?;
            let mut opt = Optimizer::new(&nn::Sgd::default(), &vs, 0.1)?
                .distributed(ddp)
                .accumulate(3);
            let rank = ctx.rank() as i64;
            let mut stepped = Vec::new();
            for m in 0..3 {
                let (x, y) = (
                    xs.narrow(0, 6 * rank + 2 * m, 2),
                    ys.narrow(0, 6 * rank + 2 * m, 2),
                );
                stepped.push(opt.backward_step(&loss(&x, &y))?);
            }
            vs.save(format!("{out}/params{rank}-accum.safetensors"))?;
            let stats = opt.ddp().unwrap().stats();
            println!(
                "rank {rank}: stepped {stepped:?}, synced {}, local {}",
                stats.synced_backward_passes, stats.local_backward_passes
            );
            // The data ends after one micro-batch of the next cycle: it still steps.
            opt.sync_next();
            let last = opt.backward_step(&loss(&xs.narrow(0, 0, 2), &ys.narrow(0, 0, 2)))?;
            println!(
                "rank {rank}: short cycle stepped {last}, synced {}",
                opt.ddp().unwrap().stats().synced_backward_passes
            );
        }
    }
    Ok(())
}
