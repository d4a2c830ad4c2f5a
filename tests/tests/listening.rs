//! Where a job listens: a job on one host opens nothing that another machine can
//! reach. Its rendezvous store (hosted by the launcher, or by rank 0 without one) and
//! its Gloo pairs listen on loopback only, read from the kernel's socket tables
//! (`/proc/PID/net/tcp` and `tcp6`) while the job trains.

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use tch_distributed_tests::{
    listening_addresses, process_tree, run_tchrun, run_with, scratch_dir, wait_until, Run,
};

const STALL: &str = env!("CARGO_BIN_EXE_stall_worker");
const TIMEOUT: Duration = Duration::from_secs(90);

/// Once both ranks of the job under `launcher` have trained 5 steps (their process
/// group and its Gloo pairs are up), what its processes listen on; then stops it.
fn listening_while_training(launcher: u32, dir: &std::path::Path) -> (Vec<SocketAddr>, usize) {
    wait_until(
        "both ranks trained 5 steps",
        Duration::from_secs(60),
        || dir.join("pid0").exists() && dir.join("pid1").exists(),
    );
    let tree = process_tree(launcher);
    let found = listening_addresses(&tree);
    unsafe { libc::kill(launcher as i32, libc::SIGTERM) };
    (found, tree.len())
}

fn assert_loopback_only(run: &Run, found: &[SocketAddr], processes: usize) {
    assert_eq!(processes, 3, "the launcher and 2 ranks: {run:?}");
    // The store and at least one Gloo pair listen.
    assert!(found.len() >= 2, "too few listening sockets: {found:?}");
    let exposed: Vec<_> = found.iter().filter(|a| !a.ip().is_loopback()).collect();
    assert!(
        exposed.is_empty(),
        "listening beyond loopback: {exposed:?} (all: {found:?})"
    );
}

#[test]
fn a_job_on_one_host_listens_on_loopback_only_under_tchrun() {
    let dir = scratch_dir("listen-tchrun");
    let d = dir.to_str().unwrap().to_string();
    let mut seen = None;
    let run = run_tchrun(
        &dir,
        &["--nproc-per-node", "2", STALL, &d],
        TIMEOUT,
        |pid, _| seen = Some(listening_while_training(pid, &dir)),
    );
    let (found, processes) = seen.unwrap();
    assert_loopback_only(&run, &found, processes);
}

#[test]
fn a_self_launched_job_listens_on_loopback_only() {
    let dir = scratch_dir("listen-self");
    let mut cmd = Command::new(STALL);
    cmd.arg(dir.to_str().unwrap())
        .env("TCH_DISTRIBUTED_NPROC", "2");
    let mut seen = None;
    let run = run_with(cmd, &dir, TIMEOUT, |pid, _| {
        seen = Some(listening_while_training(pid, &dir))
    });
    let (found, processes) = seen.unwrap();
    assert_loopback_only(&run, &found, processes);
}
