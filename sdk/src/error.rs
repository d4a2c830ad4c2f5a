//! The crate's error type.

use std::path::PathBuf;
use std::time::Duration;

/// Everything that can go wrong in `tch-distributed`. Each message names the problem
/// and, where there is one, the fix.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The run's configuration or launch environment is not usable: launch variables
    /// (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, SLURM's and MPI's), launcher
    /// flags (`--nnodes`, `--node-rank`, …), a run configuration file, or an option out
    /// of range that is not a [`Setting`](Error::Setting); the message says what to fix.
    #[error("{0}")]
    Config(String),

    /// Data the program hands the SDK is not usable: a dataset whose inputs and
    /// targets differ in length, a text shorter than the sequence, an empty dataset, a
    /// batch size of 0, a metric name given twice, values for `gather_for_metrics`
    /// whose rows match no batch, ranks whose datasets or first batches differ.
    #[error("{0}")]
    InvalidInput(String),

    /// The program called the API in a way that cannot work: a parameter group that
    /// does not exist, variables created after the optimizer, `unscale` twice in a step,
    /// an implementation or ZeRO stage that does not exist for the optimizer, ranks that
    /// built different models, `ReduceOp::Avg` on an integer tensor, a rank or root
    /// outside the world, `reduce_scatter` without one input per rank.
    #[error("{0}")]
    Usage(String),

    /// A checkpoint, or an optimizer state, cannot be used or was not written:
    /// incomplete, corrupt, another optimizer's, shapes that differ from the model's,
    /// none usable, or another rank failed while writing or reading it. `path` is the
    /// checkpoint's directory (the checkpoints' root when no single one is at fault;
    /// `None` for an optimizer state given as bytes); `message` is the whole text, as
    /// displayed; `source` is the error underneath, when there is one (the file
    /// system's, safetensors', JSON's, libtorch's).
    #[error("{message}")]
    Checkpoint {
        path: Option<PathBuf>,
        message: String,
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
    },

    /// fp16 training diverged: `skipped` steps in a row had inf or NaN gradients
    /// (the [`GradScaler`](crate::GradScaler)'s `max_consecutive_skips`), and the
    /// loss scale fell to `scale`. A program may catch it and go on from a
    /// checkpoint with a lower learning rate or bf16.
    #[error(
        "fp16: {skipped} steps in a row had inf or NaN gradients and were skipped (the scale is now {scale}): \
         the loss has diverged or overflows fp16. Use bf16 (mixed_precision = \"bf16\"), lower the learning rate, or check the data"
    )]
    Diverged { skipped: usize, scale: f64 },

    /// A run setting's value is not allowed: `given` is the setting as it was given
    /// (`--grad-accum 0`, `TCH_DISTRIBUTED_GRAD_ACCUM="0"`, `grad_accum = "0" in
    /// FILE`), `allowed` what it takes (see [`crate::settings`]).
    #[error("{given}: {allowed}")]
    Setting { given: String, allowed: String },

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

    /// A collective failed (a timeout is [`Error::Timeout`]).
    #[error("{op} failed: {message}")]
    Collective {
        op: &'static str,
        /// libtorch's message, without C++ frames unless `TORCH_SHOW_CPP_STACKTRACES=1`.
        message: String,
    },

    /// A collective, or the gradient all-reduce that DDP runs during backward, did not
    /// complete within the process group's timeout. `report` says which ranks did not
    /// arrive, as the store knows it (each rank records there the collectives it
    /// enters, and a heartbeat), and what to check. libtorch's own message is the
    /// error's [source](std::error::Error::source), shown by `{:#}` and `{:?}`.
    #[error("{op} timed out after {}: {report}", seconds(*timeout))]
    Timeout {
        /// The operation, e.g. `all_reduce (collective 5 of rank 0)`.
        op: String,
        timeout: Duration,
        /// The ranks found stalled (behind, or no longer responding); empty when none
        /// could be named.
        stalled: Vec<usize>,
        report: String,
        #[source]
        source: TorchText,
    },

    /// A collective that cannot complete: another rank entered a different collective
    /// under the same number (the ranks called collectives in different orders), found
    /// from the ranks' records in the store after this rank had waited `waited` (the
    /// run's `deadlock_check`), long before the timeout. `report` names those ranks
    /// and says what to change. Ends the rank from a thread of its own, as the
    /// collective cannot return.
    #[error("{op} cannot complete (found after {}): {report}", seconds(*waited))]
    Deadlock {
        /// The operation, e.g. `all_reduce (collective 5 of rank 0)`.
        op: String,
        waited: Duration,
        /// The ranks in another collective.
        stalled: Vec<usize>,
        report: String,
    },

    /// DDP could not finish averaging the gradients: `variables` (their names in the
    /// model's variable store) got no gradient in the last backward pass on this rank,
    /// as PyTorch's Reducer reports it ("Expected to have finished reduction in the
    /// prior iteration"), without `find_unused_parameters`. libtorch's own message is
    /// the error's [source](std::error::Error::source).
    #[error("{}", unused_parameters(variables))]
    UnusedParameters {
        variables: Vec<String>,
        #[source]
        source: TorchText,
    },

    /// [`find_executable_batch_size`](crate::find_executable_batch_size) ran out of
    /// memory even at a batch size of 1, on `ranks`; `message` is libtorch's text of
    /// this rank's error (empty when only other ranks ran out).
    #[error(
        "out of memory at batch size 1 (on rank{} {}), so no batch size fits: make the \
         model smaller per GPU (mixed_precision = \"bf16\", zero = 3, activation \
         checkpointing with tch_distributed::checkpoint) or use GPUs with more memory{}",
        if ranks.len() == 1 { "" } else { "s" },
        ranks.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", "),
        if message.is_empty() { String::new() } else { format!(" ({message})") }
    )]
    OutOfMemory { ranks: Vec<usize>, message: String },

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

/// An I/O error naming the operation and the path: `io("writing", path)` gives
/// `writing PATH: …`.
pub(crate) fn io(what: &str, path: &std::path::Path) -> impl FnOnce(std::io::Error) -> Error {
    let context = format!("{what} {}", path.display());
    move |source| Error::Io { context, source }
}

/// An [`Error::Checkpoint`] about `path` (`None` for an optimizer state given as
/// bytes), with no error underneath.
pub(crate) fn checkpoint(path: Option<&std::path::Path>, message: impl Into<String>) -> Error {
    Error::Checkpoint {
        path: path.map(std::path::Path::to_path_buf),
        message: message.into(),
        source: None,
    }
}

/// An [`Error::Checkpoint`] about `path` caused by `source`; `message` is the whole
/// text, as displayed.
pub(crate) fn checkpoint_from(
    path: Option<&std::path::Path>,
    message: impl Into<String>,
    source: impl std::error::Error + Send + Sync + 'static,
) -> Error {
    Error::Checkpoint {
        path: path.map(std::path::Path::to_path_buf),
        message: message.into(),
        source: Some(Box::new(source)),
    }
}

/// [`Error::UnusedParameters`]'s message: the variables (the first 10) and the fixes.
fn unused_parameters(variables: &[String]) -> String {
    const LISTED: usize = 10;
    let mut names: Vec<String> = variables
        .iter()
        .take(LISTED)
        .map(|n| format!("\"{n}\""))
        .collect();
    if variables.len() > LISTED {
        names.push(format!("and {} more", variables.len() - LISTED));
    }
    let (noun, they, them) = if variables.len() == 1 {
        ("variable", "it", "it")
    } else {
        ("variables", "they", "them")
    };
    format!(
        "{noun} {} got no gradient in the last backward pass, so DDP could not finish \
         averaging the gradients (each step waits for every trainable variable's): if the \
         loss leaves {them} out on purpose, turn on find_unused_parameters \
         (#[distributed(find_unused_parameters = true)], or \
         DdpOptions::find_unused_parameters); if {they} should not train, freeze {them} \
         (set_requires_grad(false)) before the optimizer is built",
        names.join(", ")
    )
}

/// `ranks` (in any order) as the messages write them: `rank 1`, `ranks 0 and 2`,
/// `ranks 0-3, 5 and 7`.
pub(crate) fn ranks_text(ranks: &[usize]) -> String {
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut runs: Vec<String> = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j + 1 < sorted.len() && sorted[j + 1] == sorted[j] + 1 {
            j += 1;
        }
        if j >= i + 2 {
            runs.push(format!("{}-{}", sorted[i], sorted[j]));
        } else {
            runs.extend(sorted[i..=j].iter().map(|r| r.to_string()));
        }
        i = j + 1;
    }
    let word = if sorted.len() == 1 { "rank" } else { "ranks" };
    match runs.as_slice() {
        [] => "no rank".to_string(),
        [one] => format!("{word} {one}"),
        [init @ .., last] => format!("{word} {} and {last}", init.join(", ")),
    }
}

/// A duration as the messages write it: `3 s`, `2.5 s`.
pub(crate) fn seconds(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{s} s")
    } else {
        format!("{s:.1} s")
    }
}

/// libtorch's own text for an error, kept whole (with the C++ stack trace, when
/// libtorch gave one) as the [source](std::error::Error::source) of an [`Error`]
/// whose message is the SDK's. It displays without the C++ frames unless
/// `TORCH_SHOW_CPP_STACKTRACES=1` asks for them (see [`without_cpp_frames`]); the
/// whole text is [`TorchText::full`].
#[derive(Clone, PartialEq, Eq)]
pub struct TorchText(String);

impl TorchText {
    pub(crate) fn new(raw: impl Into<String>) -> Self {
        TorchText(raw.into())
    }

    /// libtorch's whole text, C++ frames included.
    pub fn full(&self) -> &str {
        &self.0
    }

    /// The text without C++ frames (unless `TORCH_SHOW_CPP_STACKTRACES=1`).
    pub fn message(&self) -> String {
        without_cpp_frames(&self.0)
    }

    /// Whether libtorch reports a timeout (Gloo's `Timed out waiting …`, a work's
    /// `Operation timed out!`, NCCL's watchdog `… timeout …`).
    pub(crate) fn is_timeout(&self) -> bool {
        let lower = self.0.to_ascii_lowercase();
        lower.contains("timed out") || lower.contains("timeout")
    }
}

impl std::fmt::Display for TorchText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "libtorch: {}", self.message())
    }
}

impl std::fmt::Debug for TorchText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("TorchText").field(&self.message()).finish()
    }
}

impl std::error::Error for TorchText {}

/// tch's error as a message: libtorch's own text without tch's "Internal torch error"
/// prefix and without the C++ frames ([`without_cpp_frames`]).
pub(crate) fn torch_message(e: tch::TchError) -> String {
    without_cpp_frames(&torch_text(e).0)
}

/// tch's error as libtorch's whole text, without tch's "Internal torch error" prefix.
pub(crate) fn torch_text(e: tch::TchError) -> TorchText {
    match e {
        tch::TchError::Torch(m) => TorchText(m),
        other => TorchText(other.to_string()),
    }
}

/// libtorch's message without the C++ stack trace that follows it
/// (`Exception raised from … (most recent call first):` and the frames), as PyTorch
/// shows errors unless `TORCH_SHOW_CPP_STACKTRACES=1` asks for the frames.
pub(crate) fn without_cpp_frames(message: &str) -> String {
    if crate::protocol::show_cpp_stacktraces() {
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

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// A setting's error is the SDK's variant of the same name and text.
impl From<tch_distributed_settings::Error> for Error {
    fn from(e: tch_distributed_settings::Error) -> Error {
        use tch_distributed_settings::Error as E;
        match e {
            E::Config(message) => Error::Config(message),
            E::Setting { given, allowed } => Error::Setting { given, allowed },
            E::Io { context, source } => Error::Io { context, source },
        }
    }
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

    /// A timeout's message is the SDK's alone; libtorch's text is its source, which
    /// anyhow's `{:#}` (and `{:?}`) shows, still without the C++ frames.
    #[test]
    fn libtorch_text_is_the_source_shown_only_when_asked_for() {
        if crate::protocol::show_cpp_stacktraces() {
            return;
        }
        let raw = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete\nException raised from recv at /pytorch/gloo.cc:78 (most recent call first):\nframe #0: c10::Error::Error() + 0x8c";
        let e = super::Error::Timeout {
            op: "all_reduce (collective 5 of rank 0)".into(),
            timeout: std::time::Duration::from_secs(3),
            stalled: vec![1],
            report: "rank 1 did not arrive".into(),
            source: super::TorchText::new(raw),
        };
        let plain = format!("{e}");
        assert_eq!(
            plain,
            "all_reduce (collective 5 of rank 0) timed out after 3 s: rank 1 did not arrive"
        );
        let e = anyhow::Error::from(e);
        let alternate = format!("{e:#}");
        assert!(
            alternate.ends_with(": libtorch: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete"),
            "{alternate}"
        );
        let debug = format!("{e:?}");
        assert!(debug.contains("Timed out waiting 3000ms"), "{debug}");
        for raw in ["Exception raised from", "frame #", "Internal torch error"] {
            assert!(
                !alternate.contains(raw) && !debug.contains(raw),
                "{raw} in {debug}"
            );
        }
        assert!(e.downcast_ref::<super::Error>().is_some());
    }

    #[test]
    fn ranks_are_listed_with_runs() {
        use super::ranks_text;
        assert_eq!(ranks_text(&[1]), "rank 1");
        assert_eq!(ranks_text(&[2, 0]), "ranks 0 and 2");
        assert_eq!(ranks_text(&[0, 1, 2, 3, 5, 7]), "ranks 0-3, 5 and 7");
        assert_eq!(ranks_text(&[0, 1, 4]), "ranks 0, 1 and 4");
    }
}
