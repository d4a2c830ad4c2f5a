//! Ranks that take different paths, as the book's "When ranks take different paths"
//! describes: in a loop that `#[distributed]` shards, a `break` or `return` that one
//! rank takes on its own loss is taken by every rank at the same step, and the model
//! is one process's on the same global batches up to that step; a `filter` that
//! keeps different numbers of batches on different ranks stops every rank with the
//! first that runs out (rank 0 says how many batches were dropped) instead of
//! hanging; `any_rank` agrees by hand; and ranks whose collectives cannot match (rank
//! 0 at a barrier, rank 1 in a gradient all-reduce) are named within seconds, not at
//! the 30-minute timeout, while a rank that is only slow (computing, in no collective)
//! is waited for.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tch_distributed_tests::{compare, run_with, scratch_dir, Run};

#[path = "support/messages.rs"]
mod messages;
use messages::{assert_recorded, message_block, redact};

const WORKER: &str = env!("CARGO_BIN_EXE_different_paths_worker");

/// Runs `mode` on 2 ranks under tchrun.
fn two_ranks(dir: &Path, mode: &str) -> Run {
    let mut cmd = Command::new(tch_distributed_tests::tchrun());
    cmd.args(["--nproc-per-node", "2", WORKER, dir.to_str().unwrap(), mode]);
    run_with(cmd, dir, Duration::from_secs(90), |_, _| {})
}

/// Runs `mode` as one process on the global batches, for `steps` steps; its
/// parameters are returned under `alone-{mode}.safetensors`.
fn alone(dir: &Path, mode: &str, steps: usize) -> std::path::PathBuf {
    let mut cmd = Command::new(WORKER);
    cmd.args([dir.to_str().unwrap(), mode, "--plain", &steps.to_string()]);
    tch_distributed_tests::without_launcher(&mut cmd);
    let ours = dir.join(format!("params0-{mode}.safetensors"));
    let kept = dir.join(format!("rank0-{mode}.safetensors"));
    std::fs::rename(&ours, &kept).unwrap();
    run_with(cmd, dir, Duration::from_secs(60), |_, _| {}).assert_success();
    let reference = dir.join(format!("alone-{mode}.safetensors"));
    std::fs::rename(&ours, &reference).unwrap();
    std::fs::rename(&kept, &ours).unwrap();
    reference
}

/// `(steps, own, kept)` of `rank`: the steps it took, whether its own loss stopped it,
/// how many batches its filter kept.
fn stats(dir: &Path, rank: usize, mode: &str) -> (usize, bool, usize) {
    let text = std::fs::read_to_string(dir.join(format!("stats{rank}-{mode}.txt"))).unwrap();
    let fields: Vec<&str> = text.split_whitespace().collect();
    (
        fields[1].parse().unwrap(),
        fields[3].parse().unwrap(),
        fields[5].parse().unwrap(),
    )
}

#[test]
fn an_exit_on_one_ranks_own_loss_stops_every_rank_at_that_step() {
    let dir = scratch_dir("different-paths-exit");
    for mode in ["early-stop", "early-return"] {
        let run = two_ranks(&dir, mode);
        run.assert_success();
        let (steps0, own0, _) = stats(&dir, 0, mode);
        let (steps1, own1, _) = stats(&dir, 1, mode);
        assert_eq!(
            steps0, steps1,
            "{mode}: both ranks stopped at the same step"
        );
        assert!(steps0 < 16, "{mode}: stopped before the epoch's 16 steps");
        // Rank 1's batches have the small targets: its loss fell first, and rank 0,
        // whose own loss had not, stopped with it.
        assert!(
            own1 && !own0,
            "{mode}: rank 0 own {own0}, rank 1 own {own1}"
        );
        if mode == "early-stop" {
            assert_eq!(
                run.stdout
                    .matches(&format!("stopped after {steps0} steps"))
                    .count(),
                1,
                "rank 0 alone prints:\n{}",
                run.stdout
            );
        }
        let reference = alone(&dir, mode, steps0);
        for rank in 0..2 {
            compare::files(
                &dir.join(format!("params{rank}-{mode}.safetensors")),
                &reference,
            )
            .assert_within(
                1e-6,
                &format!(
                    "{mode}: rank {rank} against one process on the same {steps0} global batches"
                ),
            );
        }
    }
}

#[test]
fn a_filter_that_keeps_different_counts_stops_every_rank_with_the_first() {
    let dir = scratch_dir("different-paths-filter");
    let run = two_ranks(&dir, "filter");
    run.assert_success();
    let (steps0, _, kept0) = stats(&dir, 0, "filter");
    let (steps1, _, kept1) = stats(&dir, 1, "filter");
    assert_ne!(
        kept0, kept1,
        "the filter keeps different numbers on the two ranks"
    );
    assert_eq!(steps0, steps1, "both ranks took the same steps");
    assert_eq!(
        steps0,
        kept0.min(kept1),
        "they stopped when the first ran out"
    );
    let dropped = kept0.max(kept1) - steps0;
    assert!(
        run.stderr.contains(&format!(
            "the other ranks' {dropped} remaining batches were dropped"
        )),
        "rank 0 says how many were dropped ({dropped}):\n{}",
        run.stderr
    );
    let line = run
        .stderr
        .lines()
        .find(|l| l.contains("a sharded loop ran out of batches"))
        .unwrap();
    assert_recorded("uneven-batches", line);
    let reference = alone(&dir, "filter", 0);
    for rank in 0..2 {
        compare::files(
            &dir.join(format!("params{rank}-filter.safetensors")),
            &reference,
        )
        .assert_within(
            1e-6,
            &format!("filter: rank {rank} against one process on the kept batches"),
        );
    }
}

#[test]
fn any_rank_leaves_a_loop_written_by_hand_together() {
    let dir = scratch_dir("different-paths-any-rank");
    two_ranks(&dir, "any-rank").assert_success();
    for rank in 0..2 {
        assert_eq!(
            stats(&dir, rank, "any-rank").0,
            3,
            "rank {rank} left after 3 steps"
        );
    }
    compare::files(
        &dir.join("params0-any-rank.safetensors"),
        &dir.join("params1-any-rank.safetensors"),
    )
    .assert_within(0.0, "the two ranks' parameters");
}

#[test]
fn a_rank_that_is_only_slow_is_no_deadlock() {
    let dir = scratch_dir("different-paths-slow");
    // Rank 1 computes for 8 s while rank 0 waits in the gradient all-reduce; both read
    // the records after 2 s and find rank 1 behind, in no collective.
    let run = two_ranks(&dir, "slow-rank");
    run.assert_success();
    assert!(run.elapsed > Duration::from_secs(8), "{:?}", run.elapsed);
    for rank in 0..2 {
        assert_eq!(
            stats(&dir, rank, "slow-rank").0,
            16,
            "rank {rank} ran every step"
        );
    }
}

#[test]
fn collectives_that_cannot_match_are_named_in_seconds() {
    let dir = scratch_dir("different-paths-deadlock");
    // Rank 0 leaves its loop after 3 steps and waits at a barrier; rank 1 is in step
    // 4's gradient all-reduce. The timeout is the default 30 minutes.
    let run = two_ranks(&dir, "manual-break");
    assert!(!run.status.success(), "{}", run.stderr);
    assert!(
        run.elapsed < Duration::from_secs(30),
        "named after {:?}, not at the timeout:\n{}",
        run.elapsed,
        run.stderr
    );
    // Rank 1 reads the records first (the worker sets its `deadlock_check` to 2 s).
    let message = message_block(&run.stderr, "Error: rank 1: ");
    for text in [
        "Error: rank 1: the gradient all-reduce of backward pass 4 (collective 7 of rank 1) cannot complete (found after ",
        "rank 0 is waiting in another collective, barrier: the ranks called collectives in different orders",
    ] {
        assert!(message.contains(text), "{text:?} in:\n{}", run.stderr);
    }
    assert!(
        run.stderr
            .contains("tchrun: root cause: rank 1 (local rank 1, pid "),
        "tchrun's root cause names rank 1:\n{}",
        run.stderr
    );
    assert_recorded(
        "collectives-mismatch",
        &redact(&message, &[("found after ", "{t}")]),
    );
}
