//! `main_process_first` and `local_main_process_first`: the other ranks start the
//! closure only after the first rank(s) have finished it (`rank_helpers_worker` records
//! when each rank's closure started and ended; the first ones take 500 ms).

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tch_distributed_tests::{
    free_port, run_tchrun, run_together, scratch_dir, tchrun, without_launcher, Run,
};

const WORKER: &str = env!("CARGO_BIN_EXE_rank_helpers_worker");
const TIMEOUT: Duration = Duration::from_secs(90);

/// (start, end) of rank `r`'s closure.
fn times(dir: &Path, r: usize) -> (u128, u128) {
    let text = fs::read_to_string(dir.join(format!("rank{r}.txt")))
        .unwrap_or_else(|e| panic!("rank {r} did not run the closure: {e}"));
    let (start, end) = text.split_once(' ').unwrap();
    (start.parse().unwrap(), end.parse().unwrap())
}

/// Every rank of `others` started after every rank of `first` had ended.
fn assert_after(dir: &Path, first: &[usize], others: &[usize]) {
    for &f in first {
        let (f_start, f_end) = times(dir, f);
        assert!(f_end - f_start >= 500_000_000, "rank {f} did not sleep");
        for &o in others {
            let (o_start, _) = times(dir, o);
            assert!(
                o_start >= f_end,
                "rank {o} started {} ms before rank {f} ended",
                (f_end - o_start) / 1_000_000
            );
        }
    }
}

#[test]
fn main_process_first_runs_rank_0_before_the_others() {
    let dir = scratch_dir("main-first");
    let run = run_tchrun(
        &dir,
        &[
            "--nproc-per-node",
            "3",
            WORKER,
            "main",
            dir.to_str().unwrap(),
        ],
        TIMEOUT,
        |_, _| {},
    );
    run.assert_success();
    assert_after(&dir, &[0], &[1, 2]);
}

#[test]
fn local_main_process_first_runs_each_nodes_local_rank_0_first() {
    // Two "nodes" of 2 ranks on this machine: ranks 0 and 2 are local rank 0.
    let dir = scratch_dir("local-first");
    let port = free_port().to_string();
    let node = |rank: &str| {
        let mut cmd = Command::new(tchrun());
        without_launcher(&mut cmd);
        cmd.args([
            "--nnodes",
            "2",
            "--node-rank",
            rank,
            "--nproc-per-node",
            "2",
        ])
        .args([
            "--master-port",
            &port,
            WORKER,
            "local",
            dir.to_str().unwrap(),
        ]);
        cmd
    };
    let node1_dir = dir.join("node1");
    fs::create_dir_all(&node1_dir).unwrap();
    let nodes = vec![(node("0"), dir.to_path_buf()), (node("1"), node1_dir)];
    let [node0, node1]: [Run; 2] = run_together(nodes, TIMEOUT, |_, _, _| {})
        .try_into()
        .unwrap();
    node0.assert_success();
    node1.assert_success();
    assert_after(&dir, &[0, 2], &[1, 3]);
    // The two local rank 0s ran at the same time, not one after the other.
    let ((s0, e0), (s2, e2)) = (times(&dir, 0), times(&dir, 2));
    assert!(s0 < e2 && s2 < e0, "the nodes' local rank 0s overlap");
}
