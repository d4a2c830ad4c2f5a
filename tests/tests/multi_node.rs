//! Several hosts, made of network namespaces on this machine (`hosts`): each host has
//! its own address (10.77.0.1, 10.77.0.2, …) and a hostname that resolves to loopback,
//! as on many real machines. No test sets `GLOO_SOCKET_IFNAME`: the SDK must find the
//! interface itself. Needs root and `ip`; without them each test says why it skips
//! (and fails under `CI=true`, which runs as root).

use std::path::Path;
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tch_distributed_tests::hosts::Hosts;
use tch_distributed_tests::{
    compare, example, listening_addresses, run_together, run_with, scratch_dir, skip, torchrun,
    wait_until, Run,
};

#[path = "support/distributed_program_reference.rs"]
mod distributed_program_reference;
#[path = "support/messages.rs"]
mod messages;
use messages::{assert_no_raw_text, assert_recorded, message_block, redact};

const WORKER: &str = env!("CARGO_BIN_EXE_ddp_worker");
const DISTRIBUTED_PROGRAM: &str = env!("CARGO_BIN_EXE_distributed_program");
const STALL: &str = env!("CARGO_BIN_EXE_stall_worker");
const TIMEOUT: Duration = Duration::from_secs(150);
/// The port node 0 hosts the store on: each test's hosts are a network of their own.
const PORT: &str = "29400";

/// `count` hosts, or `None` after recording why they cannot be made here.
fn hosts(count: usize) -> Option<Hosts> {
    match Hosts::new(count) {
        Ok(hosts) => Some(hosts),
        Err(reason) => {
            skip(&format!("no hosts from network namespaces: {reason}"));
            None
        }
    }
}

/// `tchrun --nnodes N --node-rank K --nproc-per-node P --master-addr (host 0)
/// --master-port PORT program args…` on host `k`, with no interface named.
fn tchrun_on(hosts: &Hosts, k: usize, nnodes: usize, nproc: usize, program: &str) -> Command {
    let mut cmd = hosts.command(k, tch_distributed_tests::tchrun());
    cmd.args([
        "--nnodes",
        &nnodes.to_string(),
        "--node-rank",
        &k.to_string(),
    ])
    .args(["--nproc-per-node", &nproc.to_string()])
    .args(["--master-addr", &hosts.addr(0), "--master-port", PORT])
    .arg(program)
    .env_remove("GLOO_SOCKET_IFNAME")
    .env_remove("TCH_DISTRIBUTED_NPROC");
    cmd
}

/// A folder of host `k`'s own under `dir`.
fn host_dir(dir: &Path, k: usize) -> std::path::PathBuf {
    let path = dir.join(format!("host{k}"));
    std::fs::create_dir_all(&path).unwrap();
    path
}

/// `command(k, out)` on both hosts at once, each in a folder `out` of its own under
/// `dir`.
fn on_both_hosts(dir: &Path, command: impl Fn(usize, &Path) -> Command) -> Vec<Run> {
    let runs = (0..2)
        .map(|k| {
            let out = host_dir(dir, k);
            (command(k, &out), out)
        })
        .collect();
    run_together(runs, TIMEOUT, |_, _, _| {})
}

/// Text for the main job: small, so that a few steps on 4 ranks stay quick.
fn write_text(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("input.txt");
    std::fs::write(
        &path,
        "First Citizen:\nBefore we proceed any further, hear me speak.\n\
         All:\nSpeak, speak.\n"
            .repeat(200),
    )
    .unwrap();
    path
}

/// The shakespeare example's arguments for a short run writing `checkpoint`.
fn shakespeare_args(text: &Path, checkpoint: &Path) -> Vec<String> {
    [
        "--data",
        text.to_str().unwrap(),
        "--checkpoint",
        checkpoint.to_str().unwrap(),
        "--steps",
        "6",
        "--log-every",
        "3",
        "--batch-size",
        "8",
        "--seq-len",
        "16",
        "--hidden",
        "32",
        "--seed",
        "7",
    ]
    .map(String::from)
    .to_vec()
}

#[test]
fn the_main_job_trains_on_two_hosts_and_equals_four_ranks_on_one() {
    let Some(hosts) = hosts(2) else { return };
    let dir = scratch_dir("mh-main");
    let text = write_text(&dir);
    let shakespeare = example("shakespeare");
    let [node0, node1]: [Run; 2] = on_both_hosts(&dir, |k, out| {
        let mut cmd = tchrun_on(&hosts, k, 2, 2, shakespeare.to_str().unwrap());
        cmd.args(shakespeare_args(&text, &out.join("model.safetensors")))
            .current_dir(out);
        cmd
    })
    .try_into()
    .unwrap();
    node0.assert_success();
    node1.assert_success();
    // Rank 0 found the interface from its route to the master, and says so.
    assert!(
        node0.stdout.contains(
            "world size 4, local world size 2, devices cpu, rendezvous 10.77.0.1:29400, \
             gloo on 10.77.0.1 (eth0, the route to the master)"
        ),
        "{}",
        node0.stdout
    );
    assert!(node0.stdout.contains("trained 6 steps"), "{}", node0.stdout);

    // The same job, 4 ranks on one host.
    let one = host_dir(&dir, 9);
    let checkpoint = one.join("model.safetensors");
    let mut cmd = Command::new(tch_distributed_tests::tchrun());
    cmd.args(["--nproc-per-node", "4"])
        .arg(&shakespeare)
        .args(shakespeare_args(&text, &checkpoint))
        .env_remove("TCH_DISTRIBUTED_NPROC")
        // Its run directory (runs/shakespeare) goes there too.
        .current_dir(&one);
    run_with(cmd, &one, TIMEOUT, |_, _| {}).assert_success();
    let diff = compare::files(&dir.join("host0/model.safetensors"), &checkpoint);
    assert!(diff.elements > 0, "{diff:?}");
    diff.assert_within(1e-6, "2 hosts × 2 ranks against 1 host × 4 ranks");
}

#[test]
fn a_rank_killed_on_host_1_is_named_on_host_0_within_15_s() {
    let Some(hosts) = hosts(2) else { return };
    let dir = scratch_dir("mh-kill");
    let d = dir.to_str().unwrap().to_string();
    let runs = (0..2)
        .map(|k| {
            let mut cmd = tchrun_on(&hosts, k, 2, 1, STALL);
            // The same job token on both hosts: the failure reports travel under its
            // prefix, as the ranks' keys do.
            cmd.arg(&d)
                .env("TCH_DISTRIBUTED_JOB_TOKEN", "one-job-on-two-hosts");
            (cmd, host_dir(&dir, k))
        })
        .collect();
    let start = Instant::now();
    let killed = Mutex::new(None);
    let store_listens = Mutex::new(Vec::new());
    let [node0, node1]: [Run; 2] = run_together(runs, TIMEOUT, |k, pid, _| {
        if k == 0 {
            // Host 0's tchrun hosts the store: on the master's address alone, once
            // the job trains (rank 0 wrote its pid after its 5th step).
            wait_until("rank 0 trained 5 steps", Duration::from_secs(100), || {
                dir.join("pid0").exists()
            });
            *store_listens.lock().unwrap() = listening_addresses(&[pid]);
            return;
        }
        // Rank 1 (host 1) writes its pid after its 5th step.
        let pid_file = dir.join("pid1");
        let deadline = Instant::now() + Duration::from_secs(100);
        let pid = loop {
            if let Ok(pid) = std::fs::read_to_string(&pid_file)
                .unwrap_or_default()
                .trim()
                .parse()
            {
                break pid;
            }
            assert!(Instant::now() < deadline, "rank 1 wrote no pid");
            std::thread::sleep(Duration::from_millis(20));
        };
        *killed.lock().unwrap() = Some(Instant::now());
        unsafe { libc::kill(pid, libc::SIGKILL) };
    })
    .try_into()
    .unwrap();
    let killed = killed.into_inner().unwrap().expect("rank 1 was killed");
    let store_listens = store_listens.into_inner().unwrap();
    assert!(
        !store_listens.is_empty()
            && store_listens
                .iter()
                .all(|a| a.ip() == std::net::IpAddr::from([10, 77, 0, 1])),
        "host 0's store listens on {store_listens:?}, not on the master's address 10.77.0.1 alone"
    );
    for (k, run) in [(0, &node0), (1, &node1)] {
        assert_eq!(run.status.code(), Some(1), "host {k}: {run:?}");
        let after = (start + run.elapsed).saturating_duration_since(killed);
        assert!(after < Duration::from_secs(15), "host {k} took {after:?}");
        eprintln!("host {k}'s tchrun exited {after:?} after the kill");
    }
    let named = "rank 1 (node 1, 10.77.0.2) was killed by signal SIGKILL (9)";
    // Host 0's tchrun names it, as host 1's reported it through the store ...
    assert!(
        node0
            .stderr
            .contains(&format!("tchrun: {named}, as node 1's tchrun reported")),
        "{}",
        node0.stderr
    );
    // ... and so does rank 0's own error, which its tchrun reports as the root cause.
    assert!(
        node0.stderr.contains(&format!(
            "Error: rank 0: backward_step: backward failed: the gradient all-reduce of backward pass "
        )) && node0.stderr.contains(&format!(
            "{named}, as its launcher reported, so rank 0 lost its connection to it"
        )),
        "{}",
        node0.stderr
    );
    assert!(
        node1.stderr.contains("tchrun: rank 1 (local rank 0, pid "),
        "{}",
        node1.stderr
    );
    assert_no_raw_text(&node0.stderr);
    let seen = format!(
        "{}\n{}",
        message_block(&node0.stderr, "tchrun: rank 1 (node 1"),
        message_block(&node0.stderr, "Error: rank 0:")
    );
    assert_recorded("remote-rank-killed", &redact(&seen, &[("pass ", "{n}")]));
}

#[test]
fn an_unreachable_master_fails_within_the_rendezvous_timeout_naming_its_address() {
    let Some(hosts) = hosts(2) else { return };
    let dir = scratch_dir("mh-unreachable");
    // Host 1 alone: nothing listens on host 0.
    let mut cmd = tchrun_on(&hosts, 1, 2, 1, DISTRIBUTED_PROGRAM);
    cmd.args([dir.to_str().unwrap(), "10"])
        .env("TCH_DISTRIBUTED_TIMEOUT", "5");
    let run = run_with(cmd, &dir, TIMEOUT, |_, _| {});
    assert_eq!(run.status.code(), Some(1), "{run:?}");
    // The rank's 5 s, its start and tchrun's own report (2 s at most) on a busy machine.
    assert!(
        run.elapsed < Duration::from_secs(25),
        "took {:?}",
        run.elapsed
    );
    eprintln!("an unreachable master was reported in {:?}", run.elapsed);
    for part in [
        "Error: joining the process group: rendezvous at 10.77.0.1:29400 failed (rank 1, world size 2): \
         could not reach the rendezvous store at 10.77.0.1:29400 within 5 s: is node 0's launcher",
        "do MASTER_ADDR and MASTER_PORT (--master-addr, --master-port) name it on every host?",
    ] {
        assert!(run.stderr.contains(part), "{part:?} not in:\n{}", run.stderr);
    }
    assert_no_raw_text(&run.stderr);
    assert_recorded(
        "unreachable-store",
        &message_block(&run.stderr, "Error: joining"),
    );
}

#[test]
fn hosts_that_disagree_on_nnodes_are_refused() {
    let Some(hosts) = hosts(2) else { return };
    let dir = scratch_dir("mh-nnodes");
    let d = dir.to_str().unwrap().to_string();
    let runs = on_both_hosts(&dir, |k, _| {
        // Host 1 was told there are 3 nodes.
        let mut cmd = tchrun_on(&hosts, k, 2 + k, 1, DISTRIBUTED_PROGRAM);
        cmd.args([&d, "10"]).env("TCH_DISTRIBUTED_TIMEOUT", "20");
        cmd
    });
    for (k, run) in runs.iter().enumerate() {
        assert_eq!(run.status.code(), Some(1), "host {k}: {run:?}");
        assert!(
            run.stderr.contains(
                "the ranks disagree on the job's size; start tchrun on every host with the \
                 same --nnodes and --nproc-per-node"
            ),
            "host {k}:\n{}",
            run.stderr
        );
    }
    assert_recorded(
        "hosts-disagree",
        &message_block(&runs[1].stderr, "Error: joining"),
    );
}

#[test]
fn torchrun_runs_the_same_binary_across_two_hosts() {
    let Some(hosts) = hosts(2) else { return };
    // Without PyTorch the test is recorded as skipped (a failure under CI=true).
    let Some(torchrun) = torchrun() else { return };
    let dir = scratch_dir("mh-torchrun");
    let runs = on_both_hosts(&dir, |k, out| {
        let mut cmd = hosts.command(k, torchrun.get_program());
        cmd.args(torchrun.get_args())
            .envs(
                torchrun
                    .get_envs()
                    .filter_map(|(key, value)| Some((key, value?))),
            )
            .args(["--nnodes", "2", "--node-rank", &k.to_string()])
            .args(["--nproc-per-node", "1", "--master-addr", &hosts.addr(0)])
            .args([
                "--master-port",
                PORT,
                "--no-python",
                WORKER,
                "train",
                "--out",
            ])
            .arg(&out)
            .env_remove("GLOO_SOCKET_IFNAME");
        cmd
    });
    for (k, run) in runs.iter().enumerate() {
        run.assert_success();
        for line in [
            "ok identical after 20 steps",
            "ok equals one process on the global batch after 20 steps",
        ] {
            assert!(
                run.stdout.contains(line),
                "host {k}: {line:?} not in:\n{}",
                run.stdout
            );
        }
    }
}

#[test]
fn a_slurm_job_step_spans_two_hosts() {
    let Some(hosts) = hosts(2) else { return };
    let dir = scratch_dir("mh-slurm");
    let d = dir.to_str().unwrap().to_string();
    // One task per node, as `srun -N2 --ntasks-per-node=1` starts them; job 71234
    // puts the store on port 15000 + 1234.
    let runs = on_both_hosts(&dir, |k, _| {
        let mut cmd = hosts.command(k, DISTRIBUTED_PROGRAM);
        let task = k.to_string();
        cmd.args([&d, "30"])
            .envs([
                ("SLURM_PROCID", task.as_str()),
                ("SLURM_LOCALID", "0"),
                ("SLURM_NODEID", task.as_str()),
                ("SLURM_STEP_NUM_TASKS", "2"),
                ("SLURM_STEP_TASKS_PER_NODE", "1(x2)"),
                ("SLURM_STEP_NODELIST", "10.77.0.1,10.77.0.2"),
                ("SLURM_JOB_ID", "71234"),
                ("OMP_NUM_THREADS", "1"),
            ])
            .env_remove("GLOO_SOCKET_IFNAME")
            .env_remove("TCH_DISTRIBUTED_NPROC");
        cmd
    });
    for run in &runs {
        run.assert_success();
    }
    assert!(
        runs[0].stdout.contains(
            "world size 2, local world size 1, devices cpu, rendezvous 10.77.0.1:16234, \
             gloo on 10.77.0.1 (eth0, the route to the master)"
        ),
        "{}",
        runs[0].stdout
    );
    let params: Vec<String> = (0..2)
        .map(|r| std::fs::read_to_string(dir.join(format!("params{r}.txt"))).unwrap())
        .collect();
    assert_eq!(params[0], params[1], "one model trained by both hosts");
    distributed_program_reference::assert_model_equals_reference(&dir, 2);
}

#[test]
fn ranks_that_advertise_loopback_to_another_host_are_told_the_fix() {
    let Some(hosts) = hosts(2) else { return };
    // Both hosts' ranks listen on loopback, as PyTorch's default does where the
    // hostname resolves to 127.0.0.1 (the failure that made PyTorch's users learn
    // GLOO_SOCKET_IFNAME): neither can connect to the other. (Gloo connects a pair as
    // soon as one side reaches the other, so one host on loopback is not enough.)
    let dir = scratch_dir("mh-loopback");
    let d = dir.to_str().unwrap().to_string();
    let runs = on_both_hosts(&dir, |k, _| {
        let mut cmd = tchrun_on(&hosts, k, 2, 1, DISTRIBUTED_PROGRAM);
        cmd.args([&d, "10"])
            .env("TCH_DISTRIBUTED_TIMEOUT", "5")
            .env("GLOO_SOCKET_IFNAME", "lo");
        cmd
    });
    for (k, run) in runs.iter().enumerate() {
        assert_eq!(run.status.code(), Some(1), "host {k}: {run:?}");
        assert_no_raw_text(&run.stderr);
        assert!(
            run.elapsed < Duration::from_secs(30),
            "host {k} took {:?}",
            run.elapsed
        );
        eprintln!("host {k}'s tchrun exited after {:?}", run.elapsed);
    }
    // Each rank that failed to connect says so; at least one does before its launcher
    // is told of the other's failure.
    let told: Vec<String> = runs
        .iter()
        .filter(|run| {
            run.stderr
                .contains("could not connect to a peer at 127.0.0.1:")
        })
        .map(|run| message_block(&run.stderr, "Error: joining"))
        .collect();
    assert!(!told.is_empty(), "{runs:?}");
    for message in &told {
        for part in [
            "that is a loopback address: a rank on another host advertised it",
            "Set GLOO_SOCKET_IFNAME=<interface> on that host",
        ] {
            assert!(message.contains(part), "{part:?} not in:\n{message}");
        }
    }
    assert_recorded(
        "loopback-peer",
        &redact(&told[0], &[("127.0.0.1:", "{port}"), ("rank ", "{r}")]),
    );
}

/// Hybrid sharding across hosts (`shard_group = "node"`, 2 hosts × 2 ranks, ZeRO-3 with
/// `fully_shard` units): each host shards the model over its own ranks, and only the
/// gradient shards' all-reduce crosses between the hosts. The parameters equal DDP's
/// on 4 ranks of one host (1e-6), as flat stage 3's do on the same hosts; each rank
/// holds half of the optimizer's state (a quarter when flat); and host 0's link
/// carries less than half the bytes of the flat run (printed: the note's figures).
#[test]
fn hybrid_sharding_across_two_hosts_trains_as_ddp() {
    let Some(hosts) = hosts(2) else { return };
    let dir = scratch_dir("mh-hybrid");
    let worker = env!("CARGO_BIN_EXE_sharding_worker");
    let one = host_dir(&dir, 9);
    let mut cmd = Command::new(tch_distributed_tests::tchrun());
    cmd.args(["--nproc-per-node", "4", worker])
        .arg(&one)
        .arg("ddp.safetensors")
        .env_remove("TCH_DISTRIBUTED_NPROC");
    run_with(cmd, &one, TIMEOUT, |_, _| {}).assert_success();
    let mut crossed = Vec::new();
    for shard_group in ["4", "node"] {
        let before = hosts.bytes(0);
        let runs = on_both_hosts(&dir, |k, out| {
            let mut cmd = tchrun_on(&hosts, k, 2, 2, worker);
            cmd.arg(out)
                .arg("sharded.safetensors")
                .env("TCH_DISTRIBUTED_ZERO", "3")
                .env("TCH_DISTRIBUTED_SHARD_GROUP", shard_group)
                .env("UNITS", "1");
            cmd
        });
        for run in &runs {
            run.assert_success();
        }
        crossed.push(hosts.bytes(0) - before);
        let diff = compare::files(
            &one.join("ddp.safetensors"),
            &dir.join("host0/sharded.safetensors"),
        );
        assert!(diff.elements > 0, "{diff:?}");
        diff.assert_within(1e-6, &format!("shard_group = {shard_group} against DDP"));
        // Adam's two moments of every parameter's rows (l1 13 × 6 and 13, l2 7 × 13
        // and 7, l3 3 × 7 and 3, padded to the shard group) and 6 step counts.
        let group = if shard_group == "node" { 2 } else { 4 };
        let rows = |n: usize| n.div_ceil(group);
        let elements = rows(13) * 7 + rows(7) * 14 + rows(3) * 8;
        for rank in 0..4 {
            let out = host_dir(&dir, rank / 2);
            let bytes = tch_distributed_tests::state_bytes(&out, "sharded.safetensors", rank);
            assert_eq!(
                bytes,
                8 * elements + 4 * 6,
                "shard_group = {shard_group}, rank {rank}"
            );
        }
    }
    eprintln!(
        "bytes through host 0's link: flat stage 3 {}, hybrid (shard_group = node) {}",
        crossed[0], crossed[1]
    );
    assert!(
        2 * crossed[1] < crossed[0],
        "hybrid sharding sent {} bytes between the hosts, flat stage 3 {}",
        crossed[1],
        crossed[0]
    );
}
