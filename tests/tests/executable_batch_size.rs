//! `find_executable_batch_size` on 3 ranks (`batch_size_worker`): when one rank runs out
//! of memory, every rank retries with half the batch, and the attempt that fits trains
//! as one process on the same global batch; an error that is not out of memory stops
//! every rank.

use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use tch_distributed_tests::{run_tchrun, run_with, scratch_dir, without_launcher};

const WORKER: &str = env!("CARGO_BIN_EXE_batch_size_worker");
const TIMEOUT: Duration = Duration::from_secs(120);

fn record(dir: &std::path::Path, rank: usize) -> Value {
    let text = std::fs::read_to_string(dir.join(format!("rank{rank}.json")))
        .unwrap_or_else(|e| panic!("rank {rank} wrote no record: {e}"));
    serde_json::from_str(&text).unwrap()
}

fn three_ranks(mode: &str) -> (Vec<Value>, String) {
    let dir = scratch_dir(&format!("batch-size-{mode}"));
    let run = run_tchrun(
        &dir,
        &["--nproc-per-node", "3", WORKER, mode, dir.to_str().unwrap()],
        TIMEOUT,
        |_, _| {},
    );
    run.assert_success();
    (
        (0..3).map(|r| record(&dir, r)).collect(),
        run.stderr.clone(),
    )
}

#[test]
fn one_rank_out_of_memory_halves_the_batch_on_every_rank() {
    // The reference: one process on the global batch of the size that fits (3 × 16).
    let one = scratch_dir("batch-size-one");
    let mut cmd = Command::new(WORKER);
    without_launcher(&mut cmd).args(["fit", one.to_str().unwrap(), "48"]);
    run_with(cmd, &one, TIMEOUT, |_, _| {}).assert_success();
    let reference = record(&one, 0);
    assert_eq!(reference["tried"], serde_json::json!([48]));
    let expected = reference["result"]["weights"].as_array().unwrap();

    let (records, stderr) = three_ranks("oom");
    for (rank, got) in records.iter().enumerate() {
        // Rank 1 ran out at 64 and 32; ranks 0 and 2, which fitted, retried with it.
        assert_eq!(got["tried"], serde_json::json!([64, 32, 16]), "rank {rank}");
        let weights = got["result"]["weights"]
            .as_array()
            .unwrap_or_else(|| panic!("rank {rank}: {}", got["result"]));
        assert_eq!(weights.len(), expected.len());
        for (w, e) in weights.iter().zip(expected) {
            let (w, e) = (w.as_f64().unwrap(), e.as_f64().unwrap());
            assert!(
                (w - e).abs() <= 1e-6,
                "rank {rank}: {w} against one process's {e}"
            );
        }
    }
    assert!(
        stderr.contains(
            "out of memory at batch size 64 on rank 1: every rank retries with batch size 32"
        ),
        "{stderr}"
    );
    // The caught panic's own message is not printed.
    assert!(!stderr.contains("can't allocate memory"), "{stderr}");
}

/// Rank 2 fails with an error of its own while ranks 0 and 1 run out of memory (an
/// error value on one, a real allocator refusal on the other): nobody retries alone.
#[test]
fn another_error_on_one_rank_stops_every_rank() {
    let (records, _) = three_ranks("fail");
    for (rank, got) in records.iter().enumerate() {
        assert_eq!(got["tried"], serde_json::json!([64]), "rank {rank}");
        let error = got["result"]["error"].as_str().unwrap();
        if rank == 2 {
            assert_eq!(error, "rank 2's own failure");
        } else {
            assert!(
                error.starts_with("find_executable_batch_size: rank 2 failed at batch size 64"),
                "rank {rank}: {error}"
            );
        }
    }
}

/// A panic inside an attempt that is not out of memory (a bug of the program's) goes on
/// as the panic it is, with its message: only out-of-memory panics are kept quiet.
#[test]
fn a_panic_of_another_kind_ends_the_process_with_its_message() {
    let dir = scratch_dir("batch-size-panic");
    let mut cmd = Command::new(WORKER);
    without_launcher(&mut cmd).args(["panic", dir.to_str().unwrap()]);
    let run = run_with(cmd, &dir, TIMEOUT, |_, _| {});
    assert_eq!(run.status.code(), Some(101), "{}", run.stderr);
    assert!(
        run.stderr.contains("panicked at")
            && run.stderr.contains("the program's own bug (injected)"),
        "{}",
        run.stderr
    );
    assert!(!dir.join("rank0.json").exists());
}
