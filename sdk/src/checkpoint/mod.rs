//! Checkpoints from a data-parallel job: a `VarStore` file written by rank 0,
//! atomically, between barriers; and whole training states (`Checkpointer`).

use std::path::Path;

use tch::nn::VarStore;

use crate::error::{io, Error, Result};
use crate::files::{self, sync_dir, sync_file};
use crate::init::Context;

mod activation;
mod preemption;
mod state;

pub use activation::{
    checkpoint, checkpoint_many, checkpointed, checkpointed_t, f_checkpoint_many, Checkpointed,
    CheckpointedT,
};
pub use preemption::{preempted_exit_code, Preemption};
pub use state::{Checkpointer, TrainState};

/// Saves `vs` to `path` the way a data-parallel job must: after a barrier (every
/// rank has finished the step), rank 0 writes `path` atomically — to a temporary
/// file in the same directory, fsynced, then renamed over `path` — and a second
/// barrier keeps the other ranks from reading it early. A crash mid-write leaves
/// the previous file intact. The format follows the extension, as `VarStore::save`
/// (`.safetensors`, else libtorch's format).
///
/// Errors: [`Error::Io`] naming the path when the directory cannot be written;
/// [`Error::Torch`] when libtorch fails to serialize; [`Error::Collective`] when a
/// rank does not reach the barriers.
pub fn save_var_store(ctx: &Context, vs: &VarStore, path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    ctx.barrier()?;
    // Sharded parameters (ZeRO stage 3) are gathered for the write, on every rank.
    let written = ctx
        .units()
        .with_full_parameters(false, || match ctx.is_main_process() {
            true => write_atomically(vs, path),
            false => Ok(()),
        });
    // Every rank reaches the second barrier, even when rank 0 failed to write.
    ctx.barrier()?;
    written
}

/// Loads `path` into `vs` on every rank, after a barrier so that a file written by
/// rank 0 just before is complete.
///
/// Errors: [`Error::Torch`] when the file is missing or does not match `vs`.
pub fn load_var_store(ctx: &Context, vs: &mut VarStore, path: impl AsRef<Path>) -> Result<()> {
    ctx.barrier()?;
    // Sharded parameters take the loaded values into their shards.
    ctx.units().with_full_parameters(true, || {
        vs.load(path.as_ref())
            .map_err(|e| Error::Torch(format!("loading {}: {e}", path.as_ref().display())))
    })
}

/// `vs.save(path)` (the format follows the extension), flushed to disk.
fn save_synced(vs: &VarStore, path: &Path) -> Result<()> {
    vs.save(path)
        .map_err(|e| Error::Torch(format!("writing {}: {e}", path.display())))?;
    sync_file(path)
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
