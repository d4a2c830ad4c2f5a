//! Every collective gives the right answer on 1, 2 and 3 ranks, for f32, f64 and
//! i64 (the checks themselves live in the `collectives` worker).

use std::time::Duration;

use tch_distributed_tests::{run_tchrun, scratch_dir};

const WORKER: &str = env!("CARGO_BIN_EXE_collectives");

fn check(ranks: usize) {
    let dir = scratch_dir("collectives");
    let run = run_tchrun(
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

#[test]
fn a_collective_that_times_out_names_the_operation_and_the_wait() {
    let dir = scratch_dir("timeout");
    let mut cmd = std::process::Command::new(tch_distributed_tests::tchrun());
    cmd.args(["--nproc-per-node", "2", WORKER, "--hang"])
        .env("TCH_DISTRIBUTED_TIMEOUT", "2");
    let run = tch_distributed_tests::run_with(cmd, &dir, Duration::from_secs(60), |_, _| {});
    let line = run
        .stdout
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_else(|| panic!("{run:?}"));
    assert!(
        line.contains("all_reduce failed after waiting 2.0 s"),
        "{line}"
    );
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
}
