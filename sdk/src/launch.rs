//! Single-node process launcher behind the `tchrun` binary.
//!
//! Mirrors `torchrun`'s single-node behaviour: start `nproc_per_node` copies of
//! a program with the torchrun environment (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`,
//! `MASTER_ADDR`, `MASTER_PORT`, ...), supervise them, stop all ranks as soon
//! as one fails, and forward `SIGINT`/`SIGTERM` to the ranks.

use std::ffi::{OsStr, OsString};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use signal_hook::consts::{SIGINT, SIGKILL, SIGTERM};
use signal_hook::iterator::Signals;

use crate::error::{Error, Result};

/// How often the supervisor checks its ranks and pending signals.
const POLL_INTERVAL: Duration = Duration::from_millis(50);

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
    /// Host or IP address of the node where rank 0 runs (`--master-addr`).
    pub master_addr: String,
    /// TCP port rank 0 listens on (`--master-port`); 0 picks a free port on a
    /// single node and is an error when `nnodes > 1`.
    pub master_port: u16,
    /// How long ranks get to exit after `SIGTERM` (or a forwarded signal)
    /// before they are sent `SIGKILL`.
    pub stop_grace: Duration,
}

impl Default for LaunchConfig {
    /// One rank on one node, rank 0, master at `127.0.0.1` on a free port,
    /// 5 s stop grace period.
    fn default() -> Self {
        Self {
            nproc_per_node: 1,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".to_string(),
            master_port: 0,
            stop_grace: Duration::from_secs(5),
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
            return Err(Error::Config(
                "tchrun: --nproc-per-node must be at least 1".into(),
            ));
        }
        if self.nnodes == 0 {
            return Err(Error::Config("tchrun: --nnodes must be at least 1".into()));
        }
        if self.node_rank >= self.nnodes {
            return Err(Error::Config(format!(
                "tchrun: --node-rank {} is out of range for --nnodes {} (must be 0..{})",
                self.node_rank, self.nnodes, self.nnodes
            )));
        }
        if self.master_addr.is_empty() {
            return Err(Error::Config(
                "tchrun: --master-addr must not be empty".into(),
            ));
        }
        if self.nnodes > 1 && self.master_port == 0 {
            return Err(Error::Config(
                "tchrun: --nnodes > 1 needs a fixed port; pass --master-port so that every node uses the same port".into(),
            ));
        }
        Ok(())
    }

    /// Total number of ranks in the job: `nnodes * nproc_per_node`.
    pub fn world_size(&self) -> usize {
        self.nnodes * self.nproc_per_node
    }
}

/// Picks a free TCP port on `addr` (a host name or IP address) by binding
/// port 0 and reading the port the OS chose; the listener is closed before
/// returning, so another process could in principle take the port first
/// (torchrun has the same race).
///
/// # Errors
/// [`Error::Io`] when `addr` does not resolve or nothing can be bound on it.
pub fn free_port(addr: &str) -> Result<u16> {
    let io_err = |source| Error::Io {
        context: format!("tchrun: cannot bind {addr}:0 to pick a free master port"),
        source,
    };
    let listener = TcpListener::bind((addr, 0)).map_err(io_err)?;
    Ok(listener.local_addr().map_err(io_err)?.port())
}

/// Starts the ranks of `program args` and supervises them until all exit,
/// following torchrun's single-node behaviour.
///
/// Each rank gets the torchrun environment (`RANK`, `LOCAL_RANK`,
/// `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `ROLE_RANK`,
/// `ROLE_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `TORCHELASTIC_*`) plus
/// `TCHRUN=1`; `OMP_NUM_THREADS=1` is added (with a warning on stderr) when
/// it is unset and more than one rank runs per node. Ranks inherit stdout and
/// stderr; stdin is null.
///
/// When a rank exits non-zero or is killed by a signal, the failure is
/// printed to stderr and the remaining ranks are stopped (`SIGTERM`, then
/// `SIGKILL` after [`LaunchConfig::stop_grace`]). `SIGINT`/`SIGTERM` received
/// while supervising are forwarded to every live rank, which are then stopped
/// the same way. Each rank is killed (`SIGKILL`) by the kernel if the launcher
/// dies, even by `SIGKILL`: none outlives it. Handlers for those signals stay installed (doing nothing)
/// after this returns, so call it once and exit with its result.
///
/// Returns the exit code the launcher should exit with: 0 when every rank
/// succeeded, 1 when a rank failed, `128 + signo` when stopped by a signal.
///
/// # Errors
/// - [`Error::Config`] when the configuration is invalid (see
///   [`LaunchConfig::validate`]) or `program` is empty.
/// - [`Error::Io`] when no free port can be picked, the signal handlers cannot
///   be installed, a rank cannot be started (already started ranks are
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
        return Err(Error::Config(format!(
            "tchrun: no program given; usage: {USAGE}"
        )));
    }
    let master_port = match config.master_port {
        0 => free_port(&config.master_addr)?,
        port => port,
    };
    let set_omp = config.nproc_per_node > 1
        && std::env::var_os("OMP_NUM_THREADS").is_none()
        && !extra_env.iter().any(|(k, _)| k == "OMP_NUM_THREADS");
    if set_omp {
        eprintln!(
            "tchrun: warning: setting OMP_NUM_THREADS=1 for each rank to avoid overloading \
             the system; set OMP_NUM_THREADS yourself to tune performance"
        );
    }
    let run_id = run_id();

    // Install the handlers before starting anything so no signal is lost.
    let mut signals = Signals::new([SIGINT, SIGTERM]).map_err(|source| Error::Io {
        context: "tchrun: cannot install SIGINT/SIGTERM handlers".into(),
        source,
    })?;

    let mut ranks = Ranks::default();
    for local_rank in 0..config.nproc_per_node {
        let rank = config.node_rank * config.nproc_per_node + local_rank;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .stdin(Stdio::null())
            .envs(extra_env.iter().map(|(k, v)| (k, v)))
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local_rank.to_string())
            .env("WORLD_SIZE", config.world_size().to_string())
            .env("LOCAL_WORLD_SIZE", config.nproc_per_node.to_string())
            .env("GROUP_RANK", config.node_rank.to_string())
            .env("ROLE_RANK", rank.to_string())
            .env("ROLE_WORLD_SIZE", config.world_size().to_string())
            .env("MASTER_ADDR", &config.master_addr)
            .env("MASTER_PORT", master_port.to_string())
            .env("TORCHELASTIC_RESTART_COUNT", "0")
            .env("TORCHELASTIC_MAX_RESTARTS", "0")
            .env("TORCHELASTIC_RUN_ID", &run_id)
            .env("TCHRUN", "1");
        if set_omp {
            cmd.env("OMP_NUM_THREADS", "1");
        }
        die_with_launcher(&mut cmd);
        match cmd.spawn() {
            Ok(child) => ranks.0.push(Rank {
                rank,
                local_rank,
                child,
                status: None,
            }),
            Err(source) => {
                ranks.stop(SIGTERM, config.stop_grace, &mut signals)?;
                return Err(Error::Io {
                    context: format!(
                        "tchrun: cannot start rank {rank} (program {})",
                        program.to_string_lossy()
                    ),
                    source,
                });
            }
        }
    }

    loop {
        if let Some(signo) = signals.pending().next() {
            eprintln!(
                "tchrun: received {}, forwarding it to all ranks",
                signal_name(signo)
            );
            ranks.stop(signo, config.stop_grace, &mut signals)?;
            return Ok(128 + signo);
        }
        let mut failed = false;
        for r in ranks.0.iter_mut().filter(|r| r.status.is_none()) {
            let Some(status) = r.try_wait()? else {
                continue;
            };
            if !status.success() {
                failed = true;
                eprintln!(
                    "tchrun: rank {} (local rank {}, pid {}) {}",
                    r.rank,
                    r.local_rank,
                    r.child.id(),
                    describe_failure(status)
                );
            }
        }
        if failed {
            ranks.stop(SIGTERM, config.stop_grace, &mut signals)?;
            return Ok(FAILURE_EXIT_CODE);
        }
        if ranks.all_exited() {
            return Ok(0);
        }
        thread::sleep(POLL_INTERVAL);
    }
}

/// Makes the rank started by `cmd` die with the launcher, so that no rank outlives
/// it unsupervised when the launcher itself is killed (`SIGKILL`, the OOM killer, a
/// lost SSH session): `tchrun`'s or a self-launching program's ranks exit within
/// moments of it.
///
/// The child asks the kernel for `SIGKILL` when its parent dies
/// (`PR_SET_PDEATHSIG`). `SIGKILL` rather than `SIGTERM`: a rank that installed
/// [`Preemption`](crate::Preemption) would take `SIGTERM` as "checkpoint at the end
/// of the step", and a rank blocked in a collective with a peer that is already gone
/// never reaches that step; with the launcher dead, nothing would send the `SIGKILL`
/// that normally follows the grace period, and the rank would wait out the
/// collective timeout (30 minutes by default). Checkpoints are complete or absent,
/// so killing a rank at any point loses at most the steps since the last one. A
/// launcher that is merely asked to stop (`SIGINT`/`SIGTERM`) is not dying: it
/// forwards the signal and gives the ranks their grace period as before.
///
/// The parent may die between `fork` and `prctl`, before the request is in place;
/// the child would then have been re-parented already, so it checks that its parent
/// is still the launcher that started it and exits at once otherwise.
///
/// The kernel sends the signal when the *thread* that forked the child exits: the
/// launcher starts its ranks from the thread that then supervises them until the
/// process exits.
fn die_with_launcher(cmd: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        let launcher = std::process::id() as libc::pid_t;
        // SAFETY: the closure runs in the child between fork and exec, where only
        // async-signal-safe calls are allowed: prctl, getppid and _exit are, and
        // `last_os_error` only reads errno (no allocation).
        unsafe {
            cmd.pre_exec(move || {
                let (signal, unused) = (libc::SIGKILL as libc::c_ulong, 0 as libc::c_ulong);
                if libc::prctl(libc::PR_SET_PDEATHSIG, signal, unused, unused, unused) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != launcher {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}

/// One started rank and, once reaped, its exit status.
struct Rank {
    rank: usize,
    local_rank: usize,
    child: Child,
    status: Option<ExitStatus>,
}

impl Rank {
    /// Reaps the rank if it has exited, remembering its status.
    fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        if self.status.is_none() {
            self.status = self.child.try_wait().map_err(|source| Error::Io {
                context: format!("tchrun: cannot wait for rank {}", self.rank),
                source,
            })?;
        }
        Ok(self.status)
    }

    /// Sends `signo` if the rank has not been reaped yet (so its pid cannot
    /// have been reused).
    fn signal(&self, signo: i32) {
        if self.status.is_none() {
            // SAFETY: kill(2) has no memory-safety preconditions; the pid is a
            // child we have not reaped yet.
            unsafe { libc::kill(self.child.id() as libc::pid_t, signo) };
        }
    }
}

/// The started ranks; dropping it kills and reaps any still running, so no
/// rank outlives the launcher on an error path.
#[derive(Default)]
struct Ranks(Vec<Rank>);

impl Ranks {
    fn all_exited(&self) -> bool {
        self.0.iter().all(|r| r.status.is_some())
    }

    /// Sends `signo` to every live rank, waits up to `grace` for them to exit
    /// (forwarding further SIGINT/SIGTERM), then SIGKILLs and reaps the rest.
    /// Exit statuses seen here are not reported: we caused them.
    fn stop(&mut self, signo: i32, grace: Duration, signals: &mut Signals) -> Result<()> {
        self.0.iter().for_each(|r| r.signal(signo));
        let deadline = Instant::now() + grace;
        loop {
            for r in &mut self.0 {
                r.try_wait()?;
            }
            if self.all_exited() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                break;
            }
            for signo in signals.pending() {
                self.0.iter().for_each(|r| r.signal(signo));
            }
            thread::sleep(POLL_INTERVAL.min(deadline.saturating_duration_since(Instant::now())));
        }
        for r in self.0.iter().filter(|r| r.status.is_none()) {
            eprintln!(
                "tchrun: rank {} (pid {}) did not exit within {:.1} s, sending SIGKILL",
                r.rank,
                r.child.id(),
                grace.as_secs_f64()
            );
        }
        self.kill_all();
        Ok(())
    }

    /// SIGKILLs and reaps every rank still running.
    fn kill_all(&mut self) {
        for r in self.0.iter_mut().filter(|r| r.status.is_none()) {
            r.signal(SIGKILL);
            r.status = r.child.wait().ok();
        }
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// Says how a rank failed, e.g. "failed with exit code 3" or
/// "was killed by signal SIGKILL (9)".
fn describe_failure(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("failed with exit code {code}"),
        (None, Some(signo)) => format!("was killed by signal {} ({signo})", signal_name(signo)),
        (None, None) => format!("failed ({status})"),
    }
}

/// Conventional name of a signal, e.g. "SIGKILL".
fn signal_name(signo: i32) -> String {
    let name = match signo {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        _ => return format!("signal {signo}"),
    };
    name.to_string()
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

    #[test]
    fn free_port_is_nonzero() {
        assert_ne!(free_port("127.0.0.1").unwrap(), 0);
    }

    #[test]
    fn names_signals() {
        assert_eq!(signal_name(libc::SIGKILL), "SIGKILL");
        assert_eq!(signal_name(1000), "signal 1000");
    }
}
