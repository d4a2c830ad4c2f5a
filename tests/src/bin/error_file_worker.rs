//! Worker for the error-file tests: `error_file_worker MODE`, where rank 1 fails
//! right after joining and rank 0 waits at the exit barrier:
//!
//! - `err`: rank 1's `#[distributed]` function returns an `anyhow` error through
//!   `bail!` (an early return the attribute cannot see; `main` prints it);
//! - `return`: it returns one with `return Err(…)`;
//! - `opaque`: it returns an error whose type is not `Debug` (reported without a
//!   message; `main` exits with 1);
//! - `panic`: it panics.
//!
//! Under a launcher that sets `TORCHELASTIC_ERROR_FILE`, rank 1 writes why there.

/// An error type that cannot be printed.
struct Opaque;

#[tch_distributed::distributed]
fn train(mode: &str) -> anyhow::Result<()> {
    let rank = tch_distributed::current().map_or(0, |c| c.rank());
    if rank == 1 {
        match mode {
            "panic" => panic!("rank 1 panics on purpose"),
            "return" => return Err(anyhow::anyhow!("rank 1 returns an error on purpose")),
            _ => anyhow::bail!("rank 1 fails on purpose"),
        }
    }
    Ok(())
}

#[tch_distributed::distributed]
fn train_opaque() -> Result<(), Opaque> {
    let rank = tch_distributed::current().map_or(0, |c| c.rank());
    if rank == 1 {
        return Err(Opaque);
    }
    // Named: an error type that is not `Debug` must be known at the function's end.
    Ok::<(), Opaque>(())
}

fn main() -> anyhow::Result<()> {
    let mode = std::env::args().nth(1).unwrap_or_default();
    if mode == "opaque" {
        if train_opaque().is_err() {
            std::process::exit(1);
        }
        return Ok(());
    }
    train(&mode)
}
