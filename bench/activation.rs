//! Activation checkpointing's memory and time: a deep MLP whose activations dominate
//! (8 blocks of four Linear(256, 256) layers with tanh; batch 4096 rows per rank, so a
//! block's activations, 20 MB, outweigh its parameters, 1 MB), SGD with momentum,
//! on 2 CPU ranks over Gloo under `#[distributed]`: the plain model, and every block
//! checkpointed (`tch_distributed::checkpointed`). For each: the peak resident memory a
//! rank adds while it builds and trains the model (`VmHWM` after the steps less
//! `VmRSS` before the model is made; the largest over the ranks), its ratio to the
//! plain model's, and the mean step time of 5 steps after a warm-up step, with glibc's
//! mmap threshold fixed (`MALLOC_MMAP_THRESHOLD_=65536`) so that freed tensors leave
//! the resident set.
//!
//! ```text
//! scripts/bench.sh activation      # prints a table
//! ```
//!
//! Run with `--worker` under a launcher (`CHECKPOINT=1` or not), it is one
//! configuration: each rank writes `ACTIVATION {json}` to stderr.

use std::process::Command;

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

mod memory;
use memory::{added_peak_and_step, mean_step_ms, status_bytes, worker_rows, write_row};

/// A block's forward pass, checkpointed or not.
type Layer = Box<dyn Fn(&Tensor) -> Tensor>;

const BLOCKS: i64 = 8;
const LAYERS: i64 = 4;
const WIDTH: i64 = 256;
const BATCH: i64 = 4096;

#[tch_distributed::distributed]
fn worker() -> anyhow::Result<()> {
    let checkpointed = std::env::var("CHECKPOINT").is_ok_and(|v| v == "1");
    let baseline = status_bytes("VmRSS:") as f64;
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let blocks: Vec<Layer> = (0..BLOCKS)
        .map(|i| -> Layer {
            let path = &root / format!("b{i}");
            let block = (0..LAYERS).fold(nn::seq(), |block, j| {
                block
                    .add(nn::linear(&path / j, WIDTH, WIDTH, Default::default()))
                    .add_fn(|x| x.tanh())
            });
            match checkpointed {
                true => {
                    let block = tch_distributed::checkpointed(block);
                    Box::new(move |x| block.forward(x))
                }
                false => Box::new(move |x| block.forward(x)),
            }
        })
        .collect();
    let mut opt = nn::Sgd {
        momentum: 0.9,
        ..Default::default()
    }
    .build(&vs, 1e-3)?;
    let x = Tensor::randn([BATCH, WIDTH], (Kind::Float, Device::Cpu));
    let ctx = tch_distributed::current().expect("inside the function");
    let step_ms = mean_step_ms(&ctx, 5, || {
        let y = blocks.iter().fold(x.shallow_clone(), |h, block| block(&h));
        opt.backward_step(&y.square().mean(Kind::Float));
    })?;
    write_row(
        "ACTIVATION",
        serde_json::json!({
            "rank": ctx.rank(), "checkpointed": checkpointed,
            "baseline": baseline, "peak": status_bytes("VmHWM:") as f64, "step_ms": step_ms,
        }),
    )
}

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    if std::env::args().any(|a| a == "--worker") {
        return worker();
    }
    let exe = std::env::current_exe()?;
    let tchrun = exe.with_file_name("tchrun");
    println!("| model | added peak per rank (MB) | of the plain model's | step (ms) |");
    println!("|---|---|---|---|");
    let mut plain = (0.0, 0.0);
    for checkpointed in ["0", "1"] {
        let mut cmd = Command::new(&tchrun);
        cmd.args(["--nproc-per-node", "2"])
            .arg(&exe)
            .arg("--worker")
            .env("CHECKPOINT", checkpointed)
            .env("MALLOC_MMAP_THRESHOLD_", "65536");
        let rows = worker_rows(cmd, "ACTIVATION", "activation bench")?;
        let (added, step) = added_peak_and_step(&rows);
        if checkpointed == "0" {
            plain = (added, step);
        }
        let side = if checkpointed == "1" {
            "checkpointed"
        } else {
            "plain"
        };
        println!(
            "| {side} | {:.0} | {:.2} | {step:.1} ({:.2}×) |",
            added / 1e6,
            added / plain.0,
            step / plain.1
        );
        for row in rows {
            eprintln!("BENCH {row}");
        }
    }
    Ok(())
}
