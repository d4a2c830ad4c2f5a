// A type error in a call the attribute rewrites points at the user's code: a
// VarStore's `save` takes a path.
use tch::nn;
use tch::Device;

#[tch_distributed::distributed]
fn train() -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    vs.save(42)?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    train()
}
