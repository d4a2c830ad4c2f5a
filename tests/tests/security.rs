//! What a job exposes (the book's Security chapter):
//!
//! - where it listens: a job on one host opens nothing that another machine can
//!   reach. Its rendezvous store (hosted by the launcher, or by rank 0 without one) and
//!   its Gloo pairs listen on loopback only, read from the kernel's socket tables
//!   (`/proc/PID/net/tcp` and `tcp6`) while the job trains;
//! - who can touch its keys: with a job token (`TCH_DISTRIBUTED_JOB_TOKEN`), a client
//!   that lists the keys reads none of the job's values, one that writes the job's
//!   usual key names, even under the job's prefix, changes nothing, and a rank with
//!   another token is refused. These tests host the store themselves, as torchrun's agent does,
//!   so that they know its port without a race and write into it before the ranks start.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tch_distributed::Store;
use tch_distributed_tests::{
    compare, listening_addresses, process_tree, run_tchrun, run_together, run_with, scratch_dir,
    wait_until, without_launcher, Run,
};

const STALL: &str = env!("CARGO_BIN_EXE_stall_worker");
const WORKER: &str = env!("CARGO_BIN_EXE_ddp_worker");
const TIMEOUT: Duration = Duration::from_secs(90);

/// Once both ranks of the job under `launcher` have trained 5 steps (their process
/// group and its Gloo pairs are up), what its processes listen on; then stops it.
fn listening_while_training(launcher: u32, dir: &std::path::Path) -> (Vec<SocketAddr>, usize) {
    wait_until(
        "both ranks trained 5 steps",
        Duration::from_secs(60),
        || dir.join("pid0").exists() && dir.join("pid1").exists(),
    );
    let tree = process_tree(launcher);
    let found = listening_addresses(&tree);
    unsafe { libc::kill(launcher as i32, libc::SIGTERM) };
    (found, tree.len())
}

fn assert_loopback_only(run: &Run, found: &[SocketAddr], processes: usize) {
    assert_eq!(processes, 3, "the launcher and 2 ranks: {run:?}");
    // The store and at least one Gloo pair listen.
    assert!(found.len() >= 2, "too few listening sockets: {found:?}");
    let exposed: Vec<_> = found.iter().filter(|a| !a.ip().is_loopback()).collect();
    assert!(
        exposed.is_empty(),
        "listening beyond loopback: {exposed:?} (all: {found:?})"
    );
}

#[test]
fn a_job_on_one_host_listens_on_loopback_only_under_tchrun() {
    let dir = scratch_dir("listen-tchrun");
    let d = dir.to_str().unwrap().to_string();
    let mut seen = None;
    let run = run_tchrun(
        &dir,
        &["--nproc-per-node", "2", STALL, &d],
        TIMEOUT,
        |pid, _| seen = Some(listening_while_training(pid, &dir)),
    );
    let (found, processes) = seen.unwrap();
    assert_loopback_only(&run, &found, processes);
}

#[test]
fn a_self_launched_job_listens_on_loopback_only() {
    let dir = scratch_dir("listen-self");
    let mut cmd = Command::new(STALL);
    cmd.arg(dir.to_str().unwrap())
        .env("TCH_DISTRIBUTED_NPROC", "2");
    let mut seen = None;
    let run = run_with(cmd, &dir, TIMEOUT, |pid, _| {
        seen = Some(listening_while_training(pid, &dir))
    });
    let (found, processes) = seen.unwrap();
    assert_loopback_only(&run, &found, processes);
}

/// `ddp_worker train` on 2 ranks started by hand as clients of `store` (this test is
/// their agent, as torchrun's: `TORCHELASTIC_USE_AGENT_STORE=True`, attempt 0), rank
/// `r` with `tokens[r]`; each writes its parameters into `out`.
fn two_ranks_of_the_agent_store(store: &Store, tokens: [Option<&str>; 2], out: &Path) -> Vec<Run> {
    let port = store.port().unwrap().to_string();
    let ranks = (0..2)
        .map(|rank| {
            let dir = out.join(format!("run{rank}"));
            std::fs::create_dir_all(&dir).unwrap();
            let mut cmd = Command::new(WORKER);
            without_launcher(&mut cmd)
                .args(["train", "--out", out.to_str().unwrap()])
                .env_remove("TCH_DISTRIBUTED_JOB_TOKEN")
                .envs([
                    ("RANK", rank.to_string()),
                    ("LOCAL_RANK", rank.to_string()),
                    ("WORLD_SIZE", "2".into()),
                    ("LOCAL_WORLD_SIZE", "2".into()),
                    ("MASTER_ADDR", "127.0.0.1".into()),
                    ("MASTER_PORT", port.clone()),
                    ("TORCHELASTIC_USE_AGENT_STORE", "True".into()),
                    ("TORCHELASTIC_RESTART_COUNT", "0".into()),
                    ("TCH_DISTRIBUTED_TIMEOUT", "10".into()),
                ]);
            if let Some(token) = tokens[rank] {
                cmd.env("TCH_DISTRIBUTED_JOB_TOKEN", token);
            }
            (cmd, dir)
        })
        .collect();
    run_together(ranks, TIMEOUT, |_, _, _| {})
}

/// An agent store on loopback, on a free port that it binds itself.
fn agent_store() -> Store {
    Store::tcp("127.0.0.1", 0, 3, true, Duration::from_secs(30)).unwrap()
}

/// What a foreign client writes before the ranks come, under `prefix` (the store's
/// root, or the job's prefix found by listing the keys): the names under which the
/// ranks of attempt 0 count themselves at rendezvous (`tchd/join/…`), as if rank 1
/// had joined already, and a verdict for a job of 3.
fn write_the_usual_names(store: &Store, prefix: &str) {
    let keys = format!("{prefix}/worker/attempt_0/tchd/join");
    store.add(&format!("{keys}/rank/1"), 1).unwrap();
    store.add(&format!("{keys}/count"), 1).unwrap();
    store.set(&format!("{keys}/all"), b"size 0=3").unwrap();
}

/// The one prefix (`job-…`) of the keys listed from a job's store, beside the token's
/// check value; asserts that every other key is under it, and that no value under it
/// reads in the clear: no counter's digits, no rendezvous verdict (`size …`), no
/// loopback address (Gloo's, as text or as bytes).
fn the_job_prefix_hiding_every_value(store: &Store) -> String {
    let keys = store.list_keys().unwrap();
    let job: Vec<&String> = keys.iter().filter(|k| k.starts_with("job-")).collect();
    let first = job
        .first()
        .unwrap_or_else(|| panic!("no key under a job- prefix: {keys:?}"));
    let prefix = first.split('/').next().unwrap().to_string();
    let counters = job.iter().filter(|k| k.ends_with("/count")).count();
    assert!(counters > 0, "no join counter under the prefix: {keys:?}");
    for key in &keys {
        assert!(
            key.starts_with(&format!("{prefix}/")) || key == "tch-distributed/job-token-check",
            "a key outside the job's prefix: {key} (all: {keys:?})"
        );
    }
    for key in job {
        let value = store.get(key).unwrap();
        let text = String::from_utf8_lossy(&value);
        assert!(
            text.parse::<i64>().is_err()
                && !text.contains("size ")
                && !text.contains("127.0.0.1")
                && !value.windows(4).any(|w| w == [127, 0, 0, 1]),
            "{key} reads in the clear: {value:?}"
        );
    }
    prefix
}

#[test]
fn with_a_job_token_a_foreign_client_writing_the_usual_key_names_even_under_its_prefix_changes_nothing(
) {
    let token = Some("a-token-for-this-test");
    // Undisturbed. A foreign client that lists the keys finds the job's prefix, and
    // nothing it can read under it.
    let calm = scratch_dir("token-calm");
    let calm_store = agent_store();
    let runs = two_ranks_of_the_agent_store(&calm_store, [token, token], &calm);
    for run in &runs {
        run.assert_success();
    }
    let prefix = the_job_prefix_hiding_every_value(&calm_store);
    // The same job after a foreign client wrote its usual key names, at the root and
    // under the job's prefix.
    let written = scratch_dir("token-written");
    let store = agent_store();
    write_the_usual_names(&store, "");
    write_the_usual_names(&store, &prefix);
    let runs = two_ranks_of_the_agent_store(&store, [token, token], &written);
    for run in &runs {
        run.assert_success();
    }
    assert!(
        runs[0]
            .stdout
            .contains("ok equals one process on the global batch after 20 steps"),
        "{}",
        runs[0].stdout
    );
    for rank in 0..2 {
        let file = format!("rank{rank}.safetensors");
        let diff = compare::files(&calm.join(&file), &written.join(&file));
        assert!(
            diff.is_exact(),
            "rank {rank}: the writes changed the run: {diff:?}"
        );
    }
    // Without a token the same writes reach the job's keys: rank 1 is refused as a
    // second rank 1 (what the token prevents).
    let bare = scratch_dir("token-none");
    let store = agent_store();
    write_the_usual_names(&store, "");
    let runs = two_ranks_of_the_agent_store(&store, [None, None], &bare);
    assert!(
        runs.iter().any(|r| !r.status.success()),
        "the writes should break a job without a token: {runs:?}"
    );
}

#[test]
fn a_rank_with_another_job_token_is_refused_without_showing_either() {
    let dir = scratch_dir("token-other");
    let runs = two_ranks_of_the_agent_store(
        &agent_store(),
        [
            Some("token-secret-of-rank-0"),
            Some("token-secret-of-rank-1"),
        ],
        &dir,
    );
    let refused = &runs[1];
    assert_eq!(refused.status.code(), Some(1), "{refused:?}");
    assert!(
        refused.stderr.contains(
            "Error: rank 1's job token (TCH_DISTRIBUTED_JOB_TOKEN) differs from rank 0's"
        ),
        "{}",
        refused.stderr
    );
    assert!(
        refused.elapsed < Duration::from_secs(8),
        "refused at once, not at the timeout: {:?}",
        refused.elapsed
    );
    for run in &runs {
        assert!(
            !run.stderr.contains("secret"),
            "a token shown:\n{}",
            run.stderr
        );
    }
    // Rank 0 waits for rank 1 until its rendezvous timeout, and says so.
    assert_eq!(runs[0].status.code(), Some(1), "{:?}", runs[0]);
}

#[test]
fn tchrun_gives_its_ranks_a_token_of_its_own() {
    // The ranks' keys live under the token's prefix: none of them at the store's root
    // under c10d's usual `/worker/attempt_0/` names, and their values sealed.
    let dir = scratch_dir("token-tchrun");
    let d = dir.to_str().unwrap().to_string();
    let mut keys = Vec::new();
    let run = run_tchrun(
        &dir,
        &["--nproc-per-node", "2", STALL, &d],
        TIMEOUT,
        |pid, _| {
            wait_until(
                "both ranks trained 5 steps",
                Duration::from_secs(60),
                || dir.join("pid0").exists() && dir.join("pid1").exists(),
            );
            let port = listening_addresses(&[pid])
                .into_iter()
                .map(|a| a.port())
                .next()
                .expect("tchrun hosts the store");
            let client = Store::tcp("127.0.0.1", port, 3, false, Duration::from_secs(10)).unwrap();
            // Listing the keys mid-run finds their prefix, and no value to read.
            the_job_prefix_hiding_every_value(&client);
            keys.push(client.add("/worker/attempt_0/tchd/join/count", 0).unwrap());
            keys.push(client.add("/worker/attempt_0/tchd/join/rank/0", 0).unwrap());
            unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        },
    );
    assert!(!run.stderr.contains("job token"), "{}", run.stderr);
    assert_eq!(
        keys,
        [0, 0],
        "the ranks counted themselves outside the token's prefix"
    );
}
