//! Worker for `find_executable_batch_size`: `batch_size_worker MODE OUT_DIR [START]`
//! (START: the first batch size, 64 unless given), on one
//! process (the reference) or several. Each attempt trains a fresh `Linear(4, 1)` (the
//! same seed everywhere) for 3 SGD steps under DDP on rows `rank * b..(rank + 1) * b`
//! of a fixed global batch of `world_size * b` rows, then "evaluates".
//!
//! - `oom`: on rank 1, the evaluation runs out of memory at batch sizes over 16 (a real
//!   refusal of the CPU allocator: tch's method panics with it), after the attempt's
//!   collectives; the other ranks fit;
//! - `fit START`: nothing runs out, starting at START (the reference: one process at
//!   `3 * 16`);
//! - `panic`: the attempt panics with a message that is not out of memory (a bug of
//!   the program's): the panic goes on, with its message;
//! - `fail`: at the first batch size (64), rank 2 fails with an error of its own while
//!   rank 0 returns an out-of-memory error and rank 1 really runs out (a panic): no
//!   rank retries, ranks 0 and 1 get the error that names rank 2.
//!
//! Each rank writes `OUT_DIR/rank{r}.json`: the batch sizes tried, and the weights after
//! the attempt that fitted, or the error.

use serde_json::json;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use tch_distributed::{DdpOptions, DistributedDataParallel, Optimizer};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (mode, out) = (args[1].clone(), args[2].clone());
    tch::set_num_threads(1);
    let ctx = tch_distributed::init()?;
    let (rank, world) = (ctx.rank(), ctx.world_size());
    let start = args.get(3).map_or(Ok(64), |s| s.parse())?;
    let mut tried = Vec::new();
    let result =
        tch_distributed::find_executable_batch_size(start, |b| -> anyhow::Result<Vec<f32>> {
            tried.push(b);
            tch::manual_seed(0);
            let vs = nn::VarStore::new(Device::Cpu);
            let linear = nn::linear(vs.root(), 4, 1, Default::default());
            let ddp =
                DistributedDataParallel::new(&vs, ctx.process_group(), DdpOptions::default())?;
            let mut opt = Optimizer::new(&nn::Sgd::default(), &vs, 0.1)?.distributed(ddp);
            let rows = (world * b) as i64;
            let xs = Tensor::arange(rows * 4, (Kind::Float, Device::Cpu)).view([rows, 4])
                / (rows * 4) as f64;
            let ys = xs.sum_dim_intlist(1, true, Kind::Float).sin();
            let (x, y) = (
                xs.narrow(0, (rank * b) as i64, b as i64),
                ys.narrow(0, (rank * b) as i64, b as i64),
            );
            for _ in 0..3 {
                let loss = linear.forward(&x).mse_loss(&y, tch::Reduction::Mean);
                opt.backward_step(&loss)?;
            }
            if mode == "oom" && rank == 1 && b > 16 {
                // Petabytes: the CPU allocator refuses.
                let _ = Tensor::empty([b as i64 * (1 << 46)], (Kind::Float, Device::Cpu));
            }
            if mode == "panic" {
                panic!("the program's own bug (injected)");
            }
            if mode == "fail" {
                match rank {
                    0 => anyhow::bail!("CUDA out of memory. Tried to allocate 1.00 GiB (injected)"),
                    1 => {
                        let _ = Tensor::empty([1 << 50], (Kind::Float, Device::Cpu));
                    }
                    _ => anyhow::bail!("rank 2's own failure"),
                }
            }
            let mut weights = Vec::<f32>::try_from(linear.ws.view([-1]))?;
            weights.extend(Vec::<f32>::try_from(linear.bs.as_ref().unwrap())?);
            Ok(weights)
        });
    let result = match result {
        Ok(w) => json!({ "weights": w }),
        Err(e) => json!({ "error": format!("{e:#}") }),
    };
    let record = json!({ "tried": tried, "result": result });
    std::fs::write(format!("{out}/rank{rank}.json"), record.to_string())?;
    Ok(())
}
