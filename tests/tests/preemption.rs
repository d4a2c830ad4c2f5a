//! Preemption when the signal reaches one rank only (a node drained on its own, a
//! signal sent to one pid), which the book documents as "returns the signal on every
//! rank as soon as any rank got one, so that all ranks stop at the same step, write
//! one checkpoint together and exit with 128 + the signal". The ranks of
//! `checkpoint_worker` are started by hand (no launcher that would forward the signal to
//! the others), and one of them gets SIGTERM or SIGINT.
//! (`checkpoint.rs` covers the signal sent to `tchrun`, which forwards it to all.)

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use tch_distributed_tests::{
    free_port, run_tchrun, run_together, scratch_dir, without_launcher, Run,
};

const WORKER: &str = env!("CARGO_BIN_EXE_checkpoint_worker");
const TIMEOUT: Duration = Duration::from_secs(120);

/// The last step rank 0 finished (`checkpoint_worker` writes it to `OUT/progress`).
fn progress(out: &Path) -> u64 {
    fs::read_to_string(out.join("progress"))
        .unwrap_or_default()
        .trim()
        .parse()
        .unwrap_or(0)
}

/// Starts 2 ranks of `checkpoint_worker OUT CKPT 1000000 adam` by hand and, once step 6 is
/// done, sends `signal` to rank `target` alone; returns each rank's run.
fn preempt_one_rank(out: &Path, ckpt: &Path, signal: i32, target: usize) -> Vec<Run> {
    let port = free_port().to_string();
    let ranks = (0..2).map(|rank| {
        let dir = out.join(format!("rank{rank}"));
        fs::create_dir_all(&dir).unwrap();
        let mut cmd = Command::new(WORKER);
        without_launcher(&mut cmd)
            .args([out.to_str().unwrap(), ckpt.to_str().unwrap()])
            .args(["1000000", "adam"])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", "2")
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", "2")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &port);
        (cmd, dir)
    });
    run_together(ranks.collect(), TIMEOUT, |rank, pid, _| {
        if rank != target {
            return;
        }
        // Bounded: without the signal the job runs into the timeout, and fails the
        // test there.
        let deadline = Instant::now() + TIMEOUT / 2;
        while progress(out) < 6 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        // This rank's pid only: the other rank hears nothing.
        unsafe { libc::kill(pid as i32, signal) };
    })
}

/// The step at which `rank` says it was preempted, and the checkpoint it names.
fn preempted_at(run: &Run, rank: usize) -> (u64, PathBuf) {
    let rest = run
        .stderr
        .lines()
        .find_map(|l| l.strip_prefix(&format!("rank {rank}: preempted at step ")))
        .unwrap_or_else(|| panic!("rank {rank} reports no preemption: {run:?}"));
    let (step, saved) = rest.split_once(", saved ").unwrap();
    (step.parse().unwrap(), PathBuf::from(saved))
}

fn assert_all_ranks_stop_together(signal: i32, target: usize) {
    let dir = scratch_dir(&format!("preempt-one-{signal}-{target}"));
    let ckpt = dir.join("ckpt");
    let runs = preempt_one_rank(&dir, &ckpt, signal, target);
    let mut steps = Vec::new();
    for (rank, run) in runs.iter().enumerate() {
        assert_eq!(
            run.status.code(),
            Some(128 + signal),
            "rank {rank} (signal sent to rank {target} only): {run:?}"
        );
        let (step, saved) = preempted_at(run, rank);
        assert_eq!(saved, ckpt.join(format!("step-{step:010}")), "rank {rank}");
        steps.push(step);
    }
    assert_eq!(steps[0], steps[1], "both ranks stop at the same step");
    let step = steps[0];
    assert!(step >= 6, "the signal came after step 6, not {step}");
    assert!(
        ckpt.join(format!("step-{step:010}/COMPLETE")).exists(),
        "one complete checkpoint at step {step}"
    );
    // And the job resumes from it, on 2 ranks under tchrun.
    let resumed = dir.join("resumed");
    fs::create_dir_all(&resumed).unwrap();
    let run = run_tchrun(
        &resumed,
        &[
            "--nproc-per-node",
            "2",
            WORKER,
            resumed.to_str().unwrap(),
            ckpt.to_str().unwrap(),
            &(step + 1).to_string(),
            "adam",
        ],
        TIMEOUT,
        |_, _| {},
    );
    run.assert_success();
    assert!(
        run.stdout.contains(&format!("resumed at step {step},")),
        "{}",
        run.stdout
    );
}

#[test]
fn sigterm_to_one_rank_stops_every_rank_at_the_same_step_with_a_checkpoint() {
    assert_all_ranks_stop_together(libc::SIGTERM, 1);
}

#[test]
fn sigint_to_rank_0_alone_stops_every_rank_with_exit_130() {
    assert_all_ranks_stop_together(libc::SIGINT, 0);
}
