//! The settings (the book's Reference, Settings) given as options of `#[distributed]`
//! (`settings_worker`): `grad_accum` on 2 real ranks equals the same updates on one
//! process, with one all-reduce per optimizer step, in both spellings of a training
//! step; `mixed_precision` autocasts the forward pass, keeps the parameters in float32,
//! gives fp16 a loss scaler whose state checkpoints keep, and the banner says what was
//! chosen and why; a later function runs with the job's settings and may not ask for
//! others; `bucket_cap_mb` caps the first bucket too, as in PyTorch.

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tch::Tensor;
use tch_distributed_tests::{compare, run_tchrun, run_with, scratch_dir, Run};

const WORKER: &str = env!("CARGO_BIN_EXE_settings_worker");
const TIMEOUT: Duration = Duration::from_secs(60);

fn parse(text: &str) -> Vec<f64> {
    text.split(['[', ']', ','])
        .filter_map(|s| s.trim().parse().ok())
        .collect()
}

fn read(dir: &Path, name: &str) -> String {
    fs::read_to_string(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// One process, no launcher.
fn single(dir: &Path, mode: &str) -> Run {
    let mut cmd = Command::new(WORKER);
    cmd.args([dir.to_str().unwrap(), mode])
        .env_remove("TCH_DISTRIBUTED_NPROC");
    let run = run_with(cmd, dir, TIMEOUT, |_, _| {});
    run.assert_success();
    run
}

#[test]
fn grad_accum_on_two_ranks_equals_the_same_updates_on_one_process() {
    let dir = scratch_dir("settings-accum");
    let d = dir.to_str().unwrap();
    single(&dir, "accum-reference");
    let reference = parse(&read(&dir, "params0.txt"));
    assert_eq!(reference.len(), 4);
    for mode in ["accum", "accum-backward"] {
        let run = run_tchrun(
            &dir,
            &["--nproc-per-node", "2", WORKER, d, mode],
            TIMEOUT,
            |_, _| {},
        );
        run.assert_success();
        assert!(
            run.stdout.contains(
                "gradient accumulation 3 steps (effective batch = per-rank batch × 3 × 2 ranks = 6 × per-rank batch)"
            ),
            "the banner gives the effective batch:\n{}",
            run.stdout
        );
        for rank in 0..2 {
            // 5 micro-batches per rank: a cycle of 3, then one of 2 that the data
            // ends; each cycle all-reduces once.
            assert_eq!(
                read(&dir, &format!("stats{rank}.txt")),
                "synced 2 local 3",
                "{mode}, rank {rank}"
            );
            let ours = parse(&read(&dir, &format!("params{rank}.txt")));
            compare::tensors(&Tensor::from_slice(&ours), &Tensor::from_slice(&reference))
                .assert_within(1e-6, &format!("{mode}, rank {rank} against one process"));
        }
    }
}

#[test]
fn mixed_precision_autocasts_the_forward_pass_and_says_why() {
    let dir = scratch_dir("settings-precision");
    for (mode, banner, kinds) in [
        (
            "bf16",
            "mixed precision bf16 (asked for",
            "output BFloat16 loss Float params Float scaler None",
        ),
        (
            "auto",
            "mixed precision no (auto: CPU)",
            "output Float loss Float params Float scaler None",
        ),
        // The first step at the initial scale 2^16 overflows the fp16 weight
        // gradient (20 rows of about 2^13 each): it is skipped and the scale halved,
        // as `torch.amp.GradScaler` does.
        (
            "fp16",
            "mixed precision fp16 with loss scaling (asked for",
            "output Half loss Float params Float scaler Some(32768.0)",
        ),
    ] {
        let run = single(&dir, mode);
        assert!(run.stdout.contains(banner), "{mode}:\n{}", run.stdout);
        assert_eq!(read(&dir, "kinds0.txt"), kinds, "{mode}");
    }
    let state = read(&dir, "ckpt/step-0000000000/state.json");
    let state: serde_json::Value = serde_json::from_str(&state).unwrap();
    assert_eq!(
        state["grad_scaler"],
        serde_json::json!([32768.0, 0]),
        "the fp16 loss scaler's state is in the checkpoint"
    );
}

#[test]
fn a_later_function_runs_with_the_jobs_settings_and_may_not_ask_for_others() {
    let dir = scratch_dir("settings-second-function");
    single(&dir, "bf16-then-inherit");
    let bf16 = "output BFloat16 loss Float params Float scaler None";
    assert_eq!(read(&dir, "first0.txt"), bf16);
    assert_eq!(
        read(&dir, "kinds0.txt"),
        bf16,
        "the second function autocasts too"
    );

    fs::remove_file(dir.join("kinds0.txt")).unwrap();
    let mut cmd = Command::new(WORKER);
    cmd.args([dir.to_str().unwrap(), "bf16-then-fp16"])
        .env_remove("TCH_DISTRIBUTED_NPROC");
    let run = run_with(cmd, &dir, TIMEOUT, |_, _| {});
    assert_eq!(run.status.code(), Some(1), "{}", run.stderr);
    assert!(
        run.stderr.contains(
            "Error: entering a second #[distributed] function: it asks for \
             mixed_precision = fp16 (the job's: bf16), but this process joined its job \
             with the first function's settings"
        ),
        "{}",
        run.stderr
    );
    // The first ran; the second never started (it would have written kinds in fp16).
    assert_eq!(read(&dir, "kinds0.txt"), bf16);
}

#[test]
fn bucket_cap_mb_caps_the_first_bucket_too_as_in_pytorch() {
    // 12 gradients of 1 KiB and 256 KiB alternately, 1,542 KiB in all: PyTorch's
    // defaults (a 1 MiB first bucket, then 25 MiB) would make buckets of 8 and 4;
    // `bucket_cap_mb = 0.5` given explicitly caps the first bucket too (torch 2.11)
    // and every later one, so three buckets of 4.
    let dir = scratch_dir("settings-buckets");
    let d = dir.to_str().unwrap();
    run_tchrun(
        &dir,
        &["--nproc-per-node", "2", WORKER, d, "buckets"],
        TIMEOUT,
        |_, _| {},
    )
    .assert_success();
    for rank in 0..2 {
        assert_eq!(
            read(&dir, &format!("buckets{rank}.txt")),
            "[4, 4, 4]",
            "rank {rank}"
        );
    }
}
