use tch::nn::VarStore;
use tch::Device;

#[tch_distributed::distributed]
fn train() -> anyhow::Result<()> {
    let mut vs = VarStore::new(Device::Cpu);
    let ctx = tch_distributed::current().unwrap();
    if !ctx.is_main_process() {
        vs.load("model.safetensors")?;
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    train()
}
