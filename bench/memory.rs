//! What the benches that measure memory (`ddp`, `zero`, `sharding`, `activation`)
//! share: a rank's resident memory from `/proc/self/status`, the CUDA caching
//! allocator's statistics (through `csrc/cuda_memory.cpp`), the timing of the steps,
//! and the JSON row that each rank of a run writes to stderr and the launcher reads.
#![allow(dead_code)] // each bench uses some of it

use std::process::Command;

use tch::Device;

/// A line of `/proc/self/status`, in bytes: `VmHWM` (the peak resident memory) or
/// `VmRSS` (the resident memory now); 0 where the line is missing.
pub fn status_bytes(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

/// Runs `cmd` (a launcher and its ranks, one intra-op thread each) and returns the rows
/// that the ranks wrote to stderr as `PREFIX {json}`, one per rank.
///
/// Errors when the run fails (with its stderr, under `what`) or a row is not JSON.
pub fn worker_rows(
    mut cmd: Command,
    prefix: &str,
    what: &str,
) -> anyhow::Result<Vec<serde_json::Value>> {
    let out = cmd.env("OMP_NUM_THREADS", "1").output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    anyhow::ensure!(out.status.success(), "{what}:\n{stderr}");
    let prefix = format!("{prefix} ");
    Ok(stderr
        .lines()
        .filter_map(|l| l.strip_prefix(prefix.as_str()))
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?)
}

/// Of the ranks' rows of one run (`baseline`, `peak` in bytes, `step_ms`): the peak
/// memory added (the largest over the ranks, bytes) and the step time (the slowest
/// rank, ms).
pub fn added_peak_and_step(rows: &[serde_json::Value]) -> (f64, f64) {
    let added = rows
        .iter()
        .map(|r| r["peak"].as_f64().unwrap_or(0.0) - r["baseline"].as_f64().unwrap_or(0.0))
        .fold(0.0, f64::max);
    let step = rows
        .iter()
        .filter_map(|r| r["step_ms"].as_f64())
        .fold(0.0, f64::max);
    (added, step)
}

/// Writes the row `PREFIX {row}` to stderr, the line [`worker_rows`] reads back: every
/// rank's (`println!` prints on rank 0 only).
pub fn write_row(prefix: &str, row: serde_json::Value) -> anyhow::Result<()> {
    let line = format!("{prefix} {row}\n");
    std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes())?;
    Ok(())
}

/// Calls `step` once (the warm-up), waits at a barrier of `ctx`'s ranks, then returns
/// the mean time of `steps` more calls, in milliseconds (`step` ends with what makes
/// its work complete, a CUDA synchronize on a GPU).
pub fn mean_step_ms(
    ctx: &tch_distributed::Context,
    steps: u32,
    mut step: impl FnMut(),
) -> anyhow::Result<f64> {
    step();
    ctx.barrier()?;
    let start = std::time::Instant::now();
    for _ in 0..steps {
        step();
    }
    Ok(start.elapsed().as_secs_f64() / steps as f64 * 1e3)
}

extern "C" {
    // csrc/cuda_memory.cpp
    fn tdcb_device_memory(device: libc::c_int, out: *mut i64) -> libc::c_int;
    fn tdcb_device_memory_reset(device: libc::c_int) -> libc::c_int;
}

/// The CUDA caching allocator's bytes of `device`: allocated now, allocated peak,
/// reserved now, reserved peak; NaN on the CPU or when libtorch cannot say.
pub fn device_memory(device: Device) -> [f64; 4] {
    let mut out = [0i64; 4];
    match device {
        Device::Cuda(i)
            if unsafe { tdcb_device_memory(i as libc::c_int, out.as_mut_ptr()) } == 0 =>
        {
            out.map(|b| b as f64)
        }
        _ => [f64::NAN; 4],
    }
}

/// Frees the CUDA caching allocator's cached blocks and restarts its peaks, as
/// `torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()`.
pub fn reset_device_memory(device: Device) {
    if let Device::Cuda(i) = device {
        if unsafe { tdcb_device_memory_reset(i as libc::c_int) } != 0 {
            eprintln!("warning: could not reset the CUDA allocator's statistics");
        }
    }
}

/// Loads libtorch's CUDA support before libtorch first asks about CUDA. The benches
/// link libtorch_cuda.so already (the SDK's NCCL backend lives there); should a build
/// leave it out (`--as-needed`), this keeps CUDA visible. Found as the binary's own
/// libraries are: LD_LIBRARY_PATH, then the RUNPATH. Does nothing (no CUDA) with a
/// CPU-only libtorch.
pub fn load_libtorch_cuda() {
    unsafe {
        libc::dlopen(
            c"libtorch_cuda.so".as_ptr(),
            libc::RTLD_NOW | libc::RTLD_GLOBAL,
        );
    }
}
