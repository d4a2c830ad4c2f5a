//! The process launcher behind the `tchrun` binary, one per node.
//!
//! Mirrors `torchrun`'s behaviour: host the job's rendezvous store (node 0), start
//! `nproc_per_node` copies of a program with the torchrun environment (`RANK`,
//! `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, ...), supervise them,
//! stop all ranks as soon as one fails (here, or on another node: `remote`), and
//! forward `SIGINT`/`SIGTERM` to the ranks; with `max_restarts`, start them all
//! again after a failure (`restart`).
//!
//! `supervise`: one attempt (start the ranks, watch them, stop them);
//! `restart`: the rendezvous that every attempt meets at; `remote`: what the
//! launchers of several nodes tell each other (a rank that failed); `error_file`:
//! torchrun's `TORCHELASTIC_ERROR_FILE`, which failing ranks write and the
//! launcher reports; `output`: where each rank's standard output goes (rank 0's
//! alone, or every rank's line by line after `[rank N] `) and how its standard error
//! is copied (line by line, each line whole).

use std::ffi::{OsStr, OsString};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use crate::error::{Error, Result};
use crate::rendezvous::job_token::{JobToken, JOB_TOKEN_ENV};

mod env_report;
pub(crate) mod error_file;
mod output;
pub(crate) mod remote;
mod restart;
mod supervise;

use restart::Rendezvous;
use supervise::{Attempt, Outcome};

pub use env_report::env_report;

/// Exit code returned when a rank failed (torchrun's convention).
const FAILURE_EXIT_CODE: i32 = 1;

const USAGE: &str = "tchrun --nproc-per-node N [OPTIONS] [--] PROGRAM [ARGS...]";

/// Where and how many ranks to start; mirrors torchrun's flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Ranks started on this node (`--nproc-per-node`); at least 1.
    pub nproc_per_node: usize,
    /// Nodes taking part in the job (`--nnodes`); at least 1.
    pub nnodes: usize,
    /// This node's index in `0..nnodes` (`--node-rank`).
    pub node_rank: usize,
    /// Host or IP address of node 0, where rank 0 runs and whose launcher hosts the
    /// job's store (`--master-addr`).
    pub master_addr: String,
    /// TCP port of the job's store (`--master-port`); 0 has the store bind a free
    /// port on a single node and is an error when `nnodes > 1`.
    pub master_port: u16,
    /// How long ranks get to exit after `SIGTERM` (or a forwarded signal)
    /// before they are sent `SIGKILL`.
    pub stop_grace: Duration,
    /// How many times to start every rank again after one fails
    /// (`--max-restarts`, as torchrun's); 0 ends the job at the first failure.
    pub max_restarts: usize,
    /// Whether every rank's standard output reaches the launcher's, each line after
    /// `[rank N] ` (`N` the global rank), copied whole so that ranks' lines never mix
    /// (`--all-ranks-stdout`, the `all_ranks_stdout` setting). When false, only global
    /// rank 0's does, as torchrun's `--local-ranks-filter 0` shows (the other ranks' goes
    /// to `/dev/null`). Standard error is every rank's either way.
    pub all_ranks_stdout: bool,
    /// Whether each line of every rank's standard error goes after `[rank N] `
    /// (`--rank-prefix`, the `rank_prefix` setting), as torchrun's `--tee` prefixes each
    /// line. Either way each line is copied whole, so that two ranks' lines never mix.
    pub rank_prefix: bool,
    /// Who launches: what starts the launcher's own lines on stderr and how they name
    /// its settings.
    pub launcher: Launcher,
}

/// Who launches the ranks, for the launcher's own lines on stderr (`tchrun: rank 1
/// (local rank 1, pid 4242) exited with status 1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Launcher {
    /// The `tchrun` binary: lines start `tchrun:`, settings are its flags
    /// (`--max-restarts`).
    #[default]
    Tchrun,
    /// A `#[distributed]` program that starts its own ranks (`TCH_DISTRIBUTED_NPROC`):
    /// lines start `tch-distributed:`, as the SDK's other lines do, and settings are
    /// its variables (`TCH_DISTRIBUTED_MAX_RESTARTS`).
    SelfLaunch,
}

impl Launcher {
    /// The label that starts the launcher's lines: `tchrun` or `tch-distributed`.
    pub fn label(self) -> &'static str {
        match self {
            Launcher::Tchrun => "tchrun",
            Launcher::SelfLaunch => "tch-distributed",
        }
    }

    /// The setting of `max_restarts` as its user wrote it: `--max-restarts 3` or
    /// `TCH_DISTRIBUTED_MAX_RESTARTS=3`.
    fn max_restarts(self, n: usize) -> String {
        match self {
            Launcher::Tchrun => format!("--max-restarts {n}"),
            Launcher::SelfLaunch => format!("TCH_DISTRIBUTED_MAX_RESTARTS={n}"),
        }
    }
}

impl Default for LaunchConfig {
    /// One rank on one node, rank 0, master at `127.0.0.1` on a free port,
    /// 5 s stop grace period, no restarts, rank 0's standard output only, standard error
    /// without prefixes, launched by `tchrun`.
    fn default() -> Self {
        Self {
            nproc_per_node: 1,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".to_string(),
            master_port: 0,
            stop_grace: Duration::from_secs(5),
            max_restarts: 0,
            all_ranks_stdout: false,
            rank_prefix: false,
            launcher: Launcher::Tchrun,
        }
    }
}

impl LaunchConfig {
    /// Checks the configuration as torchrun does.
    ///
    /// # Errors
    /// [`Error::Config`] when `nproc_per_node` or `nnodes` is 0, `node_rank`
    /// is not below `nnodes`, `master_addr` is empty, or `master_port` is 0
    /// while `nnodes > 1` (each node would pick a different port).
    pub fn validate(&self) -> Result<()> {
        if self.nproc_per_node == 0 {
            return Err(Error::Config("--nproc-per-node must be at least 1".into()));
        }
        if self.nnodes == 0 {
            return Err(Error::Config("--nnodes must be at least 1".into()));
        }
        if self.node_rank >= self.nnodes {
            return Err(Error::Config(format!(
                "--node-rank {} is out of range for --nnodes {} (must be 0..{})",
                self.node_rank, self.nnodes, self.nnodes
            )));
        }
        if self.master_addr.is_empty() {
            return Err(Error::Config("--master-addr must not be empty".into()));
        }
        if self.nnodes > 1 && self.master_port == 0 {
            return Err(Error::Config(
                "--nnodes > 1 needs a fixed port; pass --master-port so that every node uses the same port".into(),
            ));
        }
        Ok(())
    }

    /// Total number of ranks in the job: `nnodes * nproc_per_node`.
    pub fn world_size(&self) -> usize {
        self.nnodes * self.nproc_per_node
    }
}

/// Starts the ranks of `program args` and supervises them until all exit,
/// following torchrun's single-node behaviour.
///
/// Each rank gets the torchrun environment (`RANK`, `LOCAL_RANK`,
/// `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `ROLE_RANK`,
/// `ROLE_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `TORCHELASTIC_*`) plus
/// `TCHRUN=1`; `OMP_NUM_THREADS=1` is added (with a warning on stderr) when
/// it is unset and more than one rank runs per node. Every rank's stderr is piped and
/// copied to the launcher's line by line, each line in one write (after `[rank N] ` with
/// [`LaunchConfig::rank_prefix`]), so that two ranks' lines never mix; stdin is null. Global rank 0 inherits stdout and the other ranks' goes to
/// `/dev/null`, as torchrun's `--local-ranks-filter 0` shows it, so that a `println!`
/// the attribute cannot see (in a helper function) appears once; with
/// [`LaunchConfig::all_ranks_stdout`], every rank's stdout is piped and copied to the
/// launcher's, line by line, each line after `[rank N] `, and every line a rank wrote
/// is copied before its attempt ends.
///
/// When a rank exits non-zero or is killed by a signal, the failure is
/// printed to stderr and the remaining ranks are stopped (`SIGTERM`, then
/// `SIGKILL` after [`LaunchConfig::stop_grace`]); then the launcher prints the
/// root cause, the message that the first failing rank wrote to its
/// `TORCHELASTIC_ERROR_FILE` (a temporary file per rank, as torchrun sets; a
/// `#[distributed]` program writes it when it fails). Then, while
/// [`LaunchConfig::max_restarts`] allows, every rank is started again, with
/// `TORCHELASTIC_RESTART_COUNT` counting the restarts and a fresh rendezvous (the
/// launcher hosts the store; each attempt's keys live under its own prefix), so a
/// program that resumes from its newest checkpoint at start carries on. A
/// `SIGINT`/`SIGTERM` received by the launcher is forwarded to every live rank,
/// which are then stopped the same way, and never leads to a restart. On node 0 the
/// store listens on the address `master_addr` resolves to (loopback for the default
/// `127.0.0.1`). The ranks get the job's token in `TCH_DISTRIBUTED_JOB_TOKEN`: the
/// launcher's own, else, for a job on one node, a fresh random one; their keys in the
/// store live under a prefix derived from it, their values sealed with it (the book's
/// Security chapter). Each rank is
/// killed (`SIGKILL`) by the kernel if the launcher dies, even by `SIGKILL`: none
/// outlives it. Handlers for those signals stay installed (doing nothing) after
/// this returns, so call it once and exit with its result.
///
/// Returns the exit code the launcher should exit with: 0 when every rank
/// succeeded, 1 when a rank failed (after the last restart), `128 + signo` when
/// stopped by a signal.
///
/// # Errors
/// - [`Error::Config`] when the configuration is invalid (see
///   [`LaunchConfig::validate`]) or `program` is empty, or, on node 0, when the
///   store cannot be hosted (the port is taken).
/// - [`Error::Io`] when the signal handlers cannot be installed, `/dev/urandom` cannot be
///   read for the job's token, a rank cannot be started (already started ranks are
///   stopped first), or a rank's status cannot be read.
pub fn launch(config: &LaunchConfig, program: &OsStr, args: &[OsString]) -> Result<i32> {
    launch_with_env(config, program, args, &[])
}

/// Like [`launch`], but also sets `extra_env` in every rank's environment
/// (for a program that launches its own ranks and marks them). The torchrun
/// variables take precedence over `extra_env` entries of the same name.
///
/// # Errors
/// The same as [`launch`].
pub fn launch_with_env(
    config: &LaunchConfig,
    program: &OsStr,
    args: &[OsString],
    extra_env: &[(String, String)],
) -> Result<i32> {
    config.validate()?;
    if program.is_empty() {
        return Err(Error::Config(format!("no program given; usage: {USAGE}")));
    }
    let set_omp = config.nproc_per_node > 1
        && !crate::protocol::omp_num_threads_set()
        && !extra_env.iter().any(|(k, _)| k == "OMP_NUM_THREADS");
    if set_omp {
        crate::eprintln_whole!(
            "{}: warning: setting OMP_NUM_THREADS=1 for each rank to avoid overloading \
             the system; set OMP_NUM_THREADS yourself to tune performance",
            config.launcher.label()
        );
    }
    let run_id = run_id();
    // The job's token (`job_token`): the user's, else a fresh one for a job on this
    // node alone; the ranks get it with the torchrun variables.
    let token = match JobToken::from_env() {
        Some(token) => Some(token),
        None if config.nnodes == 1 => Some(JobToken::generate()?),
        None => None,
    };
    let mut extra_env = extra_env.to_vec();
    if let Some(token) = &token {
        extra_env.push((JOB_TOKEN_ENV.to_string(), token.value().to_string()));
    }
    let extra_env = extra_env.as_slice();

    // Install the handlers before starting anything so no signal is lost.
    let mut signals = Signals::new([SIGINT, SIGTERM]).map_err(|source| Error::Io {
        context: "cannot install SIGINT/SIGTERM handlers".into(),
        source,
    })?;
    let rendezvous = Rendezvous::new(config)?;
    let error_files = error_file::ErrorDir::create().map_err(|source| Error::Io {
        context: "cannot create a temporary directory for the ranks' error files".into(),
        source,
    })?;

    for number in 0..=config.max_restarts {
        let attempt = Attempt {
            config,
            program,
            args,
            extra_env,
            set_omp,
            run_id: &run_id,
            master_port: rendezvous.port(),
            number,
            error_files: &error_files,
        };
        let mut remote = remote::Remote::watch(config, rendezvous.port(), number, token.as_ref());
        match attempt.run(&mut signals, &mut remote)? {
            Outcome::Succeeded => return Ok(0),
            Outcome::Signalled(signo) => return Ok(128 + signo),
            Outcome::Failed if number < config.max_restarts => {
                let ranks = match (config.nnodes, config.nproc_per_node) {
                    (1, 1) => "the rank".to_string(),
                    (1, n) => format!("all {n} ranks"),
                    (_, 1) => "this node's rank".to_string(),
                    (_, n) => format!("this node's {n} ranks"),
                };
                crate::eprintln_whole!(
                    "{}: restarting {ranks} (restart {} of {})",
                    config.launcher.label(),
                    number + 1,
                    config.max_restarts
                )
            }
            Outcome::Failed => {
                remote.linger();
                if config.max_restarts > 0 {
                    crate::eprintln_whole!(
                        "{}: no restarts left ({}), giving up",
                        config.launcher.label(),
                        config.launcher.max_restarts(config.max_restarts)
                    );
                }
                return Ok(FAILURE_EXIT_CODE);
            }
        }
    }
    unreachable!("the last attempt returns")
}

/// An id for `TORCHELASTIC_RUN_ID`, unique enough for one host.
fn run_id() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("tchrun-{}-{nanos:x}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validate_rejects_bad_configs() {
        let ok = LaunchConfig::default();
        assert!(ok.validate().is_ok());
        let bad = [
            LaunchConfig {
                nproc_per_node: 0,
                ..ok.clone()
            },
            LaunchConfig {
                nnodes: 0,
                ..ok.clone()
            },
            LaunchConfig {
                node_rank: 1,
                ..ok.clone()
            },
            LaunchConfig {
                nnodes: 2,
                node_rank: 1,
                ..ok.clone()
            },
        ];
        for c in bad {
            assert!(matches!(c.validate(), Err(Error::Config(_))), "{c:?}");
        }
        let multi = LaunchConfig {
            nnodes: 2,
            node_rank: 1,
            master_port: 29500,
            ..ok
        };
        assert!(multi.validate().is_ok());
    }
}
