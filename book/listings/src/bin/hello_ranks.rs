//! Checks that a launch works: every rank says who it is, and one all-reduce proves
//! that the ranks reach each other. Run it with any launcher, or alone.

// ANCHOR: all
use std::io::Write;
use tch::Tensor;
use tch_distributed::ReduceOp;

fn main() -> anyhow::Result<()> {
    let ctx = tch_distributed::init()?;
    if ctx.is_main_process() {
        println!("{}", ctx.banner());
    }
    // One write per line, so that the ranks' lines do not interleave.
    let line = format!(
        "rank {} of {}: local rank {}, device {:?}\n",
        ctx.rank(),
        ctx.world_size(),
        ctx.local_rank(),
        ctx.device()
    );
    std::io::stdout().write_all(line.as_bytes())?;
    // Every rank contributes rank + 1: the sum is 1 + 2 + … + world size.
    let mut x = Tensor::from_slice(&[ctx.rank() as f32 + 1.0]).to_device(ctx.device());
    ctx.process_group().all_reduce(&mut x, ReduceOp::Sum)?;
    ctx.barrier()?;
    if ctx.is_main_process() {
        println!("all_reduce: {} (expected {})", x.double_value(&[0]), {
            let n = ctx.world_size();
            n * (n + 1) / 2
        });
    }
    Ok(())
}
// ANCHOR_END: all
