//! Where each rank's standard output goes.
//!
//! By default global rank 0's is the launcher's own (inherited) and the other ranks'
//! goes to `/dev/null`, as torchrun's `--local-ranks-filter 0` shows it: a `println!`
//! that `#[distributed]` cannot keep to rank 0 (one in a helper function, which the
//! attribute does not see) appears once, not once per rank.
//!
//! With [`LaunchConfig::all_ranks_stdout`](super::LaunchConfig::all_ranks_stdout) every
//! rank's is piped to a thread of the launcher that copies it to the launcher's stdout
//! line by line, each line after `[rank N] ` (`N` the global rank, as torchrun's `--tee`
//! puts `[default N]:` before each line). A line is written whole, in one write under
//! stdout's lock, and flushed, so the ranks' lines never mix and show as they come.
//!
//! Standard error is left alone: every rank's reaches the launcher's, so no error is
//! ever hidden.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::process::{Child, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// How long the copies get, once the attempt's ranks have exited, to reach the end of
/// their pipes. A pipe ends as soon as its rank has exited, unless a process that the
/// rank started (`sleep 60 &` in a shell script) still holds it open; such a copy is left
/// to go on copying that process's lines while the launcher runs.
const DRAIN_GRACE: Duration = Duration::from_secs(2);

/// The standard output of one attempt's ranks: what each is started with, and the
/// copies of those that are piped.
pub(super) struct RankOutput {
    all_ranks: bool,
    copies: Vec<Copier>,
}

/// A thread copying one rank's standard output.
struct Copier {
    /// Disconnected once the thread has finished (it holds the sender).
    finished: mpsc::Receiver<()>,
    thread: JoinHandle<()>,
}

impl RankOutput {
    /// Every rank's standard output when `all_ranks`, else global rank 0's alone.
    pub(super) fn new(all_ranks: bool) -> Self {
        Self {
            all_ranks,
            copies: Vec::new(),
        }
    }

    /// The standard output that global rank `rank` is started with: a pipe to copy from
    /// when every rank's is shown, else the launcher's own for rank 0 and `/dev/null` for
    /// the others.
    pub(super) fn stdio(&self, rank: usize) -> Stdio {
        match (self.all_ranks, rank) {
            (true, _) => Stdio::piped(),
            (false, 0) => Stdio::inherit(),
            (false, _) => Stdio::null(),
        }
    }

    /// Starts copying the piped standard output of `child`, global rank `rank`, to the
    /// launcher's (nothing to do when it is not piped).
    ///
    /// Errors when the thread cannot be started.
    pub(super) fn copy(&mut self, rank: usize, child: &mut Child) -> io::Result<()> {
        let Some(pipe) = child.stdout.take() else {
            return Ok(());
        };
        let (sender, finished) = mpsc::channel::<()>();
        let thread = thread::Builder::new()
            .name(format!("rank {rank} stdout"))
            .spawn(move || {
                let _finished = sender;
                copy_lines(rank, pipe, write_to_stdout);
            })?;
        self.copies.push(Copier { finished, thread });
        Ok(())
    }

    /// Waits until every copy has written the last line of its rank (call it once the
    /// ranks have exited), or for [`DRAIN_GRACE`] where a process that a rank started
    /// keeps its pipe open.
    pub(super) fn finish(self) {
        let deadline = Instant::now() + DRAIN_GRACE;
        for copy in self.copies {
            let left = deadline.saturating_duration_since(Instant::now());
            match copy.finished.recv_timeout(left) {
                Err(RecvTimeoutError::Timeout) => {} // left to copy on, see DRAIN_GRACE
                Ok(()) | Err(RecvTimeoutError::Disconnected) => {
                    let _ = copy.thread.join();
                }
            }
        }
    }
}

/// Copies `pipe` line by line to `write`, each line after `[rank {rank}] ` and handed to
/// `write` whole; a last line without a newline gets one. Once `write` fails (the
/// launcher's stdout was closed), the rest is read and dropped, so that the rank never
/// blocks on a full pipe. Returns at the end of `pipe`, or at an error reading it.
fn copy_lines(rank: usize, pipe: impl Read, mut write: impl FnMut(&[u8]) -> io::Result<()>) {
    let prefix = format!("[rank {rank}] ");
    let mut pipe = BufReader::new(pipe);
    let mut line = prefix.clone().into_bytes();
    let mut writing = true;
    loop {
        line.truncate(prefix.len());
        match pipe.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if writing {
            if line.last() != Some(&b'\n') {
                line.push(b'\n');
            }
            writing = write(&line).is_ok();
        }
    }
}

/// Writes `line` to the launcher's stdout in one write under its lock, and flushes it.
fn write_to_stdout(line: &[u8]) -> io::Result<()> {
    let mut stdout = io::stdout().lock();
    stdout.write_all(line)?;
    stdout.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copied(rank: usize, input: &[u8]) -> Vec<Vec<u8>> {
        let mut writes = Vec::new();
        copy_lines(rank, input, |line| {
            writes.push(line.to_vec());
            Ok(())
        });
        writes
    }

    #[test]
    fn each_line_is_one_write_after_the_ranks_prefix() {
        assert_eq!(
            copied(3, b"eval loss 0.5\n\nno newline"),
            [
                &b"[rank 3] eval loss 0.5\n"[..],
                b"[rank 3] \n",
                b"[rank 3] no newline\n"
            ]
        );
        assert!(copied(0, b"").is_empty());
        // Bytes that are not UTF-8 are copied as they are.
        assert_eq!(copied(12, b"\xff\xfe\n"), [&b"[rank 12] \xff\xfe\n"[..]]);
    }

    #[test]
    fn a_closed_stdout_stops_the_writes_but_not_the_reading() {
        let mut tries = 0;
        let input = b"a\nb\nc\n";
        let mut reader = &input[..];
        copy_lines(1, &mut reader, |_| {
            tries += 1;
            Err(io::ErrorKind::BrokenPipe.into())
        });
        assert_eq!(tries, 1);
        assert!(reader.is_empty(), "the rest was read");
    }
}
