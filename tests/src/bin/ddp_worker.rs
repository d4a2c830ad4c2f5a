//! Worker for the DDP tests. `ddp_worker MODE [--out DIR] [--steps N] [--step-kind K]`:
//!
//! - `grad`: ranks start from different parameters; checks they all hold rank 0's
//!   after `DistributedDataParallel::new`, and that the averaged gradient of the
//!   ranks' shards equals the single-process gradient of the whole batch.
//! - `train`: SGD with momentum for `--steps` steps on per-rank data through the
//!   step kind `plain|clip|clip_norm|manual`; checks all ranks end identical, that the
//!   parameters equal those of one process that trains on the global batch of each
//!   step (see [`train_reference`]) and that they moved, and saves them to
//!   `DIR/rank{R}.safetensors`.
//! - `accumulate`: two micro-batches under `no_sync` then one synced backward equal
//!   the single-process gradient of the concatenated batch, with one all-reduce.
//! - `unused`: a model with a parameter the loss never uses, and one it uses on the
//!   second of three steps only (the set of unused parameters changes from step to
//!   step), trains with `find_unused_parameters` to the parameters of one process on
//!   the global batch (the unused one unchanged).
//! - `zero_late`: ZeRO stage 1 through the optimizer's own API, without DDP (every
//!   rank on the same whole batch, so no averaging is needed), with a variable created
//!   after the optimizer: one SGD step must move every variable, the late one too, to
//!   `p - LR·g` on every rank (the late one joins the partition, so some rank owns,
//!   updates and shares it).
//!
//! Prints `ok …` lines and `max_diff …`; exits non-zero on a failed check (an error,
//! or a panic of `tch_distributed_tests::compare` on NaN, infinity or mismatched
//! shapes).
//!
//! With `TCHD_TEST_DEVICE=cuda`, `grad` and `train` put the model and the data on the
//! rank's CUDA device (the reference gradient stays a single CPU process) and print
//! `device …`; otherwise everything runs on the CPU.

use anyhow::{bail, ensure, Context as _};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_distributed::{DdpOptions, DistributedDataParallel};
use tch_distributed_tests::compare;

const FEATURES: i64 = 8;
/// `train`'s SGD: learning rate, momentum, and the clipping maximum of `clip` (per
/// element) and `clip_norm` (global L2 norm).
const LR: f64 = 0.05;
const MOMENTUM: f64 = 0.9;
const CLIP: f64 = 0.01;

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

/// Copies of `vs`'s variables, by name.
fn named_copy(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    vs.variables()
        .into_iter()
        .map(|(name, t)| (name, t.detach().copy()))
        .collect()
}

/// A CPU copy of `vs`'s variables (an `mlp`'s), to start a reference from.
fn snapshot(vs: &nn::VarStore) -> anyhow::Result<nn::VarStore> {
    let mut copy = nn::VarStore::new(Device::Cpu);
    let _ = mlp(&copy.root());
    copy.copy(vs)?;
    Ok(copy)
}

/// Clips the gradients of `vs` as PyTorch's `torch.nn.utils` does after DDP's
/// backward, written out here rather than taken from tch or the SDK:
/// `clip_grad_value_` clamps every element to `[-max, max]`; `clip_grad_norm_`
/// multiplies every gradient by `max / (total_norm + 1e-6)` when that is below 1,
/// `total_norm` being the L2 norm of all gradients together. `kind` is `clip` or
/// `clip_norm`; any other kind leaves them. Returns whether the gradients changed.
fn clip_like_pytorch(vs: &nn::VarStore, kind: &str, max: f64) -> bool {
    tch::no_grad(|| {
        let grads: Vec<Tensor> = vs.trainable_variables().iter().map(Tensor::grad).collect();
        match kind {
            "clip" => {
                let mut changed = false;
                for g in &grads {
                    let clamped = g.clamp(-max, max);
                    changed |= !clamped.equal(g);
                    g.shallow_clone().copy_(&clamped);
                }
                changed
            }
            "clip_norm" => {
                let squares: Vec<Tensor> =
                    grads.iter().map(|g| g.square().sum(Kind::Float)).collect();
                let total = Tensor::stack(&squares, 0)
                    .sum(Kind::Float)
                    .sqrt()
                    .double_value(&[]);
                let coef = max / (total + 1e-6);
                if coef < 1.0 {
                    for g in &grads {
                        g.shallow_clone().copy_(&(g * coef));
                    }
                }
                coef < 1.0
            }
            _ => false,
        }
    })
}

/// The reference for `train`, as PyTorch DDP defines it: one process, no DDP, the
/// same SGD (`LR`, `MOMENTUM`) from the same initial parameters `init`, where step
/// `s`'s batch is the whole world's (the `world` 4-row chunks that the ranks train on
/// at step `s`, in rank order) and its loss the mean over it. That mean's gradient is
/// the average of the ranks' gradients that DDP all-reduces, the chunks being the same
/// size. For `clip` and `clip_norm` the gradient is clipped after it is complete (see
/// [`clip_like_pytorch`]), as `torch.nn.utils.clip_grad_*` after a DDP backward.
/// Returns the final parameters (flattened, in name order) and the number of steps at
/// which clipping changed the gradient.
fn train_reference(
    init: &nn::VarStore,
    xs: &Tensor,
    ys: &Tensor,
    world: i64,
    steps: i64,
    kind: &str,
) -> anyhow::Result<(Tensor, usize)> {
    let mut vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    vs.copy(init)?;
    let mut opt = nn::sgd(MOMENTUM, 0.0, 0.0, false).build(&vs, LR)?;
    let (xs, ys) = (xs.to_device(Device::Cpu), ys.to_device(Device::Cpu));
    let mut clipped = 0;
    for step in 0..steps {
        let rows: Vec<i64> = (0..world)
            .flat_map(|rank| {
                let i = (step * world + rank) % (16 * world / 4);
                4 * i..4 * i + 4
            })
            .collect();
        let rows = Tensor::from_slice(&rows);
        opt.zero_grad();
        loss(&net, &xs.index_select(0, &rows), &ys.index_select(0, &rows)).backward();
        clipped += clip_like_pytorch(&vs, kind, CLIP) as usize;
        opt.step();
    }
    Ok((flat_params(&vs), clipped))
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
            let diff = compare::tensors(&grads, &reference).max_abs;
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
            let mut opt = nn::sgd(MOMENTUM, 0.0, 0.0, false).build(&vs, LR)?;
            let ddp = DistributedDataParallel::new(
                &vs,
                pg,
                DdpOptions {
                    bucket_cap_mb: 0.0001,
                    first_bucket_cap_mb: 0.0001,
                    ..Default::default()
                },
            )?;
            let init = snapshot(&vs)?;
            let (xs, ys) = batch(16 * world, 11);
            let (xs, ys) = (xs.to_device(device), ys.to_device(device));
            let mut last = 0.0;
            for step in 0..steps {
                let i = (step * world + rank) % (16 * world / 4);
                let l = loss(&net, &xs.narrow(0, 4 * i, 4), &ys.narrow(0, 4 * i, 4));
                last = l.double_value(&[]);
                match kind.as_str() {
                    "plain" => ddp.backward_step(&mut opt, &l)?,
                    "clip" => ddp.backward_step_clip(&mut opt, &l, CLIP)?,
                    "clip_norm" => ddp.backward_step_clip_norm(&mut opt, &l, CLIP)?,
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
            let trained = flat_params(&vs);
            assert_identical(pg, &trained, "parameters after training")?;
            println!("ok identical after {steps} steps, loss {last:.6}");

            let trained = trained.to_device(Device::Cpu);
            let (reference, clipped) = train_reference(&init, &xs, &ys, world, steps, &kind)?;
            let diff = compare::tensors(&trained, &reference);
            // Measured on the CPU: up to 1.8e-7 after 20 steps with 2 and 3 ranks (the
            // mean over the global batch against the mean of the ranks' means, then
            // carried by the momentum); CUDA's kernels sum in another order than the
            // CPU's.
            let tolerance = if device.is_cuda() { 1e-5 } else { 1e-6 };
            ensure!(
                diff.max_abs <= tolerance,
                "{kind}: after {steps} steps the parameters differ from one process on \
                 the global batch by {:e} (tolerance {tolerance:e}): {diff:?}",
                diff.max_abs
            );
            let moved = compare::tensors(&flat_params(&init), &trained).max_abs;
            ensure!(
                moved > 100.0 * tolerance,
                "{kind}: the parameters moved by only {moved:e} in {steps} steps"
            );
            if kind == "clip" || kind == "clip_norm" {
                // The clipping mattered: without it the reference ends elsewhere.
                let (unclipped, _) = train_reference(&init, &xs, &ys, world, steps, "plain")?;
                let effect = compare::tensors(&unclipped, &reference).max_abs;
                ensure!(
                    clipped > 0 && effect > 100.0 * tolerance,
                    "{kind}: clipping changed {clipped} steps' gradients and the result by \
                     {effect:e}: the test would not see a missing clip"
                );
            }
            println!(
                "ok equals one process on the global batch after {steps} steps ({kind}): \
                 max |diff| {:e}, moved {moved:e}, clipped at {clipped} steps",
                diff.max_abs
            );
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
            let diff = compare::tensors(&flat_grads(&vs), &reference_grad(&vs, &xs, &ys)?).max_abs;
            println!("max_diff {diff:e}");
            ensure!(diff < 1e-6, "accumulated gradient differs by {diff}");
            println!("ok accumulate with no_sync, stats {stats:?}");
        }
        "unused" => {
            // Three linear layers, "used", "unused", and "sometimes", whose output the
            // loss adds on the second step only; plain SGD with learning rate 0.1.
            let model = |vs: &nn::VarStore| {
                let used = nn::linear(vs.root() / "used", FEATURES, 1, Default::default());
                let _unused = nn::linear(vs.root() / "unused", FEATURES, 1, Default::default());
                let sometimes =
                    nn::linear(vs.root() / "sometimes", FEATURES, 1, Default::default());
                move |xs: &Tensor, step: usize| match step {
                    1 => used.forward(xs) + sometimes.forward(xs),
                    _ => used.forward(xs),
                }
            };
            tch::manual_seed(4);
            let vs = nn::VarStore::new(Device::Cpu);
            let used = model(&vs);
            let mut opt = nn::sgd(0.0, 0.0, 0.0, false).build(&vs, 0.1)?;
            let options = DdpOptions {
                find_unused_parameters: true,
                ..Default::default()
            };
            let ddp = DistributedDataParallel::new(&vs, pg, options)?;
            let init = named_copy(&vs);
            let (xs, ys) = batch(4, 9 + rank);
            for step in 0..3 {
                ddp.backward_step(
                    &mut opt,
                    &used(&xs, step).mse_loss(&ys, tch::Reduction::Mean),
                )?;
            }
            assert_identical(pg, &flat_params(&vs), "parameters with an unused parameter")?;

            // The reference: one process on the world's 4 × world rows (every rank's
            // batch, in rank order), whose mean loss has the average of the ranks'
            // gradients, the batches being the same size; the unused layer gets no
            // gradient, and SGD leaves a parameter without one as it is.
            let reference = nn::VarStore::new(Device::Cpu);
            let reference_used = model(&reference);
            tch::no_grad(|| {
                for (name, mut var) in reference.variables() {
                    let start = &init.iter().find(|(n, _)| *n == name).unwrap().1;
                    var.copy_(start);
                }
            });
            let mut reference_opt = nn::sgd(0.0, 0.0, 0.0, false).build(&reference, 0.1)?;
            let batches: Vec<(Tensor, Tensor)> = (0..world).map(|r| batch(4, 9 + r)).collect();
            let all_xs = Tensor::cat(&batches.iter().map(|b| &b.0).collect::<Vec<_>>(), 0);
            let all_ys = Tensor::cat(&batches.iter().map(|b| &b.1).collect::<Vec<_>>(), 0);
            for step in 0..3 {
                reference_opt.backward_step(
                    &reference_used(&all_xs, step).mse_loss(&all_ys, tch::Reduction::Mean),
                );
            }
            let (trained, expected) = (named_copy(&vs), named_copy(&reference));
            let diff = compare::named(&trained, &expected);
            // Measured: 6e-8 with 2 and 3 ranks.
            ensure!(
                diff.max_abs <= 1e-6,
                "the parameters differ from one process on the global batch by {:e}: {diff:?}",
                diff.max_abs
            );
            let unused = |n: &str| n.starts_with("unused.");
            let still = compare::named_where(&init, &trained, unused);
            ensure!(still.is_exact(), "the unused layer changed: {still:?}");
            let moved = compare::named_where(&init, &trained, |n| !unused(n)).max_abs;
            ensure!(moved > 1e-3, "the used layer moved by only {moved:e}");
            let sometimes = compare::named_where(&init, &trained, |n| n.starts_with("sometimes."));
            ensure!(
                sometimes.max_abs > 1e-3,
                "the layer used once did not move: {sometimes:?}"
            );
            println!(
                "ok find_unused_parameters: equals one process on the global batch \
                 (max |diff| {:e}), the used layer moved {moved:e}, the unused one not at all",
                diff.max_abs
            );
        }
        "zero_late" => {
            ensure!(world > 1, "mode zero_late runs on several ranks");
            tch::manual_seed(5);
            let vs = nn::VarStore::new(Device::Cpu);
            let net = mlp(&vs.root());
            let mut opt = tch_distributed::Optimizer::new(&nn::Sgd::default(), &vs, LR)?.zero(1)?;
            ensure!(
                opt.zero_stage() == Some(1),
                "ZeRO shards over {world} ranks"
            );
            // Larger than any of the MLP's: partitioned first, to the rank that owns
            // the fewest elements.
            let late = vs.root().var("late", &[64], nn::Init::Const(0.5));
            let (xs, ys) = batch(16, 4);
            let l = loss(&net, &xs, &ys) + late.square().sum(Kind::Float) * 0.01;
            // No zero_grad (the gradients start undefined): the step is the first
            // call that sees the late variable, and must partition it there.
            l.backward();
            // SGD without momentum: p - LR·g, computed here before the step.
            let expected: Vec<(String, Tensor)> = vs
                .variables()
                .into_iter()
                .map(|(n, p)| (n, p.detach() - p.grad() * LR))
                .collect();
            opt.step()?;
            let diff = compare::named(&named_copy(&vs), &expected);
            ensure!(
                diff.max_abs <= 1e-7,
                "ZeRO without DDP: the parameters are not one SGD step on: {diff:?}"
            );
            assert_identical(pg, &flat_params(&vs), "parameters after a ZeRO step")?;
            println!("ok zero_late: every variable, the late one too, took one SGD step");
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
            let diff = compare::tensors(&with, &without);
            ensure!(
                diff.is_exact(),
                "DDP on one process differs from plain tch: {diff:?}"
            );
            println!("ok single process equals plain tch");
        }
        other => bail!("unknown mode {other}"),
    }
    Ok(())
}
