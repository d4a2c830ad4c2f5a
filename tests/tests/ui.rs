//! Compile tests of `#[distributed]` (trybuild): every option and every rewritten
//! pattern compiles and runs as one process (`ui/pass`), and every diagnostic reads as
//! recorded (`ui/fail/*.rs` with its `.stderr`). `TRYBUILD=overwrite` re-records them.

use std::io::Write;
use std::time::Duration;

/// How long trybuild may take: it runs cargo with no timeout of its own, and a cold
/// build of the cases on this 2-core machine takes a few minutes.
const DEADLINE: Duration = Duration::from_secs(30 * 60);

/// Starts a thread that, past `DEADLINE`, kills every process this test started
/// (cargo, rustc, the pass cases: the whole tree below this process), says why on
/// stderr and exits the test executable with 101, a failure.
fn watchdog() {
    std::thread::spawn(|| {
        std::thread::sleep(DEADLINE);
        // Parents first; again until none is left (a child started after a snapshot).
        let mut killed = std::collections::HashSet::new();
        for _ in 0..20 {
            let mut tree = tch_distributed_tests::children(std::process::id());
            if tree.is_empty() {
                break;
            }
            let mut i = 0;
            while i < tree.len() {
                let below = tch_distributed_tests::children(tree[i]);
                tree.extend(below);
                i += 1;
            }
            for &pid in &tree {
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
            killed.extend(tree);
            std::thread::sleep(Duration::from_millis(100));
        }
        let note = format!(
            "ui: trybuild did not finish within {DEADLINE:?}; killed the {} processes it \
             had started (cargo, rustc, the cases) and failed the test\n",
            killed.len()
        );
        let _ = std::io::stderr().write_all(note.as_bytes());
        std::process::exit(101);
    });
}

#[test]
fn ui() {
    watchdog();
    // The pass cases run, and trybuild builds them outside this crate, without its
    // rpath: they find libtorch through the loader's path.
    let lib = env!("TCHD_LIBTORCH_LIB");
    let path = match std::env::var("LD_LIBRARY_PATH") {
        Ok(old) if !old.is_empty() => format!("{lib}:{old}"),
        _ => lib.to_string(),
    };
    std::env::set_var("LD_LIBRARY_PATH", path);
    // One process, no launcher: the cases must not join a job of the test runner's.
    for var in [
        "RANK",
        "WORLD_SIZE",
        "TCH_DISTRIBUTED_NPROC",
        "SLURM_PROCID",
    ] {
        std::env::remove_var(var);
    }
    // On the CPU wherever the suite runs (as `tch_distributed_tests::pin_device` does for
    // the processes the other tests start): on a GPU machine the SDK's default would be
    // NCCL on the GPU.
    if !tch_distributed_tests::cuda_requested() {
        std::env::set_var("CUDA_VISIBLE_DEVICES", "");
    }
    // trybuild's project does not inherit the workspace's `[profile.dev]`: without
    // this its build of libtorch's bindings carries full debug info (gigabytes).
    std::env::set_var("CARGO_PROFILE_DEV_DEBUG", "false");
    let t = trybuild::TestCases::new();
    t.pass("ui/pass/*.rs");
    t.compile_fail("ui/fail/*.rs");
}
