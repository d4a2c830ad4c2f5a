//! The README's main job, the `shakespeare` example (plain single-GPU code plus
//! `#[distributed]`), as a short real 2-rank run that launches its own ranks.

use std::fs;
use std::process::Command;
use std::time::Duration;

use tch_distributed_tests::{example, run_with, scratch_dir};

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
}
