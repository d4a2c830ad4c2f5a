//! Checkpoints from a data-parallel job: a `VarStore` file written by rank 0,
//! atomically, between barriers; and whole training states (`Checkpointer`).

use std::path::Path;

use tch::nn::VarStore;

use crate::error::{io, Error, Result};
use crate::files::{self, sync_dir, sync_file};
use crate::init::Context;

pub(crate) mod model_file;
mod preemption;
mod state;

pub use preemption::{preempted_exit_code, Preemption};
pub use state::{AccumulationCycle, Checkpointer, TrainState};

/// Saves `vs` to `path` the way a data-parallel job must: after a barrier (every
/// rank has finished the step), rank 0 writes `path` atomically — to a temporary
/// file in the same directory, fsynced, then renamed over `path` — and a second
/// barrier keeps the other ranks from reading it early. A crash mid-write leaves
/// the previous file intact. The format follows the extension, as `VarStore::save`
/// (`.safetensors`, else libtorch's format).
///
/// # Errors
/// [`Error::Io`] naming the path when the directory cannot be written;
/// [`Error::Torch`] when libtorch fails to serialize; [`Error::Collective`] when a
/// rank does not reach the barriers.
pub fn save_var_store(ctx: &Context, vs: &VarStore, path: impl AsRef<Path>) -> Result<()> {
    save_where(ctx, vs, path.as_ref(), &|_, _| true)
}

/// Saves the variables of `vs` that require a gradient (the trainable ones: a LoRA
/// model's adapters, not its frozen base) to the safetensors file `path`, as PEFT's
/// `save_pretrained` writes `adapter_model.safetensors`: in a job, rank 0 writes it
/// atomically between barriers, as [`save_var_store`] does; the names are the store's
/// (`layers.0.lora_a`), and `VarStore::load_partial` or PyTorch's
/// `safetensors.torch.load_file` read it back. Sharded variables (ZeRO stage 3) are
/// gathered one at a time. Outside a job, or in a job of one, it writes the file
/// itself.
///
/// ```no_run
/// # fn demo(vs: &tch::nn::VarStore) -> tch_distributed::Result<()> {
/// tch_distributed::save_trainable(vs, "final_model/adapter_model.safetensors")?;
/// # Ok(()) }
/// ```
///
/// # Errors
/// [`Error::InvalidInput`] when `path` does not end in `.safetensors`; [`Error::Io`]
/// naming the path when it cannot be written; [`Error::Collective`] when a rank does
/// not reach the barriers or a gather fails.
pub fn save_trainable(vs: &VarStore, path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    if !model_file::is_safetensors(path) {
        return Err(Error::InvalidInput(format!(
            "save_trainable writes a safetensors file, and {} does not end in .safetensors: \
             name it adapter_model.safetensors, say",
            path.display()
        )));
    }
    let trainable = |_: &str, t: &tch::Tensor| t.requires_grad();
    match crate::init::current() {
        Some(ctx) => save_where(&ctx, vs, path, &trainable),
        None => files::replace(path, |tmp| {
            model_file::write(None, vs, Some(tmp), &trainable)
        }),
    }
}

/// [`save_var_store`] of the variables `keep` keeps. A safetensors file is written one
/// variable at a time (a sharded one gathered alone, on every rank); another format
/// (libtorch's, written by tch all at once) has every sharded variable gathered for
/// the write.
fn save_where(
    ctx: &Context,
    vs: &VarStore,
    path: &Path,
    keep: &dyn Fn(&str, &tch::Tensor) -> bool,
) -> Result<()> {
    ctx.barrier()?;
    let units = ctx.units();
    let written = if model_file::is_safetensors(path) {
        match ctx.is_main_process() {
            true => {
                let mut ran = false;
                let written = files::replace(path, |tmp| {
                    ran = true;
                    model_file::write(Some(units), vs, Some(tmp), keep)
                });
                // The gathers run on every rank, even when the file could not be made.
                match ran {
                    true => written,
                    false => model_file::write(Some(units), vs, None, keep).and(written),
                }
            }
            false => model_file::write(Some(units), vs, None, keep),
        }
    } else {
        units.with_full_parameters(false, || match ctx.is_main_process() {
            true => write_atomically(vs, path),
            false => Ok(()),
        })
    };
    // Every rank reaches the second barrier, even when rank 0 failed to write.
    ctx.barrier()?;
    written
}

/// Loads `path` into `vs` on every rank, after a barrier so that a file written by
/// rank 0 just before is complete. A safetensors file is read through a memory map,
/// and a sharded variable (ZeRO stage 3) reads only this rank's rows of it: the model
/// is never whole on a rank. Another format (libtorch's) is read whole, by tch.
///
/// # Errors
/// [`Error::Torch`] or [`Error::Checkpoint`] when the file is missing or does not
/// match `vs`.
pub fn load_var_store(ctx: &Context, vs: &mut VarStore, path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    ctx.barrier()?;
    if model_file::is_safetensors(path) {
        return model_file::load(Some(ctx.units()), vs, path, false).map(drop);
    }
    // Sharded parameters take the loaded values into their shards.
    ctx.units().with_full_parameters(true, || {
        vs.load(path)
            .map_err(|e| Error::Torch(format!("loading {}: {e}", path.display())))
    })
}

/// `vs.load_partial(path)` in a job: [`load_var_store`], but a variable the file lacks is
/// left as it is; returns their names, as `VarStore::load_partial`.
///
/// # Errors
/// As [`load_var_store`]'s.
pub(crate) fn load_var_store_partial(
    ctx: &Context,
    vs: &mut VarStore,
    path: &Path,
) -> Result<Vec<String>> {
    ctx.barrier()?;
    if model_file::is_safetensors(path) {
        return model_file::load(Some(ctx.units()), vs, path, true);
    }
    ctx.units().with_full_parameters(true, || {
        vs.load_partial(path)
            .map_err(|e| Error::Torch(format!("loading {}: {e}", path.display())))
    })
}

/// Writes `vs` to `path` through [`files::replace`]: `path` is replaced only once the
/// new file is complete and synced.
fn write_atomically(vs: &VarStore, path: &Path) -> Result<()> {
    files::replace(path, |tmp| {
        vs.save(tmp)
            .map_err(|e| Error::Torch(format!("writing {}: {e}", tmp.display())))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_file_libtorch_wrote_world_writable_is_synced_without_others_write_permission() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rng.safetensors");
        fs::write(&path, b"bytes").unwrap();
        // As libtorch leaves it under umask 000.
        fs::set_permissions(&path, fs::Permissions::from_mode(0o666)).unwrap();
        sync_file(&path).unwrap();
        let mode = fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(
            mode & 0o777,
            0o664,
            "the umask's choice, less others' write: {mode:o}"
        );
        assert_eq!(fs::read(&path).unwrap(), b"bytes");
    }

    #[test]
    fn a_checkpoint_replaces_the_file_whole_and_is_not_writable_by_others() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        // A file (or a link) at the name the temporary file had before: left alone.
        let old_name = dir
            .path()
            .join(format!(".tmp-{}-model.safetensors", std::process::id()));
        fs::write(&old_name, b"someone else's").unwrap();
        let vs = VarStore::new(tch::Device::Cpu);
        let _ = vs.root().zeros("w", &[2, 3]);
        write_atomically(&vs, &path).unwrap();
        write_atomically(&vs, &path).unwrap();
        let mode = fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o022, 0, "writable by others: {mode:o}");
        assert_eq!(fs::read(&old_name).unwrap(), b"someone else's");
        let mut names: Vec<String> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                old_name.file_name().unwrap().to_str().unwrap(),
                "model.safetensors"
            ],
            "no temporary file left"
        );
        let loaded = tch::Tensor::read_safetensors(&path).unwrap();
        assert_eq!(loaded.len(), 1);
    }
}
