//! torchrun's error file: how a failing rank tells its launcher why it failed.
//!
//! torchrun (torchelastic) gives each worker a path in `TORCHELASTIC_ERROR_FILE`. A
//! Python worker whose entry point has `@record` writes its uncaught exception there
//! as JSON, and when workers fail the agent reads their files and reports the first
//! failure (the smallest timestamp) as the root cause. The format is the one
//! `torch/distributed/elastic/multiprocessing/errors/error_handler.py` writes:
//!
//! ```json
//! {"message": {"message": "...", "extraInfo": {"py_callstack": "...", "timestamp": "1700000000"}}}
//! ```
//!
//! torchrun shows `py_callstack` (else `message`) as the failure's "traceback"; the
//! timestamp is whole seconds since the epoch, as a string. A `#[distributed]` rank
//! writes the file when its function returns an `Err`, when the SDK ends it with an
//! `Error: …` line, and when it panics; `tchrun` sets the variable for each of its
//! ranks and prints the first failure's message in its report.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

pub(crate) use crate::protocol::ERROR_FILE_ENV;

/// Writes `message` (what the rank printed, e.g. `Error: …`) and `details` (a
/// backtrace, shown by torchrun as the traceback; the message itself when there is
/// none) to the file that `TORCHELASTIC_ERROR_FILE` names, replacing what is there,
/// as torch's `ErrorHandler.record_exception` does. Does nothing when the variable
/// is unset; a file that cannot be written is skipped with a warning (the rank is
/// failing already: its error must not be hidden behind this one).
pub(crate) fn record(message: &str, details: Option<&str>) {
    let Some(path) = crate::protocol::error_file() else {
        return;
    };
    let timestamp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let data = serde_json::json!({
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": details.unwrap_or(message),
                "timestamp": timestamp.to_string(),
            }
        }
    });
    if let Err(e) = std::fs::write(&path, data.to_string()) {
        crate::log::warn(format_args!(
            "cannot write the error file {} ({ERROR_FILE_ENV}): {e}",
            Path::new(&path).display()
        ));
    }
}

/// [`record`] for an error as `main` prints it (`Error: {e:?}`): an `anyhow` error's
/// backtrace (with `RUST_BACKTRACE`) goes to the details only, which torchrun shows
/// as the traceback; the message (what tchrun shows) stops before it.
pub(crate) fn record_error(printed: &str) {
    match printed.split_once("\n\nStack backtrace:") {
        Some((message, _)) => record(message, Some(printed)),
        None => record(printed, None),
    }
}

/// After a `#[distributed]` function left early, through a `?` (or a macro such as
/// `anyhow::bail!`, whose `return` the attribute cannot see), when a launcher asked
/// for an error file: the error itself is not at hand, but `main` is about to print
/// it (`Error: {e:?}`) and exit. A generic message is written at once; then, until
/// the process exits, what it writes to stderr passes through a pipe (on to the real
/// stderr, unchanged), and at exit the last `Error: …` it printed replaces the
/// generic message. Set up once per process.
pub(crate) fn record_early_exit() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    if crate::protocol::error_file().is_none() {
        return;
    }
    ONCE.call_once(|| {
        record(
            "Error: the #[distributed] function returned an error (through `?`); \
             its message is in the rank's output",
            None,
        );
        capture::start();
    });
}

/// The stderr tee behind [`record_early_exit`].
mod capture {
    use std::fs::File;
    use std::io::{Read, Write};
    use std::os::fd::AsFd;
    use std::sync::{Condvar, Mutex, OnceLock};
    use std::time::Duration;

    use crate::ffi::os;

    /// The most of stderr's end that is kept.
    const KEEP: usize = 64 * 1024;

    /// The original stderr, duplicated; unset before the capture starts. Never closed.
    static SAVED: OnceLock<File> = OnceLock::new();
    static CAPTURED: Mutex<Vec<u8>> = Mutex::new(Vec::new());
    /// Set when the reader has seen the pipe's end.
    static DONE: (Mutex<bool>, Condvar) = (Mutex::new(false), Condvar::new());

    /// Points fd 2 at a pipe whose reader copies everything to the original stderr
    /// and keeps the end of it; registers [`at_exit`]. Leaves stderr alone when any
    /// step fails.
    pub(super) fn start() {
        // A descriptor of its own (close-on-exec, 3 or above) for the original stderr.
        let Ok(saved) = std::io::stderr().as_fd().try_clone_to_owned() else {
            return;
        };
        let Ok((reader, writer)) = os::pipe() else {
            return;
        };
        if SAVED.set(File::from(saved)).is_err() {
            return;
        }
        let Some(saved) = SAVED.get() else { return };
        let spawned = std::thread::Builder::new()
            .name("tchd-stderr".into())
            .spawn(move || copy(File::from(reader), saved));
        if spawned.is_err() {
            return;
        }
        // fd 2 is replaced atomically by dup2, so every write goes to the old or the
        // new target; the pipe's writer is then fd 2 alone.
        let _ = os::redirect_stderr(writer.as_fd());
        drop(writer);
        os::at_exit(at_exit);
    }

    /// The reader: pipe → the original stderr, keeping the last [`KEEP`] bytes.
    fn copy(mut reader: File, mut saved: &File) {
        let mut buf = [0u8; 4096];
        loop {
            let n = match reader.read(&mut buf) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let chunk = &buf[..n];
            let mut written = 0;
            while written < chunk.len() {
                match saved.write(&chunk[written..]) {
                    Ok(w) if w > 0 => written += w,
                    _ => break,
                }
            }
            if let Ok(mut kept) = CAPTURED.lock() {
                kept.extend_from_slice(chunk);
                if kept.len() > KEEP {
                    let cut = kept.len() - KEEP;
                    kept.drain(..cut);
                }
            }
        }
        // The reader's own fd closes here.
        drop(reader);
        if let Ok(mut done) = DONE.0.lock() {
            *done = true;
            DONE.1.notify_all();
        }
    }

    /// At exit: puts the original stderr back (which closes the pipe, unless a child
    /// process inherited it), waits a moment for the reader to pass on the rest, and
    /// records the last `Error: …` printed, if any, as the error.
    extern "C" fn at_exit() {
        let Some(saved) = SAVED.get() else {
            return;
        };
        // fd 2 goes back to the original stderr.
        let _ = os::redirect_stderr(saved.as_fd());
        if let Ok(done) = DONE.0.lock() {
            let _ = DONE
                .1
                .wait_timeout_while(done, Duration::from_secs(1), |d| !*d);
        }
        let text = match CAPTURED.lock() {
            Ok(kept) => String::from_utf8_lossy(&kept).into_owned(),
            Err(_) => return,
        };
        if let Some(error) = last_error(&text) {
            super::record_error(error);
        }
    }

    /// The last block of `text` that starts a line with `Error: `, as `main` prints
    /// a returned error, to the end.
    pub(super) fn last_error(text: &str) -> Option<&str> {
        let start = text
            .match_indices("Error: ")
            .filter(|(i, _)| *i == 0 || text.as_bytes()[i - 1] == b'\n')
            .map(|(i, _)| i)
            .last()?;
        Some(text[start..].trim_end())
    }
}

/// What a rank's error file says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RootCause {
    /// The error's message (`message.message`), or the whole file when it holds
    /// another JSON shape (torch's "new message format": a plain string).
    pub message: String,
    /// When it was written: the file's modification time, finer than the
    /// timestamp inside, which is whole seconds.
    pub written: SystemTime,
}

/// Reads the error file at `path`; `None` when the rank wrote none (it was killed
/// by a signal, or is not a program that writes one).
pub(crate) fn read(path: &Path) -> Option<RootCause> {
    let text = std::fs::read_to_string(path).ok()?;
    let written = std::fs::metadata(path)
        .and_then(|m| m.modified())
        .unwrap_or(UNIX_EPOCH);
    let message = match serde_json::from_str::<serde_json::Value>(&text) {
        Ok(json) => match &json["message"] {
            serde_json::Value::String(s) => s.clone(),
            m => match m["message"].as_str() {
                Some(s) => s.to_string(),
                None => text.trim().to_string(),
            },
        },
        Err(_) => text.trim().to_string(),
    };
    Some(RootCause { message, written })
}

/// A directory for the error files of one launcher's ranks, removed with it: made by
/// `tempfile` under `$TMPDIR` with a random name, created exclusively and readable by
/// this user alone (0700), so that no other user of a shared `/tmp` can place or read
/// the files there.
pub(crate) struct ErrorDir(tempfile::TempDir);

impl ErrorDir {
    /// Creates `$TMPDIR/tchrun-errors-XXXXXX`.
    pub(crate) fn create() -> std::io::Result<ErrorDir> {
        use std::os::unix::fs::PermissionsExt;
        tempfile::Builder::new()
            .prefix("tchrun-errors-")
            .permissions(std::fs::Permissions::from_mode(0o700))
            .tempdir()
            .map(ErrorDir)
    }

    /// The error file of global rank `rank` in attempt `attempt`.
    pub(crate) fn file(&self, attempt: usize, rank: usize) -> PathBuf {
        self.0
            .path()
            .join(format!("attempt_{attempt}-rank_{rank}.json"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_torch_and_plain_formats() {
        let dir = ErrorDir::create().unwrap();
        let path = dir.file(0, 1);
        std::fs::write(
            &path,
            r#"{"message": {"message": "RuntimeError: boom", "extraInfo": {"py_callstack": "Traceback", "timestamp": "1"}}}"#,
        )
        .unwrap();
        assert_eq!(read(&path).unwrap().message, "RuntimeError: boom");
        std::fs::write(&path, r#"{"message": "plain", "timestamp": 1}"#).unwrap();
        assert_eq!(read(&path).unwrap().message, "plain");
        std::fs::write(&path, "not json").unwrap();
        assert_eq!(read(&path).unwrap().message, "not json");
        assert!(read(&dir.file(1, 0)).is_none());
    }

    #[test]
    fn the_error_directory_is_private_unpredictable_and_removed() {
        use std::os::unix::fs::PermissionsExt;
        let (a, b) = (ErrorDir::create().unwrap(), ErrorDir::create().unwrap());
        let path = a.0.path().to_path_buf();
        assert_ne!(path, b.0.path());
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700, "{mode:o}");
        drop(a);
        assert!(!path.exists());
    }

    #[test]
    fn finds_the_last_error_printed() {
        let text = "step 1\nError: first\nnoise Error: not at a line start\nError: outer\n\nCaused by:\n    inner\n";
        assert_eq!(
            capture::last_error(text),
            Some("Error: outer\n\nCaused by:\n    inner")
        );
        assert_eq!(capture::last_error("no error here\n"), None);
        assert_eq!(
            capture::last_error("Error: at the start"),
            Some("Error: at the start")
        );
    }
}
