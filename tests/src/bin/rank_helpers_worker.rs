//! Worker for `main_process_first` and `local_main_process_first`:
//! `rank_helpers_worker main|local OUT_DIR`. Inside the helper every rank writes
//! `OUT_DIR/rank{r}.txt` with the times (nanoseconds since the epoch) at which its
//! closure started and ended; the ranks that go first sleep 500 ms in it, so that a
//! rank that did not wait for them would start before they end.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

fn now() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (mode, out) = (args[1].as_str(), args[2].clone());
    let ctx = tch_distributed::init()?;
    let goes_first = match mode {
        "main" => ctx.is_main_process(),
        "local" => ctx.is_local_main_process(),
        other => anyhow::bail!("unknown mode {other:?}: use main or local"),
    };
    let work = || -> anyhow::Result<u64> {
        let start = now();
        if goes_first {
            std::thread::sleep(Duration::from_millis(500));
        }
        let end = now();
        std::fs::write(
            format!("{out}/rank{}.txt", ctx.rank()),
            format!("{start} {end}"),
        )?;
        Ok(ctx.rank() as u64 * 10)
    };
    let value = match mode {
        "main" => tch_distributed::main_process_first(work)??,
        _ => tch_distributed::local_main_process_first(work)??,
    };
    // The closure's value comes back on every rank.
    assert_eq!(value, ctx.rank() as u64 * 10);
    ctx.barrier()?;
    Ok(())
}
