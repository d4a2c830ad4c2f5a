//! Failures at a `#[distributed]` function's entry end the program as `main` returning
//! an error does: `Error: …` naming the problem and the fix, exit code 1, no panic
//! pointing into the SDK's sources and no C++ stack frames.

use std::process::Command;
use std::time::Duration;

use tch_distributed_tests::{free_port, run_with, scratch_dir, without_launcher, Run};

#[path = "support/messages.rs"]
mod messages;

const WORKER: &str = env!("CARGO_BIN_EXE_distributed_program");

/// The marks of an unclean failure.
fn assert_clean(run: &Run, expected: &[&str]) {
    assert_eq!(run.status.code(), Some(1), "stderr:\n{}", run.stderr);
    for bad in [
        "panicked",
        "sdk/src/",
        "Exception raised from",
        "frame #",
        "Internal torch error",
    ] {
        assert!(!run.stderr.contains(bad), "{bad:?} in:\n{}", run.stderr);
    }
    for text in expected {
        assert!(
            run.stderr.contains(text),
            "{text:?} not in:\n{}",
            run.stderr
        );
    }
}

fn worker(dir: &std::path::Path, env: &[(&str, &str)]) -> Run {
    let mut cmd = Command::new(WORKER);
    without_launcher(&mut cmd).arg(dir).arg("8");
    cmd.envs(env.iter().copied());
    run_with(cmd, dir, Duration::from_secs(60), |_, _| {})
}

#[test]
fn a_bad_launch_environment_names_the_variable_and_the_fix() {
    let dir = scratch_dir("entry-bad-rank");
    let run = worker(&dir, &[("RANK", "abc"), ("WORLD_SIZE", "2")]);
    assert_clean(
        &run,
        &[
            "Error: reading the launch environment: RANK=\"abc\" is not a non-negative integer",
            "unset RANK",
        ],
    );
    assert!(run.stderr.starts_with("Error: "), "{}", run.stderr);
}

#[test]
fn a_rendezvous_that_times_out_says_where_and_what_to_check() {
    let dir = scratch_dir("entry-rendezvous");
    // A port nobody listens on: rank 1 waits for rank 0's store, which never comes.
    let port = free_port().to_string();
    let run = worker(
        &dir,
        &[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", &port),
            ("TCH_DISTRIBUTED_TIMEOUT", "3"),
        ],
    );
    assert_clean(
        &run,
        &[
            "Error: joining the process group: rendezvous at 127.0.0.1:",
            "(rank 1, world size 2)",
        ],
    );
}

#[test]
fn ranks_with_different_models_name_the_variable() {
    let dir = scratch_dir("entry-mismatch");
    let mut cmd = Command::new(tch_distributed_tests::tchrun());
    cmd.args(["--nproc-per-node", "2", WORKER, dir.to_str().unwrap(), "8"])
        .env("MISMATCH", "1");
    let run = run_with(cmd, &dir, Duration::from_secs(60), |_, _| {});
    // tchrun's own exit code is 1 when a rank fails; the rank's own line is clean.
    // Every rank stops, each naming every variable that differs and each rank's shape.
    let expected =
        "wrapping the model in DistributedDataParallel: the ranks built different models:\n  \
         variable \"bias\": rank 0 has [1], rank 1 has [2]\n  \
         variable \"weight\": rank 0 has [1, 1], rank 1 has [2, 1]\n\
         hint: every rank must create the same variables";
    assert_clean(
        &run,
        &[
            &format!("Error: rank 0: {expected}"),
            &format!("Error: rank 1: {expected}"),
        ],
    );
    messages::assert_recorded(
        "different-models",
        &messages::message_block(&run.stderr, "Error: rank 0:"),
    );
}

/// The model mismatch error for `MISMATCH=extra` (see `distributed_program`) on `nproc`
/// ranks: rank 0's message block.
fn models_error(nproc: usize, extra: usize) -> String {
    let dir = scratch_dir("entry-mismatch-many");
    let mut cmd = Command::new(tch_distributed_tests::tchrun());
    cmd.args(["--nproc-per-node", &nproc.to_string(), WORKER])
        .args([dir.to_str().unwrap(), "8"])
        .env("MISMATCH", extra.to_string());
    let run = run_with(cmd, &dir, Duration::from_secs(60), |_, _| {});
    assert_clean(&run, &["Error: rank 0: "]);
    let block = messages::message_block(&run.stderr, "Error: rank 0:");
    block
        .split_once("the ranks built different models:\n")
        .unwrap_or_else(|| panic!("{block}"))
        .1
        .split("\nhint: ")
        .next()
        .unwrap()
        .to_string()
}

/// The lines for the variables `extra00` … in `range`, which rank `last` alone has and
/// the ranks that `others` names lack.
fn extra_lines(others: &str, last: usize, range: std::ops::Range<usize>) -> Vec<String> {
    range
        .map(|i| {
            format!("  variable \"extra{i:02}\": {others} no such variable, rank {last} has [1]")
        })
        .collect()
}

#[test]
fn a_model_error_lists_only_what_differs_groups_the_ranks_and_stops_after_ten() {
    // 3 ranks, ranks 0 and 1 alike: the shared layer is not listed, the dtype is shown
    // where it differs (and only there), and of 13 differing variables 10 are listed.
    let mut expected = vec![
        "  variable \"alpha\": ranks 0 and 1 have [1] Float, rank 2 has [1] Double".to_string(),
    ];
    expected.extend(extra_lines("ranks 0 and 1 have", 2, 0..9));
    expected.push("  and 3 more variables".to_string());
    assert_eq!(models_error(3, 12), expected.join("\n"));
}

#[test]
fn a_model_error_with_ten_differing_variables_lists_all_ten() {
    let mut expected =
        vec!["  variable \"alpha\": rank 0 has [1] Float, rank 1 has [1] Double".to_string()];
    expected.extend(extra_lines("rank 0 has", 1, 0..9));
    assert_eq!(models_error(2, 9), expected.join("\n"));
}
