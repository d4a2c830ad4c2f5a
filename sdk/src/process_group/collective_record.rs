//! What each rank is doing, kept in the store, so that a collective that times out
//! can say which rank did not arrive.
//!
//! Each rank records in the store the number and name of every collective it enters
//! (one `set`, which TCPStore sends without waiting for an answer); DDP records each
//! synchronized backward pass, whose gradient all-reduce runs inside libtorch, the
//! same way. A thread of each rank also beats a heartbeat there once a second. When a
//! collective times out, the rank reads every rank's record and watches the
//! heartbeats for a few seconds:
//!
//! - a rank whose count is below this rank's did not arrive;
//! - a rank whose heartbeat stopped is stopped (`SIGSTOP`), hung in native code or
//!   dead, wherever it was;
//! - a rank at the same count but in another collective called collectives in
//!   another order.
//!
//! When the store itself does not answer, its host may be the one stalled: rank 0
//! when the ranks host the store themselves (SLURM, MPI, ranks started by hand), the
//! launcher when tchrun or torchrun hosts it.
//!
//! Some waits cannot end but at the timeout: the ranks called collectives in
//! different orders (rank 0 in the exit barrier, having left its loop, while rank 1
//! is in the next step's gradient all-reduce). The heartbeat thread watches for that
//! while this rank waits: once a collective has waited the run's `deadlock_check`
//! (5 s by default), it reads the other ranks' records every beat, and when one of
//! them entered another collective under the same number, the deadlock is certain:
//! it ends this rank at once with the timeout's diagnosis
//! ([`Error::Deadlock`](crate::Error::Deadlock)), and the launcher stops the others.
//! A rank that is behind, computing in no collective, is no proof: it waits for the
//! timeout as before. Each beat reads at most [`WINDOW`] ranks' records, in turn, so
//! that the store's load stays bounded in large jobs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::{seconds, Error, Result};
use crate::launch::remote::{Failure, FAILURE_PREFIX};
use crate::rendezvous::store::{Host, Store};

/// How often a rank's heartbeat beats.
const BEAT: Duration = Duration::from_secs(1);
/// How long a diagnosis watches the heartbeats: more than two beats.
const WATCH: Duration = Duration::from_millis(2500);
/// How long a diagnosis waits for the store to answer.
const STORE_WAIT: Duration = Duration::from_secs(5);
/// At most this many ranks are described one by one.
const LISTED: usize = 8;
/// At most this many other ranks' records are read per beat while watching for a
/// deadlock.
const WINDOW: usize = 16;
/// How long a collective waits before the other ranks' records are read, when the
/// run does not say (`deadlock_check`).
pub(crate) const DEADLOCK_CHECK: Duration = Duration::from_secs(5);

/// This rank's record of its collectives, and its heartbeat; see the module's doc.
pub(crate) struct CollectiveRecord {
    rank: usize,
    world_size: usize,
    entered: AtomicU64,
    /// The collective this rank is in, shared with the heartbeat, which watches it.
    watch: Arc<Watch>,
    /// The store under this group's prefix (`tchd/pg{k}`), shared with the heartbeat.
    view: Arc<Store>,
    /// The store under the attempt's failure prefix, where launchers report a rank
    /// that failed (see `launch::remote`).
    failures: Store,
    key: String,
    /// Dropping it stops the heartbeat.
    _heartbeat: mpsc::Sender<()>,
}

/// What a diagnosis found: the ranks it can name, and the sentence that says so.
pub(crate) struct Findings {
    pub stalled: Vec<usize>,
    pub report: String,
}

/// One rank's record: the number of the last collective it entered, and its name.
type Record = (u64, String);

/// What the heartbeat watches: the collective this rank waits in, and after how long
/// the other ranks' records are read.
struct Watch {
    /// The collective's number and name, and when this rank entered it; `None`
    /// between collectives.
    waiting: Mutex<Option<(u64, String, Instant)>>,
    /// Milliseconds a collective waits before the records are read.
    check_after_ms: AtomicU64,
    /// The group's timeout, for the message.
    timeout: Duration,
}

impl CollectiveRecord {
    /// Starts the record of this rank (`rank` of `world_size`) in `store`, under a
    /// prefix of its own for the `group`-th process group of this process, and the
    /// heartbeat thread.
    pub(crate) fn start(
        store: &Store,
        group: u64,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<Self> {
        let view = Arc::new(store.with_prefix(&format!("tchd/pg{group}"))?);
        let key = format!("progress/{rank}");
        view.set(&key, b"0 ")?;
        let beat_key = format!("alive/{rank}");
        view.set(&beat_key, b"0")?;
        let watch = Arc::new(Watch {
            waiting: Mutex::new(None),
            check_after_ms: AtomicU64::new(DEADLOCK_CHECK.as_millis() as u64),
            timeout,
        });
        let (tx, rx) = mpsc::channel::<()>();
        let beat_view = Arc::clone(&view);
        let watched = Arc::clone(&watch);
        let spawned = std::thread::Builder::new()
            .name("tchd-heartbeat".into())
            .spawn(move || {
                let mut next = (rank + 1) % world_size;
                // Its own connection, with a bounded wait: a read must not hold up
                // the heartbeat for the store's whole timeout.
                let reader = beat_view
                    .clone_connection()
                    .ok()
                    .filter(|s| s.set_timeout(STORE_WAIT).is_ok());
                for beat in 1u64.. {
                    // A failure (the store's host gone) is the collectives' to report.
                    let _ = beat_view.set(&beat_key, beat.to_string().as_bytes());
                    if let Some(reader) = &reader {
                        watched.check(reader, rank, world_size, &mut next);
                    }
                    match rx.recv_timeout(BEAT) {
                        Err(RecvTimeoutError::Timeout) => {}
                        _ => return,
                    }
                }
            });
        if let Err(e) = spawned {
            crate::log::warn(format_args!(
                "no heartbeat thread ({e}): a collective that times out cannot tell a stopped rank"
            ));
        }
        Ok(CollectiveRecord {
            rank,
            world_size,
            entered: AtomicU64::new(0),
            watch,
            failures: store.with_prefix(FAILURE_PREFIX)?,
            view,
            key,
            _heartbeat: tx,
        })
    }

    /// The store under this group's prefix.
    pub(crate) fn view(&self) -> &Store {
        &self.view
    }

    /// Records that this rank enters its next collective, `what`; returns its number
    /// (1 for the first). One store `set`, sent without waiting for an answer.
    pub(crate) fn enter(&self, what: &str) -> u64 {
        let n = self.entered.fetch_add(1, Ordering::Relaxed) + 1;
        // A store that cannot be written to shows up in the collective itself.
        let _ = self.view.set(&self.key, format!("{n} {what}").as_bytes());
        *self.watch.waiting.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((n, what.to_string(), Instant::now()));
        n
    }

    /// Records that this rank left collective `n` (completed or failed).
    pub(crate) fn leave(&self, n: u64) {
        let mut waiting = self.watch.waiting.lock().unwrap_or_else(|e| e.into_inner());
        if waiting.as_ref().is_some_and(|(m, _, _)| *m == n) {
            *waiting = None;
        }
    }

    /// Reads the other ranks' records once a collective has waited `after` (see the
    /// module's doc).
    pub(crate) fn check_deadlocks_after(&self, after: Duration) {
        self.watch.check_after_ms.store(
            after.as_millis().min(u64::MAX as u128) as u64,
            Ordering::Relaxed,
        );
    }

    /// The line in which a launcher reported a rank that failed in this attempt
    /// (`rank 1 (node 1, 10.0.0.2) was killed by signal SIGKILL (9)`), waiting up to
    /// `wait` for it; `None` when no launcher hosts the store (no launcher writes it)
    /// or none came.
    pub(crate) fn reported_failure(&self, wait: Duration) -> Option<String> {
        if self.view.host() != Host::Launcher {
            return None;
        }
        let store = self.failures.clone_connection().ok()?;
        store.set_timeout(wait).ok()?;
        let value = store.get("first").ok()?;
        Failure::decode(&value).map(|f| f.line)
    }

    /// Why collective `n` (`what`) timed out after `timeout`, from the other ranks'
    /// records and heartbeats (a few seconds of watching).
    pub(crate) fn diagnose(&self, n: u64, what: &str, timeout: Duration) -> Findings {
        let others: Vec<usize> = (0..self.world_size).filter(|&r| r != self.rank).collect();
        let (tx, rx) = mpsc::channel();
        let view = Arc::clone(&self.view);
        let ranks = others.clone();
        // On a connection of its own, in a thread of its own: a store whose host is
        // stopped never answers, and this rank must still report.
        let spawned = std::thread::Builder::new()
            .name("tchd-diagnosis".into())
            .spawn(move || {
                let read = |store: &Store| -> Result<(Vec<Option<Record>>, Vec<Option<u64>>)> {
                    let mut records = Vec::new();
                    let mut beats = Vec::new();
                    for &r in &ranks {
                        records.push(parse_record(&store.get(&format!("progress/{r}"))?));
                        beats.push(
                            std::str::from_utf8(&store.get(&format!("alive/{r}"))?)
                                .ok()
                                .and_then(|s| s.parse().ok()),
                        );
                    }
                    Ok((records, beats))
                };
                let probe = || -> Result<()> {
                    let store = view.clone_connection()?;
                    store.set_timeout(STORE_WAIT)?;
                    let start = Instant::now();
                    let first = read(&store)?;
                    let _ = tx.send(Ok(first));
                    std::thread::sleep(WATCH.saturating_sub(start.elapsed()));
                    let _ = tx.send(Ok(read(&store)?));
                    Ok(())
                };
                if let Err(e) = probe() {
                    let _ = tx.send(Err(e));
                }
            });
        let unanswered = |detail: String| match self.view.host() {
            Host::Launcher => Findings {
                stalled: vec![],
                report: format!(
                    "the rendezvous store, which the launcher (tchrun or torchrun) hosts, \
                     {detail}, so the launcher may be stopped or gone. Check the launcher's \
                     own output and whether its process is still running"
                ),
            },
            Host::Rank0 | Host::Local => Findings {
                stalled: vec![0],
                report: format!(
                    "the rendezvous store, which rank 0 hosts, {detail}, so rank 0 may be the \
                     one stalled (stopped, hung or dead). {}",
                    what_to_check(&[0], timeout)
                ),
            },
        };
        if spawned.is_err() {
            return Findings {
                stalled: vec![],
                report: format!("a rank did not reach it. {}", what_to_check(&[], timeout)),
            };
        }
        let first = match rx.recv_timeout(STORE_WAIT) {
            Ok(Ok(first)) => first,
            Ok(Err(e)) => return unanswered(format!("could not be read either ({e})")),
            Err(_) => {
                return unanswered(format!(
                    "did not answer within {} either",
                    seconds(STORE_WAIT)
                ))
            }
        };
        let (records, beats) = match rx.recv_timeout(WATCH + STORE_WAIT) {
            Ok(Ok((records, second))) => {
                let alive: Vec<Option<bool>> = first
                    .1
                    .iter()
                    .zip(&second)
                    .map(|(a, b)| match (a, b) {
                        (Some(a), Some(b)) => Some(b > a),
                        _ => None,
                    })
                    .collect();
                (records, alive)
            }
            Ok(Err(e)) => return unanswered(format!("could not be read either ({e})")),
            Err(_) => {
                return unanswered(format!("stopped answering within {}", seconds(STORE_WAIT)))
            }
        };
        findings(n, what, &others, &records, &beats, timeout)
    }
}

impl Watch {
    /// When this rank has waited in its collective long enough: reads the records of
    /// the next [`WINDOW`] ranks after `*next` (in turn, over the beats) and ends the
    /// process when one entered another collective under the same number.
    fn check(&self, store: &Store, rank: usize, world_size: usize, next: &mut usize) {
        let Some((n, what, since)) = self
            .waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        else {
            return;
        };
        let after = Duration::from_millis(self.check_after_ms.load(Ordering::Relaxed));
        if since.elapsed() < after {
            return;
        }
        let mut ranks = Vec::new();
        let mut records = Vec::new();
        for _ in 0..(world_size - 1).min(WINDOW) {
            if *next == rank {
                *next = (*next + 1) % world_size;
            }
            let r = *next;
            *next = (*next + 1) % world_size;
            // An unanswered read is no proof of anything: the timeout will tell.
            let Ok(value) = store.get(&format!("progress/{r}")) else {
                return;
            };
            ranks.push(r);
            records.push(parse_record(&value));
        }
        let Some(e) = deadlock(
            n,
            &what,
            rank,
            &ranks,
            &records,
            since.elapsed(),
            self.timeout,
        ) else {
            return;
        };
        // Still in it? A collective that completed meanwhile proves nothing.
        let still = self
            .waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|w| w.0)
            == Some(n);
        if still {
            fail_now(rank, &e);
        }
    }
}

/// The error when some of `ranks` (their `records`) entered another collective than
/// `what` under the same number `n`, which this rank has waited in for `waited`;
/// `None` when none did.
fn deadlock(
    n: u64,
    what: &str,
    rank: usize,
    ranks: &[usize],
    records: &[Option<Record>],
    waited: Duration,
    timeout: Duration,
) -> Option<Error> {
    let mut stalled = Vec::new();
    let mut sentences = Vec::new();
    for (&r, record) in ranks.iter().zip(records) {
        if let Some((m, other)) = record {
            if *m == n && other != what {
                stalled.push(r);
                sentences.push(format!(
                    "rank {r} is waiting in another collective, {other}"
                ));
            }
        }
    }
    if stalled.is_empty() {
        return None;
    }
    listed(&mut sentences);
    Some(Error::Deadlock {
        op: format!("{what} (collective {n} of rank {rank})"),
        waited,
        report: format!(
            "{}: the ranks called collectives in different orders, and would wait for each \
             other until the timeout ({}). A rank took another path: it left a loop early on \
             a value of its own (a `break`, a `return`, a shorter data source), or skipped a \
             collective in a branch. Make every rank call the same collectives in the same \
             order: in a loop that #[distributed] shards, an exit agrees across the ranks; \
             elsewhere, agree first (`tch_distributed::any_rank`). See \"When ranks take \
             different paths\" in the guide",
            sentences.join("; "),
            seconds(timeout)
        ),
        stalled,
    })
}

/// Ends this process with `e`, as `main` returning it would, from the heartbeat
/// thread: the main thread is blocked in a collective that cannot complete. One write
/// to stderr, the launcher's error file (the root cause tchrun and torchrun report),
/// then `_exit`: libtorch's exit handlers could wait on that collective.
fn fail_now(rank: usize, e: &Error) -> ! {
    let line = format!("Error: rank {rank}: {e}\n");
    let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
    crate::launch::error_file::record(line.trim_end(), None);
    crate::ffi::os::exit_now(1)
}

/// `"{n} {what}"` as a record.
fn parse_record(value: &[u8]) -> Option<Record> {
    let text = std::str::from_utf8(value).ok()?;
    let (n, what) = text.split_once(' ')?;
    Some((n.parse().ok()?, what.to_string()))
}

/// The findings for collective `n` (`what`) from the other ranks' records and
/// whether their heartbeats advanced.
fn findings(
    n: u64,
    what: &str,
    ranks: &[usize],
    records: &[Option<Record>],
    alive: &[Option<bool>],
    timeout: Duration,
) -> Findings {
    let silent = format!("no heartbeat for {}", seconds(WATCH));
    let mut stalled = Vec::new();
    let mut sentences = Vec::new();
    for ((&r, record), alive) in ranks.iter().zip(records).zip(alive) {
        let stopped = *alive == Some(false);
        let sentence = match record {
            Some((m, last)) if *m < n => {
                let last = if *m == 0 {
                    "it has entered no collective yet".to_string()
                } else {
                    format!("its last was collective {m}, {last}")
                };
                Some(if stopped {
                    format!("rank {r} did not arrive and has stopped responding ({silent}): {last}")
                } else {
                    format!("rank {r} did not arrive: it is still running, but {last}")
                })
            }
            Some(_) if stopped => Some(format!(
                "rank {r} reached it but has stopped responding ({silent})"
            )),
            Some((m, other)) if *m == n && other != what => Some(format!(
                "rank {r} is waiting in another collective, {other}: the ranks called \
                 collectives in different orders"
            )),
            Some(_) => None,
            None if stopped => Some(format!("rank {r} has stopped responding ({silent})")),
            None => None,
        };
        if let Some(sentence) = sentence {
            stalled.push(r);
            sentences.push(sentence);
        }
    }
    if stalled.is_empty() {
        return Findings {
            stalled,
            report: format!(
                "every rank reached it and is still running, so the data did not get through: \
                 check the network between the ranks (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME; \
                 NCCL_DEBUG=INFO shows where NCCL waits), or raise the timeout \
                 (TCH_DISTRIBUTED_TIMEOUT, now {}) for a very large collective",
                seconds(timeout)
            ),
        };
    }
    listed(&mut sentences);
    Findings {
        report: format!(
            "{}. {}",
            sentences.join("; "),
            what_to_check(&stalled, timeout)
        ),
        stalled,
    }
}

/// Keeps the first [`LISTED`] of `sentences`, one per rank, and says how many more.
fn listed(sentences: &mut Vec<String>) {
    if sentences.len() > LISTED {
        let more = sentences.len() - LISTED;
        sentences.truncate(LISTED);
        sentences.push(format!("{more} more ranks likewise"));
    }
}

/// What to check when `stalled` ranks (none known: `[]`) held up a collective.
fn what_to_check(stalled: &[usize], timeout: Duration) -> String {
    let (whose, it) = match stalled {
        [] => ("every rank's output".to_string(), "a rank"),
        [r] => (format!("rank {r}'s own output"), "it"),
        _ => (
            format!("the output of {}", crate::error::ranks_text(stalled)),
            "they",
        ),
    };
    format!(
        "Check {whose} first: an error, a crash or a stop there is the cause, this rank only \
         waited. With NCCL, NCCL_DEBUG=INFO shows where each rank stops. If {it} {} only slow \
         (a long first step, a checkpoint on a slow disk), raise the timeout \
         (TCH_DISTRIBUTED_TIMEOUT, now {})",
        if it == "they" { "are" } else { "is" },
        seconds(timeout)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(n: u64, what: &str) -> Option<Record> {
        Some((n, what.to_string()))
    }

    #[test]
    fn names_the_ranks_behind_and_the_stopped_ones() {
        let t = Duration::from_secs(3);
        let f = findings(
            5,
            "all_reduce",
            &[1, 2, 3],
            &[
                record(4, "barrier"),
                record(5, "all_reduce"),
                record(5, "broadcast"),
            ],
            &[Some(true), Some(false), Some(true)],
            t,
        );
        assert_eq!(f.stalled, vec![1, 2, 3]);
        assert!(f.report.starts_with(
            "rank 1 did not arrive: it is still running, but its last was collective 4, barrier; \
             rank 2 reached it but has stopped responding (no heartbeat for 2.5 s); \
             rank 3 is waiting in another collective, broadcast"
        ), "{}", f.report);
        assert!(
            f.report.contains("Check the output of ranks 1-3 first"),
            "{}",
            f.report
        );

        let f = findings(
            5,
            "all_reduce",
            &[1],
            &[record(5, "all_reduce")],
            &[Some(true)],
            t,
        );
        assert!(f.stalled.is_empty());
        assert!(
            f.report.starts_with("every rank reached it"),
            "{}",
            f.report
        );
    }
}
