//! Gradient accumulation through `Optimizer::accumulate` on 2 real ranks equals one
//! big batch on one process, with one all-reduce per optimizer step, whether the
//! training step is `backward_step` or spelled out (`zero_grad`, `backward`, `step`);
//! clipping sees the averaged gradients, so every rank clips by the same global norm.

use std::process::Command;
use std::time::Duration;

use tch_distributed_tests::{compare, run_tchrun_all_ranks, run_with, scratch_dir};

const WORKER: &str = env!("CARGO_BIN_EXE_accumulation_worker");

#[test]
fn three_micro_batches_on_two_ranks_equal_one_batch_six_times_larger() {
    let dir = scratch_dir("accum");
    let d = dir.to_str().unwrap();
    let mut cmd = Command::new(WORKER);
    cmd.args([d, "big"]).env_remove("TCH_DISTRIBUTED_NPROC");
    run_with(cmd, &dir, Duration::from_secs(60), |_, _| {}).assert_success();
    let big = dir.join("params-big.safetensors");
    let moved = compare::files(&dir.join("init.safetensors"), &big);
    assert!(
        moved.max_abs > 1e-3,
        "the big step moved the parameters: {moved:?}"
    );

    // `backward_step` on each micro-batch, then the training step spelled out: both
    // step on the cycle's third micro-batch only.
    for mode in ["accum", "spelled"] {
        let run = run_tchrun_all_ranks(
            &dir,
            &["--nproc-per-node", "2", WORKER, d, mode],
            Duration::from_secs(60),
            |_, _| {},
        );
        run.assert_success();
        for rank in 0..2 {
            let ours = dir.join(format!("params{rank}-{mode}.safetensors"));
            compare::files(&ours, &big)
                .assert_within(1e-6, &format!("{mode}: rank {rank} against one batch"));
            let expected = if mode == "accum" {
                format!("rank {rank}: stepped [false, false, true], synced 1, local 2")
            } else {
                format!("rank {rank}: spelled out, stepped [false, false, true]")
            };
            assert!(
                run.stdout.contains(&expected),
                "{mode}: one all-reduce and one step per cycle:\n{}",
                run.stdout
            );
            if mode == "accum" {
                assert!(
                    run.stdout
                        .contains(&format!("rank {rank}: short cycle stepped true, synced 2")),
                    "{}",
                    run.stdout
                );
            }
        }
    }
}

/// `(norm, clipped norm)` per rank from the `clip` mode's output.
fn norms(stdout: &str) -> Vec<(f64, f64)> {
    let mut found: Vec<(usize, f64, f64)> = stdout
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("rank ")?;
            let (rank, rest) = rest.split_once(": norm ")?;
            let (norm, clipped) = rest.split_once(" clipped ")?;
            Some((
                rank.parse().ok()?,
                norm.parse().ok()?,
                clipped.parse().ok()?,
            ))
        })
        .collect();
    found.sort_by_key(|f| f.0);
    found.into_iter().map(|(_, n, c)| (n, c)).collect()
}

#[test]
fn every_rank_clips_by_the_global_norm_of_the_averaged_gradient() {
    let dir = scratch_dir("clip");
    let d = dir.to_str().unwrap();
    let run = run_tchrun_all_ranks(
        &dir,
        &["--nproc-per-node", "2", WORKER, d, "clip"],
        Duration::from_secs(60),
        |_, _| {},
    );
    run.assert_success();
    let ranks = norms(&run.stdout);
    assert_eq!(ranks.len(), 2, "{}", run.stdout);
    assert_eq!(ranks[0], ranks[1], "the same norm on every rank");

    let mut cmd = Command::new(WORKER);
    cmd.args([d, "clip"]).env_remove("TCH_DISTRIBUTED_NPROC");
    let one = run_with(cmd, &dir, Duration::from_secs(60), |_, _| {});
    one.assert_success();
    let single = norms(&one.stdout)[0];
    let (norm, clipped) = ranks[0];
    assert!(
        (norm - single.0).abs() < 1e-6 * single.0,
        "{norm} vs one process {}",
        single.0
    );
    assert!(norm > 0.05, "the test must clip: norm {norm}");
    assert!(
        (clipped - 0.05).abs() < 1e-5,
        "clipped to the maximum: {clipped}"
    );
}
