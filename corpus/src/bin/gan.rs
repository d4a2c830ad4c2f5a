// Placeholder: to be replaced by the real program.
#[tch_distributed::distributed]
fn train() -> anyhow::Result<()> {
    Ok(())
}

fn main() -> anyhow::Result<()> {
    train()
}
