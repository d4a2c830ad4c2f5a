use tch::nn::{self, OptimizerConfig};
use tch::Device;
use tch_distributed::{Checkpointer, TrainState};

#[tch_distributed::distributed]
fn train() -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let _net = nn::linear(vs.root(), 3, 1, Default::default());
    let mut opt = nn::Adam::default().build(&vs, 1e-3)?;
    let rank = tch_distributed::current().map_or(0, |c| c.rank());
    if rank == 0 {
        Checkpointer::new("ckpt").save_state(&vs, &mut opt, &TrainState::default())?;
    }
    Ok(())
}

fn main() {}
