use tch::{Device, Kind, Tensor};

#[tch_distributed::distributed]
fn train() -> anyhow::Result<()> {
    let ctx = tch_distributed::current().unwrap();
    let mut t = Tensor::ones([4], (Kind::Float, Device::Cpu));
    if ctx.rank() > 0 {
        ctx.process_group().all_reduce(&mut t, tch_distributed::ReduceOp::Sum)?;
    } else {
        println!("rank 0 skips the all-reduce");
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    train()
}
