//! Worker for `tests/tests/error_hints.rs`: plain tch code with `#[distributed]`.
//!
//! - `error_hints_worker unused`: a model with a layer that the loss never uses, 3 steps,
//!   without `find_unused_parameters`: on several ranks, c10d's Reducer fails at the
//!   second backward pass, and the error must say how to turn the option on here.
//! - `error_hints_worker unused-found`: the same with `find_unused_parameters = true`:
//!   trains, and prints the used layer's weights (each rank's batch is its own).
//! - `error_hints_worker nograd`: a loss cut from the graph (`detach`), so autograd fails
//!   inside the first synchronized backward pass: the error is autograd's, not a
//!   collective timeout.
//! - `error_hints_worker late`: a layer created after the optimizer (tch lets it join the
//!   optimizer at its first step; DDP, which wrapped the model at the optimizer's
//!   build, would not average its gradients): on several ranks, an error that says so.
//! - `error_hints_worker converted`: the model converted to f64 (`vs.double()`) after
//!   the optimizer was built, which gives its variables new gradient accumulators
//!   without DDP's hooks: on several ranks, an error that says so; alone, it trains.
//!   `converted-back`: to f16 and back to f32 (`vs.half()`, `vs.float()`), the dtype it
//!   had, with new accumulators all the same.
//! - `error_hints_worker hello`: prints `hello from rank R of W` (for launch-environment
//!   errors, which stop it before that).
//!
//! Prints `step S` after each step (rank 0 only, as `#[distributed]` does).

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

macro_rules! unused_fn {
    ($name:ident, $($option:tt)*) => {
        #[tch_distributed::distributed($($option)*)]
        fn $name() -> anyhow::Result<()> {
            tch::manual_seed(7);
            let vs = nn::VarStore::new(Device::cuda_if_available());
            let used = nn::linear(vs.root() / "used", 2, 1, Default::default());
            let _unused = nn::linear(vs.root() / "unused", 2, 1, Default::default());
            let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
            // Each rank its own batch, so that averaging the gradients shows.
            let rank = tch_distributed::current().map_or(0, |c| c.rank());
            let x = Tensor::ones([4, 2], (Kind::Float, vs.device())) * (rank + 1) as f64;
            for step in 1..=3 {
                let loss = used.forward(&x).mean(Kind::Float);
                opt.backward_step(&loss);
                println!("step {step}");
            }
            let w = Vec::<f32>::try_from(used.ws.flatten(0, -1))?;
            println!("used.weight {w:?}");
            Ok(())
        }
    };
}

unused_fn!(unused,);
unused_fn!(unused_found, find_unused_parameters = true);

#[tch_distributed::distributed]
fn nograd() -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let net = nn::linear(vs.root(), 2, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    let x = Tensor::ones([4, 2], (Kind::Float, vs.device()));
    let loss = net.forward(&x).mean(Kind::Float).detach();
    opt.backward_step(&loss);
    println!("step 1");
    Ok(())
}

#[tch_distributed::distributed]
fn late() -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let first = nn::linear(vs.root() / "first", 2, 2, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    let head = nn::linear(vs.root() / "head", 2, 1, Default::default());
    let x = Tensor::ones([4, 2], (Kind::Float, vs.device()));
    let loss = head.forward(&first.forward(&x)).mean(Kind::Float);
    opt.backward_step(&loss);
    println!("step 1");
    Ok(())
}

#[tch_distributed::distributed]
fn converted(back: bool) -> anyhow::Result<()> {
    let mut vs = nn::VarStore::new(Device::cuda_if_available());
    let net = nn::linear(vs.root() / "net", 2, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    let kind = match back {
        true => {
            vs.half();
            vs.float();
            Kind::Float
        }
        false => {
            vs.double();
            Kind::Double
        }
    };
    let x = Tensor::ones([4, 2], (kind, vs.device()));
    let loss = net.forward(&x).mean(kind);
    opt.backward_step(&loss);
    println!("step 1");
    Ok(())
}

#[tch_distributed::distributed]
fn hello() -> anyhow::Result<()> {
    let ctx = tch_distributed::current().expect("joined");
    println!("hello from rank {} of {}", ctx.rank(), ctx.world_size());
    Ok(())
}

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    match std::env::args().nth(1).as_deref() {
        Some("unused") => unused(),
        Some("unused-found") => unused_found(),
        Some("nograd") => nograd(),
        Some("late") => late(),
        Some("converted") => converted(false),
        Some("converted-back") => converted(true),
        Some("hello") => hello(),
        other => anyhow::bail!("unknown mode {other:?}"),
    }
}
