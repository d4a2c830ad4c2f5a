//! Loader benchmark: samples/s of `tch_distributed::DataLoader` with 0, 1 and 2 worker
//! threads, on tinyshakespeare-sized text and on image-sized data, one rank.
//!
//! ```text
//! scripts/bench.sh loader            # cargo run --release -p tch-distributed-bench --bin loader
//! ```
//!
//! Workloads:
//! - `text`: `TextDataset` windows of 65 characters over 1.1 M characters (the size
//!   of tinyshakespeare), batch 32: the shakespeare example's input;
//! - `images`: `TensorDataset` of 60,000 1×28×28 float images (MNIST-sized), batch
//!   256, read with one `index_select` per batch;
//! - `images+decode`: the same images stored as u8 and converted per sample (scale
//!   and normalise, as a vision transform would), collated by stacking: the case
//!   worker threads are for.

use std::time::Instant;

use clap::Parser;
use tch::{Device, Kind, Tensor};
use tch_distributed::{DataLoader, Dataset, TensorDataset, TextDataset};

#[derive(Parser)]
struct Args {
    /// Epochs timed per configuration (after one warm-up epoch).
    #[arg(long, default_value_t = 2)]
    epochs: usize,
}

/// u8 images decoded per sample: `(x / 255 - 0.1307) / 0.3081`.
#[derive(Clone)]
struct Decode(TensorDataset);

impl Dataset for Decode {
    type Item = (Tensor, Tensor);
    fn len(&self) -> usize {
        self.0.len()
    }
    fn get(&self, index: usize) -> tch_distributed::Result<Self::Item> {
        let (x, y) = self.0.get(index)?;
        Ok(((x.to_kind(Kind::Float) / 255.0 - 0.1307) / 0.3081, y))
    }
}

fn time<D: Dataset>(name: &str, make: impl Fn() -> DataLoader<D>, epochs: usize) {
    for workers in [0, 1, 2] {
        let loader = make().num_workers(workers);
        for b in &loader {
            b.unwrap();
        }
        let start = Instant::now();
        let mut samples = 0;
        for _ in 0..epochs {
            for b in &loader {
                samples += tch_distributed::Batch::rows(&b.unwrap());
            }
        }
        let secs = start.elapsed().as_secs_f64();
        println!(
            "{name:14} workers {workers}: {:>12.0} samples/s ({samples} samples in {secs:.2} s)",
            samples as f64 / secs
        );
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tch::set_num_threads(1);
    let dir = std::env::temp_dir().join(format!("tchd-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("text.txt");
    let line = "First Citizen: Before we proceed any further, hear me speak.\n";
    std::fs::write(&path, line.repeat(1_115_394 / line.len()))?;
    let text = tch::data::TextData::new(&path)?;
    std::fs::remove_dir_all(&dir)?;
    let text = TextDataset::new(&text, 64)?;
    time(
        "text",
        || DataLoader::new(text.clone(), 32).unwrap(),
        args.epochs,
    );

    let n = 60_000;
    let pixels = Tensor::randint(256, [n, 1, 28, 28], (Kind::Uint8, Device::Cpu));
    let labels = Tensor::randint(10, [n], (Kind::Int64, Device::Cpu));
    let floats = TensorDataset::new(&(pixels.to_kind(Kind::Float) / 255.0), &labels)?;
    time(
        "images",
        || DataLoader::new(floats.clone(), 256).unwrap(),
        args.epochs,
    );
    let raw = Decode(TensorDataset::new(&pixels, &labels)?);
    time(
        "images+decode",
        || DataLoader::new(raw.clone(), 256).unwrap(),
        args.epochs,
    );
    Ok(())
}
