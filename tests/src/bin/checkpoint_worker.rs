//! Worker for the checkpoint tests, run under `tchrun`:
//! `checkpoint_worker OUT CKPT STEPS sgd|adam`
//!
//! Written as single-GPU tch code with `#[distributed]`: the optimizer that
//! `.build(&vs, lr)` returns there is the SDK's, whose state `Checkpointer` saves.
//!
//! Trains a small MLP with dropout over a `DataLoader` (40 samples, batch 4, so 5
//! steps per epoch on 2 ranks), saving a checkpoint every 4 steps (`keep_last(2)`)
//! and resuming from the newest usable one at start. With `KILL_AT=s` and
//! `KILL_RANK=r`, rank r SIGKILLs itself after step s; with `HIDDEN=n` the hidden
//! layer has n units instead of 16; with `CKPT_PER_RANK=1` rank r uses `CKPT-rank{r}`;
//! with `EPOCH=e` the saved states name epoch e themselves (the program's own count);
//! with `SCHEDULE=1` an `LrScheduler` (transformers' linear schedule, 3 warmup steps
//! of `STEPS`) sets the rate of each step, and rank 0 appends `step S: lr R` to
//! `OUT/lr` for each step it trains; with `RESUMED_GRADS=1` each rank writes the
//! gradients the resume left on its variables (an accumulation cycle's, when the
//! checkpoint was saved in its middle) to `OUT/resumed-grads{rank}.safetensors`; with
//! `BRANCH=1` a second head (`extra`) adds to the loss of the first micro-batch of
//! each accumulation cycle only (a variable the cycle's last micro-batch does not
//! use: DDP needs `find_unused_parameters`). A "step" is one `backward_step`: with
//! `TCH_DISTRIBUTED_GRAD_ACCUM=k`, a micro-batch of a cycle of k. On SIGTERM/SIGINT the ranks
//! checkpoint at the end of the step and exit with 128 + the signal. Rank 0 writes
//! the last finished step to `OUT/progress`. At the end every rank writes
//! its parameters to `OUT/final{rank}.safetensors`, then takes two more steps on a
//! fixed batch without dropout and writes the parameters to
//! `OUT/probe{rank}.safetensors`: they depend on the optimizer's state (moments,
//! step counts), whose archive bytes are not comparable (libtorch keys the state by
//! tensor addresses).
//!
//! With `TCHD_TEST_DEVICE=cuda` the model trains on the rank's CUDA device (the loader
//! copies its batches there, and dropout draws from the CUDA generator, whose state the
//! checkpoints keep), and each rank writes its device to `OUT/device{rank}`; otherwise
//! everything runs on the CPU.

use tch::nn::{self, ModuleT, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_distributed::{
    Checkpointer, DataLoader, LrSchedule, LrScheduler, Preemption, TensorDataset, TrainState,
};

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    let args: Vec<String> = std::env::args().collect();
    train(&args[1], &args[2], args[3].parse::<u64>()?, &args[4])
}

// ANCHOR: train
#[tch_distributed::distributed]
fn train(out: &str, ckpt: &str, steps: u64, kind: &str) -> anyhow::Result<()> {
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
    let rank = tch_distributed::current().map_or(0, |c| c.rank());
    tch::manual_seed(0);

    let xs = Tensor::linspace(-1.0, 1.0, 40 * 6, (Kind::Float, Device::Cpu)).view([40, 6]);
    let ys = xs.sum_dim_intlist(1, true, Kind::Float).sin();
    // The GPU test suite asks for CUDA (TCHD_TEST_DEVICE=cuda); other tests use the CPU.
    let device = match tch_distributed_tests::cuda_requested() {
        true => Device::cuda_if_available(),
        false => Device::Cpu,
    };
    let loader = DataLoader::new(TensorDataset::new(&xs, &ys)?, 4)?.to_device(device);
    let mut vs = nn::VarStore::new(device);
    // HIDDEN=n: another width than the 16 that checkpoints were written with.
    let hidden = env("HIDDEN").unwrap_or(16) as i64;
    let net = nn::seq_t()
        .add(nn::linear(vs.root() / "l1", 6, hidden, Default::default()))
        .add_fn(|x| x.relu())
        .add_fn_t(|x, train| x.dropout(0.2, train))
        .add(nn::linear(vs.root() / "l2", hidden, 1, Default::default()));
    let extra = (env("BRANCH") == Some(1))
        .then(|| nn::linear(vs.root() / "extra", 6, 1, Default::default()));
    let lr = if kind == "sgd" { 0.05 } else { 0.01 };
    let mut opt = match kind {
        "sgd" => nn::Sgd {
            momentum: 0.9,
            ..Default::default()
        }
        .build(&vs, lr)?,
        _ => nn::Adam::default().build(&vs, lr)?,
    };
    // A rank-local draw, as a rank that samples on its own makes: from here on the
    // ranks' generators (the one dropout draws from) differ, so each rank must get its
    // own back when it resumes.
    let _ = Tensor::rand([1 + rank as i64], (Kind::Float, device));

    // CKPT_PER_RANK=1: each rank its own view of the checkpoints, `CKPT-rank{r}` (as
    // nodes whose shared file system has not caught up see different listings).
    let ckpt = match std::env::var_os("CKPT_PER_RANK") {
        Some(_) => format!("{ckpt}-rank{rank}"),
        None => ckpt.to_string(),
    };
    let checkpoints = Checkpointer::new(&ckpt).keep_last(2);
    let preemption = Preemption::install()?;
    let mut step = 0;
    // The loader, the model, the optimizer and the random generators continue from
    // the checkpoint: the loader at its next loop, from where it stopped.
    if let Some(state) = checkpoints.load_state(&mut vs, &mut opt)? {
        step = state.step;
        println!("resumed at step {step}, epoch {}", state.epoch);
    }
    if env("RESUMED_GRADS") == Some(1) {
        let grads: Vec<(String, Tensor)> = vs
            .variables()
            .into_iter()
            .map(|(name, var)| (name, var.grad()))
            .filter(|(_, grad)| grad.defined())
            .collect();
        Tensor::write_safetensors(&grads, format!("{out}/resumed-grads{rank}.safetensors"))?;
    }
    // Built after the load: it starts where the optimizer's restored count says.
    let mut schedule = match env("SCHEDULE") {
        Some(1) => Some(LrScheduler::new(
            &mut opt,
            LrSchedule::linear_with_warmup(3, steps),
            lr,
        )?),
        _ => None,
    };
    let mut lr_log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(format!("{out}/lr"))?;
    'training: while step < steps {
        for batch in &loader {
            let (x, y) = batch?;
            let mut loss = net.forward_t(&x, true).mse_loss(&y, tch::Reduction::Mean);
            if let (Some(extra), 0) = (&extra, opt.micro_batches_accumulated()) {
                loss = loss + extra.forward_t(&x, true).square().mean(Kind::Float);
            }
            let rate = schedule.as_ref().map(LrScheduler::lr);
            opt.backward_step(&loss);
            step += 1;
            if let Some(schedule) = &mut schedule {
                schedule.step(&mut opt)?;
            }
            if let (Some(rate), 0) = (rate, rank) {
                use std::io::Write as _;
                writeln!(lr_log, "step {step}: lr {rate:?}")?;
            }
            let state = || TrainState {
                step,
                epoch: env("EPOCH").unwrap_or(0),
                config: serde_json::json!({ "optimizer": kind }),
                ..Default::default()
            };
            if step % 4 == 0 {
                checkpoints.save_state(&vs, &mut opt, &state())?;
            }
            if let Some(signal) = preemption.requested()? {
                let path = checkpoints.save_state(&vs, &mut opt, &state())?;
                // One write, so that the ranks' lines do not interleave (stderr is
                // unbuffered and shared by the ranks; `eprintln!` writes in pieces).
                let line = format!(
                    "rank {rank}: preempted at step {step}, saved {}\n",
                    path.display()
                );
                std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes())?;
                std::process::exit(tch_distributed::preempted_exit_code(signal));
            }
            if rank == 0 {
                std::fs::write(format!("{out}/progress"), step.to_string())?;
            }
            if env("KILL_AT") == Some(step) && env("KILL_RANK") == Some(rank as u64) {
                unsafe { libc::raise(libc::SIGKILL) };
            }
            if step == steps {
                break 'training;
            }
        }
    }
    // ANCHOR_END: train
    let write = |name: &str| {
        let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        Tensor::write_safetensors(&named, format!("{out}/{name}{rank}.safetensors"))
    };
    write("final")?;
    if tch_distributed_tests::cuda_requested() {
        std::fs::write(format!("{out}/device{rank}"), format!("{device:?}"))?;
    }
    let (xs, ys) = (xs.to_device(device), ys.to_device(device));
    for _ in 0..2 {
        let loss = net
            .forward_t(&xs, false)
            .mse_loss(&ys, tch::Reduction::Mean);
        opt.backward_step(&loss);
    }
    write("probe")?;
    Ok(())
}
