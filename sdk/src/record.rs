//! `TCH_DISTRIBUTED_RECORD=DIR`: what each rank of a job trained on and ended with,
//! to check its data parallelism by hand or in a test.
//!
//! With the variable set, every rank writes into `DIR`:
//! - `rank-R.jsonl`: one line per loop that `#[distributed]` sharded, when the loop
//!   ends: `{"rank": R, "loop": L, "run": N, "rows": [F, …]}`, where `L` identifies
//!   the loop in the program, `N` counts its runs from 0 (the epoch, for an epoch's
//!   loop) and `F` is the [`fingerprint_rows`] of each sample (row of the batch's
//!   first tensor) this rank was given, in order. Within a run, the ranks' rows are
//!   disjoint and together cover the epoch, but for [`Sharded`](crate::Sharded)'s
//!   padding.
//! - `rank-R-model-I.safetensors`: when the `#[distributed]` function returns, the
//!   variables (parameters and buffers, by their `VarStore` names) of the `I`-th model
//!   it built an optimizer for, or the variables (`variable-{i}`, in the optimizer's
//!   order) of an optimizer it did not build but stepped. Every rank's file is the
//!   same, bit for bit, when the ranks stayed in step.

use std::cell::RefCell;
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use tch::nn::{VarStore, Variables};
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::init;

/// The environment variable naming the directory to record into.
pub const RECORD_ENV: &str = "TCH_DISTRIBUTED_RECORD";

fn dir() -> Option<PathBuf> {
    crate::settings::var("record").map(PathBuf::from)
}

/// One 64-bit fingerprint per row of `t` (per index of its first dimension): FNV-1a
/// over the row's values converted to `f64`, so equal rows, whatever their dtype or
/// device, give equal fingerprints. A 0-d tensor counts as one row.
pub fn fingerprint_rows(t: &Tensor) -> Vec<u64> {
    let t = t.detach().to_device(Device::Cpu).to_kind(Kind::Double);
    let rows = if t.dim() == 0 { 1 } else { t.size()[0] };
    let flat = t.reshape([rows, -1]).contiguous();
    let values = Vec::<f64>::try_from(flat.view([-1])).unwrap_or_default();
    let width = values.len() / rows.max(1) as usize;
    (0..rows as usize)
        .map(|r| {
            crate::random_state::fnv1a(
                values[r * width..(r + 1) * width]
                    .iter()
                    .flat_map(|v| v.to_bits().to_le_bytes()),
            )
        })
        .collect()
}

/// The samples of a batch of tch's data iterators: the rows of its first tensor.
pub(crate) trait Samples {
    fn samples(&self) -> Vec<u64>;
}
impl Samples for Tensor {
    fn samples(&self) -> Vec<u64> {
        fingerprint_rows(self)
    }
}
impl Samples for (Tensor, Tensor) {
    fn samples(&self) -> Vec<u64> {
        fingerprint_rows(&self.0)
    }
}

/// The rows one sharded loop gives this rank.
pub(crate) struct Recording<T> {
    site: u64,
    run: u64,
    rows: Vec<u64>,
    samples: fn(&T) -> Vec<u64>,
}

impl<T: Samples> Recording<T> {
    /// A recording of run `run` of loop `site`, if `TCH_DISTRIBUTED_RECORD` is set.
    pub(crate) fn start(site: u64, run: u64) -> Option<Self> {
        dir()?;
        Some(Recording {
            site,
            run,
            rows: Vec::new(),
            samples: T::samples,
        })
    }
}

impl<T> Recording<T> {
    pub(crate) fn add(&mut self, item: &T) {
        self.rows.extend((self.samples)(item));
    }

    /// Appends the loop's line to `rank-R.jsonl`.
    pub(crate) fn finish(self) {
        let Some(dir) = dir() else { return };
        let (rank, _) = init::rank_and_world_size();
        let line = serde_json::json!({
            "rank": rank, "loop": self.site, "run": self.run, "rows": self.rows,
        });
        let path = dir.join(format!("rank-{rank}.jsonl"));
        let written = std::fs::create_dir_all(&dir).and_then(|()| {
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)?;
            writeln!(f, "{line}")
        });
        if let Err(e) = written {
            crate::log::warn(format_args!(
                "{RECORD_ENV}: writing {}: {e}",
                path.display()
            ));
        }
    }
}

/// A model whose end state is recorded.
enum Model {
    /// One `#[distributed]` built an optimizer for: its `VarStore`'s variables.
    Built(Arc<Mutex<Variables>>),
    /// The variables of an optimizer it did not build but stepped (named
    /// `variable-{i}`, in the optimizer's order).
    Stepped(Vec<Tensor>),
}

thread_local! {
    /// The models `#[distributed]` built or stepped an optimizer for, in order.
    static MODELS: RefCell<Vec<Model>> = const { RefCell::new(Vec::new()) };
}

/// Notes a model that `#[distributed]` built an optimizer for.
pub(crate) fn model_built(vs: &VarStore) {
    if dir().is_some() {
        MODELS.with(|m| m.borrow_mut().push(Model::Built(vs.variables_.clone())));
    }
}

/// Notes the variables of an optimizer that `#[distributed]` steps without having
/// built it (once per optimizer).
pub(crate) fn optimizer_stepped(variables: &[Tensor]) {
    if dir().is_some() {
        let variables = variables.iter().map(Tensor::shallow_clone).collect();
        MODELS.with(|m| m.borrow_mut().push(Model::Stepped(variables)));
    }
}

/// Writes every noted model's variables to `rank-R-model-I.safetensors`.
pub(crate) fn write_models() -> Result<()> {
    let Some(dir) = dir() else { return Ok(()) };
    let (rank, _) = init::rank_and_world_size();
    std::fs::create_dir_all(&dir).map_err(|source| Error::Io {
        context: format!("{RECORD_ENV}: creating {}", dir.display()),
        source,
    })?;
    let on_cpu = |t: &Tensor| t.detach().to_device(Device::Cpu);
    MODELS.with(|models| -> Result<()> {
        for (i, model) in models.borrow().iter().enumerate() {
            let named: Vec<(String, Tensor)> = match model {
                Model::Built(variables) => {
                    let v = variables.lock().expect("variable store lock");
                    v.named_variables
                        .iter()
                        .map(|(name, t)| (name.clone(), on_cpu(t)))
                        .collect()
                }
                Model::Stepped(variables) => variables
                    .iter()
                    .enumerate()
                    .map(|(i, t)| (format!("variable-{i}"), on_cpu(t)))
                    .collect(),
            };
            let path = dir.join(format!("rank-{rank}-model-{i}.safetensors"));
            Tensor::write_safetensors(&named, &path).map_err(|e| {
                Error::Torch(format!("{RECORD_ENV}: writing {}: {e}", path.display()))
            })?;
        }
        Ok(())
    })
}
