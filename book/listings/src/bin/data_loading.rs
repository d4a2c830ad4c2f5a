//! Evaluation over a `DataLoader` of a dataset of one's own, on any number of ranks,
//! with a metric that is exactly the single-process one: 1,001 samples do not divide
//! over 2 or 3 ranks, the sampler pads, and `gather_for_metrics` drops the padding.

use tch::{Kind, Tensor};
use tch_distributed::{DataLoader, Dataset};

// ANCHOR: dataset
/// A map-style dataset: `len` samples, read by index (here computed; usually read
/// from disk and decoded). The loader's workers each read through their own clone,
/// so cloning must be cheap.
#[derive(Clone)]
struct Synthetic {
    len: usize,
}

impl Dataset for Synthetic {
    /// One sample: ([2] features, a label in 0..3).
    type Item = (Tensor, Tensor);

    fn len(&self) -> usize {
        self.len
    }

    fn get(&self, i: usize) -> tch_distributed::Result<(Tensor, Tensor)> {
        let x = Tensor::from_slice(&[(i % 7) as f32, (i % 5) as f32]);
        let y = Tensor::from((i % 3) as i64);
        Ok((x, y))
    }
}
// ANCHOR_END: dataset

fn main() -> anyhow::Result<()> {
    // ANCHOR: loader
    let ctx = tch_distributed::init()?;
    // 16 samples per rank and step; evaluation, so no shuffle; read ahead on 2
    // threads; on CUDA, pinned host memory and asynchronous copies.
    let loader = DataLoader::new(Synthetic { len: 1001 }, 16)?
        .shuffle(false)
        .num_workers(2)
        .to_device(ctx.device());
    // ANCHOR_END: loader

    // ANCHOR: metrics
    let (mut correct, mut seen, mut mine) = (0i64, 0i64, 0i64);
    for batch in &loader {
        let (x, y) = batch?;
        // A stand-in for a model: predict (x0 + x1) mod 3.
        let prediction = x.sum_dim_intlist(1, false, Kind::Int64).remainder(3);
        let hits = prediction.eq_tensor(&y);
        mine += hits.size()[0];
        // Every rank's hits for this step, in dataset order, without the padding.
        let all = loader.gather_for_metrics(&hits)?;
        correct += all.sum(Kind::Int64).int64_value(&[]);
        seen += all.size()[0];
    }
    // ANCHOR_END: metrics

    let line = format!(
        "rank {}: {} steps, {mine} samples read\n",
        ctx.rank(),
        loader.len()
    );
    std::io::Write::write_all(&mut std::io::stdout(), line.as_bytes())?;
    ctx.barrier()?;
    if ctx.is_main_process() {
        println!(
            "accuracy {correct}/{seen} = {:.4} on {} rank(s)",
            correct as f64 / seen as f64,
            ctx.world_size()
        );
    }
    Ok(())
}
