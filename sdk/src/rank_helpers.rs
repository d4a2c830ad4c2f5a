//! Rank-aware helpers, as Hugging Face Accelerate has them: work that one rank (or one
//! rank per node) must do before the others, such as downloading or preprocessing a
//! dataset into a cache that the other ranks then read.

use crate::error::Result;
use crate::init::{self, Context};

/// Runs `f` on rank 0 first, then on every other rank; returns what `f` returned on
/// this rank.
///
/// The other ranks wait at a barrier while rank 0 runs `f`; once rank 0 has finished,
/// it joins the barrier, which lets them run `f` (at the same time). This is
/// Accelerate's `with accelerator.main_process_first():` (`PartialState._goes_first`:
/// the others call `wait_for_everyone()` before the block, the main process after it),
/// for work such as downloading a dataset once per job: rank 0 downloads it; the
/// others, running the same code after it, find it there.
///
/// ```no_run
/// # fn main() -> anyhow::Result<()> {
/// # let _ctx = tch_distributed::init()?;
/// # fn download_if_missing(_: &str) -> std::io::Result<std::path::PathBuf> { todo!() }
/// let data = tch_distributed::main_process_first(|| download_if_missing("data/"))??;
/// # Ok(()) }
/// ```
///
/// Every rank must call it (the barrier is a collective): never inside a branch on
/// the rank. With one process, or before the job is joined ([`init`](crate::init) or
/// a `#[distributed]` function), it just runs `f`. A rank 0 that fails inside `f`
/// should still return (an `Err` value, say) so that the others are released; one
/// that never returns leaves them waiting until the collective timeout.
///
/// # Errors
/// [`Error`](crate::Error) when the barrier fails (a rank died, or the timeout
/// passed); `f`'s own result is returned inside `Ok`.
pub fn main_process_first<R>(f: impl FnOnce() -> R) -> Result<R> {
    goes_first(Context::is_main_process, f)
}

/// Runs `f` on local rank 0 of every node first, then on the node's other ranks;
/// returns what `f` returned on this rank.
///
/// As [`main_process_first`], with each node's local rank 0 (`LOCAL_RANK=0`) going
/// first, all at the same time, and the other ranks waiting at a barrier of the
/// whole job: Accelerate's `with accelerator.local_main_process_first():`. For work
/// whose result lands on a node's own disk, such as a dataset downloaded once per
/// node into a local cache.
///
/// # Errors
/// As [`main_process_first`].
pub fn local_main_process_first<R>(f: impl FnOnce() -> R) -> Result<R> {
    goes_first(Context::is_local_main_process, f)
}

/// Whether `flag` is true on any rank: every rank gets the same answer, so that all
/// can take the same path (leave a loop, skip a step, save) at a point every rank
/// reaches. As Accelerate's `set_trigger()` on the rank that decides and
/// `check_trigger()` on all. In a loop that `#[distributed]` shards, a `break`,
/// `continue` or `return` is agreed this way already; this is for loops and
/// decisions it does not see.
///
/// ```no_run
/// # fn main() -> anyhow::Result<()> {
/// # let _ctx = tch_distributed::init()?;
/// # let loss = 0.1;
/// if tch_distributed::any_rank(loss < 0.05)? {
///     // every rank, together
/// }
/// # Ok(()) }
/// ```
///
/// A collective: every rank must call it, the same number of times. With one
/// process, or before the job is joined, it returns `flag`.
///
/// # Errors
/// [`Error`](crate::Error) when the all-reduce fails (a rank died, or the timeout
/// passed).
pub fn any_rank(flag: bool) -> Result<bool> {
    Ok(init::all_reduce_scalar(flag as i64, crate::ReduceOp::Max)? != 0)
}

/// Accelerate's `_goes_first(is_main)`: the others wait before `f`, the first rank(s)
/// after it.
fn goes_first<R>(first: impl Fn(&Context) -> bool, f: impl FnOnce() -> R) -> Result<R> {
    let Some(ctx) = init::current().filter(|c| c.world_size() > 1) else {
        return Ok(f());
    };
    let first = first(&ctx);
    if !first {
        ctx.barrier()?;
    }
    let value = f();
    if first {
        ctx.barrier()?;
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    #[test]
    fn one_process_just_runs_it() {
        assert_eq!(super::main_process_first(|| 7).unwrap(), 7);
        assert_eq!(super::local_main_process_first(|| "x").unwrap(), "x");
        assert!(super::any_rank(true).unwrap());
        assert!(!super::any_rank(false).unwrap());
    }
}
