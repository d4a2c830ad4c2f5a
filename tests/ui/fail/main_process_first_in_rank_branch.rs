#[tch_distributed::distributed]
fn train() -> anyhow::Result<()> {
    let ctx = tch_distributed::current().unwrap();
    if ctx.is_main_process() {
        tch_distributed::main_process_first(|| println!("once"))?;
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    train()
}
