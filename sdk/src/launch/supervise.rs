//! One attempt of a job on this node: start its ranks with the torchrun environment,
//! watch them, and stop them all when one fails or the launcher gets a signal.

use std::ffi::{OsStr, OsString};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use signal_hook::consts::{SIGKILL, SIGTERM};
use signal_hook::iterator::Signals;

use super::error_file::{self, ErrorDir, ERROR_FILE_ENV};
use super::output::{RankOutput, DRAIN_GRACE};
use super::remote::{Failure, Remote};
use super::LaunchConfig;
use crate::error::{Error, Result};

/// How often the supervisor checks its ranks and pending signals.
const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// How long this node's ranks get, after another node reported a failure, to fail
/// by themselves (naming it) before they are stopped.
const ELSEWHERE_GRACE: Duration = Duration::from_secs(3);

/// What every rank of one attempt is started with.
pub(super) struct Attempt<'a> {
    pub config: &'a LaunchConfig,
    pub program: &'a OsStr,
    pub args: &'a [OsString],
    pub extra_env: &'a [(String, String)],
    /// Set `OMP_NUM_THREADS=1` in the ranks.
    pub set_omp: bool,
    pub run_id: &'a str,
    /// The rendezvous port (`MASTER_PORT`).
    pub master_port: u16,
    /// 0 for the first start, then the restart's number
    /// (`TORCHELASTIC_RESTART_COUNT`).
    pub number: usize,
    /// Where each rank writes why it failed (`TORCHELASTIC_ERROR_FILE`).
    pub error_files: &'a ErrorDir,
}

/// How an attempt ended.
#[derive(Debug)]
pub(super) enum Outcome {
    /// Every rank exited 0.
    Succeeded,
    /// A rank failed (reported on stderr); all ranks have been stopped.
    Failed,
    /// The launcher got this signal; it was forwarded and all ranks have stopped.
    Signalled(i32),
}

impl Attempt<'_> {
    /// The command that starts global rank `rank` (local rank `local_rank`), its
    /// standard output as `output` says.
    fn command(&self, rank: usize, local_rank: usize, output: &RankOutput) -> Command {
        let config = self.config;
        let mut cmd = Command::new(self.program);
        cmd.args(self.args)
            .stdin(Stdio::null())
            .stdout(output.stdout(rank))
            .stderr(output.stderr())
            .envs(self.extra_env.iter().map(|(k, v)| (k, v)))
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local_rank.to_string())
            .env("WORLD_SIZE", config.world_size().to_string())
            .env("LOCAL_WORLD_SIZE", config.nproc_per_node.to_string())
            .env("GROUP_RANK", config.node_rank.to_string())
            .env("ROLE_RANK", rank.to_string())
            .env("ROLE_WORLD_SIZE", config.world_size().to_string())
            .env("MASTER_ADDR", &config.master_addr)
            .env("MASTER_PORT", self.master_port.to_string())
            .env("TORCHELASTIC_RESTART_COUNT", self.number.to_string())
            .env("TORCHELASTIC_MAX_RESTARTS", config.max_restarts.to_string())
            .env("TORCHELASTIC_RUN_ID", self.run_id)
            .env(ERROR_FILE_ENV, self.error_files.file(self.number, rank))
            .env("TCHRUN", "1")
            // The ranks join the launcher's store as clients, under
            // `/worker/attempt_{number}`.
            .env("TORCHELASTIC_USE_AGENT_STORE", "True");
        if self.set_omp {
            cmd.env("OMP_NUM_THREADS", "1");
        }
        // The rank's stderr is a pipe to ours: say when ours is a terminal, for rank 0's
        // progress bar.
        if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            cmd.env(crate::protocol::STDERR_TERMINAL_ENV, "1");
        }
        own_session_dying_with_launcher(&mut cmd);
        cmd
    }

    /// Starts this attempt's ranks and supervises them until they have all exited.
    ///
    /// When a rank exits non-zero or is killed by a signal, the failure is printed
    /// to stderr and the other ranks are stopped (`SIGTERM`, then `SIGKILL` after
    /// the grace period): [`Outcome::Failed`]. `SIGINT`/`SIGTERM` received meanwhile,
    /// even while stopping the ranks after a failure, are forwarded to every live
    /// rank, which are then stopped the same way: [`Outcome::Signalled`].
    ///
    /// On several nodes, the first failure here is reported to the other nodes'
    /// launchers (`remote`), and a failure that another node reports stops this
    /// node's ranks: they get [`ELSEWHERE_GRACE`] to fail by themselves on the lost
    /// connection (and say so) before they are stopped: [`Outcome::Failed`].
    ///
    /// Each rank's standard output goes where [`RankOutput`] says (rank 0's alone, or
    /// every rank's copied line by line), and its standard error is copied line by line;
    /// every line the ranks wrote has been copied when this returns, and a failed rank's
    /// before the launcher says it failed.
    ///
    /// # Errors
    /// [`Error::Io`] when a rank cannot be started (the ranks already
    /// started are stopped first) or its status cannot be read.
    pub(super) fn run(&self, signals: &mut Signals, remote: &mut Remote) -> Result<Outcome> {
        let mut ranks = Ranks::default();
        let mut output = RankOutput::new(self.config.all_ranks_stdout, self.config.rank_prefix);
        let outcome = self
            .start(&mut ranks, &mut output, signals)
            .and_then(|()| self.supervise(&mut ranks, &mut output, signals, remote));
        // Every rank has exited by now, but on an error: then they are killed here.
        drop(ranks);
        output.finish();
        outcome
    }

    /// Starts this attempt's ranks into `ranks`, their standard output into `output`.
    /// When one cannot be started (or its output cannot be copied), stops those already
    /// started and errors with [`Error::Io`].
    fn start(
        &self,
        ranks: &mut Ranks,
        output: &mut RankOutput,
        signals: &mut Signals,
    ) -> Result<()> {
        let config = self.config;
        for local_rank in 0..config.nproc_per_node {
            let rank = config.node_rank * config.nproc_per_node + local_rank;
            let _ = std::fs::remove_file(self.error_files.file(self.number, rank));
            let started = self.command(rank, local_rank, output).spawn();
            // A rank whose output cannot be copied is stopped with the others.
            let copied = started.and_then(|mut child| {
                let copied = output.copy(rank, &mut child);
                ranks.0.push(Rank {
                    rank,
                    local_rank,
                    child,
                    status: None,
                });
                copied
            });
            if let Err(source) = copied {
                ranks.stop(SIGTERM, config, signals)?;
                return Err(Error::Io {
                    context: format!(
                        "cannot start rank {rank} (program {})",
                        self.program.to_string_lossy()
                    ),
                    source,
                });
            }
        }
        Ok(())
    }

    /// Watches the started `ranks` until they have all exited (see [`Attempt::run`]).
    fn supervise(
        &self,
        ranks: &mut Ranks,
        output: &mut RankOutput,
        signals: &mut Signals,
        remote: &mut Remote,
    ) -> Result<Outcome> {
        let config = self.config;
        let mut elsewhere: Option<Instant> = None;
        loop {
            if let Some(signo) = signals.pending().next() {
                crate::eprintln_whole!(
                    "{}: received {}, forwarding it to all ranks",
                    config.launcher.label(),
                    signal_name(signo)
                );
                ranks.stop(signo, config, signals)?;
                return Ok(Outcome::Signalled(signo));
            }
            let mut failed = Vec::new();
            for r in ranks.0.iter_mut().filter(|r| r.status.is_none()) {
                let Some(status) = r.try_wait()? else {
                    continue;
                };
                if !status.success() {
                    failed.push((r.rank, r.local_rank, r.child.id()));
                    // Its last lines (its `Error: …`) come before the launcher's.
                    output.drain(r.rank, DRAIN_GRACE);
                    let how = describe_failure(status);
                    crate::eprintln_whole!(
                        "{}: rank {} (local rank {}, pid {}) {how}",
                        config.launcher.label(),
                        r.rank,
                        r.local_rank,
                        r.child.id(),
                    );
                    if elsewhere.is_none() {
                        remote.report(&format!("rank {} ({}) {how}", r.rank, remote.node()));
                    }
                }
            }
            if !failed.is_empty() {
                // A rank that failed because a rank elsewhere died: name that one too
                // (the watcher answers within a poll, at once when this node's
                // failure was the first).
                if elsewhere.is_none() {
                    if let Some(failure) = remote.failure_elsewhere(Duration::from_secs(1)) {
                        announce(config, &failure);
                    }
                }
                let signalled = ranks.stop(SIGTERM, config, signals)?;
                self.report_root_cause(&failed);
                return Ok(match signalled {
                    Some(signo) => Outcome::Signalled(signo),
                    None => Outcome::Failed,
                });
            }
            if ranks.all_exited() {
                return Ok(Outcome::Succeeded);
            }
            if let Some(failure) = remote.failure_elsewhere(Duration::ZERO) {
                announce(config, &failure);
                elsewhere = Some(Instant::now() + ELSEWHERE_GRACE);
            }
            if elsewhere.is_some_and(|deadline| Instant::now() >= deadline) {
                return Ok(match ranks.stop(SIGTERM, config, signals)? {
                    Some(signo) => Outcome::Signalled(signo),
                    None => Outcome::Failed,
                });
            }
            thread::sleep(POLL_INTERVAL);
        }
    }
}

impl Attempt<'_> {
    /// Prints why the first of the `failed` ranks (global rank, local rank, pid) failed,
    /// from the error files they wrote (those killed by a signal write none), and, when
    /// this launcher was given an error file of its own (it runs under torchrun or
    /// another torchelastic agent), copies that rank's file there, as torchrun's agent
    /// passes its workers' root cause up.
    fn report_root_cause(&self, failed: &[(usize, usize, u32)]) {
        let first = failed
            .iter()
            .filter_map(|&(rank, local_rank, pid)| {
                let path = self.error_files.file(self.number, rank);
                error_file::read(&path).map(|cause| (cause, rank, local_rank, pid, path))
            })
            .min_by_key(|(cause, ..)| cause.written);
        let Some((cause, rank, local_rank, pid, path)) = first else {
            return;
        };
        let message = cause.message.trim_end().replace('\n', "\n    ");
        // One write, so that it stays in one piece next to the ranks' output.
        let report = format!(
            "{}: root cause: rank {rank} (local rank {local_rank}, pid {pid}): {message}\n",
            self.config.launcher.label()
        );
        let _ = std::io::Write::write_all(&mut std::io::stderr(), report.as_bytes());
        if let Some(own) = crate::protocol::error_file() {
            let _ = std::fs::copy(&path, own);
        }
    }
}

/// Says that another node reported `failure`, and that this node's ranks stop.
fn announce(config: &LaunchConfig, failure: &Failure) {
    crate::eprintln_whole!(
        "{label}: {line}, as node {node}'s {label} reported; stopping this node's ranks",
        label = config.launcher.label(),
        line = failure.line,
        node = failure.node_rank
    );
}

/// Starts the rank of `cmd` in a session of its own, as torchrun starts its workers
/// (`start_new_session`), and makes it die with the launcher.
///
/// **Its own session:** Ctrl-C in a terminal sends `SIGINT` to the whole foreground
/// process group. Ranks in the launcher's group would get it from the terminal and
/// again from the launcher, which forwards what it receives. Outside that group, a
/// rank hears the launcher alone: one signal forwarded per signal received (a second
/// Ctrl-C still ends the ranks at once). The same holds for a scheduler that signals
/// the launcher's process group. (A scheduler that signals every process of the job,
/// as SLURM's cgroup tracking does, still reaches each rank twice;
/// [`Preemption`](crate::Preemption) tells those copies apart by their sender.)
///
/// **Death with the launcher,** so that no rank outlives it unsupervised when the
/// launcher itself is killed (`SIGKILL`, the OOM killer, a lost SSH session):
/// `tchrun`'s or a self-launching program's ranks exit within moments of it.
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
fn own_session_dying_with_launcher(cmd: &mut Command) {
    crate::ffi::os::new_session_killed_with_parent(cmd);
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
                context: format!("cannot wait for rank {}", self.rank),
                source,
            })?;
        }
        Ok(self.status)
    }

    /// Sends `signo` if the rank has not been reaped yet (so its pid cannot
    /// have been reused).
    fn signal(&self, signo: i32) {
        if self.status.is_none() {
            // The pid is a child not reaped yet, so not reused.
            let _ = crate::ffi::os::kill(self.child.id(), signo);
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

    /// Sends `signo` to every live rank, waits up to `config.stop_grace` for them to exit
    /// (forwarding further SIGINT/SIGTERM), then SIGKILLs and reaps the rest.
    /// Exit statuses seen here are not reported: we caused them. Returns the first
    /// SIGINT/SIGTERM the launcher received meanwhile, if any.
    fn stop(
        &mut self,
        signo: i32,
        config: &LaunchConfig,
        signals: &mut Signals,
    ) -> Result<Option<i32>> {
        let grace = config.stop_grace;
        self.0.iter().for_each(|r| r.signal(signo));
        let mut received = None;
        let deadline = Instant::now() + grace;
        loop {
            for r in &mut self.0 {
                r.try_wait()?;
            }
            if self.all_exited() {
                break;
            }
            if Instant::now() >= deadline {
                for r in self.0.iter().filter(|r| r.status.is_none()) {
                    crate::eprintln_whole!(
                        "{}: rank {} (pid {}) did not exit within {:.1} s, sending SIGKILL",
                        config.launcher.label(),
                        r.rank,
                        r.child.id(),
                        grace.as_secs_f64()
                    );
                }
                self.kill_all();
                break;
            }
            for signo in signals.pending() {
                received.get_or_insert(signo);
                self.0.iter().for_each(|r| r.signal(signo));
            }
            thread::sleep(POLL_INTERVAL.min(deadline.saturating_duration_since(Instant::now())));
        }
        // A signal that arrived as the last rank exited.
        if let Some(signo) = signals.pending().next() {
            received.get_or_insert(signo);
        }
        Ok(received)
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
pub(super) fn signal_name(signo: i32) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_signals() {
        assert_eq!(signal_name(libc::SIGKILL), "SIGKILL");
        assert_eq!(signal_name(1000), "signal 1000");
    }
}
