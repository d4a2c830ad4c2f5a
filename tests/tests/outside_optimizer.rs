//! Optimizers the `#[distributed]` function did not build (tch's `nn::Optimizer` or
//! the SDK's, made before the function and handed to it), as the book's "Adapting"
//! chapter describes: the attribute averages their gradients with a DDP (the c10d
//! Reducer) that it builds over their variables at their first step. On 2 ranks
//! every rank ends with the parameters of one process on the global batch, whether
//! the step is spelled out with `loss.backward()`, is one of tch's backward steps
//! (plain, clipped by value or by norm), steps two models' optimizers (each with a DDP
//! of its own), or is the SDK optimizer's accumulation; ranks
//! that start apart end together (the DDP adopts rank 0's parameters); and a layer
//! that one rank alone uses ends the job with an `Error:` line that names the fix, not
//! a hang.

use std::process::Command;
use std::time::Duration;

use tch_distributed_tests::{compare, run_tchrun, run_with, scratch_dir};

const WORKER: &str = env!("CARGO_BIN_EXE_outside_optimizer_worker");

/// Runs `mode` on 2 ranks under tchrun with `SEED=seed`.
fn two_ranks(dir: &std::path::Path, mode: &str, seed: &str) -> tch_distributed_tests::Run {
    let d = dir.to_str().unwrap();
    let mut cmd = Command::new(tch_distributed_tests::tchrun());
    cmd.args(["--nproc-per-node", "2", WORKER, d, mode])
        .env("SEED", seed);
    run_with(cmd, dir, Duration::from_secs(90), |_, _| {})
}

#[test]
fn an_optimizer_made_before_the_function_trains_as_one_process_on_the_global_batch() {
    let dir = scratch_dir("outside-optimizer");
    let d = dir.to_str().unwrap();
    for mode in ["tch", "tch-steps", "two", "sdk"] {
        let mut plain = Command::new(WORKER);
        plain
            .args([d, mode, "--plain"])
            .env("SEED", "7")
            .env_remove("RANK");
        run_with(plain, &dir, Duration::from_secs(60), |_, _| {}).assert_success();
        let reference = dir.join(format!("params0-{mode}.safetensors"));
        let alone = dir.join(format!("alone-{mode}.safetensors"));
        std::fs::rename(&reference, &alone).unwrap();

        two_ranks(&dir, mode, "7").assert_success();
        if mode == "sdk" {
            // The SDK's optimizer steps through one DDP from its first step on, built
            // then and kept: the first step's averaging, then per step a local
            // micro-batch and a synchronized one.
            let ddp = std::fs::read_to_string(dir.join("ddp0-sdk")).unwrap();
            assert_eq!(ddp, "4 3", "synchronized and local backward passes");
        }
        for rank in 0..2 {
            let ours = dir.join(format!("params{rank}-{mode}.safetensors"));
            compare::files(&ours, &alone).assert_within(
                1e-6,
                &format!("{mode}: rank {rank} of 2 against one process on the global batch"),
            );
        }
    }
}

#[test]
fn ranks_that_start_apart_end_with_the_same_parameters() {
    let dir = scratch_dir("outside-optimizer-apart");
    // Both models' optimizers: each DDP adopts rank 0's values of its own model.
    let run = two_ranks(&dir, "two", "rank");
    run.assert_success();
    let same = compare::files(
        &dir.join("params0-two.safetensors"),
        &dir.join("params1-two.safetensors"),
    );
    assert_eq!(same.max_abs, 0.0, "rank 0's parameters adopted: {same:?}");
}

#[test]
fn a_layer_that_one_rank_alone_uses_ends_the_job_with_the_fix() {
    for (mode, says) in [
        (
            "partial-1",
            "has a gradient on some ranks and none on others",
        ),
        ("partial-2", "had none at its first step"),
    ] {
        let dir = scratch_dir(&format!("outside-optimizer-{mode}"));
        let d = dir.to_str().unwrap();
        let run = run_tchrun(
            &dir,
            &["--nproc-per-node", "2", WORKER, d, mode],
            Duration::from_secs(90),
            |_, _| {},
        );
        assert!(!run.status.success(), "{mode}: the job fails");
        let line = run
            .stderr
            .lines()
            .find(|l| l.starts_with("Error: rank 0:") && l.contains(says))
            .unwrap_or_else(|| panic!("{mode}: no `Error:` line saying {says:?}:\n{}", run.stderr));
        assert!(
            line.contains("build the optimizer inside the function"),
            "{mode}: the fix is named: {line}"
        );
        assert!(
            run.elapsed < Duration::from_secs(60),
            "{mode}: failed fast, not at a timeout: {:?}",
            run.elapsed
        );
    }
}
