//! Worker for the tests of the ranks' standard output (`tests/tests/launch.rs`): plain
//! tch code with `#[distributed]` on its training function, which calls helpers that
//! the attribute does not see, so their `println!` and `eprintln!` run on every rank.
//!
//! `helper_print_worker EPOCHS` trains a linear model for `EPOCHS` epochs (the
//! gradients averaged, so every rank has the same model) and, per epoch:
//! - `evaluate` (a helper) prints `eval loss L epoch E` on every rank, in two pieces
//!   (`eval loss `, then the rest), each flushed: a launcher that copies whole lines
//!   shows one line;
//! - the function itself prints `epoch E done`, on rank 0 alone (the attribute's);
//!
//! and at the end `note` (a helper) writes `stderr from rank R` to stderr on every rank.

use std::io::Write;

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

/// The mean squared error of `net` on `(xs, ys)`, printed on every rank that calls it.
fn evaluate(net: &nn::Linear, xs: &Tensor, ys: &Tensor, epoch: usize) -> std::io::Result<()> {
    let loss = tch::no_grad(|| net.forward(xs).mse_loss(ys, tch::Reduction::Mean));
    let mut stdout = std::io::stdout();
    print!("eval loss ");
    stdout.flush()?;
    println!("{:.6} epoch {epoch}", loss.double_value(&[]));
    stdout.flush()
}

/// Says on stderr which rank this is, on every rank that calls it (in one write, so that
/// the ranks' lines do not mix).
fn note() -> std::io::Result<()> {
    let rank = tch_distributed::current().map_or(0, |c| c.rank());
    std::io::stderr().write_all(format!("stderr from rank {rank}\n").as_bytes())
}

#[tch_distributed::distributed]
fn train(epochs: usize) -> anyhow::Result<()> {
    tch::manual_seed(3);
    let xs = Tensor::arange(16, (Kind::Float, Device::Cpu)).view([16, 1]) / 16.0;
    let ys = &xs * 2.0 + 1.0;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root(), 1, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    for epoch in 0..epochs {
        let loss = net.forward(&xs).mse_loss(&ys, tch::Reduction::Mean);
        opt.backward_step(&loss);
        evaluate(&net, &xs, &ys, epoch)?;
        println!("epoch {epoch} done");
    }
    note()?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    let epochs = std::env::args()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("usage: helper_print_worker EPOCHS"))?
        .parse()?;
    train(epochs)
}
