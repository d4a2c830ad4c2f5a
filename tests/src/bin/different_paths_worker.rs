//! Ranks that take different paths, for `tests/tests/different_paths.rs` (the book's
//! "When ranks take different paths").
//!
//! `different_paths_worker DIR MODE [--plain STEPS]` trains a small MLP (2 → 8 → 1,
//! tanh; SGD, lr 0.05) on 256 fixed rows (`y = x₀ − 2x₁`, with the targets of every
//! odd batch of 8 scaled by 0.1, so that the rank dealt those batches sees smaller
//! losses), in batches of 8, and writes `DIR/params{rank}-{MODE}.safetensors` and
//! `DIR/stats{rank}-{MODE}.txt` (`steps S own B kept K`).
//!
//! - `early-stop`: a sharded loop that `break`s when this rank's own loss falls
//!   below 0.5 (`own`: whether this rank's loss did, at its last step);
//! - `early-return`: the same with `return Ok(())` in place of `break`;
//! - `filter`: a sharded loop behind a `filter` that keeps the batches whose targets'
//!   mean size is above 0.145 (`kept`: how many this rank's filter kept in all);
//! - `manual-break` (no attribute: `init`, a DDP, `shard`): rank 0 alone leaves its
//!   loop after 3 steps and waits at a barrier while rank 1 is in the next step's
//!   gradient all-reduce: a deadlock that must be named in seconds (rank 1 reads the
//!   records after 2 s, rank 0 after 20, so that rank 1 names it);
//! - `any-rank` (no attribute): the same loop, left when `any_rank(rank 0 at step
//!   3)`: both ranks leave it together;
//! - `slow-rank` (no attribute): the same loop run to its end, where rank 1 computes
//!   for 8 s before its second backward pass while rank 0 waits in the all-reduce,
//!   both ranks reading the records after 2 s: slow is no deadlock.
//!
//! With `--plain STEPS` the attributed function's body runs as one process on the
//! global batches (each step's batches of every rank together): `early-stop` and
//! `early-return` for STEPS steps, `filter` on the batches that 2 ranks would have
//! kept, step by step, until the first ran out.

use std::cell::Cell;

use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

const THRESHOLD: f64 = 0.5;
const BATCH: i64 = 8;

/// The 256 rows and their targets.
fn data() -> (Tensor, Tensor) {
    let xs = (Tensor::arange(512, (Kind::Float, Device::Cpu)) * 0.37)
        .sin()
        .view([256, 2])
        * 2.0;
    let scale = Tensor::from_slice(
        &(0..256)
            .map(|row| if (row / BATCH) % 2 == 1 { 0.1f32 } else { 1.0 })
            .collect::<Vec<_>>(),
    );
    let ys = ((xs.select(1, 0) - xs.select(1, 1) * 2.0) * scale).view([-1, 1]);
    (xs, ys)
}

/// Whether the `filter` keeps a batch: the mean size of its targets is above 0.145
/// (all 16 of rank 0's batches on 2 ranks, 5 of rank 1's, whose targets are small).
fn keep(y: &Tensor) -> bool {
    y.abs().mean(Kind::Float).double_value(&[]) > 0.145
}

#[derive(Default)]
struct Stats {
    steps: usize,
    own: bool,
    kept: Cell<usize>,
}

#[tch_distributed::distributed]
fn train(
    mode: &str,
    vs: &nn::VarStore,
    net: &nn::Sequential,
    stats: &mut Stats,
) -> anyhow::Result<()> {
    let (xs, ys) = data();
    let mut opt = nn::Sgd::default().build(vs, 0.05)?;
    match mode {
        "early-stop" => {
            // ANCHOR: early_stop
            for (x, y) in Iter2::new(&xs, &ys, BATCH) {
                let loss = net.forward(&x).mse_loss(&y, tch::Reduction::Mean);
                opt.backward_step(&loss);
                stats.steps += 1;
                stats.own = loss.double_value(&[]) < THRESHOLD;
                if stats.own {
                    break;
                }
            }
            println!("stopped after {} steps", stats.steps);
            // ANCHOR_END: early_stop
        }
        "early-return" => {
            for (x, y) in Iter2::new(&xs, &ys, BATCH) {
                let loss = net.forward(&x).mse_loss(&y, tch::Reduction::Mean);
                opt.backward_step(&loss);
                stats.steps += 1;
                stats.own = loss.double_value(&[]) < THRESHOLD;
                if stats.own {
                    return Ok(());
                }
            }
            anyhow::bail!("the loss never fell below {THRESHOLD}");
        }
        "filter" => {
            let kept = &stats.kept;
            // ANCHOR: filter
            for (x, y) in Iter2::new(&xs, &ys, BATCH).filter(|(_, y)| {
                let k = keep(y);
                kept.set(kept.get() + k as usize);
                k
            }) {
                let loss = net.forward(&x).mse_loss(&y, tch::Reduction::Mean);
                opt.backward_step(&loss);
                stats.steps += 1;
            }
            // ANCHOR_END: filter
        }
        other => anyhow::bail!("unknown mode {other}"),
    }
    Ok(())
}

/// The reference: one process, each step on the batches every rank had at that step.
fn train_plain(
    mode: &str,
    vs: &nn::VarStore,
    net: &nn::Sequential,
    steps: usize,
    stats: &mut Stats,
) -> anyhow::Result<()> {
    let (xs, ys) = data();
    let mut opt = nn::Sgd::default().build(vs, 0.05)?;
    let global: Vec<(Tensor, Tensor)> = match mode {
        "early-stop" | "early-return" => Iter2::new(&xs, &ys, 2 * BATCH).take(steps).collect(),
        "filter" => {
            // Dealt round-robin to 2 ranks, then filtered on each.
            let batches: Vec<(Tensor, Tensor)> = Iter2::new(&xs, &ys, BATCH).collect();
            let dealt = |r: usize| -> Vec<&(Tensor, Tensor)> {
                batches
                    .iter()
                    .skip(r)
                    .step_by(2)
                    .filter(|(_, y)| keep(y))
                    .collect()
            };
            let (a, b) = (dealt(0), dealt(1));
            a.iter()
                .zip(&b)
                .map(|(a, b)| (Tensor::cat(&[&a.0, &b.0], 0), Tensor::cat(&[&a.1, &b.1], 0)))
                .collect()
        }
        other => anyhow::bail!("unknown mode {other}"),
    };
    for (x, y) in &global {
        let loss = net.forward(x).mse_loss(y, tch::Reduction::Mean);
        opt.backward_step(&loss);
        stats.steps += 1;
    }
    Ok(())
}

/// `manual-break` and `any-rank`: the loop without the attribute.
fn by_hand(
    mode: &str,
    vs: &nn::VarStore,
    net: &nn::Sequential,
    stats: &mut Stats,
) -> anyhow::Result<()> {
    // Rank 1 reads the records first (after 2 s), so that its message is the one
    // named, run after run; rank 0 would after 20 s.
    let check = if mode == "slow-rank" || std::env::var("RANK").as_deref() == Ok("1") {
        "2"
    } else {
        "20"
    };
    std::env::set_var("TCH_DISTRIBUTED_DEADLOCK_CHECK", check);
    let ctx = tch_distributed::init()?;
    let ddp =
        tch_distributed::DistributedDataParallel::new(vs, ctx.process_group(), Default::default())?;
    let mut opt = nn::Sgd::default().build(vs, 0.05)?;
    let (xs, ys) = data();
    for (x, y) in tch_distributed::shard(Iter2::new(&xs, &ys, BATCH)) {
        let loss = net.forward(&x).mse_loss(&y, tch::Reduction::Mean);
        if mode == "slow-rank" && ctx.rank() == 1 && stats.steps == 1 {
            // Computing, in no collective, for 4 times the deadlock check.
            std::thread::sleep(std::time::Duration::from_secs(8));
        }
        opt.zero_grad();
        ddp.backward(&loss)?;
        opt.step();
        stats.steps += 1;
        let leave = mode != "slow-rank" && ctx.rank() == 0 && stats.steps == 3;
        let leave = match mode {
            "any-rank" => tch_distributed::any_rank(leave)?,
            _ => leave,
        };
        if leave {
            break;
        }
    }
    ctx.barrier()?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    let args: Vec<String> = std::env::args().collect();
    let (dir, mode) = (&args[1], args[2].as_str());
    let rank: usize = std::env::var("RANK")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(0);
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let net = nn::seq()
        .add(nn::linear(&root / "l1", 2, 8, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(&root / "l2", 8, 1, Default::default()));
    let mut stats = Stats::default();
    match (mode, args.get(3).map(String::as_str)) {
        (_, Some("--plain")) => train_plain(mode, &vs, &net, args[4].parse()?, &mut stats)?,
        ("manual-break" | "any-rank" | "slow-rank", _) => by_hand(mode, &vs, &net, &mut stats)?,
        _ => train(mode, &vs, &net, &mut stats)?,
    }
    vs.save(format!("{dir}/params{rank}-{mode}.safetensors"))?;
    std::fs::write(
        format!("{dir}/stats{rank}-{mode}.txt"),
        format!(
            "steps {} own {} kept {}",
            stats.steps,
            stats.own,
            stats.kept.get()
        ),
    )?;
    Ok(())
}
