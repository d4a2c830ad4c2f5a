use tch_distributed::Context;

fn report(ctx: &Context) -> anyhow::Result<()> {
    // A helper that runs a collective: the ranks that skip it never join.
    ctx.barrier()?;
    Ok(())
}

#[tch_distributed::distributed]
fn train() -> anyhow::Result<()> {
    let ctx = tch_distributed::current().unwrap();
    if ctx.rank() == 0 {
        report(&ctx)?;
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    train()
}
