//! Worker of `tests/tests/sharding.rs`: Adam (weight decay 1e-2) on an MLP whose
//! layers do not divide evenly by 2, 3 or 4 ranks (l1: 6 → 13, tanh, l2: 13 → 7,
//! tanh, l3: 7 → 3), 10 steps on 24 samples, each rank on its own share of them (rows
//! `[r·24/N, (r+1)·24/N)`), so that the averaged gradient is the whole batch's.
//! Run with `TCH_DISTRIBUTED_ZERO=2|3` to shard it; with `UNITS=1`, l2 and l3 are units
//! of their own (`fully_shard`) and l1 is the root's (l2 runs through the unit's
//! `forward_t`, a `ModuleT`'s pass, the others through `Module::forward`); with
//! `CLIP=x` the steps clip the gradients' global norm to x; with `ADAMW=1` the optimizer
//! is AdamW (the same weight decay, decoupled); with `WARMUP_LR=W` an `LrScheduler`
//! moves the rate along DeepSpeed's `WarmupLR` (log warmup over W steps); with `CKPT=path` it resumes
//! from the newest checkpoint there, saves one after step `SAVE_AT`, and with `STOP_AT`
//! = `SAVE_AT` stops there; with `EXPORT=1` (and `CKPT`) it writes the loaded state
//! whole, as `torch.optim`'s `state_dict` (DIR/OUT.optimizer.safetensors), and the
//! model (DIR/OUT), and stops; with `INIT_OUT=1` rank 0 writes the data and the initial
//! parameters to DIR/OUT.init.safetensors; with `UNUSED=1`, variables that get no
//! gradient on some steps or ranks join: l4 (13 → 7, a unit with `UNITS`) adds to l2's
//! output on odd steps only (with `UNUSED=rank0`, on rank 0 only), `l3.skip` (3, in
//! l3's unit) on rank 0 only, and `never` (5) is never used (run DDP with
//! `TCH_DISTRIBUTED_FIND_UNUSED_PARAMETERS=true` for the reference); with
//! `CHECKPOINT=1`, l3 is an activation-checkpointed block (`checkpointed`), recomputed
//! in the backward pass; with `GAIN=1`, l3's output is multiplied by a scalar
//! (`l3.gain`, shape `[]`, in l3's unit), as CLIP's `logit_scale`.
//!
//! With `TCHD_TEST_DEVICE=cuda` it trains on the rank's CUDA device, and writes it to
//! DIR/OUT.device-RANK.
//!
//! With `EVAL_FIRST=1` each rank writes its loss on its rows before the optimizer is
//! built (under `no_grad`) to DIR/OUT.initial-loss-RANK.
//!
//! Writes the parameters to DIR/OUT (rank 0), each rank's optimizer-state bytes to
//! DIR/OUT.state-bytes-RANK, its sharded collectives (`Optimizer::sharding_stats`:
//! all-gathers, prefetched ones, reduce-scatters, all-gathered bytes, reduce-scatters
//! at the step; zeros without sharding) to DIR/OUT.stats-RANK and the names of the
//! variables that hold no memory after the steps to DIR/OUT.freed-RANK.
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
    // The rank's GPU under the GPU suite (TCHD_TEST_DEVICE=cuda), else the CPU.
    let device = tch_distributed_tests::test_device(Device::cuda_if_available());
    let (x, y) = (
        xs.narrow(0, rank as i64 * share, share).to_device(device),
        ys.narrow(0, rank as i64 * share, share).to_device(device),
    );

    let mut vs = nn::VarStore::new(device);
    let root = vs.root();
    let l1 = nn::linear(&root / "l1", 6, 13, Default::default());
    let l2 = nn::linear(&root / "l2", 13, 7, Default::default());
    let unused = env("UNUSED").is_some();
    let l3 = Head {
        linear: nn::linear(&root / "l3", 7, 3, Default::default()),
        skip: unused
            .then(|| (&root / "l3").randn("skip", &[3], 0.0, 1.0))
            .filter(|_| rank == 0),
        gain: env("GAIN").map(|_| (&root / "l3").ones("gain", &[])),
    };
    let units = env("UNITS").is_some();
    let (l2, l3) = (unit(l2, &root, "l2", units), unit(l3, &root, "l3", units));
    let l3: Box<dyn Module> = match env("CHECKPOINT") {
        Some(_) => Box::new(tch_distributed::checkpointed(l3)),
        None => Box::new(l3),
    };
    let l4 = unused.then(|| {
        let l4 = nn::linear(&root / "l4", 13, 7, Default::default());
        let _never = root.randn("never", &[5], 0.0, 1.0);
        unit(l4, &root, "l4", units)
    });
    // The data and the initial parameters, for PyTorch's reference.
    // (A stage-3 unit is sharded already: its variables are read whole inside
    // `summon_full_params`, on every rank.)
    if env("INIT_OUT").is_some() {
        tch_distributed::summon_full_params(false, || -> anyhow::Result<()> {
            if rank == 0 {
                let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
                named.push(("x".into(), xs.shallow_clone()));
                named.push(("y".into(), ys.shallow_clone()));
                Tensor::write_safetensors(&named, format!("{dir}/{out}.init.safetensors"))?;
            }
            Ok(())
        })??;
    }
    // An evaluation before the optimizer exists: at stage 3 the units are sharded
    // already (gathered around their passes on their own), the loss DDP's.
    if env("EVAL_FIRST").is_some() {
        let initial = tch::no_grad(|| {
            let second = l2.forward_t(&l1.forward(&x).tanh(), false);
            l3.forward(&second.tanh())
                .mse_loss(&y, tch::Reduction::Mean)
        });
        std::fs::write(
            format!("{dir}/{out}.initial-loss-{rank}"),
            initial.double_value(&[]).to_string(),
        )?;
    }
    let mut opt = match env("ADAMW").is_some() {
        true => nn::AdamW {
            wd: 1e-2,
            ..Default::default()
        }
        .build(&vs, 0.01)?,
        false => nn::Adam {
            wd: 1e-2,
            ..Default::default()
        }
        .build(&vs, 0.01)?,
    };
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
    // DeepSpeed's WarmupLR (log warmup over WARMUP_LR steps) by the program itself.
    let mut schedule = match number("WARMUP_LR") {
        Some(w) => Some(tch_distributed::LrScheduler::new(
            &mut opt,
            tch_distributed::LrSchedule::warmup_lr(w, tch_distributed::WarmupType::Log),
            0.01,
        )?),
        None => None,
    };
    for step in start + 1..=10 {
        let first = l1.forward(&x).tanh();
        let mut second = l2.forward_t(&first, true);
        let l4_here = rank == 0 || env("UNUSED").as_deref() != Some("rank0");
        if let (Some(l4), 1, true) = (&l4, step % 2, l4_here) {
            second += l4.forward(&first);
        }
        let loss = l3
            .forward(&second.tanh())
            .mse_loss(&y, tch::Reduction::Mean);
        match clip {
            Some(max) => opt.backward_step_clip_norm(&loss, max),
            None => opt.backward_step(&loss),
        }
        if let Some(schedule) = &mut schedule {
            schedule.step(&mut opt)?;
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
    // The variables that hold no memory after the steps (a stage-3 unit's, freed):
    // reading one is an error that says so, never a crash.
    let mut freed: Vec<String> = vs
        .variables()
        .into_iter()
        .filter(|(name, t)| match t.f_sum(Kind::Double) {
            Ok(_) => false,
            Err(e) => {
                let e = e.to_string();
                assert!(e.contains(&format!("variable `{name}` is sharded")), "{e}");
                true
            }
        })
        .map(|(name, _)| name)
        .collect();
    freed.sort();
    std::fs::write(format!("{dir}/{out}.freed-{rank}"), freed.join(" "))?;
    let stats = opt.sharding_stats().unwrap_or_default();
    std::fs::write(
        format!("{dir}/{out}.stats-{rank}"),
        format!(
            "{} {} {} {} {}",
            stats.all_gathers,
            stats.prefetched_all_gathers,
            stats.reduce_scatters,
            stats.all_gather_bytes,
            stats.reduce_scatters_at_step
        ),
    )?;
    if tch_distributed_tests::cuda_requested() {
        std::fs::write(format!("{dir}/{out}.device-{rank}"), format!("{device:?}"))?;
    }
    std::fs::write(
        format!("{dir}/{out}.state-bytes-{rank}"),
        opt.state_bytes().to_string(),
    )?;
    vs.save(format!("{dir}/{out}"))?;
    Ok(())
}

/// l3, and the variable `l3.skip` added to its output where it is `Some`.
#[derive(Debug)]
struct Head {
    linear: nn::Linear,
    skip: Option<Tensor>,
    gain: Option<Tensor>,
}

impl Module for Head {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let out = self.linear.forward(xs);
        let out = match &self.skip {
            Some(skip) => out + skip,
            None => out,
        };
        match &self.gain {
            Some(gain) => out * gain,
            None => out,
        }
    }
}

/// `module` (the variables under `root / name`) as a unit with `units`, else as a
/// unit no sharded optimizer claims, which runs the module as it is.
fn unit<M>(module: M, root: &nn::Path, name: &str, units: bool) -> tch_distributed::FullyShard<M> {
    match units {
        true => tch_distributed::fully_shard(module, &(root / name)),
        false => tch_distributed::fully_shard(module, &(root / "unclaimed" / name)),
    }
}

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    let args: Vec<String> = std::env::args().collect();
    train(&args[1], &args[2])
}
