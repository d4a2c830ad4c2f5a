//! Optimizers that the `#[distributed]` function did not build, for
//! `tests/tests/outside_optimizer.rs`: the model and its optimizer are made before the
//! function and handed to it, as a trainer written for one GPU does.
//!
//! `outside_optimizer_worker DIR MODE` trains a small MLP (2 → 8 → 1, tanh) for 4
//! steps of 16 rows (`y = x₀ − 2x₁`); each of the world's ranks takes its share of
//! each step's rows (8 on 2 ranks, all 16 alone). It writes its final parameters to
//! `DIR/params{rank}-{MODE}.safetensors`. `SEED=s` seeds libtorch before the model is
//! built (`SEED=rank`: each rank its own rank as seed, so the ranks start apart).
//!
//! - `tch`: tch's `nn::Optimizer` (SGD, momentum 0.9), the step spelled out:
//!   `zero_grad`, `loss.backward()`, `step`;
//! - `tch-steps`: the same optimizer stepped with `backward_step`, then
//!   `backward_step_clip`, then `backward_step_clip_norm` (limits it does not reach);
//! - `two`: tch's optimizer on the MLP and a second one on a second model (a linear
//!   critic, as a GAN has), each stepped with `backward_step`;
//! - `sdk`: the SDK's `Optimizer` (same SGD), accumulating 2 micro-batches of 4 rows a
//!   step (`zero_grad`, `backward`, `step`, with `?`); `DIR/ddp{rank}-sdk` gets the
//!   synchronized and local backward passes of the DDP it steps through (`none`);
//! - `partial-1`, `partial-2`: tch's optimizer with a second head that rank 0 alone
//!   adds to its loss, from step 1 or from step 2: the job must fail with an `Error:`
//!   line, not hang.
//!
//! With `--plain` the same function runs without the attribute: the reference.

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

/// One body, with and without the attribute.
macro_rules! train {
    ($(#[$attr:meta])* $name:ident) => {
        $(#[$attr])*
        fn $name(
            mode: &str,
            net: &nn::Sequential,
            head: &nn::Linear,
            tch_opt: &mut nn::Optimizer,
            sdk_opt: &mut tch_distributed::Optimizer,
            (critic, critic_opt): (&nn::Linear, &mut nn::Optimizer),
        ) -> anyhow::Result<()> {
            let (rank, world) = tch_distributed::current()
                .map_or((0, 1), |c| (c.rank(), c.world_size()));
            let share = 16 / world as i64;
            for step in 0..4i64 {
                let all = Tensor::arange(32, (Kind::Float, Device::Cpu)).view([16, 2]) / 10.0
                    + step as f64;
                let xs = all.narrow(0, rank as i64 * share, share);
                let ys = (xs.select(1, 0) - xs.select(1, 1) * 2.0).view([-1, 1]);
                let loss_of = |xs: &Tensor, ys: &Tensor| {
                    let out = net.forward(xs);
                    let from = match mode {
                        "partial-1" => 0,
                        "partial-2" => 1,
                        _ => i64::MAX,
                    };
                    let out = if rank == 0 && step >= from {
                        out + head.forward(xs)
                    } else {
                        out
                    };
                    out.mse_loss(ys, tch::Reduction::Mean)
                };
                match mode {
                    "sdk" => {
                        sdk_opt.zero_grad()?;
                        for micro in 0..2 {
                            let half = share / 2;
                            let loss =
                                loss_of(&xs.narrow(0, micro * half, half), &ys.narrow(0, micro * half, half));
                            sdk_opt.backward(&loss)?;
                        }
                        sdk_opt.step()?;
                    }
                    "two" => {
                        tch_opt.backward_step(&loss_of(&xs, &ys));
                        let critic_loss = critic.forward(&xs).mse_loss(&ys, tch::Reduction::Mean);
                        critic_opt.backward_step(&critic_loss);
                    }
                    "tch-steps" => {
                        let loss = loss_of(&xs, &ys);
                        match step {
                            0 => tch_opt.backward_step(&loss),
                            1 => tch_opt.backward_step_clip(&loss, 100.0),
                            _ => tch_opt.backward_step_clip_norm(&loss, 100.0),
                        }
                    }
                    _ => {
                        let loss = loss_of(&xs, &ys);
                        tch_opt.zero_grad();
                        loss.backward();
                        tch_opt.step();
                    }
                }
            }
            Ok(())
        }
    };
}

train!(
    #[tch_distributed::distributed]
    train
);
train!(train_plain);

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    let args: Vec<String> = std::env::args().collect();
    let (dir, mode) = (&args[1], args[2].as_str());
    let rank: i64 = std::env::var("RANK")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(0);
    match std::env::var("SEED").as_deref() {
        Ok("rank") => tch::manual_seed(rank),
        Ok(seed) => tch::manual_seed(seed.parse()?),
        Err(_) => {}
    }
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let net = nn::seq()
        .add(nn::linear(&root / "l1", 2, 8, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(&root / "l2", 8, 1, Default::default()));
    let head = nn::linear(&root / "head", 2, 1, Default::default());
    let sgd = nn::Sgd {
        momentum: 0.9,
        ..Default::default()
    };
    let mut tch_opt = sgd.build(&vs, 0.01)?;
    let mut sdk_opt = tch_distributed::Optimizer::new(&sgd, &vs, 0.01)?.accumulate(2);
    // A second model with its own optimizer, as a GAN's critic.
    let critic_vs = nn::VarStore::new(Device::Cpu);
    let critic = nn::linear(critic_vs.root() / "critic", 2, 1, Default::default());
    let mut critic_opt = sgd.build(&critic_vs, 0.01)?;
    let critic_pair = (&critic, &mut critic_opt);
    if args.get(3).map(String::as_str) == Some("--plain") {
        train_plain(mode, &net, &head, &mut tch_opt, &mut sdk_opt, critic_pair)?;
    } else {
        train(mode, &net, &head, &mut tch_opt, &mut sdk_opt, critic_pair)?;
    }
    // The DDP the SDK's optimizer steps through from its first step on (one, kept):
    // its synchronized and local backward passes.
    let ddp = sdk_opt.ddp().map_or("none".to_string(), |d| {
        let stats = d.stats();
        format!(
            "{} {}",
            stats.synced_backward_passes, stats.local_backward_passes
        )
    });
    std::fs::write(format!("{dir}/ddp{rank}-{mode}"), ddp)?;
    let mut params: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    params.extend(critic_vs.variables());
    params.sort_by(|a, b| a.0.cmp(&b.0));
    Tensor::write_safetensors(&params, format!("{dir}/params{rank}-{mode}.safetensors"))?;
    Ok(())
}
