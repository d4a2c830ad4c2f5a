//! Timeouts that name the rank: a rank that stalls during training (the others'
//! gradient all-reduce times out and says which rank did not arrive, found out from
//! the store), and rank 0 stalled (named by its heartbeat under tchrun, whose store
//! still answers; when rank 0 hosts the store, the store does not answer either). The
//! messages are the book's (`book/src/errors/`, see `support/messages.rs`).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tch_distributed_tests::{run_with, scratch_dir, ProcessGroup, Run};

#[path = "support/messages.rs"]
mod messages;
use messages::{assert_no_raw_text, assert_recorded, message_block, redact};

const STALL: &str = env!("CARGO_BIN_EXE_stall_worker");

/// The numbers in a message that depend on the SDK's internals (how many collectives
/// it runs before the first step): the book shows them as placeholders. The rest
/// (ranks, backward passes, seconds) is the scenario's.
const VARYING: [(&str, &str); 1] = [("collective ", "{n}")];

/// `stall_worker` on 2 ranks under tchrun with a 3 s timeout and `env`;
/// `while_running` gets the run's directory.
fn stall_run(name: &str, env: &[(&str, &str)], while_running: impl FnOnce(&Path)) -> Run {
    let dir = scratch_dir(name);
    let mut cmd = Command::new(tch_distributed_tests::tchrun());
    cmd.args(["--nproc-per-node", "2", STALL, dir.to_str().unwrap()])
        .env("TCH_DISTRIBUTED_TIMEOUT", "3")
        .envs(env.iter().copied());
    run_with(cmd, &dir, Duration::from_secs(90), |_, dir| {
        while_running(dir)
    })
}

/// The pid that rank `rank` of a `stall_worker` run wrote, once it has.
fn rank_pid(dir: &Path, rank: usize) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let text = std::fs::read_to_string(dir.join(format!("pid{rank}"))).unwrap_or_default();
        if let Ok(pid) = text.trim().parse() {
            return pid;
        }
        assert!(Instant::now() < deadline, "rank {rank} wrote no pid");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_rank_that_stalls_in_training_is_named_by_the_others_timeout() {
    // Rank 1 stops itself (SIGSTOP) after its 5th step: rank 0 waits in the 6th
    // step's gradient all-reduce, inside backward.
    let run = stall_run("stall-rank-1", &[("STOP_RANK", "1")], |_| {});
    assert_eq!(run.status.code(), Some(1), "{run:?}");
    let message = message_block(&run.stderr, "Error: rank 0:");
    assert_no_raw_text(&run.stderr);
    for part in [
        "Error: rank 0: backward_step: the gradient all-reduce of backward pass 6 (collective ",
        "timed out after 3 s: rank 1 did not arrive and has stopped responding",
        "its last was collective ",
        "the gradient all-reduce of backward pass 5",
        "Check rank 1's own output first",
        "NCCL_DEBUG=INFO",
        "TCH_DISTRIBUTED_TIMEOUT, now 3 s",
    ] {
        assert!(message.contains(part), "{part:?} not in:\n{message}");
    }
    assert_recorded("stalled-rank", &redact(&message, &VARYING));
}

#[test]
fn rank_0_stalled_under_tchrun_is_named_by_its_heartbeat() {
    // tchrun hosts the store: with rank 0 stopped the store still answers, and rank 1
    // names rank 0 from its records and heartbeat.
    let run = stall_run("stall-rank-0", &[("STOP_RANK", "0")], |_| {});
    assert_eq!(run.status.code(), Some(1), "{run:?}");
    let message = message_block(&run.stderr, "Error: rank 1:");
    assert_no_raw_text(&run.stderr);
    for part in [
        "the gradient all-reduce of backward pass 6 (collective ",
        "timed out after 3 s: rank 0 did not arrive and has stopped responding",
        "Check rank 0's own output first",
    ] {
        assert!(message.contains(part), "{part:?} not in:\n{message}");
    }
}

#[test]
fn rank_0_stalled_shows_as_a_store_that_does_not_answer_when_rank_0_hosts_it() {
    // Ranks started without a launcher (as srun or mpirun start them): rank 0 hosts
    // the store, so stopped, it answers neither the all-reduce nor the store, and
    // rank 1 says that rank 0 may be the one stalled.
    let dir = scratch_dir("stall-store");
    let port = tch_distributed_tests::free_port().to_string();
    let rank = |r: &str| {
        let mut cmd = Command::new(STALL);
        cmd.arg(dir.to_str().unwrap())
            .envs([
                ("RANK", r),
                ("LOCAL_RANK", r),
                ("WORLD_SIZE", "2"),
                ("LOCAL_WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", &port),
                ("STOP_RANK", "0"),
                ("TCH_DISTRIBUTED_TIMEOUT", "3"),
                ("OMP_NUM_THREADS", "1"),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        cmd
    };
    // Rank 0 stays stopped: its group is killed when the guard drops, whatever rank 1
    // did, on a panic too.
    let rank0 = ProcessGroup::spawn(&mut rank("0")).expect("rank 0 starts");
    let run = run_with(rank("1"), &dir, Duration::from_secs(90), |_, _| {});
    drop(rank0);
    assert_eq!(run.status.code(), Some(1), "{run:?}");
    let message = message_block(&run.stderr, "Error: rank 1:");
    assert_no_raw_text(&run.stderr);
    for part in [
        "the gradient all-reduce of backward pass 6 (collective ",
        "timed out after 3 s: the rendezvous store, which rank 0 hosts, did not answer within 5 s either, so rank 0 may be the one stalled",
        "Check rank 0's own output first",
    ] {
        assert!(message.contains(part), "{part:?} not in:\n{message}");
    }
    assert_recorded("stalled-store", &redact(&message, &VARYING));
}

#[test]
fn a_rank_stopped_from_outside_is_named_and_libtorch_text_shows_when_asked_for() {
    // SIGSTOP from outside, wherever rank 1 is in its step; TORCH_SHOW_CPP_STACKTRACES
    // asks for libtorch's own text, which follows the message as its cause.
    let run = stall_run(
        "stall-sigstop",
        &[("TORCH_SHOW_CPP_STACKTRACES", "1")],
        |dir| {
            let pid = rank_pid(dir, 1);
            rank_pid(dir, 0);
            std::thread::sleep(Duration::from_millis(200));
            unsafe { libc::kill(pid, libc::SIGSTOP) };
        },
    );
    assert_eq!(run.status.code(), Some(1), "{run:?}");
    let message = message_block(&run.stderr, "Error: rank 0:");
    assert!(
        message.contains("Error: rank 0: backward_step: the gradient all-reduce of backward pass "),
        "{message}"
    );
    assert!(
        message.contains("timed out after 3 s: rank 1 "),
        "{message}"
    );
    assert!(
        message.contains("rank 1 did not arrive")
            || message.contains("rank 1 reached it but has stopped responding"),
        "{message}"
    );
    assert!(
        run.stderr.contains("caused by: libtorch: "),
        "no libtorch text in:\n{}",
        run.stderr
    );
}
