//! Launching and failing: torchrun agrees with tchrun, a single process needs no
//! launcher, a taken port and a killed rank fail fast with a clear message.

use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tch::Tensor;
use tch_distributed_tests::{run_tchrun, run_with, scratch_dir, torchrun, wait_for_text};

const WORKER: &str = env!("CARGO_BIN_EXE_ddp_worker");
const COLLECTIVES: &str = env!("CARGO_BIN_EXE_collectives");
const TIMEOUT: Duration = Duration::from_secs(90);

fn read_params(path: &Path) -> Vec<(String, Tensor)> {
    let mut named =
        Tensor::read_safetensors(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

#[test]
fn torchrun_no_python_trains_and_agrees_with_tchrun() {
    let Some(torchrun) = torchrun() else {
        // Only a LIBTORCH install (no project venv) lacks torchrun.
        assert!(
            std::env::var_os("LIBTORCH").is_some(),
            "the project's .venv has no torchrun"
        );
        eprintln!("skipped: no .venv/bin/torchrun with LIBTORCH set");
        return;
    };
    let ours = scratch_dir("tchrun");
    run_tchrun(
        &ours,
        &[
            "--nproc-per-node",
            "2",
            WORKER,
            "train",
            "--out",
            ours.to_str().unwrap(),
        ],
        TIMEOUT,
        |_, _| {},
    )
    .assert_success();
    let theirs = scratch_dir("torchrun");
    let mut cmd = Command::new(torchrun);
    cmd.args([
        "--standalone",
        "--nproc-per-node",
        "2",
        "--no-python",
        WORKER,
        "train",
        "--out",
        theirs.to_str().unwrap(),
    ]);
    let run = run_with(cmd, &theirs, TIMEOUT, |_, _| {});
    run.assert_success();
    assert_eq!(
        run.stdout.matches("ok identical after 20 steps").count(),
        2,
        "{}",
        run.stdout
    );
    for rank in 0..2 {
        let a = read_params(&ours.join(format!("rank{rank}.safetensors")));
        let b = read_params(&theirs.join(format!("rank{rank}.safetensors")));
        assert_eq!(a.len(), b.len());
        for ((na, ta), (nb, tb)) in a.iter().zip(&b) {
            assert_eq!(na, nb);
            assert!(ta.equal(tb), "{na} differs between tchrun and torchrun");
        }
    }
}

#[test]
fn single_process_without_launcher_equals_plain_tch() {
    let dir = scratch_dir("single");
    let mut cmd = Command::new(WORKER);
    cmd.arg("single");
    for var in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ] {
        cmd.env_remove(var);
    }
    let run = run_with(cmd, &dir, TIMEOUT, |_, _| {});
    run.assert_success();
    assert!(
        run.stdout.contains("ok single process equals plain tch"),
        "{}",
        run.stdout
    );
}

#[test]
fn port_in_use_is_a_clear_error_within_seconds() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let dir = scratch_dir("port");
    let run = run_tchrun(
        &dir,
        &["--nproc-per-node", "2", "--master-port", &port, COLLECTIVES],
        TIMEOUT,
        |_, _| {},
    );
    assert!(!run.status.success(), "{}", run.stdout);
    assert!(
        run.elapsed < Duration::from_secs(15),
        "took {:?}",
        run.elapsed
    );
    assert!(
        run.stderr
            .contains(&format!("port {port} on 127.0.0.1 is already in use")),
        "stderr:\n{}",
        run.stderr
    );
    assert!(
        run.stderr.contains("rank 0"),
        "tchrun names the failing rank:\n{}",
        run.stderr
    );
}

#[test]
fn rank_killed_mid_training_stops_the_job_within_10_seconds() {
    let dir = scratch_dir("sigkill");
    let args = [
        "--nproc-per-node",
        "2",
        WORKER,
        "train",
        "--steps",
        "1000000",
        "--sleep-ms",
        "5",
    ];
    let run = run_tchrun(&dir, &args, TIMEOUT, |_, dir| {
        let out = wait_for_text(&dir.join("run.stdout"), "pid 1 ", Duration::from_secs(30));
        let pid: i32 = out
            .lines()
            .find_map(|l| l.strip_prefix("pid 1 "))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        // Let training get going, then kill rank 1.
        std::thread::sleep(Duration::from_millis(500));
        unsafe { libc::kill(pid, libc::SIGKILL) };
    });
    assert_eq!(run.status.code(), Some(1), "stderr:\n{}", run.stderr);
    assert!(
        run.elapsed < Duration::from_secs(12),
        "took {:?}",
        run.elapsed
    );
    assert!(
        run.stderr.contains("rank 1 (local rank 1, pid"),
        "{}",
        run.stderr
    );
    assert!(run.stderr.contains("SIGKILL"), "{}", run.stderr);
}
