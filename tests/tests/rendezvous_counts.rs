//! Ranks that do not all arrive at rendezvous: every rank that did says how many of how
//! many joined within the timeout and which are missing (counted in the store); ranks
//! started with different world sizes say so at once. The message is the book's
//! (`book/src/errors/`, see `support/messages.rs`).

use std::net::TcpListener;
use std::process::Command;
use std::time::Duration;

use tch_distributed_tests::{run_with, scratch_dir, without_launcher, Run};

#[path = "support/messages.rs"]
mod messages;
use messages::{assert_no_raw_text, assert_recorded, message_block, redact};

const MACRO: &str = env!("CARGO_BIN_EXE_macro_worker");

#[test]
fn ranks_missing_at_rendezvous_are_counted() {
    // WORLD_SIZE=3 but only ranks 0 and 1 start.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let runs: Vec<Run> = std::thread::scope(|s| {
        let handles: Vec<_> = ["0", "1"]
            .map(|rank| {
                let port = port.clone();
                s.spawn(move || {
                    let dir = scratch_dir(&format!("missing-rank-{rank}"));
                    let mut cmd = Command::new(MACRO);
                    without_launcher(&mut cmd).arg(&dir).arg("8").envs([
                        ("RANK", rank),
                        ("WORLD_SIZE", "3"),
                        ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", port.as_str()),
                        ("TCH_DISTRIBUTED_TIMEOUT", "3"),
                    ]);
                    run_with(cmd, &dir, Duration::from_secs(60), |_, _| {})
                })
            })
            .into();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
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

#[test]
fn ranks_with_different_world_sizes_say_so() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let runs: Vec<Run> = std::thread::scope(|s| {
        let handles: Vec<_> = [("0", "2"), ("1", "3")]
            .map(|(rank, size)| {
                let port = port.clone();
                s.spawn(move || {
                    let dir = scratch_dir(&format!("world-size-{rank}"));
                    let mut cmd = Command::new(MACRO);
                    without_launcher(&mut cmd).arg(&dir).arg("8").envs([
                        ("RANK", rank),
                        ("WORLD_SIZE", size),
                        ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", port.as_str()),
                        ("TCH_DISTRIBUTED_TIMEOUT", "20"),
                    ]);
                    run_with(cmd, &dir, Duration::from_secs(60), |_, _| {})
                })
            })
            .into();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (run, expected) in runs.iter().zip([
        "(rank 0, world size 2): WORLD_SIZE is 2 here but 3 on rank 1: start every rank with the same WORLD_SIZE",
        "(rank 1, world size 3): WORLD_SIZE is 3 here but 2 on rank 0: start every rank with the same WORLD_SIZE",
    ]) {
        assert_eq!(run.status.code(), Some(1), "{run:?}");
        assert_no_raw_text(&run.stderr);
        assert!(run.stderr.contains(expected), "{expected:?} not in:\n{}", run.stderr);
        // At once, not after the 20 s timeout.
        assert!(run.elapsed < Duration::from_secs(15), "took {:?}", run.elapsed);
    }
}
