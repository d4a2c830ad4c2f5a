//! Worker of `tests/tests/zero.rs`: Adam (AMSGrad off, weight decay 1e-3) on an MLP
//! (l1: 8 → 32, tanh, l2: 32 → 4) from `DIR/init.safetensors`, every rank on the same
//! whole batch of `DIR/data.safetensors` (so that the averaged gradient is the same
//! bits at 1, 2 or 4 ranks), for STEPS steps in all, resuming from the newest
//! checkpoint in CKPT when one is given and saving one there after step SAVE_AT. Run
//! with `TCH_DISTRIBUTED_ZERO=1` to shard the optimizer's state.
//!
//! Writes the parameters to DIR/OUT and each rank's optimizer-state bytes to
//! DIR/OUT.state-bytes-RANK.
//!
//! Usage: zero_worker DIR OUT STEPS [CKPT SAVE_AT]
use tch::nn::{self, Module, OptimizerConfig};
use tch::Tensor;
use tch_distributed::{Checkpointer, TrainState};

#[tch_distributed::distributed]
fn train(dir: &str, out: &str, steps: u64, ckpt: Option<(&str, u64)>) -> anyhow::Result<()> {
    let data: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(format!("{dir}/data.safetensors"))?
            .into_iter()
            .collect();
    let mut vs = nn::VarStore::new(tch::Device::Cpu);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "l1", 8, 32, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(vs.root() / "l2", 32, 4, Default::default()));
    vs.load(format!("{dir}/init.safetensors"))?;
    let mut opt = nn::Adam {
        wd: 1e-3,
        ..Default::default()
    }
    .build(&vs, 0.01)?;
    let checkpoints = ckpt.map(|(path, _)| Checkpointer::new(path));
    let mut step = match &checkpoints {
        Some(c) => c.load_state(&mut vs, &mut opt)?.map_or(0, |s| s.step),
        None => 0,
    };
    while step < steps {
        let loss = net
            .forward(&data["x"])
            .mse_loss(&data["y"], tch::Reduction::Mean);
        opt.backward_step(&loss);
        step += 1;
        if let (Some(c), Some((_, save_at))) = (&checkpoints, ckpt) {
            if step == save_at {
                c.save_state(
                    &vs,
                    &mut opt,
                    &TrainState {
                        step,
                        ..Default::default()
                    },
                )?;
            }
        }
    }
    let rank = tch_distributed::current().map_or(0, |c| c.rank());
    std::fs::write(
        format!("{dir}/{out}.state-bytes-{rank}"),
        opt.state_bytes().to_string(),
    )?;
    vs.save(format!("{dir}/{out}"))?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    let args: Vec<String> = std::env::args().collect();
    let steps: u64 = args[3].parse()?;
    let ckpt = match (args.get(4), args.get(5)) {
        (Some(path), Some(at)) => Some((path.as_str(), at.parse()?)),
        _ => None,
    };
    train(&args[1], &args[2], steps, ckpt)
}
