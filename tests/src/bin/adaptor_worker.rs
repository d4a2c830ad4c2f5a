//! Worker for the iterator-adaptor tests: `Iter2` training loops behind `take`,
//! `skip`, `zip`, `map`, `filter` and `enumerate`, as single-GPU code writes them.
//! `adaptor_worker OUT_DIR [--plain]` trains a linear model over 32 samples (sample
//! `i` is the value `i`) in batches of 4, unshuffled, one loop per adaptor, and writes
//! to `OUT_DIR/adaptors{rank}.txt` one line per loop, `NAME: ids|ids|…`, each `ids`
//! the comma-separated sample ids of one step's batch (for `zip`, prefixed with the
//! zipped counter and `@`). `--plain` runs the same function without the attribute.

use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

/// The sample ids of a batch, comma-separated.
fn ids(batch: &Tensor) -> String {
    Vec::<f32>::try_from(batch.view([-1]))
        .unwrap()
        .iter()
        .map(|v| (*v as i64).to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Defines the training function twice from one body: once with the attribute.
macro_rules! train {
    (($out:ident) $($body:tt)*) => {
        #[tch_distributed::distributed]
        fn train($out: &str) -> anyhow::Result<()> { $($body)* }

        fn train_plain($out: &str) -> anyhow::Result<()> { $($body)* }
    };
}

train! {
    (out)
    let xs = Tensor::arange(32, (Kind::Float, Device::Cpu)).view([32, 1]);
    let ys = &xs * 2.0 + 1.0;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root(), 1, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 1e-5)?;
    let rank = tch_distributed::current().map(|c| c.rank()).unwrap_or(0);
    let mut log = String::new();
    let mut record = |name: &str, batches: Vec<String>| {
        log.push_str(&format!("{name}: {}\n", batches.join("|")));
    };

    let mut seen = Vec::new();
    for (x, y) in Iter2::new(&xs, &ys, 4) {
        opt.backward_step(&net.forward(&x).mse_loss(&y, tch::Reduction::Mean));
        seen.push(ids(&x));
    }
    record("none", seen);

    let mut seen = Vec::new();
    for (x, y) in Iter2::new(&xs, &ys, 4).take(2) {
        opt.backward_step(&net.forward(&x).mse_loss(&y, tch::Reduction::Mean));
        seen.push(ids(&x));
    }
    record("take", seen);

    let mut seen = Vec::new();
    for (x, y) in Iter2::new(&xs, &ys, 4).skip(1) {
        opt.backward_step(&net.forward(&x).mse_loss(&y, tch::Reduction::Mean));
        seen.push(ids(&x));
    }
    record("skip", seen);

    let mut seen = Vec::new();
    for ((x, y), n) in Iter2::new(&xs, &ys, 4).zip(10..) {
        opt.backward_step(&net.forward(&x).mse_loss(&y, tch::Reduction::Mean));
        seen.push(format!("{n}@{}", ids(&x)));
    }
    record("zip", seen);

    let mut seen = Vec::new();
    for (x, y) in Iter2::new(&xs, &ys, 4).map(|(x, y)| (x / 1.0, y)) {
        opt.backward_step(&net.forward(&x).mse_loss(&y, tch::Reduction::Mean));
        seen.push(ids(&x));
    }
    record("map", seen);

    // Drops the first two batches, one from each rank's share on 2 ranks (batches
    // are dealt round-robin), so that every rank still steps as often as the others.
    let mut seen = Vec::new();
    for (x, y) in Iter2::new(&xs, &ys, 4).filter(|(x, _)| x.int64_value(&[0, 0]) >= 8) {
        opt.backward_step(&net.forward(&x).mse_loss(&y, tch::Reduction::Mean));
        seen.push(ids(&x));
    }
    record("filter", seen);

    let mut seen = Vec::new();
    for (i, (x, y)) in Iter2::new(&xs, &ys, 4).skip(1).enumerate().take(2) {
        opt.backward_step(&net.forward(&x).mse_loss(&y, tch::Reduction::Mean));
        seen.push(format!("{i}@{}", ids(&x)));
    }
    record("skip-enumerate-take", seen);

    std::fs::write(format!("{out}/adaptors{rank}.txt"), log)?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    let args: Vec<String> = std::env::args().collect();
    if args.get(2).map(String::as_str) == Some("--plain") {
        train_plain(&args[1])
    } else {
        train(&args[1])
    }
}
