//! Runtime support for the code `#[distributed]` generates, re-exported as
//! `tch_distributed::__private`. Not public API: it may change in any release. The
//! macro emits calls to `::tch_distributed::__private::…` only.
//!
//! - [`entry`]: joining (or self-launching) at the function's entry with the run's
//!   settings (the environment's over the attribute's), the banner, the exit barrier;
//! - [`rewrites`]: what the rewritten calls run (`build`, the backward steps and the
//!   gradient averaging of optimizers the function did not build, `save`/`load`,
//!   autocast, the device);
//! - [`agreement`]: what the ranks agree on in a sharded loop: an exit one rank
//!   takes, the end of a loop whose adaptors keep batches of their own;
//! - [`probes`]: type-directed dispatch (autoref specialization) that lets a rewrite
//!   apply to some types and leave every other alone: sharded loops, `VarStore`s,
//!   optimizers' `step`, the function's `Result`.

use crate::init::{self, Context};

mod agreement;
mod entry;
mod probes;
mod rewrites;

pub use crate::error::Error;
pub use agreement::{agree_exit, agreed_ends, AgreedEnds};
pub use entry::{enter, Session};
pub use probes::*;
pub use rewrites::*;
pub use tch::nn::VarStore;

/// Ends the program as `main` returning an error does: `Error: …` on stderr (the
/// message names the problem and the fix) and exit code 1, without a panic's
/// pointer into the SDK's sources. Every caller is at a point where nothing is half
/// written: checkpoints are complete or absent.
pub(crate) fn fail(what: &str, e: impl std::fmt::Display) -> ! {
    let rank = init::current()
        .filter(|c| c.world_size() > 1)
        .map(|c| format!("rank {}: ", c.rank()))
        .unwrap_or_default();
    // One write, so that the lines of ranks failing at once do not interleave.
    let line = format!("Error: {rank}{what}: {e}\n");
    let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
    // torchrun's (and tchrun's) root cause, when the launcher asks for it.
    crate::launch::error_file::record(line.trim_end(), None);
    std::process::exit(1)
}

/// [`fail`] for the SDK's own errors. Their message is the SDK's; libtorch's own text,
/// the error's source, follows it (`caused by: libtorch: …`) only when
/// `TORCH_SHOW_CPP_STACKTRACES=1` asks for libtorch's details.
pub(crate) fn fail_with_source(what: &str, e: &Error) -> ! {
    let mut message = e.to_string();
    if crate::protocol::show_cpp_stacktraces() {
        let mut source = std::error::Error::source(e);
        while let Some(cause) = source {
            message += &format!("\ncaused by: {cause}");
            source = cause.source();
        }
    }
    fail(what, message)
}

pub(crate) fn context() -> Context {
    init::current()
        .unwrap_or_else(|| fail("internal", "no context: the function entry did not run"))
}
