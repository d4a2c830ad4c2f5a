//! Preparing a dataset once per node: local rank 0 of each node "downloads" it into the
//! node's cache directory while the node's other ranks wait, then they all read it.
//! `download_once CACHE_DIR`.

use std::io::Write;
use std::path::{Path, PathBuf};

use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

// ANCHOR: download
/// Stands in for a download (or a slow preprocessing step): writes the dataset into
/// `cache` unless an earlier run, or another rank, already did. A function without the
/// attribute: its output comes from every rank that runs it (`tchrun --all-ranks-stdout`
/// shows every rank's).
fn download_if_missing(cache: &Path) -> std::io::Result<PathBuf> {
    // ANCHOR: rank
    let rank = tch_distributed::current().map_or(0, |c| c.rank());
    // ANCHOR_END: rank
    let file = cache.join("points.txt");
    let what = if file.exists() {
        "found in cache"
    } else {
        std::fs::create_dir_all(cache)?;
        let points: String = (0..256)
            .map(|i| format!("{} {}\n", i as f32 / 256.0, 3.0 * i as f32 / 256.0 + 1.0))
            .collect();
        // Written whole, then renamed: a reader never sees half a file.
        let part = cache.join("points.txt.part");
        std::fs::write(&part, points)?;
        std::fs::rename(&part, &file)?;
        "downloaded"
    };
    std::io::stdout().write_all(format!("rank {rank}: {what} {}\n", file.display()).as_bytes())?;
    Ok(file)
}

#[tch_distributed::distributed]
fn train(cache: &Path) -> anyhow::Result<()> {
    // Local rank 0 of each node first, then the node's other ranks.
    let file = tch_distributed::local_main_process_first(|| download_if_missing(cache))??;
    let numbers: Vec<f32> = std::fs::read_to_string(&file)?
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let points = Tensor::from_slice(&numbers).view([-1, 2]);
    let (xs, ys) = (points.narrow(1, 0, 1), points.narrow(1, 1, 1));
    // ANCHOR_END: download
    let device = Device::cuda_if_available();
    let vs = nn::VarStore::new(device);
    let net = nn::linear(vs.root(), 1, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.5)?;
    for _epoch in 0..20 {
        for (x, y) in Iter2::new(&xs, &ys, 16).shuffle() {
            let loss = net
                .forward(&x.to_device(device))
                .mse_loss(&y.to_device(device), tch::Reduction::Mean);
            opt.backward_step(&loss);
        }
    }
    let loss = net
        .forward(&xs.to_device(device))
        .mse_loss(&ys.to_device(device), tch::Reduction::Mean)
        .to_kind(Kind::Double)
        .double_value(&[]);
    println!("trained on {} points: loss {loss:.4}", xs.size()[0]);
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let cache = std::env::args()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("usage: download_once CACHE_DIR"))?;
    train(Path::new(&cache))
}
