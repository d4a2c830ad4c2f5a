//! Fully sharded training's memory and speed: Adam on 16 × Linear(1024, 1024) with
//! ReLU (16.8 M parameters, every layer a unit of `fully_shard`), batch 8 per rank, on
//! 2 and 4 CPU ranks over Gloo: DDP and ZeRO stages 1, 2 and 3 here, DDP and FSDP2
//! (`fully_shard`) in PyTorch on the same libtorch. For each: the peak resident memory
//! a rank adds while it builds and trains the model (`VmHWM` after the steps less
//! `VmRSS` before the model is made; the largest over the ranks), its ratio to DDP's
//! on the same side, and the mean step time of 5 steps after one warm-up step.
//! Every side runs with glibc's mmap threshold fixed (`MALLOC_MMAP_THRESHOLD_=65536`)
//! so that freed tensors leave the resident set, but for the last two rows: the SDK's
//! own thresholds (`sdk/src/host_memory.rs`: kept for the next step under DDP, given
//! back where it shards).
//!
//! On CUDA (`--device cuda`, what `scripts/bench_gpu.sh` runs), the ranks share the
//! one visible GPU over Gloo and the memory is the CUDA caching allocator's: its peak
//! of allocated bytes less what was allocated before the model was made
//! (`torch.cuda.max_memory_allocated()` on PyTorch's side); the rows under the SDK's
//! thresholds are left out, and two rows are added: ZeRO-2 with `offload =
//! "optimizer"` and ZeRO-3 with `offload = "all"` (CPU offload: what they leave on
//! the GPU, and what the copies cost a step).
//!
//! ```text
//! scripts/bench.sh sharding [--python PYTHON] [--device cuda] [--ranks 2,4]   # prints a table
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
    // Every layer a unit of its own, unless TCHD_BENCH_UNITS=0 (one path no variable is
    // under: no unit claims any).
    let units = std::env::var("TCHD_BENCH_UNITS").map_or(true, |u| u != "0");
    let layers: Vec<_> = (0..LAYERS)
        .map(|i| {
            let path = &root / format!("l{i}");
            let unit = match units {
                true => path.clone(),
                false => &root / "none",
            };
            tch_distributed::fully_shard(nn::linear(&path, WIDTH, WIDTH, Default::default()), &unit)
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
    let peak_now = || match cuda {
        true => device_memory(device)[1],
        false => status_bytes("VmHWM:") as f64,
    };
    let peak = peak_now();
    // The model saved (`vs.save`, rank 0 writes) and loaded back (`vs.load`, every
    // rank), with what that adds to the peak.
    let dir = std::env::temp_dir().join(format!("tchd-bench-sharding-{}", ctx.world_size()));
    std::fs::create_dir_all(&dir)?;
    let mut vs = vs;
    vs.save(dir.join("model.safetensors"))?;
    let peak_with_save = peak_now();
    vs.load(dir.join("model.safetensors"))?;
    let peak_with_load = peak_now();
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
            "baseline": baseline, "peak": peak, "peak_with_save": peak_with_save,
            "peak_with_load": peak_with_load,
            "step_ms": step_ms, "units": units,
        }),
    )
}

/// What one configuration's run measured: the added peak (the largest over the
/// ranks, bytes), the same once the model was saved and once it was loaded back too
/// (NaN on PyTorch's side, which does neither), and the step time (the slowest rank,
/// ms).
struct Measured {
    added: f64,
    with_save: f64,
    with_load: f64,
    step: f64,
    rows: Vec<serde_json::Value>,
}

fn measure(cmd: Command, what: &str) -> anyhow::Result<Measured> {
    let rows = worker_rows(cmd, "SHARDING", what)?;
    let (added, step) = added_peak_and_step(&rows);
    let peak = |key: &str| {
        rows.iter()
            .map(|r| r[key].as_f64().unwrap_or(f64::NAN) - r["baseline"].as_f64().unwrap_or(0.0))
            .fold(f64::NAN, f64::max)
    };
    Ok(Measured {
        added,
        with_save: peak("peak_with_save"),
        with_load: peak("peak_with_load"),
        step,
        rows,
    })
}

/// One row of the table (each added peak in MB and as a share of `ddp`'s, the step in
/// ms), then each rank's measurements as `BENCH {json}` on stderr.
fn print_row(ranks: usize, side: &str, m: &Measured, ddp: f64) {
    let cell = |bytes: f64| match bytes.is_nan() {
        true => "| ".to_string(),
        false => format!("{:.0} | {:.2}", bytes / 1e6, bytes / ddp),
    };
    println!(
        "| {ranks} | {side} | {} | {} | {} | {:.1} |",
        cell(m.added),
        cell(m.with_save),
        cell(m.with_load),
        m.step
    );
    for row in &m.rows {
        eprintln!("BENCH {row}");
    }
}

/// One configuration of ours: ranks, ZeRO stage, every layer a unit, glibc's mmap
/// threshold fixed, the `offload` setting (only on CUDA: nothing to offload on the CPU).
struct Configuration {
    ranks: usize,
    zero: &'static str,
    units: bool,
    fixed: bool,
    offload: &'static str,
}

const fn ours(ranks: usize, zero: &'static str, units: bool, fixed: bool) -> Configuration {
    Configuration {
        ranks,
        zero,
        units,
        fixed,
        offload: "none",
    }
}

/// ZeRO stage `zero` on 2 ranks, every layer a unit, with `offload`.
const fn offloaded(zero: &'static str, offload: &'static str) -> Configuration {
    Configuration {
        offload,
        ..ours(2, zero, true, true)
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
    // `--ranks 2,4`: only those world sizes.
    let only: Option<Vec<usize>> = args
        .iter()
        .position(|a| a == "--ranks")
        .and_then(|i| args.get(i + 1))
        .map(|list| list.split(',').filter_map(|n| n.parse().ok()).collect());
    let exe = std::env::current_exe()?;
    let tchrun = exe.with_file_name("tchrun");
    // PyTorch's side: beside the sources, or where a GPU package put it.
    let script = std::env::var("TCHD_FSDP_BENCH")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/python/fsdp_bench.py").into());
    let script = script.as_str();
    println!("| ranks | side | added peak per rank (MB) | of DDP's | with a save (MB) | of DDP's | and a load (MB) | of DDP's | step (ms) |");
    println!("|---|---|---|---|---|---|---|---|---|");
    // The last rows: no MALLOC_MMAP_THRESHOLD_, so the SDK's own thresholds
    // (host_memory.rs): a step's memory kept for the next under DDP, given back where
    // it shards.
    let configurations = [
        ours(2, "0", true, true),
        ours(2, "1", true, true),
        ours(2, "2", true, true),
        ours(2, "2", false, true),
        ours(2, "3", true, true),
        ours(2, "3", false, true),
        offloaded("2", "optimizer"),
        offloaded("3", "all"),
        ours(4, "0", true, true),
        ours(4, "2", false, true),
        ours(4, "3", true, true),
        ours(8, "0", true, true),
        ours(8, "3", true, true),
        ours(2, "0", true, false),
        ours(2, "3", true, false),
    ];
    let configurations: Vec<&Configuration> = configurations
        .iter()
        .filter(|c| only.as_ref().is_none_or(|o| o.contains(&c.ranks)))
        .collect();
    let mut ddp = 0.0;
    for (i, c) in configurations.iter().enumerate() {
        // glibc's settings do not move CUDA memory; the CPU has nothing to offload.
        if (cuda && !c.fixed) || (!cuda && c.offload != "none") {
            continue;
        }
        let ranks = c.ranks;
        {
            let mut cmd = Command::new(&tchrun);
            cmd.args(["--nproc-per-node", &ranks.to_string()])
                .arg(&exe)
                .arg("--worker")
                .env("TCH_DISTRIBUTED_ZERO", c.zero)
                .env("TCH_DISTRIBUTED_OFFLOAD", c.offload)
                .env("TCHD_BENCH_UNITS", if c.units { "1" } else { "0" })
                .env("TCHD_BENCH_DEVICE", if cuda { "cuda" } else { "cpu" });
            if cuda {
                // The ranks share one GPU: NCCL needs a GPU a rank.
                cmd.env("TCH_DISTRIBUTED_BACKEND", "gloo");
            } else {
                cmd.env("CUDA_VISIBLE_DEVICES", "");
            }
            if c.fixed {
                cmd.env("MALLOC_MMAP_THRESHOLD_", "65536");
            }
            let what = format!("{ranks} ranks, zero {}, units {}", c.zero, c.units);
            let measured = measure(cmd, &what)?;
            if c.zero == "0" {
                ddp = measured.added;
            }
            let mut side = match c.zero {
                "0" => "DDP".to_string(),
                zero => format!("ZeRO-{zero}"),
            };
            if matches!(c.zero, "2" | "3") {
                side += if c.units {
                    ", every layer a unit"
                } else {
                    ", no units"
                };
            }
            if c.offload != "none" {
                side += &format!(", offload = {}", c.offload);
            }
            if !c.fixed {
                side += " (the SDK's thresholds)";
            }
            print_row(ranks, &side, &measured, ddp);
        }
        // PyTorch's rows after ours of the same world size (2 and 4 ranks).
        let last_of_world = configurations
            .get(i + 1)
            .is_none_or(|next| next.ranks != ranks || !next.fixed);
        let Some(python) = python
            .as_ref()
            .filter(|_| c.fixed && last_of_world && ranks <= 4)
        else {
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
            let measured = match measured {
                Err(e) if cuda => {
                    let why = e.to_string().lines().last().unwrap_or_default().to_string();
                    println!("| {ranks} | PyTorch {mode} | failed: {why} | | | | | | |");
                    continue;
                }
                measured => measured?,
            };
            if mode == "ddp" {
                ddp = measured.added;
            }
            let side = if mode == "ddp" {
                "PyTorch DDP"
            } else {
                "PyTorch FSDP2, every layer a unit"
            };
            print_row(ranks, side, &measured, ddp);
        }
    }
    Ok(())
}
