//! Watching a run: metrics written by rank 0 as JSONL and TensorBoard event files, a
//! PNG plot of each metric, and the run's configuration as JSON ([`Tracker`]).

mod events;
mod metrics;
mod plot;

pub use metrics::Tracker;
