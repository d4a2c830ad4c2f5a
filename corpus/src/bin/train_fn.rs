// Training as a function of its parts: `main` builds the `VarStore`, the model and the
// optimizer and hands them to `train`, which takes `&mut nn::Optimizer` and steps it
// with `backward_step_clip_norm`. The one line added for data parallelism is the
// attribute on `train`: the optimizer was not built inside it, and its gradients must
// still be averaged over the ranks (before the clipping, as under DDP).
//
// Usage: train_fn OUT.safetensors BATCH [EPOCHS]  (64 synthetic samples, 8 features)
use anyhow::Result;
use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[tch_distributed::distributed]
fn train(
    vs: &nn::VarStore,
    net: &impl Module,
    opt: &mut nn::Optimizer,
    data: (&Tensor, &Tensor),
    batch: i64,
    epochs: i64,
    out: &str,
) -> Result<()> {
    let (xs, ys) = data;
    for epoch in 1..=epochs {
        let mut sum = 0.0;
        let mut batches = 0;
        for (bx, by) in Iter2::new(xs, ys, batch) {
            let loss = net
                .forward(&bx.to_device(vs.device()))
                .mse_loss(&by.to_device(vs.device()), tch::Reduction::Mean);
            opt.backward_step_clip_norm(&loss, 0.5);
            sum += loss.double_value(&[]);
            batches += 1;
        }
        println!(
            "epoch: {epoch:3} batches: {batches} loss: {:8.5}",
            sum / batches as f64
        );
    }
    vs.save(out)?;
    Ok(())
}

fn main() -> Result<()> {
    tch::set_num_threads(1);
    tch::manual_seed(11);
    let args: Vec<String> = std::env::args().collect();
    let out = &args[1];
    let batch: i64 = args[2].parse()?;
    let epochs: i64 = args.get(3).map_or(Ok(3), |e| e.parse())?;
    let xs = Tensor::randn([64, 8], (Kind::Float, Device::Cpu));
    let ys = (xs.narrow(1, 0, 4) * xs.narrow(1, 4, 4))
        .sum_dim_intlist(1, true, Kind::Float)
        .cos();
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let root = vs.root();
    let net = nn::seq()
        .add(nn::linear(&root / "l1", 8, 16, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&root / "l2", 16, 1, Default::default()));
    let mut opt = nn::Adam::default().build(&vs, 0.01)?;
    train(&vs, &net, &mut opt, (&xs, &ys), batch, epochs, out)
}
