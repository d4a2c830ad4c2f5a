//! The guide's data-parallel listing printing, beside rank 0's mean loss of each epoch,
//! the mean over every rank's batches. `mean_loss`.

use anyhow::Result;
use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

// ANCHOR: mean
/// The mean over every rank's batches of one epoch, from each rank's `sum` of its
/// batches' losses and their `count`: one all-reduce of the two (every rank must call
/// it, and gets the same number).
fn mean_over_ranks(sum: f64, count: usize) -> Result<f64> {
    let mut t = Tensor::from_slice(&[sum, count as f64]);
    if let Some(ctx) = tch_distributed::current() {
        ctx.process_group()
            .all_reduce(&mut t, tch_distributed::ReduceOp::Sum)?;
    }
    Ok(t.double_value(&[0]) / t.double_value(&[1]))
}

#[tch_distributed::distributed]
fn train(xs: &Tensor, ys: &Tensor) -> Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "l1", 16, 64, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "l2", 64, 4, Default::default()));
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
    for epoch in 1..=3 {
        let (mut loss_sum, mut batches) = (0.0, 0);
        for (bx, by) in Iter2::new(xs, ys, 32).shuffle() {
            let loss = net.forward(&bx).cross_entropy_for_logits(&by);
            opt.backward_step(&loss);
            loss_sum += loss.double_value(&[]);
            batches += 1;
        }
        // Every rank calls it; rank 0 prints.
        let every_rank = mean_over_ranks(loss_sum, batches)?;
        println!(
            "epoch {epoch}: rank 0's mean loss {:.4}, every rank's {every_rank:.4}",
            loss_sum / batches as f64
        );
    }
    Ok(())
}
// ANCHOR_END: mean

fn main() -> Result<()> {
    tch::manual_seed(0);
    let xs = Tensor::randn([512, 16], (Kind::Float, Device::Cpu));
    let ys = xs.narrow(1, 0, 4).argmax(1, false);
    train(&xs, &ys)
}
