//! Writing files so that a crash never leaves a torn one: the one helper
//! ([`replace`]) behind checkpoints, the run configuration and the tracker's
//! `config.json`.

use std::fs::{self, File};
use std::path::{Path, PathBuf};

use crate::error::{io, Error, Result};

/// Flushes a file to disk, and takes other users' write permission away from it:
/// libtorch creates files with the process's umask alone, which (umask 000) may leave
/// them world-writable.
pub(crate) fn sync_file(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let file = File::open(path).map_err(io("opening", path))?;
    let mut permissions = file
        .metadata()
        .map_err(io("reading the permissions of", path))?
        .permissions();
    if permissions.mode() & 0o002 != 0 {
        permissions.set_mode(permissions.mode() & !0o002);
        file.set_permissions(permissions)
            .map_err(io("taking other users' write permission from", path))?;
    }
    file.sync_all().map_err(io("syncing", path))
}

/// Makes renames and new entries in `dir` durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io("syncing directory", dir))
}

/// Replaces `path` whole: `write` fills a temporary file beside it, which is synced
/// and renamed onto `path` only once `write` succeeded, so a reader (or a crash) sees
/// the old file or the new one, never a part. Creates `path`'s directory when it is
/// missing. The temporary file has a random name and is created exclusively
/// (`tempfile`), so that no one can place a file or a link under its name first, even
/// in a shared directory such as `/tmp`; it is created with mode 0644 (less what the
/// user's umask removes), never writable by other users, and keeps `path`'s file name
/// last (`.tmp-XXXX-model.safetensors`), for writers that pick a format from the
/// extension. It is removed when `write` fails.
///
/// # Errors
/// [`Error::Io`] naming the path when the directory cannot be written,
/// and with `write`'s own error.
pub(crate) fn replace(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| Error::InvalidInput(format!("{} names no file", path.display())))?;
    fs::create_dir_all(&dir).map_err(io("creating", &dir))?;
    let tmp = tempfile::Builder::new()
        .prefix(".tmp-")
        .suffix(&format!("-{}", name.to_string_lossy()))
        .permissions(fs::Permissions::from_mode(0o644))
        .tempfile_in(&dir)
        .map_err(io("creating a temporary file in", &dir))?
        .into_temp_path();
    // Removed when dropped, unless renamed onto `path`.
    write(&tmp)?;
    sync_file(&tmp)?;
    tmp.persist(path)
        .map_err(|e| e.error)
        .map_err(io("renaming the finished file onto", path))?;
    // Make the rename itself durable.
    sync_dir(&dir)
}

/// [`replace`] with `bytes`.
///
/// # Errors
/// As [`replace`].
pub(crate) fn replace_with_bytes(path: &Path, bytes: &[u8]) -> Result<()> {
    replace(path, |tmp| {
        fs::write(tmp, bytes).map_err(io("writing", tmp))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_temporary_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub").join("config.toml");
        replace_with_bytes(&path, b"old").unwrap();
        let e = replace(&path, |tmp| {
            fs::write(tmp, b"half").unwrap();
            Err(Error::InvalidInput("stopped".into()))
        });
        assert!(e.is_err());
        assert_eq!(fs::read(&path).unwrap(), b"old");
        let names: Vec<_> = fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["config.toml"]);
        replace_with_bytes(&path, b"new").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"new");
    }
}
