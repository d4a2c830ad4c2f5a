//! `Checkpointer`: whole training states in directories that are complete or absent.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write as _;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::nn::VarStore;
use tch::Tensor;

use super::{io, model_file, sync_dir, sync_file};
use crate::error::{checkpoint, checkpoint_from, Error, Result};
use crate::init;
use crate::log;
use crate::loop_position::{LoaderPosition, LoopPosition};
use crate::optim::Optimizer;
use crate::process_group::ReduceOp;
use crate::random_state::{generators, rng_state, set_rng_state};

/// The manifest that marks a checkpoint complete: every file's size and FNV-1a hash.
const COMPLETE: &str = "COMPLETE";
const MODEL: &str = "model.safetensors";
const OPTIMIZER: &str = "optimizer.safetensors";
/// Where tch-distributed 0.1 kept the optimizer's state, in libtorch's optimizer
/// archive: still read (converted on load), never written.
const LIBTORCH_OPTIMIZER: &str = "optimizer.pt";

/// Under ZeRO, rank `rank`'s shard of the optimizer's state (its rows of every
/// parameter's state).
fn optimizer_shard(rank: usize) -> String {
    format!("optimizer-rank-{rank}.safetensors")
}

/// Whether a checkpoint's file `name` holds (a shard of) the optimizer's state.
fn is_optimizer_state(name: &str) -> bool {
    name == OPTIMIZER || (name.starts_with("optimizer-rank-") && name.ends_with(".safetensors"))
}
const STATE: &str = "state.json";

/// Where training stands, saved with the model and optimizer.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// Optimizer steps taken.
    pub step: u64,
    /// The data loader's position (epoch, samples of it consumed over all ranks), or
    /// the program's own epoch counter. Left at `(0, 0)`, `save_state` writes the
    /// run's first [`DataLoader`](crate::DataLoader)'s position there.
    pub epoch: u64,
    pub samples_in_epoch: u64,
    /// The world size that wrote the checkpoint (filled in by `save_state`).
    pub world_size: usize,
    /// The fp16 loss scaler's state ([`GradScaler::state`](crate::GradScaler::state)),
    /// when training uses one. `save_state` fills it from the optimizer's
    /// [`grad_scaler`](crate::Optimizer::grad_scaler) when left `None`, and
    /// `load_state` restores it there.
    #[serde(default)]
    pub grad_scaler: Option<(f64, i64)>,
    /// The run's configuration, free-form (e.g. the command-line arguments), for
    /// the record and for checking that a resumed run matches.
    pub config: serde_json::Value,
    /// Where each loop that `#[distributed]` sharded stood: `save_state` fills it from
    /// the run's loops when left empty, and `load_state` hands it to them, so that
    /// each resumes its run (epoch) with the same shuffle, past the batches it had
    /// dealt (see [`LoopPosition`]). Empty outside the attribute.
    #[serde(default)]
    pub loops: Vec<LoopPosition>,
    /// Where each [`DataLoader`](crate::DataLoader) of the run stood, in the order they
    /// were made: `save_state` fills it when left empty, and `load_state` hands each
    /// position to the loader of the same number, which resumes there at the start of
    /// its next loop (unless [`DataLoader::resume`](crate::DataLoader::resume) is
    /// called). Empty without a context.
    #[serde(default)]
    pub loaders: Vec<LoaderPosition>,
    /// The optimizer's [`steps_taken`](crate::Optimizer::steps_taken), where an
    /// [`LrScheduler`](crate::LrScheduler) stands: `save_state` fills it from the
    /// optimizer when left `None`, and `load_state` restores the optimizer's count from
    /// it, so that a resumed run's schedule goes on from the same step, bit for bit.
    /// A checkpoint written before it existed restores the count from
    /// [`step`](Self::step).
    #[serde(default)]
    pub optimizer_steps: Option<u64>,
    /// Where the gradient-accumulation cycle stood, when the checkpoint was saved in
    /// its middle: filled in by `save_state` (whatever is given), which then writes
    /// each rank's gradients of the cycle too, and `load_state` resumes the cycle
    /// with them. `None` at a cycle's end.
    #[serde(default)]
    pub accumulation: Option<AccumulationCycle>,
}

/// Where an accumulation cycle ([`Optimizer::accumulate`]) stood when a checkpoint was
/// saved in its middle ([`TrainState::accumulation`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccumulationCycle {
    /// Micro-batches of the cycle whose gradients the checkpoint holds (at least 1,
    /// fewer than `micro_batches_per_step`).
    pub micro_batches_done: u64,
    /// The optimizer's micro-batches per step.
    pub micro_batches_per_step: u64,
}

impl TrainState {
    /// The data loader's position, for [`DataLoader::resume`](crate::DataLoader::resume).
    pub fn loader_position(&self) -> LoaderPosition {
        LoaderPosition {
            epoch: self.epoch,
            samples_in_epoch: self.samples_in_epoch,
        }
    }

    /// Sets the loader's position from [`DataLoader::position`](crate::DataLoader::position).
    pub fn with_loader_position(mut self, position: LoaderPosition) -> Self {
        self.epoch = position.epoch;
        self.samples_in_epoch = position.samples_in_epoch;
        self
    }
}

/// Saves and restores everything a resumed run needs, as Accelerate's `save_state` /
/// `load_state`, in `root/step-NNNNNNNNNN/` (or `root/checkpoint-N/`, the HF Trainer's
/// names, with [`named`](Checkpointer::named)):
///
/// | file | written by | contents |
/// |---|---|---|
/// | `model.safetensors` | rank 0 | parameters and buffers, named as `VarStore::save` names them (loads in 1 rank, N ranks, or PyTorch's `safetensors.torch.load_file`) |
/// | `optimizer.safetensors` | rank 0 | the optimizer's state in `torch.optim`'s `state_dict` layout (moments, step counts, the groups' options: see [`Optimizer::state`]); loads into PyTorch. Checkpoints of tch-distributed 0.1, with libtorch's `optimizer.pt` instead, still load |
/// | `optimizer-rank-R.safetensors` | rank R, with ZeRO ([`Optimizer::zero`]) instead of the above (under hybrid sharding, the ranks of the first shard group, R being the place in it) | rank R's rows (dim 0, as `torch.chunk` cuts) of every parameter's state, in the same layout and numbering, with `dim0_shard` in the metadata: together the whole state; they load at any world size, with or without ZeRO |
/// | `state.json` | rank 0 | [`TrainState`]: step, epoch, samples consumed, world size, configuration, the optimizer's count of steps (where a learning-rate schedule stands), where an accumulation cycle stood (in its middle) |
/// | `rank-R.safetensors` | rank R | that rank's random-generator states: `cpu`, and `cuda` when the model is on a GPU |
/// | `grads-rank-R.safetensors` | rank R, only when saved in the middle of an accumulation cycle ([`TrainState::accumulation`]) | that rank's gradients of the cycle's micro-batches so far (its own sum, not yet averaged), by variable name, whole at every ZeRO stage |
/// | `COMPLETE` | rank 0, last | every file's size and hash |
///
/// A save goes to `root/.tmp-step-N/`; every rank fsyncs its files; after all ranks
/// agree that they succeeded, rank 0 writes `COMPLETE`, fsyncs it, and renames the
/// directory into place. A crash, a full disk or a killed rank at any point leaves
/// the previous checkpoints as they were. `keep_last(K)` removes older checkpoints
/// only once the new one is in place.
///
/// `root` must be on a filesystem that every rank sees (a local disk for one
/// machine, a shared one for several).
#[derive(Clone, Debug)]
pub struct Checkpointer {
    root: PathBuf,
    keep_last: Option<usize>,
    /// Each checkpoint's directory is `{prefix}{step}`, the step padded to `width`
    /// digits.
    prefix: String,
    width: usize,
}

/// FNV-1a, 64 bits: detects torn and corrupted files.
fn fnv1a(bytes: &[u8]) -> u64 {
    crate::random_state::fnv1a(bytes.iter().copied())
}

/// FNV-1a's starting value, from which [`fnv1a`] hashes.
const FNV1A_START: u64 = crate::random_state::FNV1A_START;

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    // 0664 less the umask: never writable by other users.
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o664)
        .open(path)
        .map_err(io("creating", path))?;
    f.write_all(bytes).map_err(io("writing", path))?;
    f.sync_all().map_err(io("syncing", path))
}

/// The named tensors of a safetensors file's bytes (already read and checked) in the
/// checkpoint `dir`.
fn tensors(dir: &Path, name: &str, bytes: &[u8]) -> Result<Vec<(String, Tensor)>> {
    let file = safetensors::SafeTensors::deserialize(bytes)
        .map_err(|e| checkpoint_from(Some(dir), format!("{name}: {e}"), e))?;
    file.tensors()
        .into_iter()
        .map(|(n, view)| {
            Tensor::try_from(view)
                .map(|t| (n, t))
                .map_err(|e| checkpoint_from(Some(dir), format!("{name}: {e}"), e))
        })
        .collect()
}

fn rank_file(rank: usize) -> String {
    format!("rank-{rank}.safetensors")
}

/// Rank `rank`'s gradients of an accumulation cycle in progress.
fn grads_file(rank: usize) -> String {
    format!("grads-rank-{rank}.safetensors")
}

/// A checkpoint's gradients of an accumulation cycle in progress, saved by `saved_by`
/// ranks, for rank `rank`: its `own` file (the same world size), or else their mean
/// over the saving ranks (a variable a rank had no gradient for counts as zero
/// there), which every rank takes, so that the average over the ranks at the cycle's
/// end counts the saved micro-batches as the uninterrupted run's would (the gradients
/// are averaged once, at the end).
fn cycle_gradients(
    dir: &Path,
    saved_by: usize,
    rank: usize,
    own: bool,
    read: impl Fn(&str) -> Result<Vec<u8>>,
) -> Result<Vec<(String, Tensor)>> {
    if own {
        let name = grads_file(rank);
        return tensors(dir, &name, &read(&name)?);
    }
    let mut sum: BTreeMap<String, Tensor> = BTreeMap::new();
    for r in 0..saved_by {
        let name = grads_file(r);
        for (var, grad) in tensors(dir, &name, &read(&name)?)? {
            match sum.get_mut(&var) {
                Some(total) if total.size() == grad.size() => *total += grad,
                Some(total) => {
                    return Err(checkpoint(
                        Some(dir),
                        format!(
                            "{name}: the gradient of `{var}` has shape {:?}, another rank's {:?}",
                            grad.size(),
                            total.size()
                        ),
                    ))
                }
                None => {
                    sum.insert(var, grad);
                }
            }
        }
    }
    Ok(sum
        .into_iter()
        .map(|(var, total)| (var, total / saved_by as f64))
        .collect())
}

/// The optimizer's errors about what it is given name no checkpoint: `dir`, where it
/// came from.
fn in_checkpoint(e: Error, dir: &Path) -> Error {
    match e {
        Error::Checkpoint {
            path: None,
            message,
            source,
        } => Error::Checkpoint {
            path: Some(dir.to_path_buf()),
            message,
            source,
        },
        other => other,
    }
}

/// Whether every rank's `ok` is true (one all-reduce; a job of one needs none).
fn all_ok(ok: bool) -> Result<bool> {
    Ok(init::all_reduce_scalar(ok as i64, ReduceOp::Min)? == 1)
}

/// A checkpoint's optimizer state, as read.
enum OptimizerFile {
    /// `optimizer.safetensors`, or the ranks' shards under ZeRO
    /// ([`Optimizer::state`]).
    State(Vec<Vec<u8>>),
    /// `optimizer.pt`, libtorch's archive, from tch-distributed 0.1.
    LibtorchArchive(Vec<u8>),
}

/// A checkpoint read into memory and checked, not yet applied.
struct Loaded {
    state: TrainState,
    /// The model's file, checked: read when applied (a sharded variable's rows only).
    model: PathBuf,
    optimizer: OptimizerFile,
    /// The rank's generator states by name (`cpu`, `cuda`); empty when the world size
    /// changed.
    rng: Vec<(String, Tensor)>,
    /// The gradients of the accumulation cycle in progress, for this rank (see
    /// [`cycle_gradients`]); empty at a cycle's end.
    grads: Vec<(String, Tensor)>,
}

impl Checkpointer {
    /// Checkpoints under `root` (created on the first save), all kept.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Checkpointer {
            root: root.into(),
            keep_last: None,
            prefix: "step-".into(),
            width: 10,
        }
    }

    /// Names each checkpoint `{prefix}{step}`, the step unpadded: `named("checkpoint-")`
    /// gives the HF Trainer's `checkpoint-40/` (rather than `step-0000000040/`). Only the
    /// directories of this name are listed and loaded.
    pub fn named(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self.width = 0;
        self
    }

    /// Keep only the newest `k` complete checkpoints (at least 1).
    pub fn keep_last(mut self, k: usize) -> Self {
        self.keep_last = Some(k.max(1));
        self
    }

    /// The directory of the checkpoint at `step`.
    pub fn path_of(&self, step: u64) -> PathBuf {
        self.root
            .join(format!("{}{step:0width$}", self.prefix, width = self.width))
    }

    /// The checkpoint directories under `root`, newest first, complete or not; empty
    /// when `root` does not exist yet.
    ///
    /// # Errors
    /// [`Error::Io`] naming `root` when it exists but cannot be read (a
    /// permission problem, a network file system's error, a file where the directory
    /// should be): a job must not take that for "no checkpoints" and start afresh.
    pub fn list(&self) -> Result<Vec<(u64, PathBuf)>> {
        let entries = match fs::read_dir(&self.root) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            other => other.map_err(io("listing the checkpoints in", &self.root))?,
        };
        let mut found = Vec::new();
        for entry in entries {
            let entry = entry.map_err(io("listing the checkpoints in", &self.root))?;
            let Some(step) = entry
                .file_name()
                .to_str()
                .and_then(|name| name.strip_prefix(self.prefix.as_str())?.parse().ok())
            else {
                continue;
            };
            found.push((step, entry.path()));
        }
        found.sort_by_key(|f| std::cmp::Reverse(f.0));
        Ok(found)
    }

    /// Saves a checkpoint of `vs`, `opt` and `state` (with `state.world_size` set to
    /// the job's) as `root/step-{state.step}`; returns its path. A collective: every
    /// rank calls it at the same step.
    ///
    /// # Errors
    /// [`Error::Io`] naming the path that could not be written (the disk is
    /// full, permission denied), on every rank, with the previous checkpoints
    /// intact; [`Error::Collective`] when a rank does not take part.
    ///
    /// # Panics
    /// Never for a directory this checkpointer made: it unwraps the name of the step's directory, which always has one.
    pub fn save_state(
        &self,
        vs: &VarStore,
        opt: &mut Optimizer,
        state: &TrainState,
    ) -> Result<PathBuf> {
        let (rank, world_size) = init::rank_and_world_size();
        let final_dir = self.path_of(state.step);
        let tmp = self.root.join(format!(
            ".tmp-{}",
            final_dir.file_name().unwrap().to_string_lossy()
        ));

        // Rank 0 makes an empty temporary directory; the others wait for it.
        let made = if rank == 0 {
            (|| {
                // Never writable by other users, whatever the umask allows.
                let mut dirs = fs::DirBuilder::new();
                dirs.mode(0o775);
                dirs.recursive(true)
                    .create(&self.root)
                    .map_err(io("creating", &self.root))?;
                if tmp.exists() {
                    fs::remove_dir_all(&tmp).map_err(io("removing the stale", &tmp))?;
                }
                dirs.recursive(false)
                    .create(&tmp)
                    .map_err(io("creating", &tmp))
            })()
        } else {
            Ok(())
        };
        Self::agree(made, rank, "preparing", &tmp)?;

        // Every rank writes its own files; rank 0 the replicated ones too.
        let ctx = init::current();
        // Mid-cycle, the cycle's gradients are part of the state (the same place on
        // every rank: the ranks step together).
        let cycle = (opt.micro_batches_accumulated() > 0).then(|| AccumulationCycle {
            micro_batches_done: opt.micro_batches_accumulated() as u64,
            micro_batches_per_step: opt.accumulation_steps() as u64,
        });
        let mut write = || {
            // The model first, on every rank: its sharded variables (ZeRO stage 3) are
            // all-gathered one at a time, collectives that every rank runs whatever
            // else fails here; rank 0 writes the file.
            let model = tmp.join(MODEL);
            let units = ctx.as_ref().map(|c| c.units());
            let dest = (rank == 0).then_some(model.as_path());
            model_file::write(units, vs, dest, &|_, _| true)?;
            if rank == 0 {
                sync_file(&model)?;
            }
            let rng = generators(vs.device())
                .into_iter()
                .map(|(name, index)| Ok((name, rng_state(index)?)))
                .collect::<Result<Vec<_>>>()?;
            let path = tmp.join(rank_file(rank));
            Tensor::write_safetensors(&rng, &path)
                .map_err(|e| Error::Torch(format!("writing {}: {e}", path.display())))?;
            sync_file(&path)?;
            if cycle.is_some() {
                // This rank's own sum of the cycle's micro-batches (not yet averaged).
                let grads: Vec<(String, Tensor)> = opt
                    .accumulated_gradients()
                    .into_iter()
                    .map(|(name, g)| (name, g.to_device(tch::Device::Cpu)))
                    .collect();
                let path = tmp.join(grads_file(rank));
                Tensor::write_safetensors(&grads, &path)
                    .map_err(|e| Error::Torch(format!("writing {}: {e}", path.display())))?;
                sync_file(&path)?;
            }
            if let Some(shard) = opt.state_shard() {
                // Once per shard: under hybrid sharding, the first shard group's.
                let bytes = opt.state()?;
                if let Some(shard) = shard {
                    write_synced(&tmp.join(optimizer_shard(shard)), &bytes)?;
                }
            }
            if rank == 0 {
                if opt.zero_stage().is_none() {
                    write_synced(&tmp.join(OPTIMIZER), &opt.state()?)?;
                }
                let loops = match (&state.loops[..], &ctx) {
                    ([], Some(ctx)) => ctx.loops().now(),
                    (given, _) => given.to_vec(),
                };
                let loaders = match (&state.loaders[..], &ctx) {
                    ([], Some(ctx)) => ctx.loops().loaders(),
                    (given, _) => given.to_vec(),
                };
                // The first loader's position stands for the run's when the program
                // gave none (as `with_loader_position(loader.position())` would).
                let (epoch, samples_in_epoch) = match loaders.first() {
                    Some(p) if (state.epoch, state.samples_in_epoch) == (0, 0) => {
                        (p.epoch, p.samples_in_epoch)
                    }
                    _ => (state.epoch, state.samples_in_epoch),
                };
                let state = TrainState {
                    world_size,
                    epoch,
                    samples_in_epoch,
                    grad_scaler: state
                        .grad_scaler
                        .or_else(|| opt.scaler().map(|s| s.state())),
                    optimizer_steps: state.optimizer_steps.or(Some(opt.steps_taken())),
                    accumulation: cycle,
                    loops,
                    loaders,
                    ..state.clone()
                };
                let json = serde_json::to_vec_pretty(&state).map_err(|e| {
                    checkpoint_from(Some(&tmp), format!("encoding the training state: {e}"), e)
                })?;
                write_synced(&tmp.join(STATE), &json)?;
            }
            Ok(())
        };
        let written = write();
        Self::agree(written, rank, "writing", &tmp)?;

        // All files are durable: mark complete, move into place, prune.
        let finished = if rank == 0 {
            self.finish(&tmp, &final_dir)
        } else {
            Ok(())
        };
        Self::agree(finished, rank, "completing", &tmp)?;
        Ok(final_dir)
    }

    /// Turns one phase's local result into the job's: every rank learns whether all
    /// succeeded, and all fail together (removing the temporary directory) if not.
    fn agree(local: Result<()>, rank: usize, phase: &str, tmp: &Path) -> Result<()> {
        if all_ok(local.is_ok())? {
            return Ok(());
        }
        if rank == 0 {
            let _ = fs::remove_dir_all(tmp);
        }
        Err(local.err().unwrap_or_else(|| {
            checkpoint(
                Some(tmp),
                format!(
                    "checkpoint {}: another rank failed while {phase} (see its error); the previous checkpoints are intact",
                    tmp.display()
                ),
            )
        }))
    }

    fn finish(&self, tmp: &Path, final_dir: &Path) -> Result<()> {
        let mut manifest = BTreeMap::new();
        for entry in fs::read_dir(tmp).map_err(io("listing", tmp))? {
            let path = entry.map_err(io("listing", tmp))?.path();
            let bytes = fs::read(&path).map_err(io("reading back", &path))?;
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            manifest.insert(name, (bytes.len(), format!("{:016x}", fnv1a(&bytes))));
        }
        let json = serde_json::to_vec_pretty(&manifest)
            .map_err(|e| checkpoint_from(Some(tmp), format!("encoding the manifest: {e}"), e))?;
        write_synced(&tmp.join(COMPLETE), &json)?;
        sync_dir(tmp)?;
        // Saving the same step again: the old one stays until the new one is in place.
        let old = self.root.join(format!(
            ".old-{}",
            final_dir.file_name().unwrap().to_string_lossy()
        ));
        let replacing = final_dir.exists();
        if replacing {
            let _ = fs::remove_dir_all(&old);
            fs::rename(final_dir, &old).map_err(io("moving aside", final_dir))?;
        }
        fs::rename(tmp, final_dir)
            .map_err(io("renaming the finished checkpoint onto", final_dir))?;
        sync_dir(&self.root)?;
        if replacing {
            let _ = fs::remove_dir_all(&old);
        }
        if let Some(k) = self.keep_last {
            let complete: Vec<PathBuf> = self
                .list()?
                .into_iter()
                .filter(|(_, p)| p.join(COMPLETE).exists())
                .map(|(_, p)| p)
                .collect();
            for stale in complete.iter().skip(k) {
                fs::remove_dir_all(stale).map_err(io("pruning", stale))?;
            }
        }
        Ok(())
    }

    /// Reads and checks one checkpoint for this rank.
    fn read(
        &self,
        dir: &Path,
        rank: usize,
        world_size: usize,
        vs: &VarStore,
        opt: &Optimizer,
    ) -> Result<Loaded> {
        let marker = dir.join(COMPLETE);
        let manifest: BTreeMap<String, (usize, String)> = serde_json::from_slice(
            &fs::read(&marker)
                .map_err(|e| checkpoint_from(Some(dir), "incomplete (no COMPLETE marker)", e))?,
        )
        .map_err(|e| checkpoint_from(Some(dir), format!("unreadable COMPLETE marker: {e}"), e))?;
        // A file's size and hash against the manifest's.
        let check = |name: &str, len: usize, hash: u64| -> Result<()> {
            match manifest.get(name) {
                Some((l, h)) if *l == len && *h == format!("{hash:016x}") => Ok(()),
                Some(_) => Err(checkpoint(
                    Some(dir),
                    format!("{name} is corrupt (its size or hash differs from the manifest)"),
                )),
                None => Err(checkpoint(
                    Some(dir),
                    format!("{name} is not in the manifest"),
                )),
            }
        };
        let read = |name: &str| -> Result<Vec<u8>> {
            let path = dir.join(name);
            let bytes = fs::read(&path).map_err(io("reading", &path))?;
            check(name, bytes.len(), fnv1a(&bytes)).map(|()| bytes)
        };
        // `check` of a file too big to hold, read a block at a time.
        let check_streamed = |name: &str, path: &Path| -> Result<()> {
            use std::io::Read as _;
            let mut file = fs::File::open(path).map_err(io("reading", path))?;
            let mut block = vec![0u8; 1 << 20];
            let (mut len, mut hash) = (0, FNV1A_START);
            loop {
                let n = file.read(&mut block).map_err(io("reading", path))?;
                if n == 0 {
                    break;
                }
                len += n;
                hash = crate::random_state::fnv1a_from(hash, block[..n].iter().copied());
            }
            check(name, len, hash)
        };
        let state: TrainState = serde_json::from_slice(&read(STATE)?)
            .map_err(|e| checkpoint_from(Some(dir), format!("{STATE}: {e}"), e))?;
        // The model's file: its hash checked here a block at a time, its header read;
        // its tensors are read when the checkpoint is applied (a sharded variable's
        // rows alone).
        let model = dir.join(MODEL);
        check_streamed(MODEL, &model)?;
        let header = model_file::ModelFile::open(&model)?;
        // By name, so that the first mismatch reported is the same in every run.
        let expected: BTreeMap<String, Tensor> = vs.variables().into_iter().collect();
        for (name, var) in &expected {
            match header.shape(name) {
                Some(shape) if shape == var.size() => {}
                Some(shape) => {
                    return Err(checkpoint(
                        Some(dir),
                        format!(
                            "{MODEL}: `{name}` has shape {shape:?}, the model {:?}",
                            var.size()
                        ),
                    ))
                }
                None => {
                    return Err(checkpoint(
                        Some(dir),
                        format!("{MODEL}: no variable `{name}`"),
                    ))
                }
            }
        }
        let shards: Vec<&String> = manifest.keys().filter(|n| is_optimizer_state(n)).collect();
        let optimizer = if !shards.is_empty() {
            OptimizerFile::State(shards.into_iter().map(|n| read(n)).collect::<Result<_>>()?)
        } else if manifest.contains_key(LIBTORCH_OPTIMIZER) {
            OptimizerFile::LibtorchArchive(read(LIBTORCH_OPTIMIZER)?)
        } else {
            return Err(checkpoint(
                Some(dir),
                format!("{OPTIMIZER} is not in the manifest"),
            ));
        };
        // Per-rank random state applies only to the same rank in the same world size.
        let rng = if state.world_size == world_size {
            let name = rank_file(rank);
            tensors(dir, &name, &read(&name)?)?
        } else {
            Vec::new()
        };
        let grads = match state.accumulation {
            Some(_) => {
                let own = state.world_size == world_size && opt.resumes_cycle_with_own_gradients();
                cycle_gradients(dir, state.world_size, rank, own, read)?
            }
            None => Vec::new(),
        };
        Ok(Loaded {
            state,
            model,
            optimizer,
            rng,
            grads,
        })
    }

    /// Restores the newest usable checkpoint into `vs`, `opt` (its state, and its
    /// count of [`steps_taken`](Optimizer::steps_taken), which an
    /// [`LrScheduler`](crate::LrScheduler) follows) and this rank's random
    /// generator, and returns its [`TrainState`]; `Ok(None)` when `root` holds no
    /// checkpoint (a fresh start). Incomplete and corrupt checkpoints are skipped with
    /// a warning (on stderr, by rank 0) that names them and says why. A collective:
    /// the ranks agree on one checkpoint that every one of them can read.
    ///
    /// A checkpoint saved in the middle of a gradient-accumulation cycle resumes the
    /// cycle: each rank's gradients of its micro-batches so far are restored, and the
    /// optimizer's next step comes after the cycle's remaining micro-batches, as in
    /// the uninterrupted run (bit for bit, on the same world size; to rounding under a
    /// DDP with `find_unused_parameters`, where every rank takes the ranks' mean
    /// gradient, as on another world size below). A run that
    /// accumulates another number of micro-batches starts a new cycle instead, with a
    /// warning on rank 0.
    ///
    /// Resuming with another world size is allowed: the model and optimizer are
    /// replicated state, the loader's position is in samples
    /// ([`TrainState::loader_position`]), each rank's random generator keeps its
    /// current state instead of the saved one, and a cycle in progress resumes with the
    /// saving ranks' mean gradient on every rank (the average taken at the cycle's end
    /// then counts the saved micro-batches as the uninterrupted run would).
    ///
    /// # Errors
    /// [`Error::Checkpoint`] when checkpoints exist but none is usable (the
    /// message lists each one and why), when another rank cannot list them, or when
    /// the agreed one's optimizer state does not fit `opt` (another algorithm's, other
    /// shapes); [`Error::Io`] when `root` exists but cannot be listed (see
    /// [`list`](Self::list)), on every rank.
    ///
    /// # Panics
    /// Never: the only `expect` reads a checkpoint checked to exist a line before.
    pub fn load_state(&self, vs: &mut VarStore, opt: &mut Optimizer) -> Result<Option<TrainState>> {
        let ctx = init::current();
        let (rank, world_size) = init::rank_and_world_size();
        // Rank 0's listing, so that every rank tries the same candidates in order. A
        // listing that fails on any rank fails the load on every rank.
        let listed = self.list();
        if !all_ok(listed.is_ok())? {
            return Err(listed.err().unwrap_or_else(|| {
                checkpoint(
                    Some(&self.root),
                    format!(
                        "another rank cannot list the checkpoints in {}; its error says why",
                        self.root.display()
                    ),
                )
            }));
        }
        let mut steps: Vec<i64> = listed?.iter().map(|(s, _)| *s as i64).collect();
        if let Some(ctx) = ctx.as_ref().filter(|c| c.world_size() > 1) {
            let mut count = Tensor::from_slice(&[steps.len() as i64]);
            ctx.process_group().broadcast(&mut count, 0)?;
            let n = count.int64_value(&[0]) as usize;
            if n == 0 {
                return Ok(None);
            }
            steps.resize(n, -1);
            let mut all = Tensor::from_slice(&steps);
            ctx.process_group().broadcast(&mut all, 0)?;
            steps = Vec::<i64>::try_from(&all)?;
        }
        if steps.is_empty() {
            return Ok(None);
        }
        let mut skipped = Vec::new();
        for step in steps {
            let dir = self.path_of(step as u64);
            let loaded = self.read(&dir, rank, world_size, vs, opt);
            if !all_ok(loaded.is_ok())? {
                let why = match &loaded {
                    Err(e) => e.to_string(),
                    Ok(_) => "unreadable on another rank".into(),
                };
                if rank == 0 {
                    log::warn(format_args!("skipping checkpoint {}: {why}", dir.display()));
                } else if loaded.is_err() {
                    log::warn(format_args!(
                        "rank {rank} cannot use checkpoint {}: {why}",
                        dir.display()
                    ));
                }
                skipped.push(format!("{} ({why})", dir.display()));
                continue;
            }
            let loaded = loaded.expect("checked above");
            // Sharded parameters (ZeRO stage 3) read their rows into their shards.
            let units = ctx.as_ref().map(|c| c.units());
            model_file::load(units, vs, &loaded.model, false)?;
            let restored = match &loaded.optimizer {
                OptimizerFile::State(shards) => {
                    let shards: Vec<&[u8]> = shards.iter().map(Vec::as_slice).collect();
                    opt.load_state_shards(&shards)
                }
                OptimizerFile::LibtorchArchive(bytes) => opt.load_libtorch_archive(bytes),
            };
            restored.map_err(|e| in_checkpoint(e, &dir))?;
            for (name, index) in generators(vs.device()) {
                if let Some((_, state)) = loaded.rng.iter().find(|(n, _)| n == name) {
                    set_rng_state(index, state)?;
                }
            }
            if let (Some(scaler), Some(saved)) = (opt.scaler_mut(), loaded.state.grad_scaler) {
                scaler.load_state(saved);
            }
            opt.set_steps_taken(loaded.state.optimizer_steps.unwrap_or(loaded.state.step));
            if let Some(cycle) = loaded.state.accumulation {
                if cycle.micro_batches_per_step == opt.accumulation_steps() as u64 {
                    opt.resume_cycle(cycle.micro_batches_done as usize, &loaded.grads)
                        .map_err(|e| in_checkpoint(e, &dir))?;
                } else if rank == 0 {
                    log::warn(format_args!(
                        "checkpoint {} was saved after {} of the {} micro-batches of an \
                         accumulation cycle, and this run accumulates {}: their gradients \
                         are not used, and a new cycle starts",
                        dir.display(),
                        cycle.micro_batches_done,
                        cycle.micro_batches_per_step,
                        opt.accumulation_steps()
                    ));
                }
            }
            if let Some(ctx) = &ctx {
                ctx.loops().resume_from(&loaded.state.loops);
                ctx.loops().resume_loaders_from(&loaded.state.loaders);
            }
            if rank == 0 && !skipped.is_empty() {
                log::warn(format_args!(
                    "resumed from {} (step {})",
                    dir.display(),
                    loaded.state.step
                ));
            }
            return Ok(Some(loaded.state));
        }
        Err(checkpoint(
            Some(&self.root),
            format!(
                "no usable checkpoint in {}: {}. Remove them to start afresh, or point the run at another directory",
                self.root.display(),
                skipped.join("; ")
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn train_state_round_trips_with_the_grad_scaler() {
        let state = TrainState {
            step: 7,
            epoch: 1,
            samples_in_epoch: 96,
            world_size: 2,
            grad_scaler: Some((32768.0, 5)),
            config: serde_json::json!({ "lr": 0.1 }),
            loops: vec![LoopPosition {
                site: 9,
                run: 1,
                batches: 6,
            }],
            loaders: vec![LoaderPosition {
                epoch: 2,
                samples_in_epoch: 24,
            }],
            optimizer_steps: Some(7),
            accumulation: Some(AccumulationCycle {
                micro_batches_done: 2,
                micro_batches_per_step: 3,
            }),
        };
        let json = serde_json::to_vec(&state).unwrap();
        assert_eq!(serde_json::from_slice::<TrainState>(&json).unwrap(), state);
        let without: TrainState = serde_json::from_str(
            r#"{"step":1,"epoch":0,"samples_in_epoch":0,"world_size":1,"config":null}"#,
        )
        .unwrap();
        assert_eq!(without.grad_scaler, None);
        assert!(
            without.loops.is_empty(),
            "a checkpoint without loops resumes none"
        );
        assert_eq!(
            without.optimizer_steps, None,
            "restored from `step` on load"
        );
        assert_eq!(without.accumulation, None, "saved at a cycle's end");
        let mut scaler = crate::GradScaler::new();
        scaler.load_state((512.0, 3));
        assert_eq!(scaler.state(), (512.0, 3));
    }

    #[test]
    fn a_directory_that_cannot_be_listed_is_an_error_not_a_fresh_start() {
        let dir = std::env::temp_dir().join(format!("tdc-list-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        // Not there yet: no checkpoints.
        let missing = Checkpointer::new(dir.join("ckpt"));
        assert!(missing.list().unwrap().is_empty());
        // A file where the directory should be stands for any error but "not found"
        // (permissions, a network file system's error).
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("ckpt"), "not a directory").unwrap();
        let unreadable = Checkpointer::new(dir.join("ckpt"));
        let err = unreadable.list().unwrap_err().to_string();
        assert!(
            err.contains("listing the checkpoints in") && err.contains("ckpt"),
            "{err}"
        );
        let mut vs = VarStore::new(tch::Device::Cpu);
        let _ = vs.root().zeros("w", &[2]);
        let mut opt = Optimizer::new(&tch::nn::Sgd::default(), &vs, 0.1).unwrap();
        let err = unreadable
            .load_state(&mut vs, &mut opt)
            .unwrap_err()
            .to_string();
        assert!(err.contains("listing the checkpoints in"), "{err}");
        fs::remove_dir_all(&dir).unwrap();
    }

    /// On another world size a cycle's gradients are the saving ranks' mean, a rank
    /// without a variable's gradient counting as zero; on the same, each rank's own.
    /// Files whose shapes differ are a checkpoint error naming the variable.
    #[test]
    fn a_cycle_s_gradients_are_the_ranks_mean_on_another_world_size() {
        let dir = std::env::temp_dir().join(format!("tdc-cycle-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let write = |rank: usize, grads: &[(&str, &[f32])]| {
            let named: Vec<(String, Tensor)> = grads
                .iter()
                .map(|(n, v)| (n.to_string(), Tensor::from_slice(v)))
                .collect();
            Tensor::write_safetensors(&named, dir.join(grads_file(rank))).unwrap();
        };
        write(0, &[("a", &[1.0, 2.0]), ("b", &[4.0])]);
        write(1, &[("a", &[3.0, 6.0])]);
        let read = |name: &str| -> Result<Vec<u8>> { Ok(fs::read(dir.join(name)).unwrap()) };
        let values = |grads: Vec<(String, Tensor)>| -> Vec<(String, Vec<f32>)> {
            grads
                .into_iter()
                .map(|(n, t)| (n, Vec::<f32>::try_from(&t).unwrap()))
                .collect()
        };
        let mean = values(cycle_gradients(&dir, 2, 0, false, read).unwrap());
        assert_eq!(
            mean,
            [("a".into(), vec![2.0, 4.0]), ("b".into(), vec![2.0])]
        );
        let own = values(cycle_gradients(&dir, 2, 1, true, read).unwrap());
        assert_eq!(own, [("a".into(), vec![3.0, 6.0])]);
        write(1, &[("a", &[3.0])]);
        let err = cycle_gradients(&dir, 2, 0, false, read)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(
                "grads-rank-1.safetensors: the gradient of `a` has shape [1], another rank's [2]"
            ),
            "{err}"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn fnv1a_detects_a_flipped_bit() {
        assert_ne!(fnv1a(b"checkpoint"), fnv1a(b"checkpoinu"));
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
    }
}
