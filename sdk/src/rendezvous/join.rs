//! The count at rendezvous: every rank counts itself in at the store and waits until
//! all `WORLD_SIZE` ranks have joined, so that a job that cannot form says how many
//! ranks came, which did not, and whether two share a rank or disagree on the size.

use std::time::Duration;

use super::store::Store;
use crate::error::{ranks_text, seconds, Error, Result};

/// Counts this rank in at the store and waits, up to `timeout`, until all
/// `world_size` ranks have joined. Errors ([`Error::Rendezvous`]) say how many ranks
/// joined within the timeout and which did not, that two processes have the same
/// rank, or that the ranks were given different world sizes. `hosts_store`: this rank
/// hosts the store (rank 0 without torchrun's agent).
///
/// The first rank whose wait ends counts the ranks that joined and publishes the
/// count under the key the others wait for, so that every rank reports the same
/// count, even the ones whose store goes away when rank 0 exits with its error.
pub(crate) fn wait_for_all_ranks(
    store: &Store,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    hosts_store: bool,
) -> Result<()> {
    const ALL: &str = "tchd/join/all";
    const COUNT: &str = "tchd/join/count";
    let rendezvous = |message: String| Error::Rendezvous {
        addr: String::new(),
        port: 0,
        rank: Some(rank),
        world_size,
        message,
    };
    let size_key = |r: usize| format!("tchd/join/world_size/{r}");
    let rank_key = |r: usize| format!("tchd/join/rank/{r}");
    // Twice: as text, for the blocking read of rank 0's below, and as a counter,
    // which reads 0 without waiting when that rank never came.
    let size_counter = |r: usize| format!("tchd/join/size/{r}");
    store.set(&size_key(rank), world_size.to_string().as_bytes())?;
    store.add(&size_counter(rank), world_size as i64)?;
    if store.add(&rank_key(rank), 1)? > 1 {
        return Err(rendezvous(format!(
            "another process has already joined as rank {rank}: every process of the job needs \
             a rank of its own (RANK from 0 to {}); look for a job started twice, or a \
             launcher that gives the same RANK to two processes",
            world_size - 1
        )));
    }
    // World sizes travel as "size RANK=SIZE,…": each rank names the first rank whose
    // size differs from its own.
    if store.add(COUNT, 1)? == world_size as i64 {
        // The rank whose arrival completes this rank's count: every counted rank
        // published its size before counting itself, so compare them now (a rank
        // started with a larger WORLD_SIZE may be among them), before anyone proceeds.
        let mut sizes = Vec::new();
        for r in 0..world_size {
            sizes.push((r, store.add(&size_counter(r), 0)?));
        }
        let verdict = if sizes.iter().any(|&(_, s)| s == 0) {
            // As many processes as ranks, but not these ranks: some RANK lies outside
            // 0..world_size (its WORLD_SIZE is larger) or came twice.
            format!("missing {world_size} ")
        } else if sizes.iter().all(|&(_, s)| s == world_size as i64) {
            "ok".to_string()
        } else {
            let listed: Vec<String> = sizes.iter().map(|(r, s)| format!("{r}={s}")).collect();
            format!("size {}", listed.join(","))
        };
        store.set(ALL, verdict.as_bytes())?;
    }
    // Each `get` waits up to the store's timeout, the job's.
    let waited = (|| -> Result<Vec<u8>> {
        if rank != 0 {
            let size0 = String::from_utf8_lossy(&store.get(&size_key(0))?).into_owned();
            if size0 != world_size.to_string() {
                // Tells rank 0 and the ranks that agree with it, waiting below.
                let _ = store.set(ALL, format!("size {rank}={world_size}").as_bytes());
                return Ok(format!("size 0={size0}").into_bytes());
            }
        }
        store.get(ALL)
    })();
    let outcome = match waited {
        Ok(value) => String::from_utf8_lossy(&value).into_owned(),
        Err(_) => {
            // This rank's wait ended first: count, and tell the ranks still waiting.
            let counted = (|| -> Result<String> {
                let joined = store.add(COUNT, 0)?;
                let mut missing = Vec::new();
                for r in 0..world_size {
                    if store.add(&rank_key(r), 0)? == 0 {
                        missing.push(r.to_string());
                    }
                }
                Ok(format!("missing {joined} {}", missing.join(",")))
            })();
            match counted {
                Ok(outcome) => {
                    let _ = store.set(ALL, outcome.as_bytes());
                    if hosts_store {
                        // The others read the count from this rank's store: give the
                        // store a moment to send it before this rank exits.
                        let _ = store.add(COUNT, 0);
                        std::thread::sleep(Duration::from_millis(500));
                    }
                    outcome
                }
                Err(_) => {
                    return Err(rendezvous(format!(
                        "rank 0, which hosts the store, stopped answering before all {world_size} \
                         ranks joined: it may have given up waiting for them (its own output says \
                         how many joined within the timeout, {}) or failed",
                        seconds(timeout)
                    )))
                }
            }
        }
    };
    let mine = world_size.to_string();
    let differing = outcome.strip_prefix("size ").and_then(|sizes| {
        sizes
            .split(',')
            .filter_map(|rs| rs.split_once('='))
            .find(|(_, size)| *size != mine)
    });
    if let Some((other, size)) = differing {
        // Under tchrun the world size is --nnodes × --nproc-per-node of each host's.
        let fix = if crate::protocol::under_tchrun() {
            "start tchrun on every host with the same --nnodes and --nproc-per-node"
        } else {
            "start every rank with the same WORLD_SIZE (the number of processes of the whole job)"
        };
        return Err(rendezvous(format!(
            "WORLD_SIZE is {world_size} here but {size} on rank {other}: the ranks disagree on \
             the job's size; {fix}"
        )));
    }
    let mut words = outcome.split(' ');
    match (words.next(), words.next(), words.next()) {
        (Some("missing"), Some(joined), Some("")) => Err(rendezvous(format!(
            "{joined} processes joined within {}, but not as the {world_size} ranks (0 to {}) \
             that this rank expects: the ranks were started with different WORLD_SIZE values, \
             or two of them with the same RANK; start every rank with the same WORLD_SIZE, the \
             number of processes of the whole job",
            seconds(timeout),
            world_size - 1
        ))),
        (Some("missing"), Some(joined), missing) => {
            let missing: Vec<usize> = missing
                .unwrap_or_default()
                .split(',')
                .filter_map(|r| r.parse().ok())
                .collect();
            let verb = if missing.len() == 1 { "is" } else { "are" };
            Err(rendezvous(format!(
                "{joined} of {world_size} ranks joined within {} ({} {verb} missing): start \
                 all {world_size} ranks (WORLD_SIZE={world_size}: tchrun's or torchrun's \
                 --nproc-per-node times --nnodes, or the number of processes srun or mpirun \
                 starts), or check the missing ranks' own output: they may have failed before \
                 joining, or cannot reach this address",
                seconds(timeout),
                ranks_text(&missing)
            )))
        }
        _ => Ok(()),
    }
}
