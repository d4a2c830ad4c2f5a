//! Worker for the data tests, run under `tchrun`.
//!
//! - `data_loading_worker loader OUT N BATCH`: a `DataLoader` over samples `0..N` (batch
//!   `BATCH`, 2 epochs). Each rank writes the sample ids of each epoch to
//!   `OUT/seen{rank}.txt`, and the accuracy of a fixed "prediction" over the whole
//!   dataset, gathered batch by batch with `gather_for_metrics`, to
//!   `OUT/metric{rank}.txt`; then the rows that `gather_for_metrics` keeps over the
//!   rest of epoch 0 after resuming at its third step, to `OUT/resumed{rank}.txt`.
//! - `data_loading_worker uneven`: rank r builds a loader over `10 + r` samples (must
//!   fail).
//!
//! With `TCHD_TEST_DEVICE=cuda`, `loader` moves its batches to the rank's CUDA device
//! (`DataLoader::to_device`, through pinned host memory, the default) and prints
//! `rank R: batches on DEVICE, pinned BOOL`.

use std::fmt::Write as _;

use tch::{Device, Kind, Tensor};
use tch_distributed::{DataLoader, TensorDataset};

/// A deterministic stand-in for a model: right for samples whose id is not 1 mod 3.
fn correct(ids: &Tensor) -> Tensor {
    ids.remainder(3).ne(1).to_kind(Kind::Float)
}

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    let args: Vec<String> = std::env::args().collect();
    let ctx = tch_distributed::init()?;
    let rank = ctx.rank();
    match args[1].as_str() {
        "loader" => {
            let (out, n, batch): (&str, i64, usize) =
                (&args[2], args[3].parse()?, args[4].parse()?);
            let ids = Tensor::arange(n, (Kind::Int64, Device::Cpu));
            let device = tch_distributed_tests::test_device(ctx.device());
            let mut loader =
                DataLoader::new(TensorDataset::new(&ids, &ids)?, batch)?.num_workers(1);
            if device.is_cuda() {
                loader = loader.to_device(device);
                // What the loader's worker does to each batch before the copy.
                let pinned = ids.pin_memory(device).is_pinned(device);
                println!("rank {rank}: batches on {device:?}, pinned {pinned}");
            }
            let mut log = format!("steps per epoch {}\n", loader.len());
            let mut gathered = Vec::new();
            for epoch in 0..2 {
                let mut seen = Vec::new();
                for b in &loader {
                    let (x, _) = b?;
                    anyhow::ensure!(x.device() == device, "a batch on {:?}", x.device());
                    seen.extend(Vec::<i64>::try_from(&x.to_device(Device::Cpu))?);
                    if epoch == 0 {
                        gathered.push(loader.gather_for_metrics(&correct(&x))?);
                    }
                }
                writeln!(log, "epoch {epoch}: {seen:?}")?;
            }
            std::fs::write(format!("{out}/seen{rank}.txt"), log)?;
            let all = Tensor::cat(&gathered, 0);
            let metric = format!(
                "{} {}",
                all.size()[0],
                all.mean(Kind::Float).double_value(&[])
            );
            std::fs::write(format!("{out}/metric{rank}.txt"), metric)?;

            // Resumed after 2 steps of epoch 0 (as from a checkpoint): the rest of the
            // epoch, gathered batch by batch, is the dataset's rows past the first
            // 2 × batch × world size of the epoch's order, without the padding.
            let resumed = DataLoader::new(TensorDataset::new(&ids, &ids)?, batch)?;
            resumed.resume(tch_distributed::LoaderPosition {
                epoch: 0,
                samples_in_epoch: (2 * batch * ctx.world_size()) as u64,
            });
            let mut rows = 0;
            for b in &resumed {
                let (x, _) = b?;
                rows += resumed.gather_for_metrics(&correct(&x))?.size()[0];
            }
            std::fs::write(format!("{out}/resumed{rank}.txt"), rows.to_string())?;
        }
        "uneven" => {
            let n = 10 + rank as i64;
            let ids = Tensor::arange(n, (Kind::Int64, Device::Cpu));
            DataLoader::new(TensorDataset::new(&ids, &ids)?, 4)?;
            println!("rank {rank}: built a loader over uneven data");
        }
        other => anyhow::bail!("unknown mode {other}"),
    }
    Ok(())
}
