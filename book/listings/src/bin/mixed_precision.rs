//! Mixed precision, gradient accumulation and clipping with the SDK's API, on any
//! number of ranks: `mixed_precision [auto|no|bf16|fp16]` (default `auto`: bf16 on
//! CUDA compute capability 8.0 and later, fp16 before, float32 on the CPU).

use tch::nn::{self, Module};
use tch::{Kind, Tensor};
use tch_distributed::{
    autocast, DataLoader, DdpOptions, DistributedDataParallel, GradScaler, MixedPrecision,
    Optimizer, TensorDataset,
};

fn main() -> anyhow::Result<()> {
    let ctx = tch_distributed::init()?;
    let device = ctx.device();
    // ANCHOR: choose
    let asked = std::env::args().nth(1).unwrap_or_else(|| "auto".into());
    let (precision, why) = MixedPrecision::parse(&asked, device)?;
    if ctx.is_main_process() {
        println!("mixed precision {precision:?} ({why})");
    }
    // ANCHOR_END: choose

    tch::manual_seed(0);
    let xs = Tensor::randn([256, 16], (Kind::Float, tch::Device::Cpu));
    let ys = xs.narrow(1, 0, 4).argmax(1, false);
    let loader = DataLoader::new(TensorDataset::new(&xs, &ys)?, 8)?.to_device(device);

    let vs = nn::VarStore::new(device);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "l1", 16, 64, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "l2", 64, 4, Default::default()));
    let ddp = DistributedDataParallel::new(&vs, ctx.process_group(), DdpOptions::default())?;

    if precision == MixedPrecision::Fp16 {
        // ANCHOR: fp16
        let mut opt = Optimizer::new(&nn::AdamW::default(), &vs, 1e-3)?.distributed(ddp);
        let mut scaler = GradScaler::new(); // scale 2^16, ×2 every 2,000 clean steps
        for batch in &loader {
            let (x, y) = batch?;
            let logits = autocast(device, precision, || net.forward(&x))?;
            let loss = logits.to_kind(Kind::Float).cross_entropy_for_logits(&y);
            opt.zero_grad()?;
            let ddp = opt.ddp().expect("built with .distributed(ddp)");
            ddp.backward(&scaler.scale(&loss))?; // gradients averaged over the ranks
            scaler.unscale(&opt)?; // the true gradients, to clip them
            let _ = opt.clip_grad_norm(1.0); // returns the norm before clipping
            scaler.step(&mut opt)?; // skipped on every rank if any rank overflowed
            scaler.update()?;
        }
        // ANCHOR_END: fp16
        if ctx.is_main_process() {
            println!("loss scale after {} steps: {}", loader.len(), scaler.scale_value());
        }
    } else {
        // ANCHOR: bf16
        let mut opt = Optimizer::new(&nn::AdamW::default(), &vs, 1e-3)?
            .distributed(ddp)
            .accumulate(4); // 4 micro-batches per step: one all-reduce per step
        let mut steps = 0;
        for (i, batch) in loader.iter().enumerate() {
            let (x, y) = batch?;
            let logits = autocast(device, precision, || net.forward(&x))?;
            let loss = logits.to_kind(Kind::Float).cross_entropy_for_logits(&y);
            if i + 1 == loader.len() {
                opt.sync_next(); // the data ends mid-cycle: step anyway
            }
            // The loss is divided by 4; the norm is clipped on the averaged,
            // accumulated gradients, so every rank clips alike.
            if opt.backward_step_clip_norm(&loss, 1.0)? {
                steps += 1;
            }
        }
        // ANCHOR_END: bf16
        if ctx.is_main_process() {
            println!("{} micro-batches, {steps} optimizer steps", loader.len());
        }
    }
    Ok(())
}
