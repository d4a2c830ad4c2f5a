//! The generic `#[distributed]` training program: plain single-GPU tch code plus the
//! attribute, which every test that needs "some data-parallel training program" runs
//! (`tests/tests/`: `adapting.rs`, `entry_errors.rs`, `launch.rs`, `mpi.rs`,
//! `multi_node.rs`, `rendezvous_counts.rs`, `shuffles.rs`).
//!
//! `distributed_program OUT_DIR ROWS [--plain]` trains a linear model for 2 epochs over
//! `ROWS` samples (batch 4, shuffled, smaller last batch kept) and writes, per rank, the
//! sample ids it saw per epoch to `OUT_DIR/seen{rank}.txt`, the ids of each step's
//! batch to `OUT_DIR/batches{rank}.txt` (one line per step), its parameters once the
//! optimizer is built (rank 0's, broadcast) to `OUT_DIR/init{rank}.safetensors`, its
//! final parameters to `OUT_DIR/params{rank}.txt`, and the model to
//! `OUT_DIR/model.safetensors`: enough to recompute the training in one process
//! (`tests/tests/support/distributed_program_reference.rs`).
//! `--plain` runs the same function without the attribute. With `SEED=s` in the
//! environment it seeds libtorch's generator first (unseeded, libtorch draws a seed
//! at random); with `FAIL_RANK=r`, rank `r` returns an error after its first step;
//! with `MISMATCH=1`, rank `r`'s layer has `1 + r` outputs; with `MISMATCH=N` for
//! `N > 1`, the last rank alone adds a Double `alpha` (Float on the others) and `N`
//! variables `extra00`, `extra01`, … that the others lack (the layer is the same).

use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

/// Defines the training function twice from one body: once with the attribute.
macro_rules! train {
    (($out:ident, $rows:ident) $($body:tt)*) => {
        #[tch_distributed::distributed]
        fn train($out: &str, $rows: i64) -> anyhow::Result<()> { $($body)* }

        fn train_plain($out: &str, $rows: i64) -> anyhow::Result<()> { $($body)* }
    };
}

train! {
    (out, rows)
    if let Some(seed) = std::env::var("SEED").ok().and_then(|s| s.parse().ok()) {
        tch::manual_seed(seed);
    }
    let device = Device::cuda_if_available();
    let xs = Tensor::arange(rows, (Kind::Float, Device::Cpu)).view([rows, 1]);
    let ys = &xs * 2.0 + 1.0;
    let vs = nn::VarStore::new(device);
    let rank = tch_distributed::current().map(|c| c.rank()).unwrap_or(0);
    // MISMATCH=1: each rank builds a layer of its own width (ranks that disagree).
    let mismatch: Option<usize> = std::env::var("MISMATCH").ok().and_then(|m| m.parse().ok());
    let width = if mismatch == Some(1) { 1 + rank as i64 } else { 1 };
    let net = nn::linear(vs.root(), 1, width, Default::default());
    // MISMATCH=N > 1: the same layer everywhere; the last rank differs in a dtype and
    // in N variables of its own.
    if let Some(extra) = mismatch.filter(|&n| n > 1) {
        let last = tch_distributed::current().map(|c| c.world_size() - 1) == Some(rank);
        let kind = if last { Kind::Double } else { Kind::Float };
        let _ = vs.root().add("alpha", Tensor::ones([1], (kind, device)), true);
        for i in (0..extra).filter(|_| last) {
            let _ = vs.root().zeros(&format!("extra{i:02}"), &[1]);
        }
    }
    let mut opt = nn::Sgd::default().build(&vs, 1e-4)?;
    let mut init: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    init.sort_by(|a, b| a.0.cmp(&b.0));
    Tensor::write_safetensors(&init, format!("{out}/init{rank}.safetensors"))?;
    let mut batches = String::new();
    let fail = std::env::var("FAIL_RANK").ok().and_then(|r| r.parse::<usize>().ok());
    let mut log = String::new();
    let mut steps = 0;
    for epoch in 0..2 {
        let mut seen = Vec::new();
        for (bx, by) in Iter2::new(&xs, &ys, 4)
            .shuffle()
            .return_smaller_last_batch()
        {
            let ids: Vec<i64> = Vec::<f32>::try_from(bx.view([-1]))?
                .into_iter()
                .map(|v| v as i64)
                .collect();
            batches.push_str(&format!("{ids:?}\n"));
            seen.extend(ids);
            // Draws as much randomness as dropout on this batch would: the ranks'
            // generators drift apart on the smaller last batch.
            let noise = Tensor::rand_like(&bx) * 0.0;
            let loss = net
                .forward(&(bx + noise).to_device(device))
                .mse_loss(&by.to_device(device), tch::Reduction::Mean);
            opt.backward_step(&loss);
            steps += 1;
            if fail == Some(rank) {
                anyhow::bail!("rank {rank} fails on purpose");
            }
        }
        log.push_str(&format!("epoch {epoch}: {seen:?}\n"));
        println!("epoch {epoch} done");
    }
    log.push_str(&format!("steps {steps}\n"));
    std::fs::write(format!("{out}/seen{rank}.txt"), log)?;
    std::fs::write(format!("{out}/batches{rank}.txt"), batches)?;
    let params: Vec<f32> = vs
        .trainable_variables()
        .iter()
        .flat_map(|t| Vec::<f32>::try_from(t.view([-1])).unwrap())
        .collect();
    std::fs::write(format!("{out}/params{rank}.txt"), format!("{params:?}"))?;
    vs.save(format!("{out}/model.safetensors"))?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    let args: Vec<String> = std::env::args().collect();
    let (out, rows) = (&args[1], args[2].parse()?);
    if args.get(3).map(String::as_str) == Some("--plain") {
        train_plain(out, rows)
    } else {
        train(out, rows)
    }
}
