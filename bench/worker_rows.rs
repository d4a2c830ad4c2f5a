//! What the memory benches (`zero`, `sharding`) share: reading a rank's memory from
//! `/proc/self/status`, and collecting the JSON row that each rank of a run writes to
//! stderr.

use std::process::Command;

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
