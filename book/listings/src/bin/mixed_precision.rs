//! Mixed precision, gradient accumulation and clipping with the SDK's API, on any
//! number of ranks: `mixed_precision [auto|no|bf16|fp16]` (default `auto`: bf16 on
//! CUDA compute capability 8.0 and later, fp16 before, float32 on the CPU).

use tch::nn::{self, Module};
use tch::{Kind, Tensor};
use tch_distributed::{
    autocast, resolve_mixed_precision, DataLoader, DdpOptions, DistributedDataParallel, GradScaler,
    MixedPrecision, MixedPrecisionMode, Optimizer, TensorDataset,
};

fn main() -> anyhow::Result<()> {
    let ctx = tch_distributed::init()?;
    let device = ctx.device();
    // ANCHOR: choose
    let asked = std::env::args().nth(1).unwrap_or_else(|| "auto".into());
    let mode: MixedPrecisionMode = asked.parse()?;
    let (precision, why) = resolve_mixed_precision(mode, device)?;
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

    // ANCHOR: optimizer
    let mut opt = Optimizer::new(&nn::AdamW::default(), &vs, 1e-3)?
        .distributed(ddp) // gradients averaged over the ranks during backward
        .accumulate(4); // 4 micro-batches per step: one all-reduce per step
    if precision == MixedPrecision::Fp16 {
        // fp16's narrow range needs loss scaling: 2^16, ×2 after 2,000 clean steps.
        opt = opt.grad_scaler(GradScaler::new());
    }
    // ANCHOR_END: optimizer

    // ANCHOR: loop
    let mut steps = 0;
    for batch in &loader {
        let (x, y) = batch?;
        // The forward pass and the loss under autocast (libtorch keeps the loss in float32).
        let loss = autocast(device, precision, || {
            net.forward(&x).cross_entropy_for_logits(&y)
        })?;
        // One micro-batch: the loss is divided by 4 (and, for fp16, scaled). On every 4th
        // micro-batch, and on the epoch's last, the gradients are all-reduced, unscaled,
        // clipped to a global norm of 1, and the optimizer steps, unless an fp16
        // gradient overflowed on some rank: then every rank skips the step.
        if opt.backward_step_clip_norm(&loss, 1.0)? {
            steps += 1;
        }
    }
    // ANCHOR_END: loop
    if ctx.is_main_process() {
        println!("{} micro-batches, {steps} optimizer steps", loader.len());
        if let Some(scaler) = opt.scaler() {
            println!("loss scale {}", scaler.scale_value());
        }
    }
    Ok(())
}
