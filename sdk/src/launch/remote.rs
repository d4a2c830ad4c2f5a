//! What the launchers of a job on several nodes tell each other through its store.
//!
//! When a rank fails, its launcher writes one line for the attempt (which rank, on
//! which node and address, and how it ended: exit code or signal) under
//! `/worker/attempt_{n}/tchd/failure` in the job's store, which node 0's launcher
//! hosts. Every launcher watches that key, and a launcher whose own ranks are still
//! running when another node reports a failure names it and stops them, so no host
//! waits for a collective timeout after a rank elsewhere died. The ranks read the
//! same line when a collective fails on a closed connection, to name the dead peer
//! ([`ProcessGroup`](crate::ProcessGroup)'s errors).
//!
//! The first failure reported wins (an atomic counter decides), so every host names
//! the same root cause. Node 0's launcher, which hosts the store, keeps it (up to
//! [`LINGER`]) until every node's launcher has read the failure, so that none misses
//! it because the store went away first.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::LaunchConfig;
use crate::rendezvous::job_token::{self, JobToken};
use crate::rendezvous::store::Store;

/// The attempt's key space for failures, below the ranks' own prefix.
pub(crate) const FAILURE_PREFIX: &str = "tchd/failure";
/// How often a launcher looks for another node's failure.
const POLL: Duration = Duration::from_millis(200);
/// How long a launcher that must report a failure tries to reach the store when its
/// watcher has not yet.
const REPORT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one attempt of the watcher to connect waits: short, so that it retries
/// at its own pace rather than c10d's growing back-off.
const CONNECT_TRY: Duration = Duration::from_secs(1);
/// How long node 0's launcher keeps the store, after a failure, for the other nodes'
/// launchers to read it.
const LINGER: Duration = Duration::from_secs(5);
/// How long a launcher keeps trying to reach the store (node 0's launcher may start
/// later than this one).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1800);

/// A failure that a node reported: its node rank, and the line that says it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Failure {
    pub node_rank: usize,
    pub line: String,
}

impl Failure {
    /// As the store holds it: `{node_rank}\n{line}`.
    fn encode(&self) -> Vec<u8> {
        format!("{}\n{}", self.node_rank, self.line).into_bytes()
    }

    pub(crate) fn decode(value: &[u8]) -> Option<Failure> {
        let text = std::str::from_utf8(value).ok()?;
        let (node, line) = text.split_once('\n')?;
        Some(Failure {
            node_rank: node.parse().ok()?,
            line: line.to_string(),
        })
    }
}

/// This launcher's link to the others for one attempt; does nothing on one node.
pub(super) struct Remote {
    node_rank: usize,
    /// Only with several nodes is there anyone to tell.
    nnodes: usize,
    /// Whether the watcher has reached the store (else nothing can have come).
    connected: Arc<AtomicBool>,
    /// Where the store is: node 0's launcher, at `master_addr:port`.
    master: (String, u16),
    world_size: usize,
    /// The attempt's key space for failures, in the job's view of the store
    /// (`job_token::view`).
    prefix: String,
    token: Option<JobToken>,
    /// `node K, ADDRESS`: this node as the others' lines name it.
    node: String,
    /// The store under the attempt's failure prefix, once connected.
    store: Arc<Mutex<Option<Store>>>,
    reported: Option<Receiver<Failure>>,
    stop: Arc<AtomicBool>,
}

impl Remote {
    /// Connects (in a thread of its own, retrying while node 0's launcher starts) to
    /// the store at `config.master_addr:port`, and watches it for the failures of
    /// attempt `attempt`.
    pub(super) fn watch(
        config: &LaunchConfig,
        port: u16,
        attempt: usize,
        token: Option<&JobToken>,
    ) -> Remote {
        let store = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let mut remote = Remote {
            node_rank: config.node_rank,
            nnodes: config.nnodes,
            connected: Arc::new(AtomicBool::new(false)),
            master: (config.master_addr.clone(), port),
            world_size: config.world_size(),
            prefix: format!("/worker/attempt_{attempt}/{FAILURE_PREFIX}"),
            token: token.cloned(),
            node: format!("node {}", config.node_rank),
            store: Arc::clone(&store),
            reported: None,
            stop: Arc::clone(&stop),
        };
        if config.nnodes == 1 {
            return remote;
        }
        if let Some(address) =
            crate::rendezvous::network::address_towards(&config.master_addr, port)
        {
            remote.node = format!("node {}, {address}", config.node_rank);
        }
        let (tx, rx) = mpsc::channel();
        remote.reported = Some(rx);
        let (addr, world_size) = (config.master_addr.clone(), config.world_size());
        let (prefix, token) = (remote.prefix.clone(), remote.token.clone());
        let connected = Arc::clone(&remote.connected);
        let own_node = config.node_rank;
        let spawned = std::thread::Builder::new()
            .name("tchd-remote".into())
            .spawn(move || {
                let deadline = std::time::Instant::now() + CONNECT_TIMEOUT;
                let client = loop {
                    if stop.load(Ordering::Relaxed) || std::time::Instant::now() > deadline {
                        return;
                    }
                    match Store::tcp(&addr, port, world_size, false, CONNECT_TRY) {
                        Ok(client) => break client,
                        Err(_) => std::thread::sleep(POLL),
                    }
                };
                let open_view = || job_token::view(&client, token.as_ref(), &prefix);
                let (Ok(view), Ok(reader)) = (open_view(), open_view()) else {
                    return;
                };
                // Unless `report` connected first.
                store
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_or_insert(view);
                connected.store(true, Ordering::Relaxed);
                while !stop.load(Ordering::Relaxed) {
                    match reader.add("count", 0) {
                        Ok(0) => {}
                        Ok(_) => {
                            if let Some(failure) =
                                reader.get("first").ok().and_then(|v| Failure::decode(&v))
                            {
                                // Node 0's launcher keeps the store until all have seen
                                // it; the reporting node counted itself.
                                if failure.node_rank != own_node {
                                    let _ = reader.add("seen", 1);
                                }
                                let _ = tx.send(failure);
                            }
                            return;
                        }
                        // Node 0's launcher is gone: its own ranks' failures say why.
                        Err(_) => return,
                    }
                    std::thread::sleep(POLL);
                }
            });
        if let Err(e) = spawned {
            crate::log::warn(format_args!(
                "no thread to watch the other nodes ({e}): a failure there is seen only by the ranks"
            ));
        }
        remote
    }

    /// Tells the other nodes that `line` happened here, unless a failure was reported
    /// first (the first one is the job's root cause). Connects first when the
    /// watcher has not yet (a rank that fails at once), for up to [`REPORT_TIMEOUT`].
    pub(super) fn report(&self, line: &str) {
        if self.nnodes == 1 {
            return;
        }
        let mut guard = self.store.lock().unwrap_or_else(|e| e.into_inner());
        if guard.is_none() {
            let (addr, port) = (&self.master.0, self.master.1);
            *guard = Store::tcp(addr, port, self.world_size, false, REPORT_TIMEOUT)
                .and_then(|client| job_token::view(&client, self.token.as_ref(), &self.prefix))
                .ok();
        }
        let Some(store) = guard.as_ref() else {
            return;
        };
        let failure = Failure {
            node_rank: self.node_rank,
            line: line.to_string(),
        };
        if let Ok(1) = store.add("count", 1) {
            let _ = store.set("first", &failure.encode());
            let _ = store.add("seen", 1);
        }
    }

    /// This node as a failure's line names it: `node K, ADDRESS`.
    pub(super) fn node(&self) -> &str {
        &self.node
    }

    /// A failure that another node reported, once; waits up to `wait` for the
    /// watcher's answer (which comes at once when this node reported first).
    pub(super) fn failure_elsewhere(&mut self, wait: Duration) -> Option<Failure> {
        if !self.connected.load(Ordering::Relaxed) {
            return None;
        }
        let failure = self.reported.as_ref()?.recv_timeout(wait).ok()?;
        self.reported = None;
        (failure.node_rank != self.node_rank).then_some(failure)
    }

    /// On node 0, whose launcher hosts the store, after a failure was reported: waits,
    /// up to [`LINGER`], until every node's launcher has read it, so that the store
    /// does not go away with this launcher before the others learn why to stop.
    pub(super) fn linger(&self) {
        if self.nnodes == 1 || self.node_rank != 0 {
            return;
        }
        let guard = self.store.lock().unwrap_or_else(|e| e.into_inner());
        let Some(store) = guard.as_ref() else {
            return;
        };
        if !matches!(store.add("count", 0), Ok(n) if n > 0) {
            return;
        }
        let deadline = std::time::Instant::now() + LINGER;
        while std::time::Instant::now() < deadline {
            match store.add("seen", 0) {
                Ok(seen) if seen < self.nnodes as i64 => std::thread::sleep(POLL),
                _ => return,
            }
        }
    }
}

impl Drop for Remote {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_reads_back_as_written() {
        let failure = Failure {
            node_rank: 3,
            line: "rank 7 (node 3, 10.0.0.4) was killed by signal SIGKILL (9)".into(),
        };
        assert_eq!(Failure::decode(&failure.encode()), Some(failure));
        assert_eq!(Failure::decode(b"x\nline"), None);
        assert_eq!(Failure::decode(b"no newline"), None);
    }
}
