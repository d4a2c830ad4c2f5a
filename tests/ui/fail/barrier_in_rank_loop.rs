#[tch_distributed::distributed]
fn train() -> anyhow::Result<()> {
    let ctx = tch_distributed::current().unwrap();
    for _ in 0..ctx.rank() {
        ctx.barrier()?;
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    train()
}
