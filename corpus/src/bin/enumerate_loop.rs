// A training loop that counts its steps the usual way, with `.enumerate()` on the
// batch iterator, and logs every other step. The one line added for data parallelism
// is the attribute on `train`: the batches must be sharded under the adaptor, so that
// each rank's epoch is its share (and `i` counts this rank's steps).
//
// Usage: enumerate_loop OUT.safetensors BATCH [EPOCHS]  (64 synthetic samples)
use anyhow::Result;
use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[tch_distributed::distributed]
fn train(xs: &Tensor, ys: &Tensor, batch: i64, epochs: i64, out: &str) -> Result<()> {
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let root = vs.root();
    let net = nn::seq()
        .add(nn::linear(&root / "l1", 8, 16, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(&root / "l2", 16, 1, Default::default()));
    let mut opt = nn::Sgd {
        momentum: 0.9,
        ..Default::default()
    }
    .build(&vs, 0.05)?;
    for epoch in 1..=epochs {
        let mut steps = 0;
        for (i, (bx, by)) in Iter2::new(xs, ys, batch).enumerate() {
            let loss = net
                .forward(&bx.to_device(vs.device()))
                .mse_loss(&by.to_device(vs.device()), tch::Reduction::Mean);
            opt.backward_step(&loss);
            if i % 2 == 0 {
                println!("  step {i} loss: {:8.5}", loss.double_value(&[]));
            }
            steps = i + 1;
        }
        println!("epoch: {epoch} done after {steps} steps");
    }
    vs.save(out)?;
    Ok(())
}

fn main() -> Result<()> {
    tch::set_num_threads(1);
    tch::manual_seed(5);
    let args: Vec<String> = std::env::args().collect();
    let batch: i64 = args[2].parse()?;
    let epochs: i64 = args.get(3).map_or(Ok(3), |e| e.parse())?;
    let xs = Tensor::randn([64, 8], (Kind::Float, Device::Cpu));
    let ys = xs.sum_dim_intlist(1, true, Kind::Float).tanh();
    train(&xs, &ys, batch, epochs, &args[1])
}
