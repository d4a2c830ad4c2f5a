//! Every collective gives the right answer on 1, 2 and 3 ranks, for f32, f64 and
//! i64 (the checks themselves live in the `collectives` worker).

use std::time::Duration;

use tch_distributed_tests::{run_tchrun, scratch_dir};

const WORKER: &str = env!("CARGO_BIN_EXE_collectives");

fn check(ranks: usize) {
    let dir = scratch_dir("collectives");
    let run = run_tchrun(&dir, &["--nproc-per-node", &ranks.to_string(), WORKER], Duration::from_secs(60), |_, _| {});
    run.assert_success();
    let oks = run.stdout.lines().filter(|l| l.starts_with("ok ")).count();
    // Per dtype: 5 all-reduce ops, broadcast, reduce-scatter and one all-gather check per rank; plus the barrier.
    assert_eq!(oks, ranks * (3 * (7 + ranks) + 1), "stdout:\n{}", run.stdout);
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
