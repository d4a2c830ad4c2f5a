//! MPI launchers: `mpirun -np N PROGRAM` starts the ranks itself with its own
//! variables and no `RANK`; the ranks form one job from them. With stand-ins for Open
//! MPI's and MPICH's variables (two processes on this host, as `mpirun` sets them), and
//! with a real `mpirun` (Debian's `openmpi-bin`, which `.ci/run` installs): without one
//! on `PATH` that test is recorded as skipped, and fails under `CI=true`.

use std::process::Command;
use std::time::Duration;

use tch_distributed_tests::{
    free_port, output_within, run_with, scratch_dir, skip, without_launcher, Run, Scratch,
};

const DISTRIBUTED_PROGRAM: &str = env!("CARGO_BIN_EXE_distributed_program");

#[path = "support/distributed_program_reference.rs"]
mod distributed_program_reference;
const TIMEOUT: Duration = Duration::from_secs(90);

/// Both ranks trained one model, the one-process closed form's
/// (`distributed_program_reference`), and rank 0's banner names the job.
fn assert_one_job(run: &Run, dir: &std::path::Path, rendezvous: &str) {
    run.assert_success();
    assert!(
        run.stdout.contains(&format!(
            "world size 2, local world size 2, devices cpu, rendezvous {rendezvous}"
        )),
        "{}",
        run.stdout
    );
    assert_eq!(
        run.stdout.matches("tch-distributed: backend").count(),
        1,
        "{}",
        run.stdout
    );
    let params: Vec<String> = (0..2)
        .map(|r| std::fs::read_to_string(dir.join(format!("params{r}.txt"))).unwrap())
        .collect();
    assert_eq!(params[0], params[1], "one model trained by both ranks");
    distributed_program_reference::assert_model_equals_reference(dir, 2);
}

/// Starts `distributed_program` twice, rank `$r` of 2, with `vars` (a shell line of
/// assignments in which `$r` is the rank).
fn two_ranks_with(name: &str, vars: &str) -> (Run, Scratch) {
    let dir = scratch_dir(name);
    let d = dir.to_str().unwrap();
    let script = format!(
        "for r in 0 1; do {vars} {DISTRIBUTED_PROGRAM} {d} 30 & pids=\"$pids $!\"; done; \
         for p in $pids; do wait $p || exit 1; done"
    );
    let mut cmd = Command::new("bash");
    cmd.args(["-c", &script]);
    without_launcher(&mut cmd);
    (run_with(cmd, &dir, TIMEOUT, |_, _| {}), dir)
}

#[test]
fn open_mpi_variables_form_the_job() {
    let port = free_port();
    let (run, dir) = two_ranks_with(
        "ompi",
        &format!(
            "OMPI_COMM_WORLD_RANK=$r OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_LOCAL_RANK=$r \
             OMPI_COMM_WORLD_LOCAL_SIZE=2 MASTER_PORT={port}"
        ),
    );
    // One host and no MASTER_ADDR: rank 0's store is on loopback.
    assert_one_job(&run, &dir, &format!("127.0.0.1:{port}"));
}

#[test]
fn mpich_and_intel_mpi_variables_form_the_job() {
    let port = free_port();
    let (run, dir) = two_ranks_with(
        "mpich",
        &format!(
            "PMI_RANK=$r PMI_SIZE=2 MPI_LOCALRANKID=$r MPI_LOCALNRANKS=2 \
             MASTER_ADDR=localhost MASTER_PORT={port}"
        ),
    );
    assert_one_job(&run, &dir, &format!("localhost:{port}"));
}

/// `mpirun --version`'s first line, when an `mpirun` is on `PATH`.
fn mpirun_version() -> Option<String> {
    let on_path =
        std::env::split_paths(&std::env::var_os("PATH")?).any(|dir| dir.join("mpirun").is_file());
    if !on_path {
        return None;
    }
    let out = output_within(
        Command::new("mpirun").arg("--version"),
        b"",
        Duration::from_secs(60),
    );
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    Some(
        text.lines()
            .find(|l| !l.trim().is_empty())?
            .trim()
            .to_string(),
    )
}

#[test]
fn a_real_mpirun_starts_the_job() {
    let Some(version) = mpirun_version() else {
        skip("no mpirun on PATH (install Debian's openmpi-bin, or MPICH, to run it)");
        return;
    };
    let dir = scratch_dir("mpirun");
    let mut cmd = Command::new("mpirun");
    if version.contains("Open MPI") {
        // Root (containers, CI) needs Open MPI's consent; 2 ranks may exceed the cores.
        cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .arg("--oversubscribe");
    }
    // No MASTER_ADDR or MASTER_PORT: one host, so loopback, and a port from the job id.
    cmd.args(["-np", "2", DISTRIBUTED_PROGRAM, dir.to_str().unwrap(), "30"]);
    without_launcher(&mut cmd);
    let run = run_with(cmd, &dir, TIMEOUT, |_, _| {});
    eprintln!("ran under {version}");
    assert_one_job(&run, &dir, "127.0.0.1:");
}
