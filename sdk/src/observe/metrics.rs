//! [`Tracker`]: metrics and the run's configuration, written by rank 0 only.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use super::events::{self, EventWriter};
use super::plot;
use crate::error::{io, Error, Result};
use crate::{devices, init, ReduceOp};

/// The JSONL file's name in a tracker's directory.
pub const METRICS_FILE: &str = "metrics.jsonl";
/// The configuration file's name in a tracker's directory.
pub const CONFIG_FILE: &str = "config.json";

/// Metrics and the run's configuration on disk, as Accelerate's trackers
/// (`Accelerator.log`, `init_trackers`) and PyTorch's `SummaryWriter`: only rank 0
/// writes, so a 2-rank run leaves one set of files.
///
/// In `dir`, rank 0 writes:
/// - `metrics.jsonl`: one line per [`log`](Self::log),
///   `{"step": S, "time": T, "loss": v, …}` (`T` in seconds since the Unix epoch),
///   appended to what a previous run (say, before a resume) left there;
/// - `events.out.tfevents.*`: a TensorBoard event file per tracker, which
///   `tensorboard --logdir DIR` shows while the run trains (flushed at every `log`);
/// - `config.json`: the run's configuration (see [`new`](Self::new)), rewritten
///   whole (through a temporary file) when [`config`](Self::config) adds a field;
/// - at [`finish`](Self::finish) (or when the tracker is dropped), `NAME.png`: each
///   metric against the step, for the steps logged by this tracker.
///
/// The other ranks write nothing; their [`log`](Self::log) calls take part in the
/// all-reduce of [`average_over_ranks`](Self::average_over_ranks) when it is on, and
/// are free otherwise. So the training function calls it on every rank, with no
/// rank checks.
pub struct Tracker {
    dir: PathBuf,
    /// Rank 0's open files; `None` on the other ranks.
    files: Option<Files>,
    average: bool,
    world_size: usize,
    config: Map<String, Value>,
    /// What this tracker logged, by metric name (rank 0).
    history: BTreeMap<String, Vec<(u64, f64)>>,
    finished: bool,
}

struct Files {
    jsonl: File,
    events: EventWriter,
}

impl Tracker {
    /// A tracker writing into `dir` (created, with its parents, on rank 0), for the
    /// job joined by [`init`](crate::init) or `#[distributed]`, or for a single process
    /// without one.
    ///
    /// The configuration it records from the start: world size, backend, each rank's
    /// device (as the banner prints it), the program's command line, tch's and
    /// libtorch's versions, the run's settings that were given (`settings`: the
    /// attribute's options and the `TCH_DISTRIBUTED_*` variables over them, each as its
    /// variable would hold it) and the mixed precision chosen.
    /// Add the batch size with [`batch_size`](Self::batch_size) and anything else
    /// with [`config`](Self::config).
    ///
    /// # Errors
    /// [`Error::Io`] when rank 0 cannot create `dir` or its files.
    pub fn new(dir: impl AsRef<Path>) -> Result<Tracker> {
        let dir = dir.as_ref().to_path_buf();
        let ctx = init::current();
        let (rank, world_size) = ctx
            .as_ref()
            .map(|c| (c.rank(), c.world_size()))
            .unwrap_or((0, 1));
        let mut config = Map::new();
        config.insert("world_size".into(), json!(world_size));
        if let Some(c) = &ctx {
            config.insert("backend".into(), json!(c.backend().to_string()));
            config.insert("device".into(), json!(devices::device_name(c.device())));
            config.insert("local_world_size".into(), json!(c.local_world_size()));
        }
        config.insert(
            "command".into(),
            json!(std::env::args().collect::<Vec<_>>()),
        );
        config.insert("tch".into(), json!(crate::TCH_VERSION));
        config.insert("libtorch".into(), json!(crate::LIBTORCH_VERSION));
        if let Some(ctx) = &ctx {
            let settings = ctx.settings();
            config.insert(
                "mixed_precision".into(),
                json!(ctx.mixed_precision().to_string()),
            );
            // Every setting the run was given, as its variable would hold it.
            let given: Map<String, Value> = crate::settings::TABLE
                .iter()
                .filter_map(|row| Some((row.key.to_string(), json!(row.text(settings)?))))
                .collect();
            config.insert("settings".into(), Value::Object(given));
        }
        let files = if rank == 0 {
            fs::create_dir_all(&dir).map_err(io("creating", &dir))?;
            let path = dir.join(METRICS_FILE);
            let jsonl = OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .map_err(io("opening", &path))?;
            let events =
                EventWriter::create(&dir).map_err(io("creating an event file in", &dir))?;
            Some(Files { jsonl, events })
        } else {
            None
        };
        let tracker = Tracker {
            dir,
            files,
            average: false,
            world_size,
            config,
            history: BTreeMap::new(),
            finished: false,
        };
        tracker.write_config()?;
        Ok(tracker)
    }

    /// Logs the mean over ranks of each value instead of rank 0's own, so that the
    /// logged loss is the global batch's: every [`log`](Self::log) then all-reduces
    /// its values (one all-reduce of a float64 tensor on the CPU, as
    /// `accelerator.reduce(…, "mean")`), and must be called by every rank with the
    /// same names. Off by default: rank 0's values are logged as they are.
    pub fn average_over_ranks(mut self) -> Self {
        self.average = true;
        self
    }

    /// Records the per-rank batch size (samples per rank per step) in the
    /// configuration, with the effective batch it gives: per-rank batch × gradient
    /// accumulation steps (the attribute's `grad_accum`, else 1) × world size, as the
    /// multi-GPU guides count it.
    ///
    /// # Errors
    /// As [`config`](Self::config).
    pub fn batch_size(&mut self, per_rank: usize) -> Result<()> {
        let accumulation = init::current()
            .and_then(|c| c.settings().grad_accum)
            .unwrap_or(1);
        self.config
            .insert("batch_size_per_rank".into(), json!(per_rank));
        self.config.insert("grad_accum".into(), json!(accumulation));
        self.config(
            "effective_batch_size",
            per_rank * accumulation * self.world_size,
        )
    }

    /// Adds `key: value` to the configuration (say, the command-line arguments as a
    /// struct deriving `serde::Serialize`) and rewrites `config.json` on rank 0.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when `value` cannot be turned into JSON, and
    /// with [`Error::Io`] when rank 0 cannot write the file.
    pub fn config(&mut self, key: &str, value: impl serde::Serialize) -> Result<()> {
        let value = serde_json::to_value(value).map_err(|e| {
            Error::InvalidInput(format!("the configuration field {key:?} is not JSON: {e}"))
        })?;
        self.config.insert(key.to_string(), value);
        self.write_config()
    }

    /// The configuration as recorded so far.
    pub fn configuration(&self) -> &Map<String, Value> {
        &self.config
    }

    /// The directory the tracker writes into.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn write_config(&self) -> Result<()> {
        if self.files.is_none() {
            return Ok(());
        }
        let path = self.dir.join(CONFIG_FILE);
        let text = serde_json::to_string_pretty(&self.config).expect("a JSON map");
        crate::files::replace_with_bytes(&path, (text + "\n").as_bytes())
    }

    /// Logs `values` (name, value) at `step`: on rank 0, one line of
    /// `metrics.jsonl` and one TensorBoard event; with
    /// [`average_over_ranks`](Self::average_over_ranks), the mean over ranks of each
    /// value.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a name that is empty or repeated in
    /// `values`, with the all-reduce's error when averaging fails (a rank that does
    /// not call `log` makes the others time out), and with [`Error::Io`] when rank 0
    /// cannot write.
    pub fn log(&mut self, step: u64, values: &[(&str, f64)]) -> Result<()> {
        for (i, (name, _)) in values.iter().enumerate() {
            if name.is_empty() || values[..i].iter().any(|(n, _)| n == name) {
                return Err(Error::InvalidInput(format!(
                    "Tracker::log at step {step}: the metric name {name:?} is empty or given twice: give each value its own name"
                )));
            }
        }
        let values = self.reduce(values)?;
        let Some(files) = self.files.as_mut() else {
            return Ok(());
        };
        // Only rank 0 draws a bar.
        super::progress_bar::set_last_metrics(&values);
        let mut line = Map::new();
        line.insert("step".into(), json!(step));
        line.insert("time".into(), json!(events::now()));
        for (name, v) in &values {
            // JSON has no NaN or infinity: those are written as null.
            line.insert(name.to_string(), json!(v));
        }
        let path = self.dir.join(METRICS_FILE);
        writeln!(files.jsonl, "{}", Value::Object(line)).map_err(io("writing", &path))?;
        files
            .events
            .scalars(step, &values)
            .map_err(io("writing", files.events.path()))?;
        for (name, v) in values {
            self.history
                .entry(name.to_string())
                .or_default()
                .push((step, v));
        }
        Ok(())
    }

    /// `values`, or their means over ranks when averaging.
    fn reduce<'a>(&self, values: &[(&'a str, f64)]) -> Result<Vec<(&'a str, f64)>> {
        let ctx = init::current().filter(|c| c.world_size() > 1);
        let (true, Some(ctx)) = (self.average, ctx) else {
            return Ok(values.to_vec());
        };
        let raw: Vec<f64> = values.iter().map(|(_, v)| *v).collect();
        let mut t = tch::Tensor::from_slice(&raw);
        ctx.process_group().all_reduce(&mut t, ReduceOp::Sum)?;
        let sums = Vec::<f64>::try_from(&t).map_err(|e| Error::Torch(e.to_string()))?;
        Ok(values
            .iter()
            .zip(sums)
            .map(|((name, _), sum)| (*name, sum / ctx.world_size() as f64))
            .collect())
    }

    /// Ends the tracker: rank 0 draws `NAME.png` for each metric logged (the value
    /// against the step) and returns their paths; the other ranks return none.
    /// Dropping the tracker does the same, reporting a failure on stderr.
    ///
    /// # Errors
    /// [`Error::Io`] when a plot cannot be written.
    pub fn finish(mut self) -> Result<Vec<PathBuf>> {
        self.plot()
    }

    fn plot(&mut self) -> Result<Vec<PathBuf>> {
        if self.finished || self.files.is_none() {
            return Ok(Vec::new());
        }
        self.finished = true;
        let mut written = Vec::new();
        for (name, points) in &self.history {
            let path = self.dir.join(format!("{}.png", plot::file_stem(name)));
            plot::draw(&path, name, points).map_err(|e| Error::Io {
                context: format!("drawing {}", path.display()),
                source: std::io::Error::other(e),
            })?;
            written.push(path);
        }
        Ok(written)
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        if let Err(e) = self.plot() {
            crate::log::warn(format_args!("the tracker's plots: {e}"));
        }
    }
}
