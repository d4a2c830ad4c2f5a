use tch::nn::VarStore;
use tch::Device;

#[tch_distributed::distributed]
fn train() -> anyhow::Result<()> {
    let vs = VarStore::new(Device::Cpu);
    let rank = tch_distributed::current().unwrap().rank();
    if rank == 0 {
        vs.save("model.safetensors")?;
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    train()
}
