//! Worker for the DDP tests. `ddp_worker MODE [--out DIR] [--steps N] [--step-kind K]`:
//!
//! - `grad`: ranks start from different parameters; checks they all hold rank 0's
//!   after `DistributedDataParallel::new`, and that the averaged gradient of the
//!   ranks' shards equals the single-process gradient of the whole batch.
//! - `train`: SGD with momentum for `--steps` steps on per-rank data through the
//!   step kind `plain|clip|clip_norm|manual`; checks all ranks end identical and saves
//!   the parameters to `DIR/rank{R}.safetensors`.
//! - `accumulate`: two micro-batches under `no_sync` then one synced backward equal
//!   the single-process gradient of the concatenated batch, with one all-reduce.
//! - `unused`: a model with a parameter the loss never uses trains with
//!   `find_unused_parameters`.
//!
//! Prints `ok …` lines and `max_diff …`; exits non-zero on a failed check.
//!
//! With `TCHD_TEST_DEVICE=cuda`, `grad` and `train` put the model and the data on the
//! rank's CUDA device (the reference gradient stays a single CPU process) and print
//! `device …`; otherwise everything runs on the CPU.

use anyhow::{bail, ensure, Context as _};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_distributed::{DdpOptions, DistributedDataParallel};

const FEATURES: i64 = 8;

fn mlp(vs: &nn::Path) -> impl Module {
    nn::seq()
        .add(nn::linear(vs / "l1", FEATURES, 16, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(vs / "l2", 16, 1, Default::default()))
}

/// The whole batch, identical on every rank: (xs [rows, FEATURES], ys [rows, 1]).
fn batch(rows: i64, seed: i64) -> (Tensor, Tensor) {
    tch::manual_seed(seed);
    let xs = Tensor::randn([rows, FEATURES], (Kind::Float, Device::Cpu));
    let ys = Tensor::randn([rows, 1], (Kind::Float, Device::Cpu));
    (xs, ys)
}

fn loss(net: &impl Module, xs: &Tensor, ys: &Tensor) -> Tensor {
    net.forward(xs).mse_loss(ys, tch::Reduction::Mean)
}

/// `f` of every variable, flattened and concatenated in name order.
fn flat(vs: &nn::VarStore, f: impl Fn(&Tensor) -> Tensor) -> Tensor {
    let mut named: Vec<_> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    Tensor::cat(
        &named
            .iter()
            .map(|(_, t)| f(t).flatten(0, -1))
            .collect::<Vec<_>>(),
        0,
    )
}

fn flat_params(vs: &nn::VarStore) -> Tensor {
    flat(vs, Tensor::detach)
}

fn flat_grads(vs: &nn::VarStore) -> Tensor {
    flat(vs, Tensor::grad)
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// Asserts that every rank holds exactly the same `t`.
fn assert_identical(
    pg: &tch_distributed::ProcessGroup,
    t: &Tensor,
    what: &str,
) -> anyhow::Result<()> {
    let all = pg.all_gather(t)?;
    for (r, other) in all.iter().enumerate() {
        ensure!(other.equal(&all[0]), "{what}: rank {r} differs from rank 0");
    }
    Ok(())
}

/// The single-process reference gradient of the loss over `xs`, from parameters `init`.
fn reference_grad(init: &nn::VarStore, xs: &Tensor, ys: &Tensor) -> anyhow::Result<Tensor> {
    let mut vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    vs.copy(init)?;
    loss(&net, xs, ys).backward();
    Ok(flat_grads(&vs))
}

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .map(|i| args[i + 1].clone())
    };
    let mode = args.first().context("usage: ddp_worker MODE")?.clone();
    let ctx = tch_distributed::init()?;
    let pg = ctx.process_group();
    let (rank, world) = (ctx.rank() as i64, ctx.world_size() as i64);
    println!("pid {rank} {}", std::process::id());

    match mode.as_str() {
        "grad" => {
            let device = tch_distributed_tests::test_device(ctx.device());
            if device.is_cuda() {
                println!("device {device:?}");
            }
            tch::manual_seed(100 + rank);
            let vs = nn::VarStore::new(device);
            let net = mlp(&vs.root());
            let before = flat_params(&vs);
            let ddp = DistributedDataParallel::new(&vs, pg, DdpOptions::default())?;
            let after = flat_params(&vs);
            assert_identical(pg, &after, "parameters after DistributedDataParallel::new")?;
            ensure!(
                rank == 0 || !before.equal(&after),
                "rank {rank} started equal to rank 0: test is vacuous"
            );
            println!("ok broadcast from rank 0");

            let rows = 4 * world;
            let (xs, ys) = batch(rows, 7);
            let shard = |t: &Tensor| t.narrow(0, 4 * rank, 4).to_device(device);
            ddp.backward(&loss(&net, &shard(&xs), &shard(&ys)))?;
            let grads = flat_grads(&vs).to_device(Device::Cpu);
            let reference = reference_grad(&vs, &xs, &ys)?;
            let diff = max_diff(&grads, &reference);
            println!("max_diff {diff:e}");
            // CUDA's kernels sum in another order than the CPU's.
            let tolerance = if device.is_cuda() { 1e-5 } else { 1e-6 };
            ensure!(
                diff < tolerance,
                "averaged gradient differs from the single-process one by {diff}"
            );
            println!("ok averaged gradient");
        }
        "train" => {
            let steps: i64 = flag("--steps")
                .map(|s| s.parse())
                .transpose()?
                .unwrap_or(20);
            let kind = flag("--step-kind").unwrap_or_else(|| "plain".into());
            let sleep_ms: u64 = flag("--sleep-ms")
                .map(|s| s.parse())
                .transpose()?
                .unwrap_or(0);
            let device = tch_distributed_tests::test_device(ctx.device());
            if device.is_cuda() {
                println!("device {device:?}");
            }
            tch::manual_seed(1);
            let vs = nn::VarStore::new(device);
            let net = mlp(&vs.root());
            let mut opt = nn::sgd(0.9, 0.0, 0.0, false).build(&vs, 0.05)?;
            let ddp = DistributedDataParallel::new(
                &vs,
                pg,
                DdpOptions {
                    bucket_cap_mb: 0.0001,
                    first_bucket_cap_mb: 0.0001,
                    ..Default::default()
                },
            )?;
            let (xs, ys) = batch(16 * world, 11);
            let (xs, ys) = (xs.to_device(device), ys.to_device(device));
            let mut last = 0.0;
            for step in 0..steps {
                let i = (step * world + rank) % (16 * world / 4);
                let l = loss(&net, &xs.narrow(0, 4 * i, 4), &ys.narrow(0, 4 * i, 4));
                last = l.double_value(&[]);
                match kind.as_str() {
                    "plain" => ddp.backward_step(&mut opt, &l)?,
                    "clip" => ddp.backward_step_clip(&mut opt, &l, 0.01)?,
                    "clip_norm" => ddp.backward_step_clip_norm(&mut opt, &l, 0.01)?,
                    "manual" => {
                        opt.zero_grad();
                        ddp.backward(&l)?;
                        opt.step();
                    }
                    other => bail!("unknown step kind {other}"),
                }
                if sleep_ms > 0 {
                    std::thread::sleep(std::time::Duration::from_millis(sleep_ms));
                }
            }
            assert_identical(pg, &flat_params(&vs), "parameters after training")?;
            println!("ok identical after {steps} steps, loss {last:.6}");
            println!("buckets {:?} stats {:?}", ddp.bucket_sizes()?, ddp.stats());
            if let Some(dir) = flag("--out") {
                vs.save(format!("{dir}/rank{rank}.safetensors"))?;
            }
        }
        "accumulate" => {
            tch::manual_seed(3);
            let vs = nn::VarStore::new(Device::Cpu);
            let net = mlp(&vs.root());
            let ddp = DistributedDataParallel::new(&vs, pg, DdpOptions::default())?;
            let (xs, ys) = batch(8 * world, 5);
            // Rank r's micro-batches: rows [8r, 8r+4) and [8r+4, 8r+8); each loss / 2.
            {
                let _guard = ddp.no_sync();
                let l = loss(&net, &xs.narrow(0, 8 * rank, 4), &ys.narrow(0, 8 * rank, 4)) / 2.0;
                ddp.backward(&l)?;
            }
            let l = loss(
                &net,
                &xs.narrow(0, 8 * rank + 4, 4),
                &ys.narrow(0, 8 * rank + 4, 4),
            ) / 2.0;
            ddp.backward(&l)?;
            let stats = ddp.stats();
            ensure!(
                stats.synced_backward_passes == 1 && stats.local_backward_passes == 1,
                "stats {stats:?}"
            );
            let diff = max_diff(&flat_grads(&vs), &reference_grad(&vs, &xs, &ys)?);
            println!("max_diff {diff:e}");
            ensure!(diff < 1e-6, "accumulated gradient differs by {diff}");
            println!("ok accumulate with no_sync, stats {stats:?}");
        }
        "unused" => {
            tch::manual_seed(4);
            let vs = nn::VarStore::new(Device::Cpu);
            let used = nn::linear(vs.root() / "used", FEATURES, 1, Default::default());
            let _unused = nn::linear(vs.root() / "unused", FEATURES, 1, Default::default());
            let mut opt = nn::sgd(0.0, 0.0, 0.0, false).build(&vs, 0.1)?;
            let options = DdpOptions {
                find_unused_parameters: true,
                ..Default::default()
            };
            let ddp = DistributedDataParallel::new(&vs, pg, options)?;
            let (xs, ys) = batch(4, 9 + rank);
            for _ in 0..3 {
                ddp.backward_step(
                    &mut opt,
                    &used.forward(&xs).mse_loss(&ys, tch::Reduction::Mean),
                )?;
            }
            assert_identical(pg, &flat_params(&vs), "parameters with an unused parameter")?;
            println!("ok find_unused_parameters");
        }
        "single" => {
            // The same training twice from the same seed: through DDP, and as plain tch.
            ensure!(world == 1, "mode single runs without a launcher");
            let train = |with_ddp: bool| -> anyhow::Result<Tensor> {
                tch::manual_seed(8);
                let vs = nn::VarStore::new(Device::Cpu);
                let net = mlp(&vs.root());
                let mut opt = nn::adam(0.9, 0.999, 0.0).build(&vs, 0.01)?;
                let ddp = if with_ddp {
                    Some(DistributedDataParallel::new(
                        &vs,
                        pg,
                        DdpOptions::default(),
                    )?)
                } else {
                    None
                };
                let (xs, ys) = batch(32, 2);
                for step in 0..10 {
                    let l = loss(
                        &net,
                        &xs.narrow(0, 4 * (step % 8), 4),
                        &ys.narrow(0, 4 * (step % 8), 4),
                    );
                    match &ddp {
                        Some(ddp) => ddp.backward_step(&mut opt, &l)?,
                        None => opt.backward_step(&l),
                    }
                }
                Ok(flat_params(&vs))
            };
            let (with, without) = (train(true)?, train(false)?);
            ensure!(
                with.equal(&without),
                "DDP on one process differs from plain tch by {}",
                max_diff(&with, &without)
            );
            println!("ok single process equals plain tch");
        }
        other => bail!("unknown mode {other}"),
    }
    Ok(())
}
