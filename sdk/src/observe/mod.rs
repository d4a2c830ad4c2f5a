//! Watching a run: metrics written by rank 0 as JSONL and TensorBoard event files, a
//! PNG plot of each metric, and the run's configuration as JSON ([`Tracker`]); a
//! progress bar on rank 0 ([`progress_bar`]).

mod events;
mod metrics;
mod plot;
pub(crate) mod progress_bar;

pub use metrics::Tracker;
pub use progress_bar::PROGRESS_ENV;
