//! Distributed inference (`split_between_processes`): on 3 ranks, each rank is given
//! Accelerate's contiguous part of the items, and every rank gets back exactly what one
//! process computing all of them gets (`inference_worker` run alone), in order, with no
//! duplicates, for JSON values, for padded parts and for tensors.

use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use tch_distributed_tests::{run_tchrun, run_with, scratch_dir, without_launcher};

const WORKER: &str = env!("CARGO_BIN_EXE_inference_worker");
const TIMEOUT: Duration = Duration::from_secs(90);

fn record(dir: &std::path::Path, rank: usize) -> Value {
    let text = std::fs::read_to_string(dir.join(format!("rank{rank}.json")))
        .unwrap_or_else(|e| panic!("rank {rank} wrote no record: {e}"));
    serde_json::from_str(&text).unwrap()
}

fn items(range: std::ops::Range<usize>) -> Value {
    range.map(|i| format!("item-{}", "x".repeat(i))).collect()
}

#[test]
fn three_ranks_gather_what_one_process_computes_in_order() {
    let one = scratch_dir("inference-one");
    let mut cmd = Command::new(WORKER);
    without_launcher(&mut cmd).arg(one.as_os_str());
    run_with(cmd, &one, TIMEOUT, |_, _| {}).assert_success();
    let reference = record(&one, 0);
    assert_eq!(reference["given"], items(0..10));

    let dir = scratch_dir("inference-three");
    run_tchrun(
        &dir,
        &["--nproc-per-node", "3", WORKER, dir.to_str().unwrap()],
        TIMEOUT,
        |_, _| {},
    )
    .assert_success();
    let last = items(9..10)[0].clone();
    for (rank, (part, padded_extra)) in [(0..4, 0), (4..7, 1), (7..10, 1)].into_iter().enumerate() {
        let got = record(&dir, rank);
        // Accelerate's split: 4, 3, 3 items; padded, the last item again.
        assert_eq!(got["given"], items(part.clone()), "rank {rank}");
        let mut padded = items(part).as_array().unwrap().clone();
        padded.extend(std::iter::repeat_n(last.clone(), padded_extra));
        assert_eq!(got["given_padded"], Value::from(padded), "rank {rank}");
        // Every rank: one process's results, in order, none twice.
        assert_eq!(got["strings"], reference["strings"], "rank {rank}");
        assert_eq!(got["padded"], reference["strings"], "rank {rank}");
        assert_eq!(got["tensor_shape"], reference["tensor_shape"]);
        let (a, b) = (
            got["tensor"].as_array().unwrap(),
            reference["tensor"].as_array().unwrap(),
        );
        assert_eq!(a.len(), 30);
        for (x, y) in a.iter().zip(b) {
            let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            assert!(
                (x - y).abs() <= 1e-6 * y.abs().max(1.0),
                "rank {rank}: {x} vs {y}"
            );
        }
        // A wrong count on rank 1: the same error on every rank.
        assert_eq!(
            got["wrong_count"],
            "split_between_processes: on rank 1, the closure was given 3 items \
             and returned 2 results: return one result per item (a Vec entry, or a tensor \
             row on dim 0), so that the gather can put them back in order",
            "rank {rank}"
        );
        // Rows of another shape on rank 1: every rank names it.
        let wrong_layout = got["wrong_layout"].as_str().unwrap();
        assert!(
            wrong_layout.starts_with(
                "split_between_processes: rank 1 returned tensors of another dtype or \
                 shape past dim 0 than rank 0"
            ),
            "rank {rank}: {wrong_layout}"
        );
    }
}
