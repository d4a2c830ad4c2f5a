//! Worker for `tests/tests/tracker.rs` and `tests/tests/progress.rs`:
//! `tracker_worker OUT [--no-average] [--loader]`, under `tchrun`. A `#[distributed]` function trains a linear model on 32 samples (batch 4,
//! one epoch, sharded by the attribute) and logs, through a `Tracker` writing into
//! `OUT/run`, at each step `s` (from 1): `loss` (this rank's loss on its batch) and
//! `rank` (this rank's rank), averaged over ranks unless `--no-average`. Each rank
//! also writes its own losses, one per line (f64 `Debug`), to `OUT/local{rank}.txt`.
//! The configuration gets the batch size (4) and `args`: this program's arguments.
//! With `--loader` the batches come from the SDK's `DataLoader` (unshuffled) instead
//! of tch's `Iter2` in a loop the attribute shards.

use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_distributed::{DataLoader, TensorDataset, Tracker};

#[tch_distributed::distributed]
fn train(out: &str, average: bool, loader: bool) -> anyhow::Result<()> {
    let xs = Tensor::arange(32, (Kind::Float, Device::Cpu)).view([32, 1]) / 32.0;
    let ys = (&xs * 3.0).cos();
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root(), 1, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    let rank = tch_distributed::current().map(|c| c.rank()).unwrap_or(0);
    let mut tracker = Tracker::new(format!("{out}/run"))?;
    if average {
        tracker = tracker.average_over_ranks();
    }
    tracker.batch_size(4)?;
    tracker.config("args", std::env::args().collect::<Vec<_>>())?;
    let mut local = String::new();
    let mut step = 0;
    {
        let mut train_step = |bx: Tensor, by: Tensor| -> anyhow::Result<()> {
            let loss = net.forward(&bx).mse_loss(&by, tch::Reduction::Mean);
            let value = loss.double_value(&[]);
            opt.backward_step(&loss);
            step += 1;
            tracker.log(step, &[("loss", value), ("rank", rank as f64)])?;
            local.push_str(&format!("{value:?}\n"));
            Ok(())
        };
        if loader {
            let data = DataLoader::new(TensorDataset::new(&xs, &ys)?, 4)?.shuffle(false);
            for batch in &data {
                let (bx, by) = batch?;
                train_step(bx, by)?;
            }
        } else {
            for (bx, by) in Iter2::new(&xs, &ys, 4) {
                train_step(bx, by)?;
            }
        }
    }
    std::fs::write(format!("{out}/local{rank}.txt"), local)?;
    tracker.finish()?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    let args: Vec<String> = std::env::args().collect();
    let flag = |f: &str| args[2..].iter().any(|a| a == f);
    train(&args[1], !flag("--no-average"), flag("--loader"))
}
