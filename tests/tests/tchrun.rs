//! End-to-end tests of the `tchrun` binary, using `sh` scripts as ranks.

use std::fs;
use std::path::Path;
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use tch_distributed_tests::{rank_line, run_tchrun, scratch_dir};

/// Waits until `n` files named `ready.*` exist in `dir`.
fn wait_ready(dir: &Path, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let ready = fs::read_dir(dir)
            .unwrap()
            .filter(|e| {
                let name = e.as_ref().unwrap().file_name();
                name.to_string_lossy().starts_with("ready.")
            })
            .count();
        if ready >= n {
            return;
        }
        assert!(Instant::now() < deadline, "ranks did not become ready");
        thread::sleep(Duration::from_millis(20));
    }
}

fn send_signal(pid: u32, signal: &str) {
    let out = tch_distributed_tests::output_within(
        Command::new("kill").args([&format!("-{signal}"), &pid.to_string()]),
        b"",
        Duration::from_secs(30),
    );
    assert!(out.status.success(), "kill -{signal} {pid} failed: {out:?}");
}

const TIMEOUT: Duration = Duration::from_secs(30);

/// The lines of a run that showed every rank's stdout, as the ranks wrote them, each
/// checked to come from the rank that its first word names (`$RANK`).
fn lines_of_their_ranks(run: &tch_distributed_tests::Run) -> Vec<&str> {
    run.stdout
        .lines()
        .map(|line| {
            let (rank, text) = rank_line(line);
            let named = text.split(' ').next().and_then(|r| r.parse().ok());
            assert!(
                rank.is_some() && rank == named,
                "{line:?} in:\n{}",
                run.stdout
            );
            text
        })
        .collect()
}

/// A run that tchrun stopped because a rank failed: exit 1 within 10 s, with every
/// `needle` in its stderr.
fn assert_failed_fast(run: &tch_distributed_tests::Run, needles: &[&str]) {
    assert_eq!(run.status.code(), Some(1), "stderr: {}", run.stderr);
    assert!(
        run.elapsed < Duration::from_secs(10),
        "took {:?}",
        run.elapsed
    );
    for needle in needles {
        assert!(
            run.stderr.contains(needle),
            "no {needle:?} in stderr: {}",
            run.stderr
        );
    }
}

#[test]
fn ranks_get_torchrun_environment() {
    let dir = scratch_dir("env");
    let script = "echo \"$RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $MASTER_ADDR \
                  $MASTER_PORT $TCHRUN $TORCHELASTIC_RESTART_COUNT args=$*\"";
    let run = run_tchrun(
        &dir,
        &[
            "--all-ranks-stdout",
            "--nproc-per-node",
            "3",
            "--",
            "sh",
            "-c",
            script,
            "sh",
            "-x",
            "--y",
        ],
        TIMEOUT,
        |_, _| {},
    );
    assert!(run.status.success(), "stderr: {}", run.stderr);
    let mut lines: Vec<Vec<&str>> = lines_of_their_ranks(&run)
        .into_iter()
        .map(|l| l.split(' ').collect())
        .collect();
    lines.sort();
    assert_eq!(lines.len(), 3, "stdout: {}", run.stdout);
    let port = lines[0][5];
    assert_ne!(port.parse::<u16>().unwrap(), 0);
    for (rank, fields) in lines.iter().enumerate() {
        let rank = rank.to_string();
        let expected = [
            &rank,
            &rank,
            "3",
            "3",
            "127.0.0.1",
            port,
            "1",
            "0",
            "args=-x",
            "--y",
        ];
        assert_eq!(fields[..], expected[..], "stdout: {}", run.stdout);
    }
}

#[test]
fn multi_node_ranks_and_explicit_port() {
    let dir = scratch_dir("multinode");
    let run = run_tchrun(
        &dir,
        &[
            "--all-ranks-stdout",
            "--nproc-per-node",
            "2",
            "--nnodes",
            "3",
            "--node-rank",
            "2",
            "--master-port",
            "29555",
            "sh",
            "-c",
            "echo \"$RANK $LOCAL_RANK $WORLD_SIZE $GROUP_RANK $MASTER_PORT\"",
        ],
        TIMEOUT,
        |_, _| {},
    );
    assert!(run.status.success(), "stderr: {}", run.stderr);
    let mut lines = lines_of_their_ranks(&run);
    lines.sort();
    assert_eq!(lines, ["4 0 6 2 29555", "5 1 6 2 29555"]);
}

#[test]
fn failing_rank_stops_the_others() {
    let dir = scratch_dir("exit3");
    let run = run_tchrun(
        &dir,
        &[
            "--nproc-per-node",
            "3",
            "sh",
            "-c",
            "if [ \"$RANK\" = 1 ]; then sleep 0.2; exit 3; fi; exec sleep 60",
        ],
        TIMEOUT,
        |_, _| {},
    );
    assert_failed_fast(
        &run,
        &["rank 1 (local rank 1, pid ", "failed with exit code 3"],
    );
    // Ranks 0 and 2 were stopped by tchrun, not failures of their own.
    assert!(!run.stderr.contains("rank 0 ("), "stderr: {}", run.stderr);
    assert!(!run.stderr.contains("rank 2 ("), "stderr: {}", run.stderr);
}

#[test]
fn rank_killed_by_signal_is_reported() {
    let dir = scratch_dir("kill9");
    let run = run_tchrun(
        &dir,
        &[
            "--nproc-per-node",
            "2",
            "sh",
            "-c",
            "if [ \"$RANK\" = 1 ]; then kill -9 $$; fi; exec sleep 60",
        ],
        TIMEOUT,
        |_, _| {},
    );
    assert_failed_fast(
        &run,
        &[
            "rank 1 (local rank 1, pid ",
            "was killed by signal SIGKILL (9)",
        ],
    );
}

#[test]
fn rank_ignoring_sigterm_is_killed_after_grace() {
    let dir = scratch_dir("grace");
    // Rank 1 fails once rank 0 ignores SIGTERM.
    let script = "if [ \"$RANK\" = 1 ]; then \
                      while [ ! -e \"$D/ready.0\" ]; do sleep 0.05; done; exit 2; \
                  fi; \
                  trap '' TERM; touch \"$D/ready.$RANK\"; while :; do sleep 0.1; done";
    let run = run_tchrun(
        &dir,
        &[
            "--nproc-per-node",
            "2",
            "--stop-grace-seconds",
            "1",
            "sh",
            "-c",
            script,
        ],
        TIMEOUT,
        |_, _| {},
    );
    assert_failed_fast(&run, &["failed with exit code 2", "sending SIGKILL"]);
}

/// Ranks that record the signal they get, then exit.
const TRAP_SCRIPT: &str = "trap 'echo TERM > \"$D/got.$RANK\"; kill $pid; exit 0' TERM; \
                           trap 'echo INT > \"$D/got.$RANK\"; kill $pid; exit 0' INT; \
                           sleep 60 & pid=$!; touch \"$D/ready.$RANK\"; wait";

fn check_forwarded(signal: &str, expected_code: i32) {
    let dir = scratch_dir(signal);
    let run = run_tchrun(
        &dir,
        &["--nproc-per-node", "3", "sh", "-c", TRAP_SCRIPT],
        TIMEOUT,
        |pid, dir| {
            wait_ready(dir, 3);
            send_signal(pid, signal);
        },
    );
    assert_eq!(
        run.status.code(),
        Some(expected_code),
        "stderr: {}",
        run.stderr
    );
    assert!(
        run.elapsed < Duration::from_secs(10),
        "took {:?}",
        run.elapsed
    );
    for rank in 0..3 {
        let got = fs::read_to_string(dir.join(format!("got.{rank}")))
            .unwrap_or_else(|_| panic!("rank {rank} did not get {signal}"));
        assert_eq!(got.trim(), signal);
    }
}

#[test]
fn sigterm_is_forwarded_and_exit_code_is_143() {
    check_forwarded("TERM", 143);
}

#[test]
fn sigint_is_forwarded_and_exit_code_is_130() {
    check_forwarded("INT", 130);
}

#[test]
fn missing_program_is_a_clear_error() {
    let dir = scratch_dir("missing");
    let run = run_tchrun(
        &dir,
        &["--nproc-per-node", "2", "--", "tchrun-no-such-program"],
        TIMEOUT,
        |_, _| {},
    );
    assert!(!run.status.success());
    assert!(
        run.stderr.contains("tchrun-no-such-program")
            && run.stderr.contains("No such file or directory"),
        "stderr: {}",
        run.stderr
    );
}

#[test]
fn configuration_errors() {
    let dir = scratch_dir("config");
    let cases: &[(&[&str], &str)] = &[
        (&["--nproc-per-node", "2"], "no program given"),
        (&["--nproc-per-node", "0", "true"], "--nproc-per-node"),
        (
            &["--nnodes", "2", "--node-rank", "1", "true"],
            "--master-port",
        ),
        (
            &[
                "--nnodes",
                "2",
                "--node-rank",
                "2",
                "--master-port",
                "1234",
                "true",
            ],
            "--node-rank",
        ),
    ];
    for (args, message) in cases {
        let run = run_tchrun(&dir, args, TIMEOUT, |_, _| {});
        assert!(!run.status.success(), "{args:?} succeeded");
        assert!(
            run.stderr.contains(message),
            "{args:?}: stderr: {}",
            run.stderr
        );
    }
}

/// Each rank appends "RANK RESTART_COUNT MAX_RESTARTS USE_AGENT_STORE MASTER_PORT" to
/// `$D/starts` when it starts.
const RECORD_START: &str = "echo \"$RANK $TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS \
                            $TORCHELASTIC_USE_AGENT_STORE $MASTER_PORT\" >> \"$D/starts\"; ";

fn starts(dir: &Path) -> Vec<Vec<String>> {
    let mut lines: Vec<Vec<String>> = fs::read_to_string(dir.join("starts"))
        .unwrap_or_default()
        .lines()
        .map(|l| l.split(' ').map(str::to_string).collect())
        .collect();
    lines.sort();
    lines
}

#[test]
fn max_restarts_starts_every_rank_again_with_the_restart_count() {
    let dir = scratch_dir("restarts");
    // Rank 1 fails in attempts 0 and 1 while rank 0 trains on; attempt 2 succeeds.
    let script = format!(
        "{RECORD_START}a=$TORCHELASTIC_RESTART_COUNT; touch \"$D/up.$RANK.$a\"; \
         if [ $a = 2 ]; then exit 0; fi; \
         if [ \"$RANK\" = 1 ]; then \
             while [ ! -e \"$D/up.0.$a\" ]; do sleep 0.05; done; exit 3; \
         fi; exec sleep 60"
    );
    let run = run_tchrun(
        &dir,
        &[
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "2",
            "sh",
            "-c",
            &script,
        ],
        TIMEOUT,
        |_, _| {},
    );
    assert!(run.status.success(), "stderr: {}", run.stderr);
    assert!(
        run.elapsed < Duration::from_secs(10),
        "took {:?}",
        run.elapsed
    );
    let starts = starts(&dir);
    let port = &starts[0][4];
    assert_ne!(port.parse::<u16>().unwrap(), 0);
    let mut expected = Vec::new();
    for rank in 0..2 {
        for attempt in 0..3 {
            expected.push(vec![
                rank.to_string(),
                attempt.to_string(),
                "2".to_string(),
                // The ranks join tchrun's store under /worker/attempt_N.
                "True".to_string(),
                port.clone(),
            ]);
        }
    }
    assert_eq!(starts, expected, "stderr: {}", run.stderr);
    for needle in [
        "restarting all 2 ranks (restart 1 of 2)",
        "restarting all 2 ranks (restart 2 of 2)",
        "failed with exit code 3",
    ] {
        assert!(run.stderr.contains(needle), "no {needle:?}: {}", run.stderr);
    }
    // Rank 0 was stopped for the restarts, not reported as failing.
    assert!(!run.stderr.contains("rank 0 ("), "stderr: {}", run.stderr);
}

#[test]
fn max_restarts_runs_out() {
    let dir = scratch_dir("restarts-out");
    let script = format!("{RECORD_START}if [ \"$RANK\" = 1 ]; then exit 3; fi; exec sleep 60");
    let run = run_tchrun(
        &dir,
        &[
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "sh",
            "-c",
            &script,
        ],
        TIMEOUT,
        |_, _| {},
    );
    assert_failed_fast(
        &run,
        &[
            "restarting all 2 ranks (restart 1 of 1)",
            "no restarts left (--max-restarts 1), giving up",
        ],
    );
    // Rank 0 may be stopped before it records its start; rank 1 records each one.
    let rank1 = starts(&dir).into_iter().filter(|s| s[0] == "1").count();
    assert_eq!(rank1, 2, "two attempts: {}", run.stderr);
}

#[test]
fn a_signal_to_tchrun_is_forwarded_not_restarted() {
    let dir = scratch_dir("restarts-signal");
    let script = format!("{RECORD_START}{TRAP_SCRIPT}");
    let run = run_tchrun(
        &dir,
        &[
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "3",
            "sh",
            "-c",
            &script,
        ],
        TIMEOUT,
        |pid, dir| {
            wait_ready(dir, 2);
            send_signal(pid, "TERM");
        },
    );
    assert_eq!(run.status.code(), Some(143), "stderr: {}", run.stderr);
    assert_eq!(starts(&dir).len(), 2, "one attempt: {}", run.stderr);
    assert!(!run.stderr.contains("restarting"), "stderr: {}", run.stderr);
}

#[test]
fn a_signal_while_stopping_after_a_failure_is_not_restarted() {
    let dir = scratch_dir("restarts-signal-stopping");
    // Rank 1 fails; rank 0 notes tchrun's SIGTERM and carries on; then tchrun itself
    // gets SIGTERM, before the grace period is over.
    let script = format!(
        "{RECORD_START}if [ \"$RANK\" = 1 ]; then \
             while [ ! -e \"$D/ready.0\" ]; do sleep 0.05; done; exit 2; \
         fi; \
         trap 'touch \"$D/stopping\"' TERM; touch \"$D/ready.$RANK\"; \
         while :; do sleep 0.1; done"
    );
    let run = run_tchrun(
        &dir,
        &[
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "3",
            "--stop-grace-seconds",
            "3",
            "sh",
            "-c",
            &script,
        ],
        TIMEOUT,
        |pid, dir| {
            let deadline = Instant::now() + Duration::from_secs(10);
            while !dir.join("stopping").exists() {
                assert!(Instant::now() < deadline, "rank 0 was not stopped");
                thread::sleep(Duration::from_millis(20));
            }
            send_signal(pid, "TERM");
        },
    );
    assert_eq!(run.status.code(), Some(143), "stderr: {}", run.stderr);
    assert_eq!(starts(&dir).len(), 2, "one attempt: {}", run.stderr);
    assert!(!run.stderr.contains("restarting"), "stderr: {}", run.stderr);
}

/// A rank that fails after writing torchrun's error file (as a Python worker with
/// `@record` does): tchrun names it as the root cause, and copies the file to its own
/// `TORCHELASTIC_ERROR_FILE` when it has one (tchrun under a torchelastic agent).
#[test]
fn a_failing_ranks_error_file_is_reported_as_the_root_cause() {
    let dir = scratch_dir("error-file");
    let own = dir.join("tchrun-error.json");
    let script = "echo \"$TORCHELASTIC_ERROR_FILE\" > \"$D/errfile.$RANK\"; \
                  if [ \"$RANK\" = 1 ]; then \
                      printf '%s' '{\"message\": {\"message\": \"RuntimeError: boom\\nsecond line\", \
                      \"extraInfo\": {\"py_callstack\": \"Traceback\", \"timestamp\": \"1700000000\"}}}' \
                        > \"$TORCHELASTIC_ERROR_FILE\"; \
                      exit 1; \
                  fi; exec sleep 60";
    let mut cmd = Command::new(tch_distributed_tests::tchrun());
    cmd.args(["--nproc-per-node", "2", "sh", "-c", script])
        .env("TORCHELASTIC_ERROR_FILE", &own);
    let run = tch_distributed_tests::run_with(cmd, &dir, TIMEOUT, |_, _| {});
    assert_failed_fast(
        &run,
        &[
            "tchrun: rank 1 (local rank 1, pid ",
            "tchrun: root cause: rank 1 (local rank 1, pid ",
            "): RuntimeError: boom\n    second line\n",
        ],
    );
    let files: Vec<String> = (0..2)
        .map(|r| fs::read_to_string(dir.join(format!("errfile.{r}"))).unwrap())
        .collect();
    assert!(
        !files[0].trim().is_empty() && files[0] != files[1],
        "{files:?}"
    );
    // tchrun removes its ranks' error files when it ends.
    assert!(!Path::new(files[1].trim()).exists(), "{}", files[1]);
    let copied = fs::read_to_string(&own).unwrap();
    assert!(copied.contains("RuntimeError: boom"), "{copied}");
}

#[test]
fn a_rank_without_an_error_file_has_no_root_cause_line() {
    let dir = scratch_dir("no-error-file");
    let run = run_tchrun(
        &dir,
        &[
            "--nproc-per-node",
            "2",
            "sh",
            "-c",
            "if [ \"$RANK\" = 1 ]; then exit 4; fi; exec sleep 60",
        ],
        TIMEOUT,
        |_, _| {},
    );
    assert_failed_fast(&run, &["failed with exit code 4"]);
    assert!(!run.stderr.contains("root cause"), "{}", run.stderr);
}
