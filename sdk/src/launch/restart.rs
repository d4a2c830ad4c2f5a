//! Elastic restarts, as torchrun's `--max-restarts`: when a rank fails, every rank
//! is stopped and the whole node starts again, up to `max_restarts` times, each
//! attempt with a fresh rendezvous.
//!
//! A fresh rendezvous is torchrun's: the launcher hosts the job's `TCPStore` (its
//! "agent store") for as long as it runs, and the ranks join it as clients with
//! `TORCHELASTIC_USE_AGENT_STORE=True`, keeping their keys under
//! `/worker/attempt_{TORCHELASTIC_RESTART_COUNT}` (the SDK's `init` does, as
//! `torch.distributed` does). Keys that a failed attempt left behind, or a stale rank
//! of another node that is still at the previous attempt, cannot mix with the new
//! attempt's. The store's port is bound once, by the launcher (a free one unless
//! `--master-port` is given), so no other process can take it between attempts.
//! On several nodes, node 0's launcher hosts the store and every node's ranks join it.
//!
//! The launcher hosts the store with or without restarts, as torchrun's agent does:
//! a free port is bound by the store itself (port 0), never picked, closed and bound
//! again, so nothing can take it in between.

use std::time::Duration;

use super::LaunchConfig;
use crate::error::{Error, Result};
use crate::rendezvous::store::Store;

/// How long the agent store's own connection waits on a key (it never does).
const STORE_TIMEOUT: Duration = Duration::from_secs(1800);

/// Where the ranks of every attempt meet.
pub(super) struct Rendezvous {
    port: u16,
    /// The store this launcher hosts (on node 0), kept alive while it runs.
    _store: Option<Store>,
}

impl Rendezvous {
    /// The agent store, hosted here on node 0 on `config.master_port` (0: a free
    /// port, bound by the store itself, so no other process can take it first), and
    /// joined by every node's ranks.
    ///
    /// # Errors
    /// [`Error::Config`] when the store cannot be hosted (the port is
    /// taken, or libtorch's own reason).
    pub(super) fn new(config: &LaunchConfig) -> Result<Rendezvous> {
        if config.node_rank != 0 {
            return Ok(Rendezvous {
                port: config.master_port,
                _store: None,
            });
        }
        // On loopback for a job on this node alone (`--master-addr` 127.0.0.1, the
        // default), else on the master's address.
        let store = Store::tcp_server(
            &config.master_addr,
            config.master_port,
            config.world_size(),
            config.nnodes > 1,
            STORE_TIMEOUT,
        )
        .map_err(|e| match e {
            Error::PortInUse { addr, port } => Error::Config(format!(
                "port {port} on {addr} is already in use, so {} cannot host the job's \
                 rendezvous store: stop the process using it, or pick another --master-port \
                 (0 picks a free one)",
                config.launcher.label()
            )),
            other => Error::Config(format!(
                "cannot host the job's rendezvous store on {}:{}: {other}",
                config.master_addr, config.master_port
            )),
        })?;
        let port = store.port().unwrap_or(config.master_port);
        Ok(Rendezvous {
            port,
            _store: Some(store),
        })
    }

    /// The port the ranks meet on (`MASTER_PORT`), the same for every attempt.
    pub(super) fn port(&self) -> u16 {
        self.port
    }
}
