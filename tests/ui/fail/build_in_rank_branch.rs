use tch::nn::{self, OptimizerConfig};
use tch::Device;

#[tch_distributed::distributed]
fn train() -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let local_rank = tch_distributed::current().unwrap().local_rank();
    let _opt = match local_rank {
        0 => Some(nn::Sgd::default().build(&vs, 0.1)?),
        _ => None,
    };
    Ok(())
}

fn main() -> anyhow::Result<()> {
    train()
}
