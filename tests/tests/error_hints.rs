//! Documented failures that no other test provokes, each of which must end the
//! program with an error naming the problem and the fix, not a panic or a hang
//! (`error_hints_worker`, plain tch code with `#[distributed]`):
//!
//! - a launch environment with `RANK` but no `WORLD_SIZE`, or the reverse;
//! - a rendezvous address that cannot be reached (TEST-NET-1, never routed), with a
//!   short `TCH_DISTRIBUTED_TIMEOUT`: the error comes within that timeout;
//! - a model with a parameter the loss never uses, without `find_unused_parameters`:
//!   the error names the variables (c10d's Reducer lists indices) and says how to turn
//!   the option on here, or to freeze them.
//!
//! (Ranks that build different models, and a rendezvous port nobody listens on, are
//! in `entry_errors.rs`.)

use std::process::Command;
use std::time::Duration;

use tch_distributed_tests::{run_tchrun_all_ranks, run_with, scratch_dir, without_launcher, Run};

const WORKER: &str = env!("CARGO_BIN_EXE_error_hints_worker");
const TIMEOUT: Duration = Duration::from_secs(90);

/// `error_hints_worker hello` as one process with `env` as its launch environment.
fn hello(name: &str, env: &[(&str, &str)]) -> Run {
    let dir = scratch_dir(name);
    let mut cmd = Command::new(WORKER);
    without_launcher(&mut cmd)
        .arg("hello")
        .envs(env.iter().copied());
    run_with(cmd, &dir, TIMEOUT, |_, _| {})
}

/// Exit code 1, each of `expected` in stderr, no panic, and the function never ran.
fn assert_clean_failure(run: &Run, expected: &[&str]) {
    assert_eq!(run.status.code(), Some(1), "{run:?}");
    for text in expected {
        assert!(
            run.stderr.contains(text),
            "{text:?} not in:\n{}",
            run.stderr
        );
    }
    assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
    assert!(!run.stdout.contains("hello from"), "{}", run.stdout);
}

#[test]
fn rank_without_world_size_and_world_size_without_rank_say_to_set_both() {
    let run = hello("hint-rank-only", &[("RANK", "0")]);
    assert_clean_failure(
        &run,
        &["Error: reading the launch environment: RANK is set but WORLD_SIZE is not: set both (torchrun and tchrun do)"],
    );
    let run = hello("hint-world-size-only", &[("WORLD_SIZE", "2")]);
    assert_clean_failure(
        &run,
        &["Error: reading the launch environment: WORLD_SIZE is set but RANK is not: set both (torchrun and tchrun do)"],
    );
    // Both set: the same program runs (the errors above come from the environment).
    let run = hello("hint-both", &[("RANK", "0"), ("WORLD_SIZE", "1")]);
    run.assert_success();
    assert!(
        run.stdout.contains("hello from rank 0 of 1"),
        "{}",
        run.stdout
    );
}

#[test]
fn an_unreachable_rendezvous_address_fails_within_the_timeout_and_names_it() {
    // 192.0.2.1 (TEST-NET-1) is never routed: connecting can only time out or fail.
    let run = hello(
        "hint-unreachable",
        &[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "192.0.2.1"),
            ("MASTER_PORT", "29577"),
            ("TCH_DISTRIBUTED_TIMEOUT", "3"),
        ],
    );
    assert_clean_failure(
        &run,
        &[
            "Error: joining the process group: rendezvous at 192.0.2.1:29577 failed (rank 1, world size 2)",
            "could not reach the rendezvous store at 192.0.2.1:29577 within 3 s",
            "do MASTER_ADDR and MASTER_PORT (--master-addr, --master-port) name it on every host?",
        ],
    );
    // The 3 s timeout bounds the wait (the default is 30 minutes); the rest is
    // starting the process and loading libtorch on a busy machine.
    assert!(
        run.elapsed < Duration::from_secs(45),
        "{:?}:\n{}",
        run.elapsed,
        run.stderr
    );
}

const UNUSED_FIX: &str = "turn on find_unused_parameters (#[distributed(find_unused_parameters = true)], or DdpOptions::find_unused_parameters); if they should not train, freeze them (set_requires_grad(false)) before the optimizer is built";

#[test]
fn an_unused_parameter_error_names_the_variables_and_how_to_turn_on_find_unused_parameters() {
    let dir = scratch_dir("hint-unused");
    let run = run_tchrun_all_ranks(
        &dir,
        &["--nproc-per-node", "2", WORKER, "unused"],
        TIMEOUT,
        |_, _| {},
    );
    assert!(!run.status.success(), "{run:?}");
    // The first backward pass goes through; the Reducer notices at the second.
    assert!(
        run.stdout.contains("step 1\n") && !run.stdout.contains("step 2"),
        "{}",
        run.stdout
    );
    // The SDK's message names the variables (the Reducer lists indices) and both
    // fixes; libtorch's own text is its source, not shown.
    for rank in 0..2 {
        let line = run
            .stderr
            .lines()
            .find(|l| l.starts_with(&format!("Error: rank {rank}: backward_step: ")))
            .unwrap_or_else(|| panic!("no error line of rank {rank}:\n{}", run.stderr));
        assert!(
            line.contains(
                "backward_step: variables \"unused.bias\", \"unused.weight\" got no \
                 gradient in the last backward pass, so DDP could not finish averaging"
            ),
            "{line}"
        );
        assert!(line.contains(UNUSED_FIX), "{line}");
    }
    assert!(
        !run.stderr.contains("Expected to have finished reduction"),
        "{}",
        run.stderr
    );
    // A Reducer error inside backward, not a collective that timed out.
    assert!(!run.stderr.contains("timed out"), "{}", run.stderr);
    assert!(!run.stderr.contains("panicked"), "{}", run.stderr);

    // With the option, the same model trains.
    let dir = scratch_dir("hint-unused-found");
    let run = run_tchrun_all_ranks(
        &dir,
        &["--nproc-per-node", "2", WORKER, "unused-found"],
        TIMEOUT,
        |_, _| {},
    );
    run.assert_success();
    assert!(run.stdout.contains("step 3"), "{}", run.stdout);
}

/// The static-graph setting (`static_graph`, `tchrun --static-graph`,
/// `TCH_DISTRIBUTED_STATIC_GRAPH`), as PyTorch DDP's `static_graph=True`: the same
/// program whose unused layer stops it at the second step without the setting trains,
/// and the Reducer averages its gradients from the first step on (that step's
/// all-reduce runs once its backward pass has ended), so rank 0 ends with the weights
/// that `find_unused_parameters = true` gives, each rank having its own batch.
#[test]
fn a_static_graph_trains_a_model_with_an_unused_layer_as_find_unused_parameters_does() {
    let weights = |name: &str, flags: &[&str], env: &[(&str, &str)]| {
        let dir = scratch_dir(name);
        let mut cmd = Command::new(tch_distributed_tests::tchrun());
        cmd.args(["--nproc-per-node", "2"]).args(flags);
        cmd.envs(env.iter().copied());
        let run = run_with(cmd, &dir, TIMEOUT, |_, _| {});
        run.assert_success();
        run.stdout
            .lines()
            .find(|l| l.starts_with("used.weight "))
            .unwrap_or_else(|| panic!("no weights:\n{}", run.stdout))
            .to_string()
    };
    let found = weights("static-found", &[WORKER, "unused-found"], &[]);
    let flag = weights("static-flag", &["--static-graph", WORKER, "unused"], &[]);
    let var = weights(
        "static-var",
        &[WORKER, "unused"],
        &[("TCH_DISTRIBUTED_STATIC_GRAPH", "1")],
    );
    assert_eq!(flag, found);
    assert_eq!(var, found);
}

/// An error of autograd's inside a synchronized backward pass (the gradient
/// all-reduce was armed) is reported as itself, not as a collective that timed out.
#[test]
fn an_autograd_error_inside_a_synchronized_backward_is_not_a_timeout() {
    let dir = scratch_dir("hint-nograd");
    let run = run_tchrun_all_ranks(
        &dir,
        &["--nproc-per-node", "2", WORKER, "nograd"],
        TIMEOUT,
        |_, _| {},
    );
    assert!(!run.status.success(), "{run:?}");
    assert!(!run.stdout.contains("step 1"), "{}", run.stdout);
    assert!(
        run.stderr.contains("Error: rank 0: backward_step: ")
            && run.stderr.contains("does not require grad"),
        "{}",
        run.stderr
    );
    assert!(!run.stderr.contains("timed out"), "{}", run.stderr);
    assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
}

/// Runs the worker's `mode` on 2 ranks (with tchrun's `flags`), which must fail before
/// its first step with every one of `expected` in its errors and no panic; then alone,
/// where it trains (tch's behaviour: one process has no DDP to bypass).
fn refused_on_several_ranks_alone_trains(
    name: &str,
    mode: &str,
    flags: &[&str],
    expected: &[&str],
) {
    let dir = scratch_dir(name);
    let args = [flags, &["--nproc-per-node", "2", WORKER, mode]].concat();
    let run = run_tchrun_all_ranks(&dir, &args, TIMEOUT, |_, _| {});
    assert!(!run.status.success(), "{run:?}");
    assert!(!run.stdout.contains("step 1"), "{}", run.stdout);
    for text in expected {
        assert!(run.stderr.contains(text), "{text}: {}", run.stderr);
    }
    assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
    let mut alone = std::process::Command::new(WORKER);
    without_launcher(&mut alone).arg(mode);
    let alone = run_with(alone, &dir, TIMEOUT, |_, _| {});
    alone.assert_success();
    assert!(alone.stdout.contains("step 1"), "{}", alone.stdout);
}

/// A model converted after its optimizer was built (`vs.double()`, or `vs.half()` and
/// back to the f32 it was) would train apart on each rank (its variables' new gradient
/// accumulators have none of DDP's hooks, nor ZeRO's): an error that names the variable
/// and the fix, on several ranks, under DDP and at ZeRO stage 3; one process trains.
/// (Converted and back, the ranks trained apart silently before: the check compared
/// dtypes.)
#[test]
fn variables_converted_after_the_optimizer_are_refused_on_several_ranks() {
    let cases = [
        ("converted", "Double", &[][..]),
        ("converted-back", "Float", &[][..]),
        ("converted-back", "Float", &["--zero", "3"][..]),
    ];
    for (mode, kind, flags) in cases {
        refused_on_several_ranks_alone_trains(
            &format!("hint-{mode}-{}", flags.len()),
            mode,
            flags,
            &[
                &format!(
                    "variable `net.bias` was converted after its optimizer was built (it is \
                     {kind} on Cpu now"
                ),
                "Convert or load the model before building the optimizer",
            ],
        );
    }
}

/// A layer created after the optimizer (DDP wrapped the model at the build): an error
/// on several ranks (rank 0 names the same variables as rank 1: the names are sorted);
/// one process lets the layer join and train, as tch does.
#[test]
fn variables_created_after_the_optimizer_are_refused_on_several_ranks() {
    refused_on_several_ranks_alone_trains(
        "hint-late",
        "late",
        &[],
        &[
            "2 trainable variable(s) were created on the VarStore after its optimizer was \
             built (head.bias, head.weight): DistributedDataParallel averages the gradients \
             of the variables that existed when it wrapped the model, so these would train \
             apart on each rank. Build the whole model before the optimizer",
        ],
    );
}
