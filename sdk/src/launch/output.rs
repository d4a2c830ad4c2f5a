//! Where each rank's standard output and standard error go.
//!
//! **Standard output.** By default global rank 0's is the launcher's own (inherited) and
//! the other ranks' goes to `/dev/null`, as torchrun's `--local-ranks-filter 0` shows it:
//! a `println!` that `#[distributed]` cannot keep to rank 0 (one in a helper function,
//! which the attribute does not see) appears once, not once per rank. With
//! [`LaunchConfig::all_ranks_stdout`](super::LaunchConfig::all_ranks_stdout) every rank's
//! is piped to a thread of the launcher that copies it to the launcher's stdout line by
//! line, each line after `[rank N] ` (`N` the global rank, as torchrun's `--tee` puts
//! `[default N]:` before each line).
//!
//! **Standard error** is every rank's, so that no error is ever hidden, and it is always
//! piped and copied the same way, to the launcher's stderr: a program writes a line in
//! pieces (Rust's `eprintln!` makes one `write` per piece of its format string, and
//! libtorch's C++ logging its own), and two ranks writing to one inherited stderr would
//! mix their pieces mid-line. Each line gets `[rank N] ` in front with
//! [`LaunchConfig::rank_prefix`](super::LaunchConfig::rank_prefix).
//!
//! Every copied line is written whole, in one write under the stream's lock, and flushed,
//! so that no line holds another rank's bytes (nor the launcher's own lines, written the
//! same way) and lines show as they come. One exception keeps a progress bar alive: a
//! line being redrawn in place (it holds a carriage return or an escape sequence, as
//! indicatif draws a bar, and ends only when the bar is done) is passed on as it comes.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::process::{Child, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// How long the copies get, once the attempt's ranks have exited, to reach the end of
/// their pipes. A pipe ends as soon as its rank has exited, unless a process that the
/// rank started (`sleep 60 &` in a shell script) still holds it open; such a copy is left
/// to go on copying that process's lines while the launcher runs.
pub(super) const DRAIN_GRACE: Duration = Duration::from_secs(2);

/// The longest piece of a line held back: a longer line (one without a newline for
/// 64 KiB) is passed on in pieces of this size rather than held without bound.
const MAX_LINE: usize = 64 * 1024;

/// The standard output and error of one attempt's ranks: what each is started with, and
/// the copies of those that are piped.
pub(super) struct RankOutput {
    all_ranks_stdout: bool,
    rank_prefix: bool,
    copies: Vec<Copier>,
}

/// A thread copying one stream of one rank.
struct Copier {
    /// The global rank whose stream it copies.
    rank: usize,
    /// Disconnected once the thread has finished (it holds the sender).
    finished: mpsc::Receiver<()>,
    thread: Option<JoinHandle<()>>,
}

impl Copier {
    /// Waits until the copy has reached the end of its pipe, or until `deadline`.
    fn wait(&mut self, deadline: Instant) {
        let left = deadline.saturating_duration_since(Instant::now());
        match self.finished.recv_timeout(left) {
            Err(RecvTimeoutError::Timeout) => {} // left to copy on, see DRAIN_GRACE
            Ok(()) | Err(RecvTimeoutError::Disconnected) => {
                if let Some(thread) = self.thread.take() {
                    let _ = thread.join();
                }
            }
        }
    }
}

impl RankOutput {
    /// Every rank's standard output when `all_ranks_stdout`, else global rank 0's alone;
    /// every rank's standard error, each line after `[rank N] ` when `rank_prefix`.
    pub(super) fn new(all_ranks_stdout: bool, rank_prefix: bool) -> Self {
        Self {
            all_ranks_stdout,
            rank_prefix,
            copies: Vec::new(),
        }
    }

    /// The standard output that global rank `rank` is started with: a pipe to copy from
    /// when every rank's is shown, else the launcher's own for rank 0 and `/dev/null` for
    /// the others.
    pub(super) fn stdout(&self, rank: usize) -> Stdio {
        match (self.all_ranks_stdout, rank) {
            (true, _) => Stdio::piped(),
            (false, 0) => Stdio::inherit(),
            (false, _) => Stdio::null(),
        }
    }

    /// The standard error that every rank is started with: a pipe to copy from.
    pub(super) fn stderr(&self) -> Stdio {
        Stdio::piped()
    }

    /// Starts copying the piped standard output and error of `child`, global rank
    /// `rank`, to the launcher's.
    ///
    /// # Errors
    /// When a thread cannot be started.
    pub(super) fn copy(&mut self, rank: usize, child: &mut Child) -> io::Result<()> {
        let prefix = format!("[rank {rank}] ");
        if let Some(pipe) = child.stdout.take() {
            self.spawn(rank, "stdout", prefix.clone(), pipe, |line| {
                write_whole(&mut io::stdout().lock(), line)
            })?;
        }
        if let Some(pipe) = child.stderr.take() {
            let prefix = if self.rank_prefix {
                prefix
            } else {
                String::new()
            };
            self.spawn(rank, "stderr", prefix, pipe, |line| {
                write_whole(&mut io::stderr().lock(), line)
            })?;
        }
        Ok(())
    }

    /// Starts a thread copying `pipe` with [`copy_lines`].
    fn spawn(
        &mut self,
        rank: usize,
        stream: &str,
        prefix: String,
        pipe: impl Read + Send + 'static,
        write: impl FnMut(&[u8]) -> io::Result<()> + Send + 'static,
    ) -> io::Result<()> {
        let (sender, finished) = mpsc::channel::<()>();
        let thread = thread::Builder::new()
            .name(format!("rank {rank} {stream}"))
            .spawn(move || {
                let _finished = sender;
                copy_lines(prefix.as_bytes(), pipe, write);
            })?;
        self.copies.push(Copier {
            rank,
            finished,
            thread: Some(thread),
        });
        Ok(())
    }

    /// Waits until every line that global rank `rank` wrote before it exited has been
    /// copied (call it once the rank has exited, before saying so: its last words, such as
    /// its `Error: …` line, come before the launcher's report), for at most `grace`.
    pub(super) fn drain(&mut self, rank: usize, grace: Duration) {
        let deadline = Instant::now() + grace;
        for copy in self.copies.iter_mut().filter(|c| c.rank == rank) {
            copy.wait(deadline);
        }
    }

    /// Waits until every copy has written the last line of its rank (call it once the
    /// ranks have exited), or for [`DRAIN_GRACE`] where a process that a rank started
    /// keeps its pipe open.
    pub(super) fn finish(mut self) {
        let deadline = Instant::now() + DRAIN_GRACE;
        for copy in &mut self.copies {
            copy.wait(deadline);
        }
    }
}

/// Copies `pipe` line by line to `write`, each line after `prefix` and handed to `write`
/// whole; the whole lines of one read go in one call, so that a block of lines the rank
/// wrote at once (the SDK's `Error: …` with its hint, in one write) is not cut by another
/// rank's lines; a last line without a newline gets one. A line being redrawn in place (it holds
/// `\r` or an escape, ESC) is handed on as it comes, and so is a piece of [`MAX_LINE`]
/// bytes of a line that long; the prefix goes before the first piece only. Once `write`
/// fails (the launcher's stream was closed), the rest is read and dropped, so that the
/// rank never blocks on a full pipe. Returns at the end of `pipe`, or at an error reading
/// it.
fn copy_lines(prefix: &[u8], pipe: impl Read, mut write: impl FnMut(&[u8]) -> io::Result<()>) {
    let mut pipe = BufReader::new(pipe);
    // What goes out next: the prefix (unless the line was begun) and the line's bytes.
    let mut line = prefix.to_vec();
    // How many bytes of `line` are whole lines, not handed on yet.
    let mut whole = 0;
    // Part of the current line was handed on already, after the prefix.
    let mut begun = false;
    let mut redrawn = false;
    let mut writing = true;
    let mut hand_on = |line: &mut Vec<u8>| {
        if writing {
            writing = write(line).is_ok();
        }
        line.clear();
    };
    loop {
        let chunk = match pipe.fill_buf() {
            Ok([]) => break,
            Ok(chunk) => chunk,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        let taken = chunk.len();
        for piece in chunk.split_inclusive(|&b| b == b'\n') {
            line.extend_from_slice(piece);
            redrawn |= piece.iter().any(|&b| b == b'\r' || b == 0x1b);
            if piece.ends_with(b"\n") {
                whole = line.len();
                line.extend_from_slice(prefix);
                (begun, redrawn) = (false, false);
            } else if redrawn || line.len() - whole >= MAX_LINE {
                hand_on(&mut line);
                (whole, begun) = (0, true);
            }
        }
        pipe.consume(taken);
        // This read's whole lines, in one call; the line begun stays.
        if whole > 0 {
            let rest = line.split_off(whole);
            hand_on(&mut line);
            (line, whole) = (rest, 0);
        }
    }
    if begun || line.len() > prefix.len() {
        line.push(b'\n');
        hand_on(&mut line);
    }
}

/// Writes `line` to `stream` in one write (under the lock the caller holds), and flushes
/// it.
fn write_whole(stream: &mut impl Write, line: &[u8]) -> io::Result<()> {
    stream.write_all(line)?;
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pipe that yields at most 3 bytes a read, as a rank writing a line in pieces.
    struct Trickle<'a>(&'a [u8]);

    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = self.0.len().min(buf.len()).min(3);
            buf[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            Ok(n)
        }
    }

    fn copied(prefix: &str, input: &[u8]) -> Vec<Vec<u8>> {
        let mut writes = Vec::new();
        copy_lines(prefix.as_bytes(), Trickle(input), |line| {
            writes.push(line.to_vec());
            Ok(())
        });
        writes
    }

    #[test]
    fn each_line_is_one_write_after_the_prefix_however_it_was_read() {
        // Read 3 bytes at a time: "5\n\n" is one read, whose two whole lines go
        // together.
        assert_eq!(
            copied("[rank 3] ", b"eval loss 0.5\n\nno newline"),
            [
                &b"[rank 3] eval loss 0.5\n[rank 3] \n"[..],
                b"[rank 3] no newline\n"
            ]
        );
        // The lines of one read, each after the prefix, in one write.
        let mut writes = Vec::new();
        copy_lines(b"[rank 1] ", &b"Error: a\n  b\nhint: c\n"[..], |block| {
            writes.push(block.to_vec());
            Ok(())
        });
        assert_eq!(
            writes,
            [&b"[rank 1] Error: a\n[rank 1]   b\n[rank 1] hint: c\n"[..]]
        );
        assert!(copied("[rank 0] ", b"").is_empty());
        // Without a prefix, the lines as they were.
        assert_eq!(copied("", b"a b\nc"), [&b"a b\n"[..], b"c\n"]);
        assert!(copied("", b"").is_empty());
        // Bytes that are not UTF-8 are copied as they are.
        assert_eq!(
            copied("[rank 12] ", b"\xff\xfe\n"),
            [&b"[rank 12] \xff\xfe\n"[..]]
        );
    }

    #[test]
    fn a_line_redrawn_in_place_is_handed_on_as_it_comes() {
        // A bar drawn three times, then a line: each piece of the bar after its `\r` goes
        // out as read; the prefix goes before the bar's first piece only.
        let writes = copied("[rank 0] ", b"\r1/3\r2/3\r3/3\ndone\n");
        assert!(writes[0].starts_with(b"[rank 0] \r"), "{writes:?}");
        let joined: Vec<u8> = writes.concat();
        assert_eq!(joined, b"[rank 0] \r1/3\r2/3\r3/3\n[rank 0] done\n");
        assert!(writes.len() > 3, "{writes:?}");
        assert_eq!(writes.last().unwrap(), b"[rank 0] done\n");
        // A bar left unfinished at the end is ended with a newline.
        assert_eq!(copied("", b"\x1b[2K5/9").concat(), b"\x1b[2K5/9\n");
    }

    #[test]
    fn a_line_longer_than_the_limit_goes_out_in_pieces() {
        let long = vec![b'x'; MAX_LINE * 2 + 10];
        let mut input = long.clone();
        input.extend_from_slice(b"\nnext\n");
        let mut writes = Vec::new();
        copy_lines(b"> ", &input[..], |line| {
            writes.push(line.to_vec());
            Ok(())
        });
        assert!(writes.len() >= 3, "{}", writes.len());
        assert!(writes.iter().all(|w| w.len() <= MAX_LINE + 4096));
        let mut expected = b"> ".to_vec();
        expected.extend_from_slice(&input[..input.len() - 5]);
        expected.extend_from_slice(b"> next\n");
        assert_eq!(writes.concat(), expected);
    }

    #[test]
    fn a_closed_stream_stops_the_writes_but_not_the_reading() {
        let mut tries = 0;
        let input = b"a\nb\nc\n";
        let mut reader = &input[..];
        copy_lines(b"[rank 1] ", &mut reader, |_| {
            tries += 1;
            Err(io::ErrorKind::BrokenPipe.into())
        });
        assert_eq!(tries, 1);
        assert!(reader.is_empty(), "the rest was read");
    }
}
