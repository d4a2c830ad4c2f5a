//! Fully sharded training's memory and speed: Adam on 16 × Linear(1024, 1024) with
//! ReLU (16.8 M parameters, every layer a unit of `fully_shard`), batch 8 per rank, on
//! 2 and 4 CPU ranks over Gloo: DDP and ZeRO stages 1, 2 and 3 here, DDP and FSDP2
//! (`fully_shard`) in PyTorch on the same libtorch. For each: the peak resident memory
//! a rank adds while it builds and trains the model (`VmHWM` after the steps less
//! `VmRSS` before the model is made; the largest over the ranks), its ratio to DDP's
//! on the same side, and the mean step time of 5 steps after one warm-up step.
//! Every side runs with glibc's mmap threshold fixed (`MALLOC_MMAP_THRESHOLD_=65536`)
//! so that freed tensors leave the resident set, but for the last two rows: glibc's
//! own settings, under which the SDK fixes the threshold itself when it shards.
//!
//! On CUDA (`--device cuda`, what `scripts/bench_gpu.sh` runs), the ranks share the
//! one visible GPU over Gloo and the memory is the CUDA caching allocator's: its peak
//! of allocated bytes less what was allocated before the model was made
//! (`torch.cuda.max_memory_allocated()` on PyTorch's side); the rows under glibc's
//! defaults are left out.
//!
//! ```text
//! scripts/bench.sh sharding [--python PYTHON] [--device cuda]   # every configuration; prints a table
//! ```
//!
//! Run with `--worker` (under a launcher, `TCH_DISTRIBUTED_ZERO` set or not,
//! `TCHD_BENCH_DEVICE=cuda` or not), it is one configuration: each rank writes
//! `SHARDING {json}` to stderr.

use std::process::Command;

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

mod memory;
use memory::{
    added_peak_and_step, device_memory, load_libtorch_cuda, mean_step_ms, reset_device_memory,
    status_bytes, worker_rows, write_row,
};

const LAYERS: i64 = 16;
const WIDTH: i64 = 1024;
const BATCH: i64 = 8;

#[tch_distributed::distributed]
fn worker() -> anyhow::Result<()> {
    let cuda = std::env::var("TCHD_BENCH_DEVICE").is_ok_and(|d| d == "cuda");
    // The rank's GPU (the SDK picks it; ranks share a single visible one), or the CPU.
    let device = match cuda {
        true => Device::cuda_if_available(),
        false => Device::Cpu,
    };
    anyhow::ensure!(
        device.is_cuda() == cuda,
        "TCHD_BENCH_DEVICE=cuda, but no CUDA device is visible"
    );
    reset_device_memory(device);
    let baseline = match cuda {
        true => device_memory(device)[0],
        false => status_bytes("VmRSS:") as f64,
    };
    let vs = nn::VarStore::new(device);
    let root = vs.root();
    let layers: Vec<_> = (0..LAYERS)
        .map(|i| {
            let path = &root / format!("l{i}");
            tch_distributed::fully_shard(nn::linear(&path, WIDTH, WIDTH, Default::default()), &path)
        })
        .collect();
    let mut opt = nn::Adam::default().build(&vs, 1e-4)?;
    let x = Tensor::randn([BATCH, WIDTH], (Kind::Float, device));
    let ctx = tch_distributed::current().expect("inside the function");
    let step_ms = mean_step_ms(&ctx, 5, || {
        let y = layers
            .iter()
            .fold(x.shallow_clone(), |h, layer| layer.forward(&h).relu());
        opt.backward_step(&y.square().mean(Kind::Float));
        if let Device::Cuda(i) = device {
            tch::Cuda::synchronize(i as i64);
        }
    })?;
    let peak = match cuda {
        true => device_memory(device)[1],
        false => status_bytes("VmHWM:") as f64,
    };
    let zero = std::env::var("TCH_DISTRIBUTED_ZERO").unwrap_or_default();
    let side = match zero.as_str() {
        "" | "0" => "ddp".to_string(),
        stage => format!("zero{stage}"),
    };
    write_row(
        "SHARDING",
        serde_json::json!({
            "rank": ctx.rank(), "world_size": ctx.world_size(), "side": side,
            "device": if cuda { "cuda" } else { "cpu" },
            "baseline": baseline, "peak": peak, "step_ms": step_ms,
        }),
    )
}

/// The ranks' rows of one configuration's run: the added peak (the largest over the
/// ranks, bytes) and the step time (the slowest rank, ms).
fn measure(cmd: Command, what: &str) -> anyhow::Result<(f64, f64, Vec<serde_json::Value>)> {
    let rows = worker_rows(cmd, "SHARDING", what)?;
    let (added, step) = added_peak_and_step(&rows);
    Ok((added, step, rows))
}

/// One row of the table (the added peak in MB and as a share of `ddp`'s, the step in
/// ms), then each rank's measurements as `BENCH {json}` on stderr.
fn print_row(
    ranks: usize,
    side: &str,
    added: f64,
    ddp: f64,
    step: f64,
    rows: &[serde_json::Value],
) {
    println!(
        "| {ranks} | {side} | {:.0} | {:.2} | {step:.1} |",
        added / 1e6,
        added / ddp
    );
    for row in rows {
        eprintln!("BENCH {row}");
    }
}

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    let args: Vec<String> = std::env::args().collect();
    if std::env::var("TCHD_BENCH_DEVICE").is_ok_and(|d| d == "cuda") {
        load_libtorch_cuda();
    }
    if args.iter().any(|a| a == "--worker") {
        return worker();
    }
    let python = args
        .iter()
        .position(|a| a == "--python")
        .and_then(|i| args.get(i + 1).cloned());
    let cuda = args
        .iter()
        .position(|a| a == "--device")
        .is_some_and(|i| args.get(i + 1).is_some_and(|d| d == "cuda"));
    let exe = std::env::current_exe()?;
    let tchrun = exe.with_file_name("tchrun");
    // PyTorch's side: beside the sources, or where a GPU package put it.
    let script = std::env::var("TCHD_FSDP_BENCH")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/python/fsdp_bench.py").into());
    let script = script.as_str();
    println!("| ranks | side | added peak per rank (MB) | of DDP's | step (ms) |");
    println!("|---|---|---|---|---|");
    // The last rows: glibc's own settings (no fixed mmap threshold), where the SDK
    // fixes the threshold itself when it shards.
    let configurations = [
        (2, "0", true),
        (2, "1", true),
        (2, "2", true),
        (2, "3", true),
        (4, "0", true),
        (4, "3", true),
        (2, "0", false),
        (2, "3", false),
    ];
    let mut ddp = 0.0;
    for (i, (ranks, zero, fixed)) in configurations.into_iter().enumerate() {
        // glibc's settings do not move CUDA memory.
        if cuda && !fixed {
            continue;
        }
        {
            let mut cmd = Command::new(&tchrun);
            cmd.args(["--nproc-per-node", &ranks.to_string()])
                .arg(&exe)
                .arg("--worker")
                .env("TCH_DISTRIBUTED_ZERO", zero)
                .env("TCHD_BENCH_DEVICE", if cuda { "cuda" } else { "cpu" });
            if !cuda {
                cmd.env("CUDA_VISIBLE_DEVICES", "");
            }
            if fixed {
                cmd.env("MALLOC_MMAP_THRESHOLD_", "65536");
            }
            let (added, step, rows) = measure(cmd, &format!("{ranks} ranks, zero {zero}"))?;
            if zero == "0" {
                ddp = added;
            }
            let mut side = if zero == "0" {
                "DDP".to_string()
            } else {
                format!("ZeRO-{zero}")
            };
            if !fixed {
                side += " (glibc's defaults)";
            }
            print_row(ranks, &side, added, ddp, step, &rows);
        }
        // PyTorch's rows after ours of the same world size.
        let last_of_world = configurations
            .get(i + 1)
            .is_none_or(|c| c.0 != ranks || !c.2);
        let Some(python) = python.as_ref().filter(|_| fixed && last_of_world) else {
            continue;
        };
        let mut ddp = 0.0;
        for mode in ["ddp", "fsdp2"] {
            let mut cmd = Command::new(python);
            let device = if cuda { "cuda" } else { "cpu" };
            cmd.args([script, &ranks.to_string(), mode, device])
                .env("MALLOC_MMAP_THRESHOLD_", "65536");
            let measured = measure(cmd, &format!("PyTorch {mode}, {ranks} ranks"));
            // On CUDA, Gloo may lack a collective that FSDP2 asks for: the row says so.
            let (added, step, rows) = match measured {
                Err(e) if cuda => {
                    let why = e.to_string().lines().last().unwrap_or_default().to_string();
                    println!("| {ranks} | PyTorch {mode} | failed: {why} | | |");
                    continue;
                }
                measured => measured?,
            };
            if mode == "ddp" {
                ddp = added;
            }
            let side = if mode == "ddp" {
                "PyTorch DDP"
            } else {
                "PyTorch FSDP2"
            };
            print_row(ranks, &side, added, ddp, step, &rows);
        }
    }
    Ok(())
}
