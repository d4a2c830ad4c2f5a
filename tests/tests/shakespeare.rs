//! The README's main job, the `shakespeare` example (plain single-GPU code plus
//! `#[distributed]`), as a short real 2-rank run that launches its own ranks.

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tch_distributed_tests::{
    all_ranks_stdout, children, compare, example, run_with, scratch_dir, tchrun, Scratch,
};

#[test]
fn launches_two_ranks_itself_trains_and_writes_one_checkpoint() {
    let dir = scratch_dir("shakespeare");
    let text = dir.join("input.txt");
    fs::write(
        &text,
        "First Citizen:\nBefore we proceed any further, hear me speak.\n".repeat(200),
    )
    .unwrap();
    let checkpoint = dir.join("model.safetensors");
    let mut cmd = Command::new(example("shakespeare"));
    cmd.arg("--data")
        .arg(&text)
        .arg("--checkpoint")
        .arg(&checkpoint)
        .arg("--runs")
        .arg(dir.join("runs"))
        .args(["--steps", "6", "--log-every", "3", "--batch-size", "4"])
        .args(["--seq-len", "16", "--hidden", "32"])
        .env("TCH_DISTRIBUTED_NPROC", "2");
    // Every rank's stdout: what only rank 0 prints is seen once.
    all_ranks_stdout(&mut cmd);
    let run = run_with(cmd, &dir, Duration::from_secs(120), |_, _| {}).without_rank_prefixes();
    run.assert_success();
    assert!(run.stderr.contains("starting 2 ranks"), "{}", run.stderr);
    for once in [
        "tch-distributed: backend gloo, world size 2",
        "epoch 1 step     3 |",
        "epoch 1 step     6 |",
        "trained 6 steps",
        "plotted ",
        "sample:",
    ] {
        assert_eq!(
            run.stdout.matches(once).count(),
            1,
            "{once:?} should be printed once, by rank 0:\n{}",
            run.stdout
        );
    }
    let saved = tch::Tensor::read_safetensors(&checkpoint).unwrap();
    assert!(
        saved.iter().any(|(name, _)| name.starts_with("lstm")),
        "{saved:?}"
    );
    let leftovers: Vec<_> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with(".tmp-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    // The tracker's files: the global loss of each of the 6 steps, the plot, and the
    // configuration with the arguments (tests/tests/tracker.rs checks their contents).
    let runs = dir.join("runs");
    let metrics = fs::read_to_string(runs.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 6, "{metrics}");
    assert!(runs.join("loss.png").is_file());
    let config: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(runs.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["args"]["steps"], 6, "{config}");
    assert_eq!(
        config["effective_batch_size"], 8,
        "4 per rank × 2 ranks: {config}"
    );
}

/// The main job's arguments for the restart tests: `steps` steps, a checkpoint every 4.
fn restart_args(cmd: &mut Command, steps: &str) {
    cmd.args([
        "--checkpoint-every",
        "4",
        "--steps",
        steps,
        "--log-every",
        "100",
    ])
    .args(["--batch-size", "4", "--seq-len", "16", "--hidden", "32"]);
}

/// The main job's restart pattern: with `--checkpoint-dir`, a rank SIGKILLed mid-run
/// under `tchrun --max-restarts 1` costs only the steps since the last checkpoint: the
/// job starts again, resumes from the newest complete checkpoint (its batch loop with
/// the same shuffle, past the batches it had trained on) and finishes with the
/// weights of a run that was not interrupted, bit for bit.
#[test]
fn a_killed_rank_under_max_restarts_resumes_from_the_newest_checkpoint() {
    let (mut cmd, dir) = main_job_under_tchrun("shakespeare-restart", &["--max-restarts", "1"]);
    let ckpt = dir.join("ckpt");
    restart_args(&mut cmd, "400");
    // Every rank's stdout: the job ends once, on rank 0.
    all_ranks_stdout(&mut cmd);
    let run = run_with(cmd, &dir, Duration::from_secs(300), |pid, _| {
        // Once a checkpoint is complete, kill a rank.
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        while !ckpt.join("step-0000000004/COMPLETE").exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "no checkpoint written"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let ranks = children(pid);
        assert_eq!(ranks.len(), 2, "tchrun's ranks: {ranks:?}");
        unsafe { libc::kill(*ranks.iter().max().unwrap() as i32, libc::SIGKILL) };
    })
    .without_rank_prefixes();
    run.assert_success();
    let resumed = run
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("resumed from step "))
        .unwrap_or_else(|| panic!("no resume in:\n{}\n{}", run.stdout, run.stderr));
    let step: usize = resumed.trim().parse().unwrap();
    assert!(step >= 4 && step % 4 == 0, "resumed from step {step}");
    assert_eq!(
        run.stdout.matches("trained 400 steps").count(),
        1,
        "{}",
        run.stdout
    );

    // The same job, not interrupted.
    let (mut cmd, whole) = main_job_under_tchrun("shakespeare-uninterrupted", &[]);
    restart_args(&mut cmd, "400");
    run_with(cmd, &whole, Duration::from_secs(300), |_, _| {}).assert_success();
    let same = compare::files(
        &dir.join("model.safetensors"),
        &whole.join("model.safetensors"),
    );
    assert_eq!(same.max_abs, 0.0, "resumed against uninterrupted: {same:?}");
}

/// A run that ends at `--steps` leaves a checkpoint of its last step: the same job with
/// more `--steps` continues from there, to the weights of one run of that many steps,
/// bit for bit, with a learning-rate warmup that the resume lands in the middle of
/// (the schedule goes on from the checkpoint's step). Its closing line counts the steps
/// that run trained: its rate is no more than its last report's, which covers the same
/// steps in a little less time (it said 4 times as much, 12 steps' tokens over 3
/// steps' time, until it counted only its own).
#[test]
fn more_steps_continue_from_the_last_step() {
    const WARMUP: &[&str] = &["--warmup-steps", "10"];
    let (mut cmd, dir) = main_job_under_tchrun("shakespeare-continue", &[]);
    restart_args(&mut cmd, "9");
    cmd.args(WARMUP);
    run_with(cmd, &dir, Duration::from_secs(120), |_, _| {}).assert_success();
    assert!(
        dir.join("ckpt/step-0000000009/COMPLETE").exists(),
        "the last step's checkpoint"
    );
    let mut cmd = main_job_in(&dir, &[]);
    restart_args(&mut cmd, "12");
    cmd.args(WARMUP);
    let run = run_with(cmd, &dir, Duration::from_secs(120), |_, _| {}).without_rank_prefixes();
    run.assert_success();
    assert!(run.stdout.contains("resumed from step 9"), "{}", run.stdout);
    let rate = |line: &str| -> f64 {
        let (before, _) = line.split_once(" tokens/s per process").unwrap();
        before.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let report = run
        .stdout
        .lines()
        .find(|l| l.starts_with("epoch ") && l.contains(" step    12 |"))
        .unwrap_or_else(|| panic!("no report of step 12:\n{}", run.stdout));
    let closing = run
        .stdout
        .lines()
        .find(|l| l.starts_with("trained 12 steps (3 in this run, resumed from step 9) in "))
        .unwrap_or_else(|| panic!("no closing line:\n{}", run.stdout));
    let (report, closing) = (rate(report), rate(closing));
    assert!(
        closing > 0.0 && closing <= 1.1 * report,
        "closing {closing} tokens/s against the report's {report}:\n{}",
        run.stdout
    );

    let (mut cmd, whole) = main_job_under_tchrun("shakespeare-twelve", &[]);
    restart_args(&mut cmd, "12");
    cmd.args(WARMUP);
    run_with(cmd, &whole, Duration::from_secs(120), |_, _| {}).assert_success();
    let same = compare::files(
        &dir.join("model.safetensors"),
        &whole.join("model.safetensors"),
    );
    assert_eq!(same.max_abs, 0.0, "9 then 3 more against 12: {same:?}");
    // Each step's rate, as the tracker logged it: the warmup's, in both runs.
    let schedule = tch_distributed::LrSchedule::constant_with_warmup(10);
    for run in [&dir, &whole] {
        let metrics = fs::read_to_string(run.join("runs").join("metrics.jsonl")).unwrap();
        let mut steps = Vec::new();
        for line in metrics.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let step = v["step"].as_u64().unwrap();
            assert_eq!(
                v["lr"].as_f64(),
                Some(schedule.lr(0.003, step - 1)),
                "step {step}: {line}"
            );
            steps.push(step);
        }
        assert_eq!(steps, (1..=12).collect::<Vec<_>>(), "{metrics}");
    }
}

/// The main job on 2 ranks under `tchrun` with `flags`, on a small text, writing its
/// weights, runs and checkpoints (`ckpt/`) in its scratch directory: the command, to
/// which a test adds the example's other arguments, and that directory.
fn main_job_under_tchrun(name: &str, flags: &[&str]) -> (Command, Scratch) {
    let dir = scratch_dir(name);
    (main_job_in(&dir, flags), dir)
}

/// [`main_job_under_tchrun`] in `dir`, which may hold an earlier run's checkpoints.
fn main_job_in(dir: &Path, flags: &[&str]) -> Command {
    let text = dir.join("input.txt");
    fs::write(
        &text,
        "First Citizen:\nBefore we proceed any further, hear me speak.\n".repeat(200),
    )
    .unwrap();
    let mut cmd = Command::new(tchrun());
    cmd.args(["--nproc-per-node", "2"])
        .args(flags)
        .arg(example("shakespeare"))
        .arg("--data")
        .arg(&text)
        .arg("--checkpoint")
        .arg(dir.join("model.safetensors"))
        .arg("--runs")
        .arg(dir.join("runs"))
        .arg("--checkpoint-dir")
        .arg(dir.join("ckpt"));
    cmd
}

/// The main job's global loss at each step (rank 0's `metrics.jsonl`), and the
/// run's directory, with `tchrun` given `flags` and the ranks `env`.
fn main_job_losses(name: &str, flags: &[&str], env: &[(&str, &str)]) -> (Vec<f64>, Scratch) {
    let (mut cmd, dir) = main_job_under_tchrun(name, flags);
    cmd.args([
        "--steps",
        "4",
        "--checkpoint-every",
        "2",
        "--log-every",
        "4",
    ])
    .args(["--batch-size", "4", "--seq-len", "16", "--hidden", "32"])
    .envs(env.iter().copied());
    let run = run_with(cmd, &dir, Duration::from_secs(120), |_, _| {});
    run.assert_success();
    let metrics = fs::read_to_string(dir.join("runs").join("metrics.jsonl")).unwrap();
    let losses = metrics
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["loss"]
                .as_f64()
                .unwrap_or_else(|| panic!("no loss in {l}"))
        })
        .collect::<Vec<_>>();
    assert_eq!(losses.len(), 4, "{metrics}");
    (losses, dir)
}

/// The fp16 loss scaler's state in the main job's step-2 checkpoint, if it has one.
fn grad_scaler_in_checkpoint(dir: &Path) -> serde_json::Value {
    let state = fs::read_to_string(dir.join("ckpt/step-0000000002/state.json")).unwrap();
    let state: serde_json::Value = serde_json::from_str(&state).unwrap();
    state["grad_scaler"].clone()
}

/// A mixed precision given at run time reaches the forward pass of a program whose
/// attribute names none, as one written in the attribute does: `tchrun
/// --mixed-precision bf16` (or the variable) changes the main job's losses (bf16
/// autocast on the CPU), and `fp16` adds the loss scaler, whose state the checkpoint
/// holds. Until the macro wrote the autocast guard only for an attribute that named a
/// precision, the banner said "bf16 (asked for)" and the losses were fp32's, bit for bit.
#[test]
fn a_mixed_precision_given_to_tchrun_changes_the_main_jobs_losses() {
    let (fp32, fp32_dir) = main_job_losses("mp-fp32", &[], &[]);
    let (bf16, _bf16_dir) = main_job_losses("mp-bf16", &["--mixed-precision", "bf16"], &[]);
    let (bf16_env, _env_dir) = main_job_losses(
        "mp-bf16-env",
        &[],
        &[("TCH_DISTRIBUTED_MIXED_PRECISION", "bf16")],
    );
    let (fp16, fp16_dir) = main_job_losses("mp-fp16", &["--mixed-precision", "fp16"], &[]);
    for (step, (a, b)) in fp32.iter().zip(&bf16).enumerate() {
        assert_ne!(
            a,
            b,
            "step {}: bf16's loss is fp32's: {fp32:?} {bf16:?}",
            step + 1
        );
        // The same model, trained in a lower precision: close, not equal.
        assert!(
            (a - b).abs() < 0.05 * a.abs(),
            "step {}: {fp32:?} {bf16:?}",
            step + 1
        );
    }
    assert_eq!(bf16, bf16_env, "the flag and the variable are one setting");
    assert_ne!(fp16, fp32, "fp16's losses are fp32's");
    assert_eq!(
        grad_scaler_in_checkpoint(&fp32_dir),
        serde_json::Value::Null
    );
    let scaler = grad_scaler_in_checkpoint(&fp16_dir);
    // (scale, growth tracker): GradScaler's initial scale is 2^16.
    let scale = scaler[0]
        .as_f64()
        .unwrap_or_else(|| panic!("no loss scaler: {scaler}"));
    assert!(scale >= 1.0, "{scaler}");
}

/// The main job under `tchrun --zero 3` (or `TCH_DISTRIBUTED_ZERO=3`): parameters,
/// gradients and Adam's state sharded over the ranks, the gradients' norm clipped over
/// the shards; its losses are DDP's up to rounding, and its checkpoints hold one
/// optimizer shard per rank.
#[test]
fn the_main_job_trains_under_zero_3_as_under_ddp() {
    let (ddp, _ddp_dir) = main_job_losses("zero3-ddp", &[], &[]);
    let (zero3, zero3_dir) = main_job_losses("zero3", &["--zero", "3"], &[]);
    let (zero3_env, _env_dir) = main_job_losses("zero3-env", &[], &[("TCH_DISTRIBUTED_ZERO", "3")]);
    for (step, (a, b)) in ddp.iter().zip(&zero3).enumerate() {
        assert!(
            (a - b).abs() < 1e-5 * a.abs(),
            "step {}: {ddp:?} {zero3:?}",
            step + 1
        );
    }
    assert_eq!(
        zero3, zero3_env,
        "the flag and the variable are one setting"
    );
    for rank in 0..2 {
        let shard = zero3_dir.join(format!(
            "ckpt/step-0000000002/optimizer-rank-{rank}.safetensors"
        ));
        assert!(shard.exists(), "{}", shard.display());
    }
}
