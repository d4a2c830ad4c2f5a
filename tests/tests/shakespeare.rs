//! The README's main job, the `shakespeare` example (plain single-GPU code plus
//! `#[distributed]`), as a short real 2-rank run that launches its own ranks.

use std::fs;
use std::process::Command;
use std::time::Duration;

use tch_distributed_tests::{children, example, run_with, scratch_dir, tchrun};

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
    let run = run_with(cmd, &dir, Duration::from_secs(120), |_, _| {});
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

/// The main job's restart pattern: with `--checkpoint-dir`, a rank SIGKILLed mid-run
/// under `tchrun --max-restarts 1` costs only the steps since the last checkpoint: the
/// job starts again, resumes from the newest complete checkpoint and finishes.
#[test]
fn a_killed_rank_under_max_restarts_resumes_from_the_newest_checkpoint() {
    let dir = scratch_dir("shakespeare-restart");
    let text = dir.join("input.txt");
    fs::write(
        &text,
        "First Citizen:\nBefore we proceed any further, hear me speak.\n".repeat(200),
    )
    .unwrap();
    let ckpt = dir.join("ckpt");
    let mut cmd = Command::new(tchrun());
    cmd.args(["--nproc-per-node", "2", "--max-restarts", "1"])
        .arg(example("shakespeare"))
        .arg("--data")
        .arg(&text)
        .arg("--checkpoint")
        .arg(dir.join("model.safetensors"))
        .arg("--runs")
        .arg(dir.join("runs"))
        .arg("--checkpoint-dir")
        .arg(&ckpt)
        .args([
            "--checkpoint-every",
            "4",
            "--steps",
            "400",
            "--log-every",
            "100",
        ])
        .args(["--batch-size", "4", "--seq-len", "16", "--hidden", "32"]);
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
    });
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
}
