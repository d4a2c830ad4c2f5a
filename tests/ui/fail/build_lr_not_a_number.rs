// A type error in a call the attribute rewrites points at the user's code: the
// learning rate is an `f64` in tch's `OptimizerConfig::build`.
use tch::nn::{self, OptimizerConfig};
use tch::Device;

#[tch_distributed::distributed]
fn train() -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let _opt = nn::Adam::default().build(&vs, "1e-3")?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    train()
}
