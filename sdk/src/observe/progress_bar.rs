//! A progress bar on rank 0 (`indicatif`), as Accelerate's "only the main process
//! shows the progress bar": one bar per epoch of the SDK's
//! [`DataLoader`](crate::DataLoader) and of each loop that `#[distributed]` shards, showing the
//! epoch, step/steps, the rate, the time left and the last values a
//! [`Tracker`](crate::Tracker) logged.
//!
//! It is drawn only on rank 0, only when standard error is a terminal (so logs and
//! CI output stay clean), and not at all with `TCH_DISTRIBUTED_PROGRESS=0`.

use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::init;

/// The variable that turns the bar off: `TCH_DISTRIBUTED_PROGRESS=0`.
pub const PROGRESS_ENV: &str = "TCH_DISTRIBUTED_PROGRESS";

/// The last values a tracker logged, as the bar shows them (`loss 1.234 · lr 0.01`).
static LAST_METRICS: Mutex<String> = Mutex::new(String::new());

/// Records `values` as the last metrics, for the bar.
pub(crate) fn set_last_metrics(values: &[(&str, f64)]) {
    let text = values
        .iter()
        .map(|(name, v)| format!("{name} {v:.4}"))
        .collect::<Vec<_>>()
        .join(" · ");
    *LAST_METRICS.lock().unwrap_or_else(|e| e.into_inner()) = text;
}

fn last_metrics() -> String {
    LAST_METRICS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
}

/// Whether this process draws bars: rank 0, standard error a terminal (its own, or the
/// launcher's that it is copied to), and not turned off by `TCH_DISTRIBUTED_PROGRESS=0`.
fn enabled() -> bool {
    let off = crate::settings::var("progress")
        .is_some_and(|v| <bool as crate::settings::Value>::parse(&v) == Ok(false));
    let terminal = std::io::stderr().is_terminal() || crate::protocol::stderr_reaches_terminal();
    !off && init::rank_and_world_size().0 == 0 && terminal
}

/// Where a bar is drawn: standard error; through the launcher (a pipe that it copies to
/// its terminal), drawn as on a terminal, which indicatif's `stderr` target would hide.
fn draw_target() -> ProgressDrawTarget {
    if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::term_like(Box::new(console::Term::buffered_stderr()))
    }
}

/// One epoch's bar; draws nothing where [`enabled`] is false. A step is counted
/// when the loop is handed its next batch, and when the bar is dropped (the epoch
/// ended, or the loop was left with `break`).
pub(crate) struct Progress {
    bar: Option<ProgressBar>,
    /// A batch was handed out and its step is not counted yet.
    pending: bool,
}

impl Progress {
    /// A bar for `epoch` (when known) of `steps` steps (when known: otherwise it counts
    /// steps with no total and no time left), `done` of them already done (resuming
    /// mid-epoch).
    pub(crate) fn start(epoch: Option<u64>, steps: Option<u64>, done: u64) -> Progress {
        if !enabled() {
            return Progress::none();
        }
        let prefix = epoch.map(|e| format!("epoch {e}")).unwrap_or_default();
        let (bar, template) = match steps {
            Some(n) => (
                ProgressBar::new(n),
                "{prefix} {bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}, {per_sec}] {msg}",
            ),
            None => (
                ProgressBar::no_length(),
                "{prefix} {spinner} step {pos} [{elapsed_precise}, {per_sec}] {msg}",
            ),
        };
        bar.set_draw_target(draw_target());
        bar.set_style(ProgressStyle::with_template(template).expect("a valid template"));
        bar.set_prefix(prefix);
        bar.set_position(done);
        bar.reset_eta();
        bar.enable_steady_tick(Duration::from_millis(500));
        Progress {
            bar: Some(bar),
            pending: false,
        }
    }

    /// A bar that draws nothing.
    pub(crate) fn none() -> Progress {
        Progress {
            bar: None,
            pending: false,
        }
    }

    /// The loop is handed a batch: the step of the one before it is done.
    pub(crate) fn handed_out(&mut self) {
        self.count_pending();
        self.pending = true;
    }

    fn count_pending(&mut self) {
        if let (true, Some(bar)) = (std::mem::take(&mut self.pending), &self.bar) {
            bar.set_message(last_metrics());
            bar.inc(1);
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.count_pending();
        if let Some(bar) = self.bar.take() {
            // The epoch's last state stays on screen, as tqdm's default.
            bar.set_message(last_metrics());
            bar.finish();
        }
    }
}
