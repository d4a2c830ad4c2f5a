//! Every collective gives the right answer on 1, 2 and 3 ranks, for f32, f64 and
//! i64 (the checks themselves live in the `collectives` worker).

use std::time::Duration;

use tch_distributed_tests::{run_tchrun_all_ranks, scratch_dir};

#[path = "support/messages.rs"]
mod messages;

const WORKER: &str = env!("CARGO_BIN_EXE_collectives");

fn check(ranks: usize) {
    let dir = scratch_dir("collectives");
    let run = run_tchrun_all_ranks(
        &dir,
        &["--nproc-per-node", &ranks.to_string(), WORKER],
        Duration::from_secs(60),
        |_, _| {},
    );
    run.assert_success();
    let oks = run.stdout.lines().filter(|l| l.starts_with("ok ")).count();
    // Per dtype: 5 all-reduce ops, broadcast, reduce-scatter and one all-gather check per rank; plus the barrier.
    assert_eq!(
        oks,
        ranks * (3 * (7 + ranks) + 1),
        "stdout:\n{}",
        run.stdout
    );
}

#[test]
fn collectives_on_1_rank() {
    check(1);
}

#[test]
fn collectives_on_2_ranks() {
    check(2);
}

#[test]
fn collectives_on_3_ranks() {
    check(3);
}

/// Rank 1 sleeps instead of joining rank 0's all-reduce: rank 0's error names the
/// operation, the wait and rank 1, found out from the store (alive, but it has entered
/// no collective). Its message is the SDK's alone; libtorch's text is the error's
/// source, which anyhow's `{:#}` shows.
#[test]
fn a_collective_that_times_out_names_the_operation_the_wait_and_the_rank() {
    let dir = scratch_dir("timeout");
    let mut cmd = std::process::Command::new(tch_distributed_tests::tchrun());
    cmd.args(["--nproc-per-node", "2", WORKER, "--hang"])
        .env("TCH_DISTRIBUTED_TIMEOUT", "2");
    let run = tch_distributed_tests::run_with(cmd, &dir, Duration::from_secs(60), |_, _| {});
    let line = |prefix: &str| {
        run.stdout
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("no {prefix:?} in {run:?}"))
            .to_string()
    };
    let plain = line("error: ");
    assert_eq!(
        plain,
        "all_reduce (collective 1 of rank 0) timed out after 2 s: rank 1 did not arrive: it is \
         still running, but it has entered no collective yet. Check rank 1's own output first: \
         an error, a crash or a stop there is the cause, this rank only waited. With NCCL, \
         NCCL_DEBUG=INFO shows where each rank stops. If it is only slow (a long first step, a \
         checkpoint on a slow disk), raise the timeout (TCH_DISTRIBUTED_TIMEOUT, now 2 s)"
    );
    assert!(!plain.contains("libtorch"), "{plain}");
    messages::assert_no_raw_text(&plain);
    // `{:#}`: the message, then libtorch's own text (Gloo's), without C++ frames.
    let alternate = line("alternate: ");
    assert!(
        alternate.starts_with(&format!("{plain}: libtorch: "))
            && alternate.len() > plain.len() + 12,
        "{alternate}"
    );
    messages::assert_no_raw_text(&alternate);
    assert!(
        run.stderr.contains("rank 0 (local rank 0"),
        "{}",
        run.stderr
    );
    assert!(
        run.elapsed < Duration::from_secs(20),
        "took {:?}",
        run.elapsed
    );
    messages::assert_recorded(
        "collective-timeout",
        &messages::redact(&plain, &[("collective ", "{n}")]),
    );
}
