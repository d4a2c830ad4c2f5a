// A type error in a call the attribute rewrites points at the user's code:
// `Device::Cuda` takes the GPU's index.
use tch::nn;
use tch::Device;

#[tch_distributed::distributed]
fn train() -> anyhow::Result<()> {
    let _vs = nn::VarStore::new(Device::Cuda("0"));
    Ok(())
}

fn main() -> anyhow::Result<()> {
    train()
}
