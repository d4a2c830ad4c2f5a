//! `tchrun env`: what to paste into a bug report, as `accelerate env` and
//! `python -m torch.utils.collect_env` give it: the versions of the SDK, tch, libtorch,
//! CUDA and NCCL, the backends compiled in, the GPUs, the launch and SDK variables that
//! are set, and the OS and Rust versions.

use std::fmt::Write as _;

use crate::compat::{LIBTORCH_VERSION, TCH_VERSION};
use crate::error::{Error, Result};
use crate::ffi;

/// The variables shown: the SDK's settings and those of the launchers and libraries it
/// works with, by prefix or whole name.
const PREFIXES: [&str; 7] = [
    "TCH_DISTRIBUTED_",
    "TORCHELASTIC_",
    "TORCH_",
    "NCCL_",
    "GLOO_",
    "CUDA_",
    "SLURM_",
];
const NAMES: [&str; 14] = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TCHRUN",
    "OMP_NUM_THREADS",
    "MALLOC_MMAP_THRESHOLD_",
    "LIBTORCH",
    "LIBTORCH_USE_PYTORCH",
    "LD_LIBRARY_PATH",
    "OMPI_COMM_WORLD_RANK",
];

/// The report, as lines of `name: value`: this build, what libtorch finds on this
/// machine, and the variables that are set (secrets, such as the job token, shown as
/// `(set)`).
///
/// # Errors
/// [`Error::Torch`] when libtorch cannot be asked (its CUDA library fails to load).
pub fn env_report() -> Result<String> {
    let mut out = String::new();
    let mut line = |name: &str, value: &str| {
        let _ = writeln!(out, "{:<20}{value}", format!("{name}:"));
    };
    line("tch-distributed", env!("CARGO_PKG_VERSION"));
    line("tch", TCH_VERSION);
    line("libtorch", LIBTORCH_VERSION);
    line(
        "libtorch loaded",
        &loaded_libtorch().unwrap_or_else(|| "(not found in /proc/self/maps)".into()),
    );
    line(
        "backends",
        if crate::compat::nccl_available() {
            "gloo, nccl"
        } else {
            "gloo (nccl not compiled in: no CUDA headers at build time)"
        },
    );
    let runtime = runtime_report()?;
    let mut gpus = 0;
    for (key, value) in &runtime {
        match key.as_str() {
            "cuda runtime" | "cudnn" => line(key, &version_number(key, value)),
            gpu if gpu.starts_with("gpu ") => {
                gpus += 1;
                line(gpu, &gpu_line(value));
            }
            _ => line(key, value),
        }
    }
    if gpus == 0 {
        line("gpus", "none");
    }
    line("os", &os());
    line("rust", env!("TDC_RUSTC_VERSION"));
    line(
        "cpus",
        &std::thread::available_parallelism().map_or("?".into(), |n| n.to_string()),
    );
    let vars = crate::protocol::report_vars(&PREFIXES, &NAMES);
    out.push_str("\nvariables set:\n");
    if vars.is_empty() {
        out.push_str("  (none)\n");
    }
    for (name, value) in vars {
        let _ = writeln!(out, "  {name}={}", shown(&name, &value));
    }
    Ok(out)
}

/// libtorch's `key\tvalue` lines (`tdc_runtime_report`).
fn runtime_report() -> Result<Vec<(String, String)>> {
    let text = ffi::runtime_report().map_err(Error::Torch)?;
    Ok(String::from_utf8_lossy(text.as_bytes())
        .lines()
        .filter_map(|l| l.split_once('\t'))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect())
}

/// CUDA's `13000` as `13.0`; cuDNN's `91000` as `9.10.0` (its scheme since 9.0).
fn version_number(key: &str, value: &str) -> String {
    let Ok(n) = value.parse::<u64>() else {
        return value.to_string();
    };
    match key {
        "cuda runtime" => format!("{}.{}", n / 1000, n % 1000 / 10),
        _ => format!("{}.{}.{}", n / 10000, n % 10000 / 100, n % 100),
    }
}

/// `NAME, compute capability 9.0, BYTES bytes` with the bytes in GiB.
fn gpu_line(value: &str) -> String {
    let Some((head, bytes)) = value.rsplit_once(", ") else {
        return value.to_string();
    };
    match bytes
        .strip_suffix(" bytes")
        .and_then(|b| b.parse::<u64>().ok())
    {
        Some(b) => format!("{head}, {:.1} GiB", b as f64 / (1u64 << 30) as f64),
        None => value.to_string(),
    }
}

/// The path of the `libtorch_cpu.so` this process mapped: the libtorch it really runs
/// against, whatever the build saw.
fn loaded_libtorch() -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|path| path.ends_with("/libtorch_cpu.so"))
        .map(str::to_string)
}

/// The kernel (`uname`) and, when there, the distribution's name.
fn os() -> String {
    let kernel = match ffi::os::uname() {
        Some((sysname, release, machine)) => format!("{sysname} {release} {machine}"),
        None => std::env::consts::OS.to_string(),
    };
    let distribution = std::fs::read_to_string("/etc/os-release")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("PRETTY_NAME="))
                .map(|v| v.trim_matches('"').to_string())
        });
    match distribution {
        Some(d) => format!("{kernel} ({d})"),
        None => kernel,
    }
}

/// A value as shown: secrets (the job token, anything named like a key or password)
/// only as `(set)`.
fn shown<'a>(name: &str, value: &'a str) -> &'a str {
    let secret = ["TOKEN", "SECRET", "PASSWORD", "KEY"]
        .iter()
        .any(|s| name.contains(s));
    if secret {
        "(set)"
    } else {
        value
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_read_as_their_projects_write_them() {
        assert_eq!(version_number("cuda runtime", "13000"), "13.0");
        assert_eq!(version_number("cuda runtime", "12080"), "12.8");
        assert_eq!(version_number("cudnn", "91000"), "9.10.0");
        assert_eq!(
            gpu_line("NVIDIA H100 80GB HBM3, compute capability 9.0, 85045346304 bytes"),
            "NVIDIA H100 80GB HBM3, compute capability 9.0, 79.2 GiB"
        );
    }

    #[test]
    fn the_report_names_this_build_and_hides_secrets() {
        std::env::set_var("TCH_DISTRIBUTED_JOB_TOKEN", "very-secret");
        let report = env_report().unwrap();
        std::env::remove_var("TCH_DISTRIBUTED_JOB_TOKEN");
        assert!(
            report.contains(&format!("libtorch:           {LIBTORCH_VERSION}\n")),
            "{report}"
        );
        assert!(report.contains("cuda available:"), "{report}");
        assert!(
            report.contains("TCH_DISTRIBUTED_JOB_TOKEN=(set)"),
            "{report}"
        );
        assert!(!report.contains("very-secret"), "{report}");
        assert!(report.contains("/libtorch_cpu.so\n"), "{report}");
    }
}
