//! ZeRO stage 1's memory: Adam on 8 × Linear(2560, 2560) (52.5 M parameters) on 1, 2
//! and 4 CPU ranks, with the optimizer's state replicated (DDP) and sharded (ZeRO):
//! the optimizer-state bytes and the resident memory (now and at its peak) of each
//! rank, after 3 steps.
//!
//! ```text
//! scripts/bench.sh zero            # every configuration, under tchrun; prints a table
//! ```
//!
//! Run with `--worker` (under a launcher, `TCH_DISTRIBUTED_ZERO` set or not), it is one
//! configuration: each rank writes `ZERO {json}` to stderr.

use std::process::Command;

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

mod memory;
use memory::{status_bytes, worker_rows, write_row};

const LAYERS: i64 = 8;
const WIDTH: i64 = 2560;

#[tch_distributed::distributed]
fn worker() -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let mut net = nn::seq();
    for i in 0..LAYERS {
        net = net.add(nn::linear(
            vs.root() / format!("l{i}"),
            WIDTH,
            WIDTH,
            Default::default(),
        ));
    }
    let mut opt = nn::Adam::default().build(&vs, 1e-4)?;
    let x = Tensor::randn([4, WIDTH], (Kind::Float, Device::Cpu));
    for _ in 0..3 {
        opt.backward_step(&net.forward(&x).square().mean(Kind::Float));
    }
    let ctx = tch_distributed::current().expect("inside the function");
    let parameters: i64 = vs
        .trainable_variables()
        .iter()
        .map(|t| t.numel() as i64)
        .sum();
    write_row(
        "ZERO",
        serde_json::json!({
            "rank": ctx.rank(), "world_size": ctx.world_size(),
            "zero": opt.zero_stage().is_some(), "parameters": parameters,
            "state_bytes": opt.state_bytes(), "peak_rss": status_bytes("VmHWM:"),
            "rss": status_bytes("VmRSS:"),
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
    println!(
        "| ranks | optimizer state | state per rank (MB) | of the whole | resident after 3 steps, per rank (MB) | peak resident, per rank (MB) |"
    );
    println!("|---|---|---|---|---|---|");
    let mut whole = 0u64;
    for ranks in [1, 2, 4] {
        for zero in [false, true] {
            if ranks == 1 && zero {
                continue;
            }
            let mut cmd = Command::new(&tchrun);
            cmd.args(["--nproc-per-node", &ranks.to_string()])
                .arg(&exe)
                .arg("--worker")
                .env("TCH_DISTRIBUTED_ZERO", if zero { "1" } else { "0" });
            let rows = worker_rows(cmd, "ZERO", &format!("{ranks} ranks, zero {zero}"))?;
            let max = |key: &str| {
                rows.iter()
                    .filter_map(|r| r[key].as_u64())
                    .max()
                    .unwrap_or(0)
            };
            let state = max("state_bytes");
            if ranks == 1 {
                whole = state;
            }
            println!(
                "| {ranks} | {} | {:.1} | {:.3} | {:.0} | {:.0} |",
                if zero {
                    "sharded (ZeRO-1)"
                } else {
                    "replicated (DDP)"
                },
                state as f64 / 1e6,
                state as f64 / whole as f64,
                max("rss") as f64 / 1e6,
                max("peak_rss") as f64 / 1e6,
            );
            for row in rows {
                println!("BENCH {row}");
            }
        }
    }
    Ok(())
}
