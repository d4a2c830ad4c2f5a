//! The crate's error type.

use std::time::Duration;

/// Everything that can go wrong in `tch-distributed`. Each message names the problem
/// and, where there is one, the fix.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Bad configuration (environment variables, options, launcher flags); the message
    /// says what to fix.
    #[error("{0}")]
    Config(String),

    /// An I/O operation failed; `context` names the operation and path.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },

    /// A launched rank failed (reported by the launcher).
    #[error("{0}")]
    RankFailed(String),

    /// The rendezvous port is taken by another process.
    #[error(
        "port {port} on {addr} is already in use, so rank 0 cannot host the rendezvous store: \
         stop the process using it, or pick another port (tchrun --master-port P, or \
         MASTER_PORT=P; tchrun's default of 0 picks a free one)"
    )]
    PortInUse { addr: String, port: u16 },

    /// Joining the rendezvous (store or process group) failed.
    #[error("rendezvous at {addr}:{port} failed ({}world size {world_size}): {message}", rank.map(|r| format!("rank {r}, ")).unwrap_or_default())]
    Rendezvous {
        addr: String,
        port: u16,
        /// This process's rank, when known at the failing step.
        rank: Option<usize>,
        world_size: usize,
        message: String,
    },

    /// A collective failed or timed out.
    #[error("{op} failed{}: {message}", if *timed_out { format!(" after waiting {:.1} s (the process group's timeout): a rank did not reach the same collective; check that every rank runs the same number of steps, or raise the timeout", timeout.as_secs_f64()) } else { String::new() })]
    Collective {
        op: &'static str,
        timeout: Duration,
        timed_out: bool,
        message: String,
    },

    /// The NCCL backend was asked for but is not available.
    #[error("{0}")]
    BackendUnavailable(String),

    /// An error reported by libtorch (through the shim or through `tch`).
    #[error("libtorch: {0}")]
    Torch(String),
}

impl From<tch::TchError> for Error {
    fn from(e: tch::TchError) -> Self {
        Error::Torch(torch_message(e))
    }
}

/// tch's error as a message: libtorch's own text without tch's "Internal torch error"
/// prefix and without the C++ frames ([`without_cpp_frames`]).
pub(crate) fn torch_message(e: tch::TchError) -> String {
    match e {
        tch::TchError::Torch(m) => without_cpp_frames(&m),
        other => without_cpp_frames(&other.to_string()),
    }
}

/// libtorch's message without the C++ stack trace that follows it
/// (`Exception raised from … (most recent call first):` and the frames), as PyTorch
/// shows errors unless `TORCH_SHOW_CPP_STACKTRACES=1` asks for the frames.
pub(crate) fn without_cpp_frames(message: &str) -> String {
    if std::env::var("TORCH_SHOW_CPP_STACKTRACES").is_ok_and(|v| v == "1") {
        return message.to_string();
    }
    let mut kept: Vec<&str> = Vec::new();
    for line in message.lines() {
        if line.trim_start().starts_with("Exception raised from ") {
            break;
        }
        kept.push(line);
    }
    kept.join("\n").trim_end().to_string()
}

#[cfg(test)]
mod tests {
    #[test]
    fn cpp_frames_are_cut_unless_asked_for() {
        let raw = "Timed out waiting 10000ms for recv\nException raised from recv at /pytorch/gloo.cc:78 (most recent call first):\nframe #0: c10::Error::Error() + 0x8c";
        assert_eq!(
            super::without_cpp_frames(raw),
            "Timed out waiting 10000ms for recv"
        );
        assert_eq!(super::without_cpp_frames("no frames"), "no frames");
    }
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
