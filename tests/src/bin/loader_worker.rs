//! Worker for `tests/tests/loader_epochs.rs`, under `tchrun`: a `DataLoader` whose
//! samples carry their id, so that each rank can write which samples it trained on.
//!
//! - `loader_worker resume OUT CKPT N BATCH STOP_AFTER EPOCHS`: a linear model trained
//!   through DDP over samples `0..N` (batch `BATCH` per rank, seed 7), resumed from
//!   the newest checkpoint in `CKPT` when there is one (`DataLoader::resume` at the
//!   saved position, whatever world size saved it). Trains until the loader's epoch
//!   reaches `EPOCHS`; with `STOP_AFTER` > 0 it stops after that many steps in all,
//!   saving a checkpoint (`TrainState::with_loader_position`) there. Each rank writes
//!   `OUT/seen{rank}.txt`: `resumed at step S epoch E samples X world size W` after
//!   a resume, and `epoch E: [ids…]` for each epoch it trained in (partial at a stop,
//!   or after a resume).
//! - `loader_worker accum OUT N BATCH ACCUM EPOCHS`: the same data and model with
//!   `Optimizer::accumulate(ACCUM)` and one reading thread, `EPOCHS` epochs of
//!   `opt.backward_step` per batch. Each rank writes `OUT/accum{rank}.txt`: per
//!   micro-batch `epoch E stepped B ids [..]`, then `params [w, b]` (bit-exact
//!   float32 Debug) and `stats synced S local L` (DDP's backward passes).
//!
//! The data (the test rebuilds it the same way): sample `i` is `x = [i, 0.025 i]`
//! (column 0 is the id, which the model does not see) and `y = cos(3 × 0.025 i)`;
//! the model is `nn::linear(1, 1)` on column 1, starting at weight 0.3, bias -0.2.

use std::fmt::Write as _;

use tch::nn::{self, Module, VarStore};
use tch::{Device, Kind, Tensor};
use tch_distributed::{
    Checkpointer, DataLoader, DdpOptions, DistributedDataParallel, Optimizer, TensorDataset,
    TrainState,
};

fn data(n: i64) -> (Tensor, Tensor) {
    let ids = Tensor::arange(n, (Kind::Float, Device::Cpu)).view([n, 1]);
    let feature = &ids * 0.025;
    let ys = (&feature * 3.0).cos();
    (Tensor::cat(&[&ids, &feature], 1), ys)
}

fn model(vs: &VarStore) -> nn::Linear {
    let net = nn::linear(vs.root(), 1, 1, Default::default());
    tch::no_grad(|| {
        let mut ws = net.ws.shallow_clone();
        let _ = ws.fill_(0.3);
        let mut bs = net.bs.as_ref().unwrap().shallow_clone();
        let _ = bs.fill_(-0.2);
    });
    net
}

fn loss(net: &nn::Linear, x: &Tensor, y: &Tensor) -> Tensor {
    net.forward(&x.narrow(1, 1, 1))
        .mse_loss(y, tch::Reduction::Mean)
}

fn ids(x: &Tensor) -> anyhow::Result<Vec<i64>> {
    Ok(Vec::<f32>::try_from(x.narrow(1, 0, 1).reshape([-1]))?
        .into_iter()
        .map(|v| v as i64)
        .collect())
}

fn resume(
    out: &str,
    ckpt: &str,
    n: i64,
    batch: usize,
    stop_after: u64,
    epochs: u64,
) -> anyhow::Result<()> {
    let ctx = tch_distributed::init()?;
    let rank = ctx.rank();
    let (xs, ys) = data(n);
    let loader = DataLoader::new(TensorDataset::new(&xs, &ys)?, batch)?.seed(7);
    let mut vs = VarStore::new(Device::Cpu);
    let net = model(&vs);
    let ddp = DistributedDataParallel::new(&vs, ctx.process_group(), DdpOptions::default())?;
    let mut opt = Optimizer::new(&nn::Sgd::default(), &vs, 1e-3)?.distributed(ddp);
    let checkpoints = Checkpointer::new(ckpt);
    let mut log = String::new();
    let mut step = 0;
    if let Some(state) = checkpoints.load_state(&mut vs, &mut opt)? {
        step = state.step;
        loader.resume(state.loader_position());
        writeln!(
            log,
            "resumed at step {step} epoch {} samples {} world size {}",
            state.epoch, state.samples_in_epoch, state.world_size
        )?;
    }
    let path = format!("{out}/seen{rank}.txt");
    while loader.epoch() < epochs {
        let epoch = loader.epoch();
        let mut seen = Vec::new();
        for batch in &loader {
            let (x, y) = batch?;
            seen.extend(ids(&x)?);
            opt.backward_step(&loss(&net, &x, &y))?;
            step += 1;
            if stop_after == step {
                let state = TrainState {
                    step,
                    ..Default::default()
                }
                .with_loader_position(loader.position());
                checkpoints.save_state(&vs, &mut opt, &state)?;
                writeln!(log, "epoch {epoch}: {seen:?}")?;
                std::fs::write(&path, log)?;
                return Ok(());
            }
        }
        writeln!(log, "epoch {epoch}: {seen:?}")?;
    }
    std::fs::write(&path, log)?;
    Ok(())
}

fn accum(out: &str, n: i64, batch: usize, steps: usize, epochs: u64) -> anyhow::Result<()> {
    let ctx = tch_distributed::init()?;
    let rank = ctx.rank();
    let (xs, ys) = data(n);
    let loader = DataLoader::new(TensorDataset::new(&xs, &ys)?, batch)?
        .seed(7)
        .num_workers(1);
    let vs = VarStore::new(Device::Cpu);
    let net = model(&vs);
    let ddp = DistributedDataParallel::new(&vs, ctx.process_group(), DdpOptions::default())?;
    let mut opt = Optimizer::new(&nn::Sgd::default(), &vs, 0.1)?
        .distributed(ddp)
        .accumulate(steps);
    let mut log = String::new();
    for epoch in 0..epochs {
        for batch in &loader {
            let (x, y) = batch?;
            let stepped = opt.backward_step(&loss(&net, &x, &y))?;
            writeln!(log, "epoch {epoch} stepped {stepped} ids {:?}", ids(&x)?)?;
        }
    }
    let params: Vec<f32> = vs
        .trainable_variables()
        .iter()
        .flat_map(|t| Vec::<f32>::try_from(t.reshape([-1])).unwrap())
        .collect();
    let stats = opt.ddp().expect("distributed").stats();
    writeln!(log, "params {params:?}")?;
    writeln!(
        log,
        "stats synced {} local {}",
        stats.synced_backward_passes, stats.local_backward_passes
    )?;
    std::fs::write(format!("{out}/accum{rank}.txt"), log)?;
    Ok(())
}

/// The modes, as the module's docs give them.
#[derive(clap::Parser)]
enum Mode {
    Resume {
        out: String,
        ckpt: String,
        n: i64,
        batch: usize,
        stop_after: u64,
        epochs: u64,
    },
    Accum {
        out: String,
        n: i64,
        batch: usize,
        accum: usize,
        epochs: u64,
    },
}

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    match <Mode as clap::Parser>::parse() {
        Mode::Resume {
            out,
            ckpt,
            n,
            batch,
            stop_after,
            epochs,
        } => resume(&out, &ckpt, n, batch, stop_after, epochs),
        Mode::Accum {
            out,
            n,
            batch,
            accum: steps,
            epochs,
        } => accum(&out, n, batch, steps, epochs),
    }
}
