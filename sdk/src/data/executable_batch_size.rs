//! Finding a batch size that fits in memory: run, and on out-of-memory retry with half
//! the batch, every rank together, as Accelerate's `find_executable_batch_size`.

use std::cell::Cell;
use std::fmt::Display;
use std::panic::{self, AssertUnwindSafe};
use std::sync::Once;

use tch::Tensor;

use crate::error::{Error, Result};
use crate::init;
use crate::log;

/// The texts by which libtorch reports running out of memory, as Accelerate's
/// `should_reduce_batch_size` reads them: CUDA's caching allocator, cuDNN's workspace,
/// and the CPU allocator.
const OUT_OF_MEMORY: [&str; 3] = [
    "CUDA out of memory.",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
    "DefaultCPUAllocator: can't allocate memory",
];

/// What an attempt ended with on a rank, as every rank tells the others (higher wins).
const FITTED: i64 = 0;
const OUT_OF_MEMORY_CODE: i64 = 1;
const FAILED: i64 = 2;

/// Runs `f(batch_size)`, starting at `starting_batch_size`; when it runs out of memory
/// on any rank, runs it again on every rank with half the batch size, until it returns
/// on every rank. Returns what `f` returned at the batch size that fitted. As
/// Accelerate's `find_executable_batch_size`, with the ranks agreeing: after each
/// attempt, every rank tells the others how it ended (one all-reduce), so a rank whose
/// attempt fitted retries with the others and no rank goes on alone.
///
/// ```no_run
/// # fn train(batch_size: usize) -> anyhow::Result<f64> { Ok(batch_size as f64) }
/// # fn main() -> anyhow::Result<()> {
/// let _ctx = tch_distributed::init()?;
/// // 256, then 128, 64, … until an attempt fits on every rank.
/// let loss = tch_distributed::find_executable_batch_size(256, |batch_size| {
///     train(batch_size) // builds its batches (and model, optimizer) from batch_size
/// })?;
/// # let _ = loss; Ok(()) }
/// ```
///
/// Out of memory is an `Err` from `f`, or a panic inside it (tch's tensor methods
/// panic on a libtorch error), whose text has CUDA's `CUDA out of memory.`, cuDNN's
/// `CUDNN_STATUS_NOT_SUPPORTED` or the CPU allocator's `can't allocate memory`. Such
/// a panic is caught, and its default message is not printed; rank 0 prints one line
/// per retry, naming the ranks that ran out. Memory that `f`'s locals held is freed
/// when they drop, before the retry.
///
/// `f` should build what depends on the batch size (its data loader, and a model and
/// optimizer if it created them) from its argument: everything an attempt made is
/// dropped. Any other error or panic ends it on every rank: that rank's own error or
/// panic is returned or resumed, the others get [`Error::RankFailed`].
///
/// Every rank must call it, and each attempt must end on every rank at the same point
/// among the collectives: the agreement is itself a collective. That holds when the
/// memory runs out before the attempt's first collective, or on every rank in the same
/// operation (the same model at the same batch size, as is usual). A rank that runs out
/// in the backward pass while the others are in DDP's all-reduce cannot be recovered:
/// the others fail with the collective's error. With one process, or before the job is
/// joined, there is nothing to agree on.
///
/// # Errors
/// - [`Error::OutOfMemory`] when even a batch of 1 ran out of memory;
/// - [`Error::InvalidInput`] when `starting_batch_size` is 0;
/// - [`Error::RankFailed`] when `f` failed on another rank with something other than
///   out of memory;
/// - `f`'s own error, when it failed with something else on this rank;
/// - a collective's error when the agreement fails.
pub fn find_executable_batch_size<R, E>(
    starting_batch_size: usize,
    mut f: impl FnMut(usize) -> std::result::Result<R, E>,
) -> std::result::Result<R, E>
where
    E: Display + From<Error>,
{
    if starting_batch_size == 0 {
        return Err(Error::InvalidInput(
            "find_executable_batch_size: the starting batch size is 0: start from the \
             largest batch size to try"
                .into(),
        )
        .into());
    }
    quiet_out_of_memory_panics();
    let mut batch_size = starting_batch_size;
    loop {
        let attempt = IN_ATTEMPT.with(|inside| {
            let was = inside.replace(true);
            let attempt = panic::catch_unwind(AssertUnwindSafe(|| f(batch_size)));
            inside.set(was);
            attempt
        });
        let mine = match &attempt {
            Ok(Ok(_)) => FITTED,
            Ok(Err(e)) if is_out_of_memory(&format!("{e:#}")) => OUT_OF_MEMORY_CODE,
            Err(p) if panic_text(&**p).is_some_and(is_out_of_memory) => OUT_OF_MEMORY_CODE,
            _ => FAILED,
        };
        let codes = every_rank(mine)?;
        match codes.iter().max().copied().unwrap_or(FITTED) {
            FITTED => match attempt {
                Ok(Ok(value)) => return Ok(value),
                _ => unreachable!("every rank's attempt fitted"),
            },
            OUT_OF_MEMORY_CODE => {
                let ranks = ranks_with(&codes, OUT_OF_MEMORY_CODE);
                if batch_size == 1 {
                    return Err(Error::OutOfMemory {
                        ranks,
                        message: out_of_memory_text(attempt),
                    }
                    .into());
                }
                let next = batch_size / 2;
                if codes.len() == 1 {
                    log::warn(format_args!(
                        "out of memory at batch size {batch_size}: retrying with batch size \
                         {next}"
                    ));
                } else if init::current().is_some_and(|c| c.is_main_process()) {
                    log::warn(format_args!(
                        "out of memory at batch size {batch_size} on {}: every rank \
                         retries with batch size {next}",
                        rank_list(&ranks)
                    ));
                }
                drop(attempt);
                batch_size = next;
            }
            _ => {
                return match attempt {
                    Err(payload) if mine == FAILED => panic::resume_unwind(payload),
                    Ok(Err(e)) if mine == FAILED => Err(e),
                    _ => Err(Error::RankFailed(format!(
                        "find_executable_batch_size: {} failed at batch size {batch_size} \
                         with an error other than out of memory, so every rank stops: see \
                         that rank's error",
                        rank_list(&ranks_with(&codes, FAILED))
                    ))
                    .into()),
                };
            }
        }
    }
}

thread_local! {
    /// Whether this thread is inside an attempt: out-of-memory panics are caught there,
    /// and their default message is left out.
    static IN_ATTEMPT: Cell<bool> = const { Cell::new(false) };
}

/// Every rank's code, in rank order (one all-gather of a CPU scalar); this rank's alone
/// without a job of several.
fn every_rank(code: i64) -> Result<Vec<i64>> {
    match init::current().filter(|c| c.world_size() > 1) {
        None => Ok(vec![code]),
        Some(ctx) => Ok(ctx
            .process_group()
            .all_gather(&Tensor::from_slice(&[code]))?
            .iter()
            .map(|t| t.int64_value(&[0]))
            .collect()),
    }
}

fn ranks_with(codes: &[i64], code: i64) -> Vec<usize> {
    (0..codes.len()).filter(|&r| codes[r] == code).collect()
}

/// `rank 1`, or `ranks 0 and 2`.
fn rank_list(ranks: &[usize]) -> String {
    match ranks {
        [one] => format!("rank {one}"),
        _ => {
            let (last, rest) = ranks.split_last().expect("at least one rank");
            let rest: Vec<String> = rest.iter().map(|r| r.to_string()).collect();
            format!("ranks {} and {last}", rest.join(", "))
        }
    }
}

fn is_out_of_memory(text: &str) -> bool {
    OUT_OF_MEMORY.iter().any(|marker| text.contains(marker))
}

/// A panic's message, when it is text (`panic!` with a literal or a format).
fn panic_text(payload: &(dyn std::any::Any + Send)) -> Option<&str> {
    payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
}

/// libtorch's text of this rank's last out-of-memory error (empty when it was another
/// rank's).
fn out_of_memory_text<R, E: Display>(
    attempt: std::thread::Result<std::result::Result<R, E>>,
) -> String {
    match attempt {
        Ok(Err(e)) => format!("{e:#}"),
        Err(payload) => panic_text(&*payload).unwrap_or_default().to_string(),
        Ok(Ok(_)) => String::new(),
    }
}

/// Installs, once, a panic hook that leaves out the default message of out-of-memory
/// panics inside an attempt (they are caught and retried); every other panic goes to
/// the hook that was there before.
fn quiet_out_of_memory_panics() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            let caught = IN_ATTEMPT.with(Cell::get)
                && panic_text(info.payload()).is_some_and(is_out_of_memory);
            if !caught {
                previous(info);
            }
        }));
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One process: a real allocation failure of the CPU allocator at the larger
    /// sizes, an error value at the next, and the first size that fits is returned.
    #[test]
    fn halves_until_it_fits() {
        let mut tried = Vec::new();
        let got: std::result::Result<usize, Error> = find_executable_batch_size(64, |n| {
            tried.push(n);
            if n > 16 {
                // Petabytes: the CPU allocator refuses; tch's method panics with it.
                let _ = Tensor::empty([n as i64 * (1 << 46)], tch::kind::FLOAT_CPU);
                return Ok(n * 1000);
            }
            if n > 8 {
                return Err(Error::Torch(
                    "CUDA out of memory. Tried to allocate 2.00 GiB".into(),
                ));
            }
            Ok(n * 10)
        });
        assert_eq!(got.unwrap(), 80);
        assert_eq!(tried, [64, 32, 16, 8]);
    }

    #[test]
    fn other_errors_and_panics_are_not_retried() {
        let mut calls = 0;
        let got: std::result::Result<(), Error> = find_executable_batch_size(8, |_| {
            calls += 1;
            Err(Error::Usage("bad".into()))
        });
        assert_eq!(got.unwrap_err().to_string(), "bad");
        assert_eq!(calls, 1);
        let panicked = panic::catch_unwind(|| {
            let _: std::result::Result<(), Error> =
                find_executable_batch_size(8, |_| panic!("not memory"));
        });
        assert_eq!(panic_text(&*panicked.unwrap_err()), Some("not memory"));
    }

    #[test]
    fn out_of_memory_at_1_is_an_error_with_the_cause() {
        let got: std::result::Result<(), Error> = find_executable_batch_size(4, |n| {
            Err(Error::Torch(format!(
                "DefaultCPUAllocator: can't allocate memory: you tried to allocate {n}"
            )))
        });
        let e = got.unwrap_err();
        assert!(
            matches!(&e, Error::OutOfMemory { ranks, .. } if ranks == &[0]),
            "{e:?}"
        );
        let text = e.to_string();
        assert!(
            text.starts_with("out of memory at batch size 1 (on rank 0)"),
            "{text}"
        );
        assert!(text.contains("you tried to allocate 1"), "{text}");
        let zero: std::result::Result<(), Error> = find_executable_batch_size(0, |_| Ok(()));
        assert!(zero
            .unwrap_err()
            .to_string()
            .contains("starting batch size is 0"));
    }
}
