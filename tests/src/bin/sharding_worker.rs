//! Worker of `tests/tests/sharding.rs`: Adam (weight decay 1e-2) on an MLP whose
//! layers do not divide evenly by 2, 3 or 4 ranks (l1: 6 → 13, tanh, l2: 13 → 7,
//! tanh, l3: 7 → 3), 10 steps on 24 samples, each rank on its own share of them (rows
//! `[r·24/N, (r+1)·24/N)`), so that the averaged gradient is the whole batch's.
//! Run with `TCH_DISTRIBUTED_ZERO=2|3` to shard it; with `UNITS=1`, l2 and l3 are
//! units of their own (`fully_shard`) and l1 is the root's; with `CLIP=x` the steps
//! clip the gradients' global norm to x; with `CKPT=path` it resumes from the newest
//! checkpoint there, saves one after step `SAVE_AT`, and with `STOP_AT` = `SAVE_AT`
//! stops there; with `EXPORT=1` (and `CKPT`) it writes the loaded state whole, as
//! `torch.optim`'s `state_dict` (DIR/OUT.optimizer.safetensors), and the model
//! (DIR/OUT), and stops; with `INIT_OUT=1` rank 0 writes the data and the initial
//! parameters to DIR/OUT.init.safetensors.
//!
//! With `TCHD_TEST_DEVICE=cuda` it trains on the rank's CUDA device.
//!
//! Writes the parameters to DIR/OUT (rank 0), each rank's optimizer-state bytes to
//! DIR/OUT.state-bytes-RANK and the names of the variables that hold no memory after
//! the steps to DIR/OUT.freed-RANK.
//!
//! Usage: sharding_worker DIR OUT
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_distributed::{Checkpointer, TrainState};

#[tch_distributed::distributed]
fn train(dir: &str, out: &str) -> anyhow::Result<()> {
    let env = |k: &str| std::env::var(k).ok();
    let (rank, world) = tch_distributed::current().map_or((0, 1), |c| (c.rank(), c.world_size()));
    tch::manual_seed(0);
    let xs = Tensor::randn([24, 6], (Kind::Float, Device::Cpu));
    let ys = xs.narrow(1, 0, 3).sin() + xs.narrow(1, 3, 3).cos();
    let share = 24 / world as i64;
    let (x, y) = (
        xs.narrow(0, rank as i64 * share, share),
        ys.narrow(0, rank as i64 * share, share),
    );

    let mut vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let l1 = nn::linear(&root / "l1", 6, 13, Default::default());
    let l2 = nn::linear(&root / "l2", 13, 7, Default::default());
    let l3 = nn::linear(&root / "l3", 7, 3, Default::default());
    let units = env("UNITS").is_some();
    let (l2, l3) = match units {
        true => (
            tch_distributed::fully_shard(l2, &(&root / "l2")),
            tch_distributed::fully_shard(l3, &(&root / "l3")),
        ),
        // Units no sharded optimizer claims: the modules run as they are.
        false => (
            tch_distributed::fully_shard(l2, &(&root / "unclaimed" / "l2")),
            tch_distributed::fully_shard(l3, &(&root / "unclaimed" / "l3")),
        ),
    };
    // The data and the initial parameters, for PyTorch's reference.
    if rank == 0 && env("INIT_OUT").is_some() {
        let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        named.push(("x".into(), xs.shallow_clone()));
        named.push(("y".into(), ys.shallow_clone()));
        Tensor::write_safetensors(&named, format!("{dir}/{out}.init.safetensors"))?;
    }
    let mut opt = nn::Adam {
        wd: 1e-2,
        ..Default::default()
    }
    .build(&vs, 0.01)?;
    let clip: Option<f64> = env("CLIP").and_then(|c| c.parse().ok());
    let number = |k: &str| env(k).and_then(|v| v.parse::<u64>().ok());
    let checkpoints = env("CKPT").map(Checkpointer::new);
    let mut start = 0;
    if let Some(c) = &checkpoints {
        start = c.load_state(&mut vs, &mut opt)?.map_or(0, |s| s.step);
        println!("resumed at step {start}");
        if env("EXPORT").is_some() {
            std::fs::write(format!("{dir}/{out}.optimizer.safetensors"), opt.state()?)?;
            vs.save(format!("{dir}/{out}"))?;
            return Ok(());
        }
    }
    for step in start + 1..=10 {
        let loss = l3
            .forward(&l2.forward(&l1.forward(&x).tanh()).tanh())
            .mse_loss(&y, tch::Reduction::Mean);
        match clip {
            Some(max) => opt.backward_step_clip_norm(&loss, max),
            None => opt.backward_step(&loss),
        }
        if let (Some(c), Some(save_at)) = (&checkpoints, number("SAVE_AT")) {
            if step == save_at {
                c.save_state(
                    &vs,
                    &mut opt,
                    &TrainState {
                        step,
                        ..Default::default()
                    },
                )?;
                if number("STOP_AT") == Some(step) {
                    return Ok(());
                }
            }
        }
    }
    // The variables that hold no memory after the steps (a stage-3 unit's, freed).
    let mut freed: Vec<String> = vs
        .variables()
        .into_iter()
        .filter(|(_, t)| t.data_ptr().is_null())
        .map(|(name, _)| name)
        .collect();
    freed.sort();
    std::fs::write(format!("{dir}/{out}.freed-{rank}"), freed.join(" "))?;
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
    train(&args[1], &args[2])
}
