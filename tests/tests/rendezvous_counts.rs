//! Ranks that do not all arrive at rendezvous: every rank that did says how many of how
//! many joined within the timeout and which are missing (counted in the store); ranks
//! started with different world sizes say so at once. The message is the book's
//! (`book/src/errors/`, see `support/messages.rs`).

use std::process::Command;
use std::time::Duration;

use tch_distributed_tests::{free_port, run_together, scratch_dir, without_launcher};

#[path = "support/messages.rs"]
mod messages;
use messages::{assert_no_raw_text, assert_recorded, message_block, redact};

const DISTRIBUTED_PROGRAM: &str = env!("CARGO_BIN_EXE_distributed_program");

#[test]
fn ranks_missing_at_rendezvous_are_counted() {
    // WORLD_SIZE=3 but only ranks 0 and 1 start.
    let port = free_port().to_string();
    let dirs: Vec<_> = ["0", "1"]
        .map(|r| scratch_dir(&format!("missing-rank-{r}")))
        .into();
    let ranks = ["0", "1"].iter().zip(&dirs).map(|(rank, dir)| {
        let mut cmd = Command::new(DISTRIBUTED_PROGRAM);
        without_launcher(&mut cmd).arg(dir).arg("8").envs([
            ("RANK", *rank),
            ("WORLD_SIZE", "3"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", port.as_str()),
            ("TCH_DISTRIBUTED_TIMEOUT", "3"),
        ]);
        (cmd, dir)
    });
    let runs = run_together(ranks.collect(), Duration::from_secs(60), |_, _, _| {});
    for (rank, run) in runs.iter().enumerate() {
        assert_eq!(run.status.code(), Some(1), "{run:?}");
        assert_no_raw_text(&run.stderr);
        let message = message_block(&run.stderr, "Error: ");
        let expected = format!(
            "Error: joining the process group: rendezvous at 127.0.0.1:{port} failed (rank {rank}, world size 3): 2 of 3 ranks joined within 3 s (rank 2 is missing)"
        );
        assert!(message.starts_with(&expected), "{message}");
        assert!(
            run.elapsed < Duration::from_secs(30),
            "took {:?}",
            run.elapsed
        );
        if rank == 0 {
            assert_recorded(
                "missing-ranks",
                &redact(&message, &[("127.0.0.1:", "{port}")]),
            );
        }
    }
}

/// Rank 0 with `WORLD_SIZE=2`, rank 1 with 3: both say so at once, whichever arrives
/// last (the last one to arrive completes rank 0's count of 2, so the sizes must be
/// compared then too, not only by the ranks that wait).
#[test]
fn ranks_with_different_world_sizes_say_so() {
    for late in ["0", "1"] {
        let port = free_port().to_string();
        let dirs: Vec<_> = ["0", "1"]
            .map(|r| scratch_dir(&format!("world-size-{r}-late-{late}")))
            .into();
        let ranks = [("0", "2"), ("1", "3")]
            .iter()
            .zip(&dirs)
            .map(|((rank, size), dir)| {
                // The late rank starts a second after the other.
                let mut cmd = Command::new("sh");
                let delay = if *rank == late { "1" } else { "0" };
                cmd.args([
                    "-c",
                    &format!("sleep {delay}; exec \"$0\" \"$@\""),
                    DISTRIBUTED_PROGRAM,
                ]);
                without_launcher(&mut cmd).arg(dir).arg("8").envs([
                    ("RANK", *rank),
                    ("WORLD_SIZE", *size),
                    ("MASTER_ADDR", "127.0.0.1"),
                    ("MASTER_PORT", port.as_str()),
                    ("TCH_DISTRIBUTED_TIMEOUT", "20"),
                ]);
                (cmd, dir)
            });
        let runs = run_together(ranks.collect(), Duration::from_secs(60), |_, _, _| {});
        for (run, expected) in runs.iter().zip([
            "(rank 0, world size 2): WORLD_SIZE is 2 here but 3 on rank 1: the ranks disagree on the job's size; start every rank with the same WORLD_SIZE",
            "(rank 1, world size 3): WORLD_SIZE is 3 here but 2 on rank 0: the ranks disagree on the job's size; start every rank with the same WORLD_SIZE",
        ]) {
            let what = format!("rank {late} late");
            assert_eq!(run.status.code(), Some(1), "{what}: {run:?}");
            assert_no_raw_text(&run.stderr);
            assert!(
                run.stderr.contains(expected),
                "{what}: {expected:?} not in:\n{}",
                run.stderr
            );
            // At once, not after the 20 s timeout.
            assert!(run.elapsed < Duration::from_secs(15), "{what}: took {:?}", run.elapsed);
        }
    }
}
