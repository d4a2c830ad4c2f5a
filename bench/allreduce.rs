//! Raw all-reduce sweep, Rust side: `ProcessGroup::all_reduce` (sum, float32) from 1 KiB
//! to 64 MiB in ×4 steps. `bench/python/allreduce_bench.py` is the same sweep over
//! `torch.distributed.all_reduce`; `scripts/bench.sh` runs both and compares them.
//!
//! ```text
//! tchrun --nproc-per-node 2 target/release/allreduce
//! ```
//!
//! For each size: `--warmup` all-reduces, a barrier, then `iterations(bytes)`
//! all-reduces back to back, each timed on every rank; the time of one all-reduce is
//! the slowest rank's median, which bursts of other load on a shared machine disturb
//! least (with the CPU time per all-reduce, the ranks' mean, all threads).
//! Rank 0 prints one `BENCH {json}` line per size with algbw
//! (bytes / time) and busbw (algbw × 2(n − 1)/n, as nccl-tests).

use std::time::Instant;

use anyhow::Result;
use clap::Parser;
use tch::{Kind, Tensor};
use tch_distributed::ReduceOp;

#[derive(Parser)]
#[command(about = "All-reduce bandwidth sweep (Rust side; see bench/python/allreduce_bench.py)")]
struct Args {
    /// Smallest message in bytes.
    #[arg(long, default_value_t = 1 << 10)]
    min_bytes: usize,
    /// Largest message in bytes.
    #[arg(long, default_value_t = 64 << 20)]
    max_bytes: usize,
    /// Untimed all-reduces per size.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Bytes all-reduced per size and rank, in all (sets the repetitions; at least 10,
    /// at most 2,000).
    #[arg(long, default_value_t = 512 << 20)]
    volume: usize,
}

/// Repetitions for a size: `volume / bytes`, clamped to 10..=2000 (the Python side uses
/// the same rule).
fn iterations(bytes: usize, volume: usize) -> usize {
    (volume / bytes).clamp(10, 2000)
}

/// User and system CPU seconds of this process so far (all its threads).
fn cpu_seconds() -> f64 {
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    secs(u.ru_utime) + secs(u.ru_stime)
}

fn main() -> Result<()> {
    let args = Args::parse();
    tch::set_num_threads(1);
    let ctx = tch_distributed::init()?;
    let group = ctx.process_group();
    let world = ctx.world_size();
    let mut bytes = args.min_bytes;
    while bytes <= args.max_bytes {
        let mut t = Tensor::zeros([(bytes / 4) as i64], (Kind::Float, ctx.device()));
        for _ in 0..args.warmup {
            group.all_reduce(&mut t, ReduceOp::Sum)?;
        }
        let n = iterations(bytes, args.volume);
        group.barrier()?;
        let mut times = Vec::with_capacity(n);
        let cpu_start = cpu_seconds();
        for _ in 0..n {
            let start = Instant::now();
            group.all_reduce(&mut t, ReduceOp::Sum)?;
            times.push(start.elapsed().as_secs_f64());
        }
        let cpu = (cpu_seconds() - cpu_start) / n as f64;
        times.sort_by(f64::total_cmp);
        let mine = Tensor::from_slice(&[times[n / 2], cpu]);
        let every = group.all_gather(&mine)?;
        let secs = every
            .iter()
            .map(|t| t.double_value(&[0]))
            .fold(0.0, f64::max);
        let cpu = every.iter().map(|t| t.double_value(&[1])).sum::<f64>() / world as f64;
        if ctx.is_main_process() {
            let algbw = bytes as f64 / secs;
            let report = serde_json::json!({
                "side": "rust",
                "world": world,
                "bytes": bytes,
                "iterations": n,
                "seconds": secs,
                "cpu_seconds": cpu,
                "algbw": algbw,
                "busbw": algbw * 2.0 * (world as f64 - 1.0) / world as f64,
            });
            println!("BENCH {report}");
        }
        bytes *= 4;
    }
    Ok(())
}
