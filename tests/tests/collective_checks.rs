//! `debug = "detail"` (`TCH_DISTRIBUTED_DEBUG=detail`): c10d's `ProcessGroupWrapper`
//! compares every collective across the ranks before it runs (`debug_worker`). A
//! mismatch of shapes (which Gloo alone aborts on) and of kinds (which hangs until the
//! deadlock check alone) are errors on every rank naming each rank's collective; a run
//! whose collectives agree trains to the same bits as without the checks.

use std::path::Path;
use std::time::Duration;

use tch_distributed_tests::{run_tchrun, scratch_dir};

#[path = "support/messages.rs"]
mod messages;

const WORKER: &str = env!("CARGO_BIN_EXE_debug_worker");
const TIMEOUT: Duration = Duration::from_secs(90);

/// `debug_worker mode` on `ranks` ranks, with `debug` (and a deadlock check too late to
/// be the one that finds a mismatch); the scratch directory.
fn run(mode: &str, ranks: usize, debug: &str) -> tch_distributed_tests::Scratch {
    let dir = scratch_dir(&format!("debug-{mode}-{debug}"));
    let run = run_tchrun(
        &dir,
        &[
            "--nproc-per-node",
            &ranks.to_string(),
            "--debug",
            debug,
            "--deadlock-check",
            "600",
            WORKER,
            mode,
            dir.to_str().unwrap(),
        ],
        TIMEOUT,
        |_, _| {},
    );
    run.assert_success();
    dir
}

fn error(dir: &Path, rank: usize) -> String {
    std::fs::read_to_string(dir.join(format!("rank{rank}.txt")))
        .unwrap_or_else(|e| panic!("rank {rank} got no error: {e}"))
}

#[test]
fn shapes_that_differ_are_an_error_naming_each_ranks_tensor() {
    let dir = run("shape", 2, "detail");
    for (rank, other) in [(0, 1), (1, 0)] {
        let expected = format!(
            "all_reduce failed: the ranks called different collectives (debug = \"detail\" \
             compares each one before it runs): rank {rank} is in all_reduce of [{}] Float \
             (its collective 1), rank {other} in all_reduce of [{}] Float (its collective 1).",
            rank + 3,
            other + 3
        );
        let got = error(&dir, rank);
        assert!(got.starts_with(&expected), "rank {rank}: {got}");
    }
}

#[test]
fn collectives_in_different_orders_are_an_error_on_every_rank() {
    let dir = run("order", 3, "detail");
    for rank in 0..3 {
        let got = error(&dir, rank);
        let (mine, theirs) = match rank {
            0 => ("all_reduce", "broadcast"),
            _ => ("broadcast", "all_reduce"),
        };
        assert!(
            got.starts_with(&format!(
                "{mine} failed: the ranks called different collectives"
            )),
            "rank {rank}: {got}"
        );
        assert!(
            got.contains(&format!("rank {rank} is in {mine} of [4] Float")),
            "{got}"
        );
        assert!(got.contains(&format!(" in {theirs} of [4] Float")), "{got}");
    }
    messages::assert_recorded("collective-checks", &error(&dir, 1));
}

#[test]
fn training_whose_collectives_agree_is_unchanged_by_the_checks() {
    let checked = run("train", 2, "detail");
    let plain = run("train", 2, "off");
    for rank in 0..2 {
        let file = format!("rank{rank}.safetensors");
        let read = |dir: &Path| {
            let mut named = tch::Tensor::read_safetensors(dir.join(&file)).unwrap();
            named.sort_by(|x, y| x.0.cmp(&y.0));
            named
        };
        let (a, b) = (read(&checked), read(&plain));
        assert_eq!(a.len(), 4);
        for ((name, x), (_, y)) in a.iter().zip(&b) {
            assert!(x.equal(y), "{name} on rank {rank} differs with the checks");
        }
    }
}
