//! Worker for `tests/tests/settings.rs`: settings given as options of `#[distributed]`,
//! written as single-GPU tch code: `settings_worker OUT MODE`, MODE one of
//!
//! - `accum`, `accum-backward`: `grad_accum = 3` over 10 batches of 2 samples per
//!   epoch (5 micro-batches per rank on 2 ranks: a full cycle, then one that the data
//!   ends), with `opt.backward_step(&loss)` or with `loss.backward(); opt.step();
//!   opt.zero_grad()`. Writes `OUT/params{rank}.txt` and `OUT/stats{rank}.txt`
//!   (synced and local backward passes).
//! - `accum-reference`: the same updates in plain tch on one process, without the
//!   attribute: one step on samples 0..12, one on 12..20 with the loss × 2/3 (the
//!   short cycle's 2 micro-batches per rank, each divided by 3, as Accelerate does).
//! - `buckets`: `bucket_cap_mb = 0.5`; writes the gradient buckets' sizes.
//! - `bf16`, `fp16`, `auto`: `mixed_precision` with that value; writes
//!   `OUT/kinds{rank}.txt` (the forward output's, the loss's and the parameters'
//!   dtypes) and, for fp16, saves a checkpoint in `OUT/ckpt`. On a CUDA device
//!   (a machine with a GPU) also writes the device to `OUT/device{rank}.txt`.

use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

fn data() -> (Tensor, Tensor) {
    let xs = Tensor::linspace(-1.0, 1.0, 20 * 3, (Kind::Float, Device::Cpu)).view([20, 3]);
    let ys = xs.sum_dim_intlist(1, true, Kind::Float).sin();
    (xs, ys)
}

fn rank() -> usize {
    tch_distributed::current().map_or(0, |c| c.rank())
}

fn write_params(out: &str, vs: &nn::VarStore) -> anyhow::Result<()> {
    let params: Vec<f32> = vs
        .trainable_variables()
        .iter()
        .flat_map(|t| Vec::<f32>::try_from(t.view([-1])).unwrap())
        .collect();
    std::fs::write(format!("{out}/params{}.txt", rank()), format!("{params:?}"))?;
    Ok(())
}

// ANCHOR: accum
#[tch_distributed::distributed(grad_accum = 3)]
fn accum(out: &str, spelled_out: bool) -> anyhow::Result<()> {
    tch::manual_seed(0);
    let (xs, ys) = data();
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let net = nn::linear(vs.root(), 3, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    for (x, y) in Iter2::new(&xs, &ys, 2) {
        let loss = net.forward(&x).mse_loss(&y, tch::Reduction::Mean);
        if spelled_out {
            opt.zero_grad();
            loss.backward();
            opt.step();
        } else {
            opt.backward_step(&loss);
        }
    }
    let stats = opt.ddp().unwrap().stats();
    std::fs::write(
        format!("{out}/stats{}.txt", rank()),
        format!(
            "synced {} local {}",
            stats.synced_backward_passes, stats.local_backward_passes
        ),
    )?;
    write_params(out, &vs)
}
// ANCHOR_END: accum

fn accum_reference(out: &str) -> anyhow::Result<()> {
    tch::manual_seed(0);
    let (xs, ys) = data();
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root(), 3, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    for (start, len, weight) in [(0, 12, 1.0), (12, 8, 2.0 / 3.0)] {
        let (x, y) = (xs.narrow(0, start, len), ys.narrow(0, start, len));
        let loss = net.forward(&x).mse_loss(&y, tch::Reduction::Mean) * weight;
        opt.backward_step(&loss);
    }
    write_params(out, &vs)
}

/// `bucket_cap_mb = 0.5` over 6 × Linear(256, 256) (6 × 257 KiB of gradients): after
/// the rebuild at the second backward, writes the bucket sizes to
/// `OUT/buckets{rank}.txt`.
#[tch_distributed::distributed(bucket_cap_mb = 0.5)]
fn buckets(out: &str) -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let layers: Vec<nn::Linear> = (0..6)
        .map(|i| nn::linear(vs.root() / i, 256, 256, Default::default()))
        .collect();
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    let x = Tensor::ones([2, 256], (Kind::Float, vs.device()));
    for _ in 0..2 {
        let loss = layers
            .iter()
            .fold(x.shallow_clone(), |h, l| l.forward(&h))
            .mean(Kind::Float);
        opt.backward_step(&loss);
    }
    let sizes = opt.ddp().unwrap().bucket_sizes()?;
    std::fs::write(format!("{out}/buckets{}.txt", rank()), format!("{sizes:?}"))?;
    Ok(())
}

/// One step of a linear model; writes the dtypes seen.
macro_rules! precision_fn {
    ($name:ident, $($option:tt)*) => {
        #[tch_distributed::distributed($($option)*)]
        fn $name(out: &str) -> anyhow::Result<()> {
            tch::manual_seed(0);
            let (xs, ys) = data();
            let vs = nn::VarStore::new(Device::cuda_if_available());
            let (xs, ys) = (xs.to_device(vs.device()), ys.to_device(vs.device()));
            let net = nn::linear(vs.root(), 3, 1, Default::default());
            let mut opt = nn::Adam::default().build(&vs, 1e-3)?;
            let output = net.forward(&xs);
            let loss = net.forward(&xs).mse_loss(&ys, tch::Reduction::Mean);
            opt.backward_step_clip_norm(&loss, 1.0);
            let kinds = format!(
                "output {:?} loss {:?} params {:?} scaler {:?}",
                output.kind(),
                loss.kind(),
                vs.trainable_variables()[0].kind(),
                opt.scaler().map(|s| s.scale_value())
            );
            std::fs::write(format!("{out}/kinds{}.txt", rank()), kinds)?;
            if vs.device().is_cuda() {
                let device = format!("{:?}", vs.device());
                std::fs::write(format!("{out}/device{}.txt", rank()), device)?;
            }
            if opt.scaler().is_some() {
                tch_distributed::Checkpointer::new(format!("{out}/ckpt")).save_state(
                    &vs,
                    &mut opt,
                    &tch_distributed::TrainState::default(),
                )?;
            }
            Ok(())
        }
    };
}

precision_fn!(bf16, mixed_precision = "bf16");
precision_fn!(fp16, mixed_precision = "fp16");
precision_fn!(auto, mixed_precision = "auto");
// No option: the job's settings, whatever they are.
precision_fn!(inherit,);

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    let args: Vec<String> = std::env::args().collect();
    let out = &args[1];
    match args[2].as_str() {
        "accum" => accum(out, false),
        "accum-backward" => accum(out, true),
        "accum-reference" => accum_reference(out),
        "buckets" => buckets(out),
        "bf16" => bf16(out),
        "fp16" => fp16(out),
        "auto" => auto(out),
        // A second function after the first returned: one that leaves the precision
        // out runs with the job's; one that asks for another stops with an error.
        "bf16-then-inherit" => bf16(out).and_then(|()| {
            std::fs::rename(format!("{out}/kinds0.txt"), format!("{out}/first0.txt"))?;
            inherit(out)
        }),
        "bf16-then-fp16" => bf16(out).and_then(|()| fp16(out)),
        other => anyhow::bail!("unknown mode {other}"),
    }
}
