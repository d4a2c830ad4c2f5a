//! Launching and failing: torchrun agrees with tchrun, a single process needs no
//! launcher, a taken port and a killed rank fail fast with a clear message.

use std::net::TcpListener;
use std::process::Command;
use std::time::Duration;

use tch_distributed_tests::{
    children, compare, free_port, rank_line, run_tchrun, run_together, run_with, scratch_dir,
    tchrun, torchrun, wait_for_text, Run,
};

#[path = "support/distributed_program_reference.rs"]
mod distributed_program_reference;

const WORKER: &str = env!("CARGO_BIN_EXE_ddp_worker");
const COLLECTIVES: &str = env!("CARGO_BIN_EXE_collectives");
const DISTRIBUTED_PROGRAM: &str = env!("CARGO_BIN_EXE_distributed_program");
const TIMEOUT: Duration = Duration::from_secs(90);

#[test]
fn torchrun_no_python_trains_and_agrees_with_tchrun() {
    // Without PyTorch the test is recorded as skipped (a failure under CI=true).
    let Some(mut cmd) = torchrun() else {
        return;
    };
    let ours = scratch_dir("tchrun");
    run_tchrun(
        &ours,
        &[
            "--nproc-per-node",
            "2",
            WORKER,
            "train",
            "--out",
            ours.to_str().unwrap(),
        ],
        TIMEOUT,
        |_, _| {},
    )
    .assert_success();
    let theirs = scratch_dir("torchrun");
    cmd.args([
        "--standalone",
        "--nproc-per-node",
        "2",
        "--no-python",
        WORKER,
        "train",
        "--out",
        theirs.to_str().unwrap(),
    ]);
    let run = run_with(cmd, &theirs, TIMEOUT, |_, _| {});
    run.assert_success();
    assert_eq!(
        run.stdout.matches("ok identical after 20 steps").count(),
        2,
        "{}",
        run.stdout
    );
    // Each rank checked its parameters against one process on the global batch.
    assert_eq!(
        run.stdout
            .matches("ok equals one process on the global batch after 20 steps")
            .count(),
        2,
        "{}",
        run.stdout
    );
    for rank in 0..2 {
        let file = format!("rank{rank}.safetensors");
        let diff = compare::files(&ours.join(&file), &theirs.join(&file));
        assert!(
            diff.is_exact(),
            "rank {rank}: tchrun and torchrun differ: {diff:?}"
        );
    }
}

#[test]
fn single_process_without_launcher_equals_plain_tch() {
    let dir = scratch_dir("single");
    let mut cmd = Command::new(WORKER);
    cmd.arg("single");
    for var in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ] {
        cmd.env_remove(var);
    }
    let run = run_with(cmd, &dir, TIMEOUT, |_, _| {});
    run.assert_success();
    assert!(
        run.stdout.contains("ok single process equals plain tch"),
        "{}",
        run.stdout
    );
}

#[test]
fn port_in_use_is_a_clear_error_within_seconds() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let dir = scratch_dir("port");
    let run = run_tchrun(
        &dir,
        &["--nproc-per-node", "2", "--master-port", &port, COLLECTIVES],
        TIMEOUT,
        |_, _| {},
    );
    assert!(!run.status.success(), "{}", run.stdout);
    assert!(
        run.elapsed < Duration::from_secs(15),
        "took {:?}",
        run.elapsed
    );
    assert!(
        run.stderr
            .contains(&format!("port {port} on 127.0.0.1 is already in use")),
        "stderr:\n{}",
        run.stderr
    );
    // tchrun hosts the store (as torchrun's agent does): it fails before any rank starts.
    assert!(
        run.stderr
            .contains("so tchrun cannot host the job's rendezvous store")
            && run.stderr.contains("pick another --master-port"),
        "tchrun says it cannot host the store, and the fix:\n{}",
        run.stderr
    );
    assert!(
        !run.stderr.contains("rank 0 (local rank 0"),
        "no rank started:\n{}",
        run.stderr
    );
}

#[test]
fn rank_killed_mid_training_stops_the_job_within_10_seconds() {
    let dir = scratch_dir("sigkill");
    // Every rank's stdout, for rank 1's pid.
    let args = [
        "--all-ranks-stdout",
        "--nproc-per-node",
        "2",
        WORKER,
        "train",
        "--steps",
        "1000000",
        "--sleep-ms",
        "5",
    ];
    let run = run_tchrun(&dir, &args, TIMEOUT, |_, dir| {
        let out = wait_for_text(&dir.join("run.stdout"), "pid 1 ", Duration::from_secs(30));
        let pid: i32 = out
            .lines()
            .find_map(|l| match rank_line(l) {
                (Some(1), text) => text.strip_prefix("pid 1 "),
                _ => None,
            })
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        // Let training get going, then kill rank 1.
        std::thread::sleep(Duration::from_millis(500));
        unsafe { libc::kill(pid, libc::SIGKILL) };
    });
    assert_eq!(run.status.code(), Some(1), "stderr:\n{}", run.stderr);
    assert!(
        run.elapsed < Duration::from_secs(12),
        "took {:?}",
        run.elapsed
    );
    assert!(
        run.stderr.contains("rank 1 (local rank 1, pid"),
        "{}",
        run.stderr
    );
    assert!(run.stderr.contains("SIGKILL"), "{}", run.stderr);
}

/// `srun --ntasks 2` starts both tasks itself with SLURM's variables and no RANK:
/// they form one job (here two tasks of a job step on this host, as srun sets them).
#[test]
fn a_slurm_job_step_forms_the_job_from_srun_variables() {
    // A free port that a job id can name: 15000 + its last 4 digits.
    let start = std::process::id() as u16 % 10000;
    let port = (0..10000u16)
        .map(|i| 15000 + (start + i) % 10000)
        .find(|&p| TcpListener::bind(("127.0.0.1", p)).is_ok())
        .expect("a free port in 15000..25000");
    let dir = scratch_dir("slurm");
    let d = dir.to_str().unwrap();
    let script = format!(
        "for task in 0 1; do \
           SLURM_PROCID=$task SLURM_LOCALID=$task SLURM_NODEID=0 SLURM_STEP_NUM_TASKS=2 \
           SLURM_STEP_TASKS_PER_NODE='2(x1)' SLURM_STEP_NODELIST=localhost SLURM_JOB_ID=7{:04} \
           {DISTRIBUTED_PROGRAM} {d} 30 & pids=\"$pids $!\"; done; \
         for p in $pids; do wait $p || exit 1; done",
        port - 15000
    );
    let mut cmd = Command::new("bash");
    cmd.args(["-c", &script])
        .env_remove("TCH_DISTRIBUTED_NPROC");
    let run = run_with(cmd, &dir, TIMEOUT, |_, _| {});
    run.assert_success();
    assert!(
        run.stdout.contains(&format!(
            "world size 2, local world size 2, devices cpu, rendezvous localhost:{port}"
        )),
        "{}",
        run.stdout
    );
    let params: Vec<String> = (0..2)
        .map(|r| std::fs::read_to_string(dir.join(format!("params{r}.txt"))).unwrap())
        .collect();
    assert_eq!(params[0], params[1], "one model trained by both tasks");
    distributed_program_reference::assert_model_equals_reference(&dir, 2);
}

/// Whether `pid` still runs (exists and is not a zombie).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| {
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .is_some_and(|state| state != "Z")
        })
        .unwrap_or(false)
}

/// Runs `cmd` (a launcher starting 2 ranks), waits until `ready` is in its stdout,
/// SIGKILLs the launcher alone (not its process group) and returns how long its ranks
/// took to exit, or the ranks still running 10 s later.
fn kill_launcher(cmd: Command, name: &str, ready: &str) -> Result<Duration, Vec<u32>> {
    let dir = scratch_dir(name);
    let mut outcome = Err(Vec::new());
    run_with(cmd, &dir, TIMEOUT, |pid, dir| {
        wait_for_text(&dir.join("run.stdout"), ready, Duration::from_secs(60));
        // Training is under way on both ranks.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let ranks = loop {
            let ranks = children(pid);
            if ranks.len() == 2 || std::time::Instant::now() > deadline {
                break ranks;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(ranks.len(), 2, "the launcher's ranks: {ranks:?}");
        std::thread::sleep(Duration::from_millis(500));
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        let killed = std::time::Instant::now();
        outcome = loop {
            let left: Vec<u32> = ranks.iter().copied().filter(|&r| alive(r)).collect();
            if left.is_empty() {
                break Ok(killed.elapsed());
            }
            if killed.elapsed() > Duration::from_secs(10) {
                break Err(left);
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        // run_with kills what is left of the process group once this returns.
    });
    outcome
}

#[test]
fn ranks_exit_when_tchrun_is_sigkilled() {
    let mut cmd = Command::new(tch_distributed_tests::tchrun());
    // Every rank's stdout, for rank 1's pid line.
    cmd.args([
        "--all-ranks-stdout",
        "--nproc-per-node",
        "2",
        WORKER,
        "train",
        "--steps",
        "1000000",
        "--sleep-ms",
        "5",
    ]);
    let took = kill_launcher(cmd, "orphans-tchrun", "[rank 1] pid 1 ")
        .unwrap_or_else(|left| panic!("ranks {left:?} still run 10 s after tchrun died"));
    eprintln!("ranks exited {took:?} after tchrun was killed");
}

#[test]
fn ranks_exit_when_a_self_launching_program_is_sigkilled() {
    let dir = scratch_dir("orphans-self-out");
    let mut cmd = Command::new(DISTRIBUTED_PROGRAM);
    // 2 epochs of 500,000 batches: far longer than the test.
    cmd.args([dir.to_str().unwrap(), "2000000"]);
    tch_distributed_tests::without_launcher(&mut cmd).env("TCH_DISTRIBUTED_NPROC", "2");
    let took = kill_launcher(cmd, "orphans-self", "world size 2")
        .unwrap_or_else(|left| panic!("ranks {left:?} still run 10 s after their launcher died"));
    eprintln!("ranks exited {took:?} after the program that launched them was killed");
}

/// `TCH_DISTRIBUTED_MAX_RESTARTS` is `tchrun --max-restarts` for a program that
/// launches its own ranks: a rank that fails in every attempt is started twice.
#[test]
fn a_self_launching_program_restarts_its_ranks() {
    let dir = scratch_dir("self-restarts");
    let mut cmd = Command::new(DISTRIBUTED_PROGRAM);
    cmd.args([dir.to_str().unwrap(), "40"]);
    tch_distributed_tests::without_launcher(&mut cmd)
        .env("TCH_DISTRIBUTED_NPROC", "2")
        .env("TCH_DISTRIBUTED_MAX_RESTARTS", "1")
        .env("FAIL_RANK", "1");
    let run = run_with(cmd, &dir, TIMEOUT, |_, _| {});
    assert_eq!(run.status.code(), Some(1), "{run:?}");
    assert_eq!(
        run.stderr
            .lines()
            .filter(|l| l.starts_with("Error: rank 1 fails on purpose"))
            .count(),
        2,
        "{}",
        run.stderr
    );
    // The launcher's lines name the program's own launcher and settings, not tchrun's.
    for needle in [
        "tch-distributed: restarting all 2 ranks (restart 1 of 1)",
        "tch-distributed: no restarts left (TCH_DISTRIBUTED_MAX_RESTARTS=1), giving up",
        "tch-distributed: rank 1 (local rank 1, pid ",
        "tch-distributed: root cause: rank 1 (local rank 1, pid ",
    ] {
        assert!(
            run.stderr.contains(needle),
            "no {needle:?}:\n{}",
            run.stderr
        );
    }
    assert!(!run.stderr.contains("tchrun"), "{}", run.stderr);
}

const ERROR_FILE_WORKER: &str = env!("CARGO_BIN_EXE_error_file_worker");

#[path = "support/messages.rs"]
mod messages;

/// tchrun's report of a job whose rank 1 fails as `mode` says (`error_file_worker`):
/// the run, after checking that it failed.
fn failing_under_tchrun(mode: &str, env: &[(&str, &str)]) -> tch_distributed_tests::Run {
    let dir = scratch_dir(&format!("error-file-{mode}"));
    let mut cmd = Command::new(tch_distributed_tests::tchrun());
    cmd.args(["--nproc-per-node", "2", ERROR_FILE_WORKER, mode])
        .env("RUST_BACKTRACE", "0")
        .envs(env.iter().copied());
    let run = run_with(cmd, &dir, TIMEOUT, |_, _| {});
    assert_eq!(run.status.code(), Some(1), "{run:?}");
    run
}

/// A `#[distributed]` rank that fails writes `TORCHELASTIC_ERROR_FILE`, and tchrun's
/// report ends with its message, whichever way it failed.
#[test]
fn tchrun_reports_a_failing_ranks_own_message() {
    // (mode, environment, what the root cause says)
    type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], &'a str);
    let cases: &[Case] = &[
        // `bail!`/`?`: the error that `main` prints.
        ("err", &[], ": Error: rank 1 fails on purpose\n"),
        // `return Err(…)`: the error, as `main` would print it.
        (
            "return",
            &[],
            ": Error: rank 1 returns an error on purpose\n",
        ),
        // An error type without `Debug`: that it failed, no message.
        (
            "opaque",
            &[],
            ": Error: the #[distributed] function returned an Err\n",
        ),
        (
            "panic",
            &[],
            "panicked at tests/src/bin/error_file_worker.rs:",
        ),
        // The SDK's own `Error:` line (here joining fails on every rank: NCCL on the
        // CPU, a setting tchrun accepts and only a rank can refuse).
        (
            "err",
            &[("TCH_DISTRIBUTED_BACKEND", "nccl")],
            ": Error: joining the process group: the NCCL backend needs a CUDA device",
        ),
    ];
    for (mode, env, needle) in cases {
        let run = failing_under_tchrun(mode, env);
        let report = run
            .stderr
            .split_once("tchrun: root cause: rank ")
            .unwrap_or_else(|| panic!("{mode} {env:?}: no root cause:\n{}", run.stderr))
            .1;
        assert!(
            report.contains(needle),
            "{mode} {env:?}: no {needle:?} in the root cause:\n{}",
            run.stderr
        );
        if *mode == "err" && env.is_empty() {
            // The book's troubleshooting chapter shows tchrun's report.
            let lines: Vec<&str> = run
                .stderr
                .lines()
                .filter(|l| {
                    l.starts_with("tchrun: rank 1 (") || l.starts_with("tchrun: root cause")
                })
                .collect();
            let report = messages::redact(&lines.join("\n"), &[("pid ", "{pid}")]);
            messages::assert_recorded("root-cause", &report);
        }
    }
}

/// `torchrun --no-python` reads the error file that a failing rank wrote and shows
/// its message in its report (the root cause), as for a Python worker with `@record`
/// (without it, torchrun's report says only "To enable traceback see: …").
#[test]
fn torchrun_reports_a_failing_ranks_message_as_the_root_cause() {
    // Without PyTorch the test is recorded as skipped (a failure under CI=true).
    if torchrun().is_none() {
        return;
    }
    for (mode, needle) in [
        ("err", "traceback : Error: rank 1 fails on purpose"),
        (
            "panic",
            "traceback : panicked at tests/src/bin/error_file_worker.rs:",
        ),
    ] {
        let dir = scratch_dir(&format!("torchrun-error-file-{mode}"));
        let mut cmd = torchrun().unwrap();
        cmd.args([
            "--standalone",
            "--nproc-per-node",
            "2",
            "--no-python",
            ERROR_FILE_WORKER,
            mode,
        ])
        .env("RUST_BACKTRACE", "0");
        let run = run_with(cmd, &dir, TIMEOUT, |_, _| {});
        assert!(!run.status.success(), "{run:?}");
        // torchrun's report: "traceback : <py_callstack>" for each failed rank. The
        // root cause is the earliest failure by whole seconds, so a rank 0 that
        // torchrun stopped in the same second may stand there instead of rank 1.
        let report = run
            .stderr
            .split_once("ChildFailedError")
            .unwrap_or_else(|| panic!("{mode}: no torchrun report:\n{}", run.stderr))
            .1;
        assert!(
            report.contains("rank      : 1 (local_rank: 1)") && report.contains(needle),
            "{mode}: torchrun does not report rank 1's {needle:?}:\n{}",
            run.stderr
        );
    }
}

/// Two nodes (two `tchrun`s on this machine) under `--max-restarts 1`: node 0's
/// `tchrun` hosts the store, node 1's ranks join it; rank 1 (node 1) fails in the
/// first attempt, both nodes start their ranks again, and the second attempt meets
/// under its own keys and trains to the end.
#[test]
fn two_nodes_restart_together_at_node_0s_store() {
    let port = free_port().to_string();
    let dir = scratch_dir("two-nodes-restart");
    let d = dir.to_str().unwrap();
    // Rank 1 fails after its first step, in the first attempt only.
    let wrapper = "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then export FAIL_RANK=1; fi; \
                   exec \"$0\" \"$@\"";
    let node = |rank: &str| {
        let mut cmd = Command::new(tch_distributed_tests::tchrun());
        cmd.args([
            "--nnodes",
            "2",
            "--node-rank",
            rank,
            "--nproc-per-node",
            "1",
        ])
        .args(["--master-port", &port, "--max-restarts", "1"])
        .args(["sh", "-c", wrapper, DISTRIBUTED_PROGRAM, d, "40"])
        .env_remove("TCH_DISTRIBUTED_NPROC");
        cmd
    };
    let node1_dir = dir.join("node1");
    std::fs::create_dir_all(&node1_dir).unwrap();
    let nodes = vec![(node("0"), dir.to_path_buf()), (node("1"), node1_dir)];
    let [run, node1]: [Run; 2] = run_together(nodes, TIMEOUT, |_, _, _| {})
        .try_into()
        .unwrap();
    run.assert_success();
    node1.assert_success();
    assert!(
        node1.stderr.contains("rank 1 fails on purpose")
            && node1
                .stderr
                .contains("restarting this node's rank (restart 1 of 1)"),
        "{}",
        node1.stderr
    );
    assert!(
        run.stderr
            .contains("restarting this node's rank (restart 1 of 1)"),
        "{}",
        run.stderr
    );
    assert!(
        run.stdout.contains(&format!("rendezvous 127.0.0.1:{port}")),
        "{}",
        run.stdout
    );
    // The second attempt trained both epochs, as one model.
    let params: Vec<String> = (0..2)
        .map(|r| std::fs::read_to_string(dir.join(format!("params{r}.txt"))).unwrap())
        .collect();
    assert_eq!(params[0], params[1], "one model trained by both nodes");
    distributed_program_reference::assert_model_equals_reference(&dir, 2);
}

const HELPER_PRINT: &str = env!("CARGO_BIN_EXE_helper_print_worker");

/// Epochs of `helper_print_worker`: its helper prints one `eval loss` line per epoch.
const EPOCHS: usize = 3;

/// `helper_print_worker EPOCHS` on 2 ranks: under `tchrun` (`tchrun_args` before the
/// program), or, with no `tchrun_args`, launching its own ranks; `env` added.
fn helper_print(name: &str, tchrun_args: Option<&[&str]>, env: &[(&str, &str)]) -> Run {
    let dir = scratch_dir(name);
    let mut cmd = match tchrun_args {
        Some(args) => {
            let mut cmd = Command::new(tch_distributed_tests::tchrun());
            cmd.args(args).args(["--nproc-per-node", "2", HELPER_PRINT]);
            cmd
        }
        None => Command::new(HELPER_PRINT),
    };
    tch_distributed_tests::without_launcher(&mut cmd)
        .arg(EPOCHS.to_string())
        .envs(env.iter().copied());
    if tchrun_args.is_none() {
        cmd.env("TCH_DISTRIBUTED_NPROC", "2");
    }
    let run = run_with(cmd, &dir, TIMEOUT, |_, _| {});
    run.assert_success();
    // Standard error is every rank's, whatever the setting.
    for rank in 0..2 {
        let line = format!("stderr from rank {rank}");
        assert_eq!(
            run.stderr.lines().filter(|l| *l == line).count(),
            1,
            "{line:?} once in:\n{}",
            run.stderr
        );
    }
    run
}

/// The losses of the `eval loss L epoch E` lines among `lines`, in order; panics on any
/// other line that starts with `eval loss` (one cut or mixed with another).
fn eval_losses<'a>(lines: impl Iterator<Item = &'a str>) -> Vec<String> {
    lines
        .filter(|l| l.starts_with("eval loss"))
        .enumerate()
        .map(|(epoch, l)| {
            let (loss, at) = l
                .strip_prefix("eval loss ")
                .and_then(|rest| rest.split_once(" epoch "))
                .unwrap_or_else(|| panic!("not a whole line: {l:?}"));
            assert_eq!(at, epoch.to_string(), "{l:?}");
            assert!(loss.parse::<f64>().is_ok(), "{l:?}");
            loss.to_string()
        })
        .collect()
}

/// By default rank 0's stdout alone: the helper's line once per call, and the
/// function's own line once, no line with a rank before it.
fn assert_rank_0s_stdout_alone(run: &Run) {
    let losses = eval_losses(run.stdout.lines());
    assert_eq!(losses.len(), EPOCHS, "once per epoch:\n{}", run.stdout);
    let done = run.stdout.lines().filter(|l| l.ends_with(" done")).count();
    assert_eq!(done, EPOCHS, "{}", run.stdout);
    assert!(!run.stdout.contains("[rank "), "{}", run.stdout);
}

/// With `all_ranks_stdout`, every rank's stdout: each line after `[rank N] `, whole; the
/// helper's line once per call on each rank (the same losses: one model), the
/// function's own lines and the banner on rank 0 alone.
fn assert_every_ranks_stdout(run: &Run) {
    let mut of_rank: [Vec<&str>; 2] = Default::default();
    for line in run.stdout.lines() {
        let (rank, text) = rank_line(line);
        let rank = rank.unwrap_or_else(|| panic!("no rank before {line:?}:\n{}", run.stdout));
        of_rank[rank].push(text);
    }
    let losses = of_rank.clone().map(|lines| eval_losses(lines.into_iter()));
    assert_eq!(
        losses[0].len(),
        EPOCHS,
        "rank 0, once per epoch:\n{}",
        run.stdout
    );
    assert_eq!(losses[0], losses[1], "rank 1 as rank 0:\n{}", run.stdout);
    let others = |rank: usize| -> Vec<&str> {
        of_rank[rank]
            .iter()
            .copied()
            .filter(|l| !l.starts_with("eval loss"))
            .collect()
    };
    assert!(others(1).is_empty(), "rank 1 printed {:?}", others(1));
    let done: Vec<&str> = others(0)
        .into_iter()
        .filter(|l| !l.starts_with("tch-distributed: backend gloo, world size 2"))
        .collect();
    let expected: Vec<String> = (0..EPOCHS).map(|e| format!("epoch {e} done")).collect();
    assert_eq!(done, expected, "{}", run.stdout);
}

/// A `println!` in a helper that `#[distributed]` cannot see runs on every rank: under
/// `tchrun` it shows once per call, rank 0's, as `torchrun --local-ranks-filter 0`
/// shows; `--all-ranks-stdout` (or its variable) shows every rank's, each line after
/// `[rank N] `. Every rank's stderr shows either way.
#[test]
fn a_helpers_println_shows_once_under_tchrun_and_every_ranks_with_all_ranks_stdout() {
    let run = helper_print("helper-print-tchrun", Some(&[]), &[]);
    assert_rank_0s_stdout_alone(&run);
    let run = helper_print("helper-print-flag", Some(&["--all-ranks-stdout"]), &[]);
    assert_every_ranks_stdout(&run);
    let run = helper_print(
        "helper-print-var",
        Some(&[]),
        &[("TCH_DISTRIBUTED_ALL_RANKS_STDOUT", "1")],
    );
    assert_every_ranks_stdout(&run);
}

/// The same for a program that starts its own ranks: rank 0's stdout alone, every
/// rank's with `TCH_DISTRIBUTED_ALL_RANKS_STDOUT`.
#[test]
fn a_helpers_println_shows_once_when_a_program_starts_its_own_ranks() {
    let run = helper_print("helper-print-self", None, &[]);
    assert!(run.stderr.contains("starting 2 ranks"), "{}", run.stderr);
    assert_rank_0s_stdout_alone(&run);
    let run = helper_print(
        "helper-print-self-all",
        None,
        &[("TCH_DISTRIBUTED_ALL_RANKS_STDOUT", "true")],
    );
    assert_every_ranks_stdout(&run);
}

/// `tchrun env` reports what PyTorch itself reports for the same libtorch (its version,
/// CUDA's, cuDNN's and NCCL's), and the variables that are set, the job token hidden.
#[test]
fn tchrun_env_reports_what_pytorch_reports() {
    let dir = scratch_dir("tchrun-env");
    let mut cmd = Command::new(tchrun());
    cmd.arg("env")
        .env("RANK", "3")
        .env("TCH_DISTRIBUTED_ZERO", "2")
        .env("TCH_DISTRIBUTED_JOB_TOKEN", "not-for-bug-reports");
    let run = run_with(cmd, &dir, Duration::from_secs(60), |_, _| {});
    run.assert_success();
    let report = &run.stdout;
    let field = |name: &str| -> String {
        report
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .unwrap_or_else(|| panic!("no {name} in:\n{report}"))
            .trim()
            .to_string()
    };
    assert!(report.contains("  RANK=3\n"), "{report}");
    assert!(report.contains("  TCH_DISTRIBUTED_ZERO=2\n"), "{report}");
    assert!(
        report.contains("  TCH_DISTRIBUTED_JOB_TOKEN=(set)\n"),
        "{report}"
    );
    assert!(!report.contains("not-for-bug-reports"), "{report}");
    let Some(python) =
        tch_distributed_tests::python_or_skip("the comparison with PyTorch's own report")
    else {
        return;
    };
    let script = "import torch\n\
        print(torch.__version__.split('+')[0])\n\
        print(torch.version.cuda or '')\n\
        print(torch.backends.cudnn.version() or '')\n\
        print('.'.join(map(str, torch.cuda.nccl.version())) if torch.version.cuda else '')\n";
    let out = tch_distributed_tests::output_within(
        Command::new(&python).args(["-c", script]),
        b"",
        tch_distributed_tests::PYTHON_TIMEOUT,
    );
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let torch: Vec<&str> = text.lines().collect();
    assert_eq!(field("libtorch"), torch[0]);
    if !torch[1].is_empty() {
        assert_eq!(field("cuda runtime"), torch[1]);
        let cudnn: u64 = torch[2].parse().unwrap();
        let expected = format!("{}.{}.{}", cudnn / 10000, cudnn % 10000 / 100, cudnn % 100);
        assert_eq!(field("cudnn"), expected);
        if field("backends") == "gloo, nccl" {
            assert_eq!(field("nccl"), torch[3]);
        }
    }
}

/// `tchrun test`: every check passes on 1 and 3 ranks over Gloo, and a job that cannot
/// start (NCCL asked for on the CPU) fails with the SDK's error.
#[test]
fn tchrun_test_checks_collectives_the_store_and_a_ddp_step() {
    const CHECKS: [&str; 8] = [
        "all_reduce (sum, max, min, avg)",
        "broadcast",
        "all_gather",
        "reduce_scatter",
        "broadcast_coalesced",
        "barrier",
        "TCP store",
        "one DDP step against one process",
    ];
    for ranks in ["1", "3"] {
        let dir = scratch_dir("tchrun-test");
        let run = run_tchrun(
            &dir,
            &["test", "--nproc-per-node", ranks],
            TIMEOUT,
            |_, _| {},
        );
        run.assert_success();
        for check in CHECKS {
            assert!(
                run.stdout.contains(&format!("  ok      {check}\n")),
                "{check} on {ranks} rank(s):\n{}",
                run.stdout
            );
        }
        assert!(
            run.stdout.ends_with(&format!(
                "tchrun test: passed on {ranks} rank(s), backend gloo, devices cpu\n"
            )),
            "{}",
            run.stdout
        );
    }
    let dir = scratch_dir("tchrun-test-nccl");
    let run = run_tchrun(
        &dir,
        &["test", "--nproc-per-node", "2", "--backend", "nccl"],
        TIMEOUT,
        |_, _| {},
    );
    assert!(!run.status.success(), "{}", run.stdout);
    assert!(
        run.stderr.contains("Error: tchrun test: "),
        "{}",
        run.stderr
    );
}

/// Two ranks each write 10,000 lines to stderr at once, in pieces (`eprintln!` and
/// `writeln!` make one write per piece of their format, so over a shared stderr their
/// pieces mix mid-line): every line reaches tchrun's stderr whole, in its rank's order;
/// with `--rank-prefix`, after `[rank N] ` naming the rank that wrote it.
#[test]
fn every_line_a_rank_writes_to_stderr_arrives_whole() {
    const LINES: usize = 10_000;
    let worker = env!("CARGO_BIN_EXE_stderr_lines_worker");
    for prefix in [false, true] {
        let dir = scratch_dir(if prefix {
            "stderr-prefix"
        } else {
            "stderr-lines"
        });
        let mut args = vec!["--nproc-per-node", "2"];
        if prefix {
            args.push("--rank-prefix");
        }
        let lines = LINES.to_string();
        args.extend([worker, dir.to_str().unwrap(), &lines]);
        let run = run_tchrun(&dir, &args, TIMEOUT, |_, _| {});
        run.assert_success();
        let mut next = [0usize; 2];
        for line in run.stderr.lines().filter(|l| !l.starts_with("tchrun: ")) {
            let (from, body) = match line.strip_prefix("[rank ") {
                Some(rest) if prefix => {
                    let (n, body) = rest.split_once("] ").unwrap_or_else(|| panic!("{line:?}"));
                    (n.parse::<usize>().ok(), body)
                }
                _ => (None, line),
            };
            assert_eq!(prefix, from.is_some(), "the prefix: {line:?}");
            let whole = body
                .strip_prefix("rank ")
                .and_then(|b| b.strip_suffix(" end"))
                .and_then(|b| {
                    let (rank, rest) = b.split_once(" line ")?;
                    let (i, rest) = rest.split_once(" of ")?;
                    let (n, pad) = rest.split_once(": ")?;
                    let rank: usize = rank.parse().ok()?;
                    let ok =
                        n == lines && pad.len() == 20 + 7 * rank && pad.bytes().all(|b| b == b'x');
                    ok.then_some((rank, i.parse::<usize>().ok()?))
                });
            let (rank, i) = whole.unwrap_or_else(|| panic!("a line was not whole: {line:?}"));
            assert_eq!(from.unwrap_or(rank), rank, "{line:?}");
            assert_eq!(
                i, next[rank],
                "rank {rank}'s lines out of order at {line:?}"
            );
            next[rank] += 1;
        }
        assert_eq!(next, [LINES, LINES], "lines that arrived, per rank");
    }
}
