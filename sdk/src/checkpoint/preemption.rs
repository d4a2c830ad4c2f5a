//! Preemption: `SIGTERM`/`SIGINT` become "checkpoint at the next step, then exit".

use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::Arc;

use signal_hook::consts::{SIGINT, SIGTERM};

use crate::error::{Error, Result};
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

/// How many distinct senders of the first signal are told apart; a further sender's
/// signal counts as a second request.
const SENDERS: usize = 4;

/// The processes that sent the first signal so far (`si_pid`; 0 is the kernel, as for
/// a terminal's Ctrl-C), shared by the handlers. Only atomics: it is read and written
/// in signal handlers.
struct Senders([AtomicI32; SENDERS]);

/// Marks an empty slot of [`Senders`] (no process has pid -1).
const NO_SENDER: i32 = -1;

impl Senders {
    fn new() -> Self {
        Senders(std::array::from_fn(|_| AtomicI32::new(NO_SENDER)))
    }

    /// Records `pid` as a sender of the first signal; false when it had sent it
    /// already (or no slot is left): a second request.
    fn first_from(&self, pid: i32) -> bool {
        for slot in &self.0 {
            match slot.compare_exchange(NO_SENDER, pid, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => return true,
                Err(seen) if seen == pid => return false,
                Err(_) => {}
            }
        }
        false
    }
}

impl Preemption {
    /// Installs the handlers (once per process is enough; each call adds its own).
    ///
    /// Errors with [`Error::Io`] when the handlers cannot be installed.
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
            unsafe {
                signal_hook_registry::register_sigaction(signo, move |info| {
                    // SAFETY: SIGTERM and SIGINT sent by a process carry its pid.
                    let sender = info.si_pid();
                    let first = flag.load(Ordering::SeqCst);
                    if first == 0 {
                        senders.first_from(sender);
                        flag.store(signo as usize, Ordering::SeqCst);
                    } else if first != signo as usize || !senders.first_from(sender) {
                        // A second request: exit at once, as a shell would.
                        signal_hook::low_level::exit(preempted_exit_code(signo));
                    }
                })
            }
            .map_err(io)?;
        }
        Ok(Preemption { signal })
    }

    /// Whether a rank has received a preemption signal: `Some(signal)` on every rank
    /// as soon as any one has (one all-reduce, at a step boundary, so that all
    /// ranks stop at the same step); `None` otherwise. A collective: every rank calls
    /// it once per step.
    ///
    /// Errors with [`Error::Collective`] when the all-reduce fails.
    pub fn requested(&self) -> Result<Option<i32>> {
        let mine = self.signal.load(Ordering::SeqCst) as i64;
        let any = init::all_reduce_scalar(mine, ReduceOp::Max)?;
        Ok((any != 0).then_some(any as i32))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sender_counts_once() {
        let senders = Senders::new();
        // SLURM's signal to the rank, then the launcher's forwarded copy: one request.
        assert!(senders.first_from(4242));
        assert!(senders.first_from(17));
        // The scheduler again, or the launcher forwarding a second Ctrl-C: a second
        // request.
        assert!(!senders.first_from(4242));
        assert!(!senders.first_from(17));
        // A terminal's Ctrl-C comes from the kernel (pid 0), twice for a second one.
        assert!(senders.first_from(0));
        assert!(!senders.first_from(0));
    }

    #[test]
    fn senders_beyond_the_slots_count_as_second_requests() {
        let senders = Senders::new();
        for pid in 0..SENDERS as i32 {
            assert!(senders.first_from(pid), "sender {pid}");
        }
        assert!(!senders.first_from(1000));
    }
}
