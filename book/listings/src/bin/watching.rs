//! Watching a run: `watching RUN_DIR` trains a small classifier under `#[distributed]`
//! through the SDK's `DataLoader` (rank 0 draws its progress bar when standard error is
//! a terminal) and logs the global loss with a `Tracker` into `RUN_DIR`.

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_distributed::{DataLoader, TensorDataset, Tracker};

// ANCHOR: train
#[tch_distributed::distributed]
fn train(run_dir: &str) -> anyhow::Result<()> {
    tch::manual_seed(0);
    let xs = Tensor::randn([512, 16], (Kind::Float, Device::Cpu));
    let ys = xs.narrow(1, 0, 4).argmax(1, false);
    let loader = DataLoader::new(TensorDataset::new(&xs, &ys)?, 16)?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root(), 16, 4, Default::default());
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;

    // Every rank makes one; rank 0 alone writes. With averaging, each `log` is one
    // all-reduce, so the loss logged is the global batch's.
    let mut tracker = Tracker::new(run_dir)?.average_over_ranks();
    tracker.batch_size(16)?;
    tracker.config("lr", 1e-2)?;

    let mut step = 0;
    for epoch in 0..3 {
        loader.set_epoch(epoch);
        for batch in &loader {
            let (x, y) = batch?;
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            opt.backward_step(&loss);
            step += 1;
            tracker.log(
                step,
                &[("loss", loss.double_value(&[])), ("epoch", epoch as f64)],
            )?;
        }
    }
    // Draws RUN_DIR/loss.png and RUN_DIR/epoch.png (dropping the tracker does too).
    for plot in tracker.finish()? {
        println!("plotted {}", plot.display());
    }
    Ok(())
}
// ANCHOR_END: train

fn main() -> anyhow::Result<()> {
    let dir = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "runs/watching".into());
    train(&dir)
}
