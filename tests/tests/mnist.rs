//! The `mnist` example (plain single-GPU tch code plus `#[distributed]`) as a real
//! 2-rank run under `tchrun`, on a small synthetic dataset in MNIST's idx format.

use std::fs;
use std::process::Command;
use std::time::Duration;

use tch_distributed_tests::{
    example, run_tchrun, run_tchrun_all_ranks, run_with, scratch_dir, write_mnist,
};

#[test]
fn two_ranks_learn_synthetic_mnist_with_one_printer_and_one_checkpoint() {
    let dir = scratch_dir("mnist");
    write_mnist(&dir, 512, 128);
    let exe = example("mnist");
    let checkpoint = dir.join("mnist.safetensors");
    // Every rank's stdout: what only rank 0 prints is seen once.
    let run = run_tchrun_all_ranks(
        &dir,
        &[
            "--nproc-per-node",
            "2",
            exe.to_str().unwrap(),
            "--data",
            dir.to_str().unwrap(),
            "--epochs",
            "2",
            "--batch-size",
            "32",
            "--lr",
            "3e-3",
            "--conv1",
            "8",
            "--conv2",
            "16",
            "--hidden",
            "64",
            "--checkpoint",
            checkpoint.to_str().unwrap(),
        ],
        Duration::from_secs(180),
        |_, _| {},
    );
    run.assert_success();
    let out = &run.stdout;
    assert_eq!(
        out.matches("tch-distributed: backend gloo, world size 2")
            .count(),
        1,
        "banner once:\n{out}"
    );
    for epoch in 1..=2 {
        let prefix = format!("epoch: {epoch:4} train loss:");
        assert_eq!(
            out.lines().filter(|l| l.starts_with(&prefix)).count(),
            1,
            "epoch {epoch}: one line, from rank 0 only:\n{out}"
        );
    }
    assert_eq!(
        out.lines().filter(|l| l.starts_with("epoch:")).count(),
        2,
        "{out}"
    );
    let accuracy: f64 = out
        .lines()
        .find_map(|l| l.strip_prefix("final test accuracy:"))
        .and_then(|s| s.trim().trim_end_matches('%').parse().ok())
        .unwrap_or_else(|| panic!("no final accuracy line:\n{out}"));
    assert!(
        accuracy > 80.0,
        "the net did not learn the synthetic classes ({accuracy}%, chance is 10%):\n{out}"
    );
    assert_eq!(out.matches("final test accuracy:").count(), 1, "{out}");

    let tensors = tch::Tensor::read_safetensors(&checkpoint)
        .unwrap_or_else(|e| panic!("loading {}: {e}", checkpoint.display()));
    let mut names: Vec<_> = tensors
        .iter()
        .map(|(name, t)| (name.as_str(), t.size()))
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            ("conv1.bias", vec![8]),
            ("conv1.weight", vec![8, 1, 5, 5]),
            ("conv2.bias", vec![16]),
            ("conv2.weight", vec![16, 8, 5, 5]),
            ("fc1.bias", vec![64]),
            ("fc1.weight", vec![64, 256]),
            ("fc2.bias", vec![10]),
            ("fc2.weight", vec![10, 64]),
        ]
    );
    let entries: Vec<_> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(
        !entries.iter().any(|e| e.starts_with(".tmp-")),
        "a temporary file was left: {entries:?}"
    );
    eprintln!(
        "2-rank synthetic MNIST: {accuracy}% test accuracy in {:?}",
        run.elapsed
    );
}

#[test]
fn a_missing_data_dir_fails_naming_it() {
    let dir = scratch_dir("mnist-missing");
    let missing = dir.join("no-such-mnist");
    let exe = example("mnist");

    // One process, no launcher.
    let mut cmd = Command::new(&exe);
    cmd.env_remove("TCH_DISTRIBUTED_NPROC")
        .arg("--data")
        .arg(&missing);
    let run = run_with(cmd, &dir, Duration::from_secs(60), |_, _| {});
    assert!(!run.status.success(), "{run:?}");
    assert!(
        run.stderr
            .contains(&format!("loading MNIST from {}", missing.display())),
        "the error names the directory:\n{}",
        run.stderr
    );

    // Two ranks under tchrun: both fail the same way and the job ends promptly.
    let run = run_tchrun(
        &dir,
        &[
            "--nproc-per-node",
            "2",
            exe.to_str().unwrap(),
            "--data",
            missing.to_str().unwrap(),
        ],
        Duration::from_secs(60),
        |_, _| {},
    );
    assert!(!run.status.success(), "{run:?}");
    assert!(
        run.stderr
            .contains(&format!("loading MNIST from {}", missing.display())),
        "the error names the directory:\n{}",
        run.stderr
    );
}
