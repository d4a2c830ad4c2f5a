//! Preemption: `SIGTERM`/`SIGINT` become "checkpoint at the next step, then exit".

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use signal_hook::consts::{SIGINT, SIGTERM};

use crate::error::{Error, Result};
use crate::ffi::os::{self, Senders};
use crate::init;
use crate::process_group::ReduceOp;

/// The exit code of a rank that stopped for a preemption signal after checkpointing:
/// 128 + the signal's number, as a shell reports a process ended by that signal
/// (143 for `SIGTERM`, 130 for `SIGINT`), so schedulers and launchers treat it as
/// "stopped by the signal" (SLURM can requeue it).
pub fn preempted_exit_code(signal: i32) -> i32 {
    128 + signal
}

/// Watches for `SIGTERM` and `SIGINT` (a cluster's preemption notice, Ctrl-C). The
/// first signal only sets a flag; training goes on to the end of the step, where
/// [`requested`](Self::requested) tells every rank, together, to write a checkpoint
/// and exit with [`preempted_exit_code`]. A second request ends the process at once.
///
/// One request often arrives twice: SLURM's `--signal` (with its usual cgroup process
/// tracking) and a cluster's preemption signal every process of the job, and the
/// launcher (`tchrun`, `torchrun`) forwards what it received to each rank as well. So
/// a repeat of the first signal counts as a second request only when it comes from a
/// process that sent one already (a second Ctrl-C, forwarded by the launcher again; a
/// second `scancel`), or is another signal; the same signal from a process not seen
/// yet is the first request again, and ignored. The sender is the signal's `si_pid`.
///
/// ```no_run
/// # fn main() -> tch_distributed::Result<()> {
/// let preemption = tch_distributed::Preemption::install()?;
/// for step in 0.. {
///     // … one training step …
///     if let Some(signal) = preemption.requested()? {
///         // checkpoints.save_state(&vs, &mut opt, &state)?;
///         std::process::exit(tch_distributed::preempted_exit_code(signal));
///     }
/// #   let _ = step;
/// }
/// # Ok(()) }
/// ```
///
/// Under `tchrun` (which forwards the signal to every rank) the checkpoint must be
/// written within `--stop-grace-seconds`; under `torchrun`, within its own grace period.
pub struct Preemption {
    /// The first signal received, 0 while none.
    signal: Arc<AtomicUsize>,
}

impl Preemption {
    /// Installs the handlers (once per process is enough; each call adds its own).
    ///
    /// # Errors
    /// [`Error::Io`] when the handlers cannot be installed.
    pub fn install() -> Result<Self> {
        let signal = Arc::new(AtomicUsize::new(0));
        let senders = Arc::new(Senders::new());
        for signo in [SIGTERM, SIGINT] {
            let flag = signal.clone();
            let senders = senders.clone();
            let io = |source| Error::Io {
                context: format!("installing the signal {signo} handler"),
                source,
            };
            os::on_preemption_signal(signo, flag, senders, preempted_exit_code(signo))
                .map_err(io)?;
        }
        Ok(Preemption { signal })
    }

    /// Whether a rank has received a preemption signal: `Some(signal)` on every rank
    /// as soon as any one has (one all-reduce, at a step boundary, so that all
    /// ranks stop at the same step); `None` otherwise. A collective: every rank calls
    /// it once per step.
    ///
    /// # Errors
    /// [`Error::Collective`] when the all-reduce fails.
    pub fn requested(&self) -> Result<Option<i32>> {
        let mine = self.signal.load(Ordering::SeqCst) as i64;
        let any = init::all_reduce_scalar(mine, ReduceOp::Max)?;
        Ok((any != 0).then_some(any as i32))
    }
}
