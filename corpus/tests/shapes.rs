//! Shapes of training code that the attribute must see through:
//!
//! - optimizers the `#[distributed]` function did not build: a trainer struct's field
//!   stepped with the training step spelled out (`src/bin/trainer.rs`), or in a method
//!   of its own that `fit` calls, with the attribute on the `impl` block
//!   (`src/bin/trainer_methods.rs`), and a
//!   `&mut nn::Optimizer` argument stepped with `backward_step_clip_norm`
//!   (`src/bin/train_fn.rs`), and an `Option<nn::Optimizer>` field that a helper
//!   fills, stepped through `self.opt.as_mut().unwrap()` (`src/bin/lazy_optimizer.rs`):
//!   their gradients must be averaged all the same;
//! - a batch loop behind `.enumerate()` (`src/bin/enumerate_loop.rs`): it must be
//!   sharded under the adaptor;
//! - a logging helper that all-reduces, called in `println!`'s arguments
//!   (`src/bin/logging_helper.rs`): every rank must run it, rank 0 alone print, and
//!   the printed epoch loss must be one process's;
//! - a hand-written evaluation loop after the training loop (`src/bin/evaluate.rs`):
//!   it trains nothing, so it runs whole on every rank and rank 0 prints one process's
//!   metric.
//!
//! On 2 ranks every rank ends with the same parameters, equal to one process of the
//! plain program on the global batch (2 × 8 samples a step), and each epoch's 8
//! batches become 4 a rank.

mod common;

use std::collections::HashSet;

use common::*;
use tch::{Device, Kind, Tensor};

/// The fingerprints of the 64 samples that a program seeded with `seed` trains on:
/// the programs draw their data from libtorch's generator after `manual_seed`, and
/// this draws the same, under the test binary's `RNG` lock (the generator is the
/// process's).
fn universe(seed: i64) -> HashSet<u64> {
    let _one = RNG.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(seed);
    fingerprints(&Tensor::randn([64, 8], (Kind::Float, Device::Cpu)))
}

/// The values that `epoch: E loss: L` lines print, in order.
fn epoch_losses(stdout: &str) -> Vec<f64> {
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("epoch: ")?.split_once(" loss: "))
        .map(|(_, loss)| loss.trim().parse().unwrap())
        .collect()
}

/// Runs `program` on 2 ranks (batch 8 a rank) and `plain` alone (batch 16), 3 epochs;
/// returns both runs' output.
fn check(name: &str, program: &str, plain: &str, seed: i64) -> (Run, Run) {
    let dir = scratch_dir(&format!("corpus-{name}"));
    let out = dir.join("model.safetensors");
    let run = run_ranks(program, &[out.to_str().unwrap(), "8"], 2, &dir);
    assert_printed(&run.stdout, "epoch:", 3);
    assert_printed(&run.stdout, "tch-distributed: backend", 1);
    assert_eq!(assert_ranks_agree(&dir, 2), 1, "one optimizer stepped");
    let runs = assert_shards_partition(&dir, 2, 8, 64, &universe(seed));
    assert_eq!(runs, 3, "one sharded loop run per epoch");
    // 8 batches an epoch alone, 4 a rank.
    for run in loop_runs(&dir, 2) {
        for rows in &run.per_rank {
            assert_eq!(rows.len(), 4 * 8, "4 batches of 8 a rank");
        }
    }

    let alone = dir.join("alone");
    std::fs::create_dir_all(&alone).unwrap();
    let reference = alone.join("model.safetensors");
    let alone_run = run_alone(plain, &[reference.to_str().unwrap(), "16"], &alone);
    let ours = read_tensors(&out);
    let theirs = read_tensors(&reference);
    assert_close(
        &ours,
        &theirs,
        1e-5,
        &format!("{name}: 2 ranks × 8 against one process × 16"),
    );
    let init = read_tensors(&dir.join("record").join("rank-0-model-0.safetensors"));
    assert_eq!(
        init.len(),
        ours.len(),
        "the recorded model is the saved one"
    );
    (run, alone_run)
}

#[test]
fn a_trainer_structs_optimizer_field_is_averaged_over_2_ranks() {
    let _ = check(
        "trainer",
        env!("CARGO_BIN_EXE_trainer"),
        env!("CARGO_BIN_EXE_trainer_plain"),
        7,
    );
}

#[test]
fn a_trainer_that_steps_in_a_method_of_its_own_is_averaged_with_the_attribute_on_its_impl() {
    let _ = check(
        "trainer_methods",
        env!("CARGO_BIN_EXE_trainer_methods"),
        env!("CARGO_BIN_EXE_trainer_methods_plain"),
        7,
    );
}

#[test]
fn an_optimizer_passed_by_mut_reference_is_averaged_over_2_ranks() {
    let _ = check(
        "train-fn",
        env!("CARGO_BIN_EXE_train_fn"),
        env!("CARGO_BIN_EXE_train_fn_plain"),
        11,
    );
}

#[test]
fn an_optimizer_from_a_helper_in_an_option_is_averaged_over_2_ranks() {
    let _ = check(
        "lazy-optimizer",
        env!("CARGO_BIN_EXE_lazy_optimizer"),
        env!("CARGO_BIN_EXE_lazy_optimizer_plain"),
        13,
    );
}

#[test]
fn a_loop_behind_enumerate_is_sharded_on_2_ranks() {
    let _ = check(
        "enumerate-loop",
        env!("CARGO_BIN_EXE_enumerate_loop"),
        env!("CARGO_BIN_EXE_enumerate_loop_plain"),
        5,
    );
}

#[test]
fn a_collective_in_printlns_arguments_runs_on_every_rank() {
    let (ranks, alone) = check(
        "logging-helper",
        env!("CARGO_BIN_EXE_logging_helper"),
        env!("CARGO_BIN_EXE_logging_helper_plain"),
        3,
    );
    // Rank 0 printed each epoch's loss averaged over the ranks: one process's (the
    // mean of the same 64 samples' losses, from the same parameters at every step).
    let (ours, theirs) = (epoch_losses(&ranks.stdout), epoch_losses(&alone.stdout));
    assert_eq!(ours.len(), 3, "{}", ranks.stdout);
    assert_eq!(theirs.len(), 3, "{}", alone.stdout);
    for (a, b) in ours.iter().zip(&theirs) {
        assert!(
            (a - b).abs() <= 2e-6,
            "epoch loss {a} on 2 ranks, {b} alone"
        );
    }
}

#[test]
fn a_hand_written_evaluation_loop_sees_the_whole_set_on_2_ranks() {
    let (ranks, alone) = check(
        "evaluate",
        env!("CARGO_BIN_EXE_evaluate"),
        env!("CARGO_BIN_EXE_evaluate_plain"),
        9,
    );
    let metrics = |stdout: &str| -> Vec<(f64, String)> {
        stdout
            .lines()
            .filter_map(|l| l.split_once(" test mse: "))
            .map(|(_, rest)| {
                let (mse, count) = rest.split_once(" over ").unwrap();
                (mse.parse().unwrap(), count.to_string())
            })
            .collect()
    };
    let (ours, theirs) = (metrics(&ranks.stdout), metrics(&alone.stdout));
    assert_eq!(ours.len(), 3, "{}", ranks.stdout);
    assert_eq!(theirs.len(), 3, "{}", alone.stdout);
    for ((a, n), (b, m)) in ours.iter().zip(&theirs) {
        assert_eq!(n, "64 samples", "rank 0 evaluated the whole held-out set");
        assert_eq!(m, "64 samples");
        assert!((a - b).abs() <= 2e-6, "test mse {a} on 2 ranks, {b} alone");
    }
}
