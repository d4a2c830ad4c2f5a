//! The other launchers' and libraries' variables that the SDK reads (the protocol of
//! torchrun, c10d, Gloo, NCCL and CUDA, not settings of ours: those are
//! [`crate::settings`]): torchrun's, SLURM's and MPI's rank variables (through
//! [`var`], for [`LaunchEnv`](crate::LaunchEnv)) and the few others below. Each is read
//! here only. Nothing here depends on the rest of the SDK.

use std::path::PathBuf;

/// `TORCHELASTIC_ERROR_FILE`: torchrun's (and tchrun's) variable naming where a failing
/// worker writes its error as JSON.
pub(crate) const ERROR_FILE_ENV: &str = "TORCHELASTIC_ERROR_FILE";

/// The variable `name`, as set.
pub(crate) fn var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// The variable `name`, when set and not empty.
fn set(name: &str) -> Option<String> {
    var(name).filter(|v| !v.is_empty())
}

/// `TORCHELASTIC_ERROR_FILE`: where a failing rank writes its error (torchrun's and
/// tchrun's root cause).
pub(crate) fn error_file() -> Option<PathBuf> {
    std::env::var_os(ERROR_FILE_ENV)
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
}

/// `TORCH_SHOW_CPP_STACKTRACES=1`: libtorch's own text and C++ frames are shown.
pub(crate) fn show_cpp_stacktraces() -> bool {
    set("TORCH_SHOW_CPP_STACKTRACES").is_some_and(|v| v == "1")
}

/// `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`, `MALLOC_TOP_PAD_`, or a
/// `glibc.malloc` key in `GLIBC_TUNABLES`: whether the user tuned glibc's allocator.
pub(crate) fn malloc_tuned() -> bool {
    [
        "MALLOC_MMAP_THRESHOLD_",
        "MALLOC_TRIM_THRESHOLD_",
        "MALLOC_TOP_PAD_",
    ]
    .iter()
    .any(|name| set(name).is_some())
        || set("GLIBC_TUNABLES").is_some_and(|t| t.contains("glibc.malloc."))
}

/// `CUDA_VISIBLE_DEVICES`, as set.
pub(crate) fn cuda_visible_devices() -> Option<String> {
    var("CUDA_VISIBLE_DEVICES")
}

/// `GLOO_SOCKET_IFNAME`: the interfaces Gloo binds.
pub(crate) fn gloo_socket_ifname() -> Option<String> {
    set("GLOO_SOCKET_IFNAME")
}

/// Sets `NCCL_SOCKET_IFNAME` to `interface` (the route to the master) unless the
/// user set it. NCCL reads it from the environment only, when its bootstrap
/// starts; this is the one variable the SDK sets in its own process.
pub(crate) fn default_nccl_socket_ifname(interface: &str) {
    if std::env::var_os("NCCL_SOCKET_IFNAME").is_none() {
        std::env::set_var("NCCL_SOCKET_IFNAME", interface);
    }
}

/// Whether `tchrun` started this rank (it sets `TCHRUN=1`).
pub(crate) fn under_tchrun() -> bool {
    std::env::var_os("TCHRUN").is_some()
}

/// `TCHRUN_STDERR_TERMINAL`: set to `1` by tchrun (and a program that starts its own
/// ranks) for its ranks when its own standard error is a terminal. A rank's standard
/// error is then a pipe that the launcher copies to that terminal, and rank 0 draws its
/// progress bar there all the same.
pub(crate) const STDERR_TERMINAL_ENV: &str = "TCHRUN_STDERR_TERMINAL";

/// Whether this rank's standard error reaches a terminal through its launcher
/// ([`STDERR_TERMINAL_ENV`]).
pub(crate) fn stderr_reaches_terminal() -> bool {
    set(STDERR_TERMINAL_ENV).is_some_and(|v| v == "1")
}

/// Whether `OMP_NUM_THREADS` is set.
pub(crate) fn omp_num_threads_set() -> bool {
    std::env::var_os("OMP_NUM_THREADS").is_some()
}

/// The variables whose names start with one of `prefixes` or are one of `names`, sorted
/// by name: what `tchrun env` shows.
pub(crate) fn report_vars(prefixes: &[&str], names: &[&str]) -> Vec<(String, String)> {
    let mut vars: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.to_string_lossy().into_owned())))
        .filter(|(k, _)| names.contains(&k.as_str()) || prefixes.iter().any(|p| k.starts_with(p)))
        .collect();
    vars.sort();
    vars
}
