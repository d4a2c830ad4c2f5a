// Logging through a helper: after each epoch the program prints the epoch's loss
// averaged over the ranks, `global_mean(&loss)?`, called inside `println!`'s
// arguments. The helper all-reduces when the program runs on several ranks (alone it
// returns the value as it is). The one line added for data parallelism is the
// attribute on `train`: rank 0 alone must print, yet every rank must run the helper's
// all-reduce, or the job hangs.
//
// Usage: logging_helper OUT.safetensors BATCH [EPOCHS]  (64 synthetic samples)
use anyhow::Result;
use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

/// `value` averaged over the ranks of the job, if there is one.
fn global_mean(value: &Tensor) -> Result<f64> {
    let mut v = value
        .detach()
        .to_device(Device::Cpu)
        .to_kind(Kind::Double)
        .view([1]);
    if let Some(ctx) = tch_distributed::current() {
        ctx.process_group()
            .all_reduce(&mut v, tch_distributed::ReduceOp::Avg)?;
    }
    Ok(v.double_value(&[0]))
}

#[tch_distributed::distributed]
fn train(xs: &Tensor, ys: &Tensor, batch: i64, epochs: i64, out: &str) -> Result<()> {
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let root = vs.root();
    let net = nn::seq()
        .add(nn::linear(&root / "l1", 8, 16, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(&root / "l2", 16, 1, Default::default()));
    let mut opt = nn::Adam::default().build(&vs, 0.01)?;
    for epoch in 1..=epochs {
        let mut losses = Vec::new();
        for (bx, by) in Iter2::new(xs, ys, batch) {
            let loss = net
                .forward(&bx.to_device(vs.device()))
                .mse_loss(&by.to_device(vs.device()), tch::Reduction::Mean);
            opt.backward_step(&loss);
            losses.push(loss.detach());
        }
        let epoch_loss = Tensor::stack(&losses, 0).mean(Kind::Float);
        println!("epoch: {epoch} loss: {:.6}", global_mean(&epoch_loss)?);
    }
    vs.save(out)?;
    Ok(())
}

fn main() -> Result<()> {
    tch::set_num_threads(1);
    tch::manual_seed(3);
    let args: Vec<String> = std::env::args().collect();
    let batch: i64 = args[2].parse()?;
    let epochs: i64 = args.get(3).map_or(Ok(3), |e| e.parse())?;
    let xs = Tensor::randn([64, 8], (Kind::Float, Device::Cpu));
    let ys = (xs.narrow(1, 0, 2).sum_dim_intlist(1, true, Kind::Float) * 0.5).sin();
    train(&xs, &ys, batch, epochs, &args[1])
}
