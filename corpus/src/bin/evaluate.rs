// Train, then evaluate by hand: after training on 64 samples, a second loop
// over the 64 held-out samples sums the squared errors and counts the samples, and
// prints their mean. The one line added for data parallelism is the attribute on
// `train`: the training loop is sharded, and the evaluation loop, which trains
// nothing, must still see the whole held-out set, so that rank 0 prints one process's
// number.
//
// Usage: evaluate OUT.safetensors BATCH [EPOCHS]  (64 synthetic training samples, 64 held out)
use anyhow::Result;
use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[tch_distributed::distributed]
fn train(xs: &Tensor, ys: &Tensor, batch: i64, epochs: i64, out: &str) -> Result<()> {
    let (train_x, test_x) = (xs.narrow(0, 0, 64), xs.narrow(0, 64, 64));
    let (train_y, test_y) = (ys.narrow(0, 0, 64), ys.narrow(0, 64, 64));
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let root = vs.root();
    let net = nn::seq()
        .add(nn::linear(&root / "l1", 8, 16, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(&root / "l2", 16, 1, Default::default()));
    let mut opt = nn::Adam::default().build(&vs, 0.01)?;
    for epoch in 1..=epochs {
        for (bx, by) in Iter2::new(&train_x, &train_y, batch) {
            let loss = net
                .forward(&bx.to_device(vs.device()))
                .mse_loss(&by.to_device(vs.device()), tch::Reduction::Mean);
            opt.backward_step(&loss);
        }
        let mut sum = 0.0;
        let mut count = 0;
        for (bx, by) in Iter2::new(&test_x, &test_y, 10).return_smaller_last_batch() {
            let err = tch::no_grad(|| net.forward(&bx.to_device(vs.device())))
                .to_device(Device::Cpu)
                - by;
            sum += err.square().sum(Kind::Double).double_value(&[]);
            count += bx.size()[0];
        }
        println!(
            "epoch: {epoch} test mse: {:.6} over {count} samples",
            sum / count as f64
        );
    }
    vs.save(out)?;
    Ok(())
}

fn main() -> Result<()> {
    tch::set_num_threads(1);
    tch::manual_seed(9);
    let args: Vec<String> = std::env::args().collect();
    let batch: i64 = args[2].parse()?;
    let epochs: i64 = args.get(3).map_or(Ok(3), |e| e.parse())?;
    let xs = Tensor::randn([64, 8], (Kind::Float, Device::Cpu));
    let held_out = Tensor::randn([64, 8], (Kind::Float, Device::Cpu));
    let xs = Tensor::cat(&[xs, held_out], 0);
    let ys = xs
        .narrow(1, 0, 3)
        .sum_dim_intlist(1, true, Kind::Float)
        .tanh();
    train(&xs, &ys, batch, epochs, &args[1])
}
