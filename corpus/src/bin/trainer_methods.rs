// A trainer split across methods, as larger programs are written: `fit(&mut self)` runs
// the epochs and calls `self.train_step(&x, &y)`, which computes the loss and steps
// `self.opt` with `backward_step`; `new()` builds the model and the optimizer. The one
// line added for data parallelism is the attribute on the `impl` block, which adapts
// every method: the step in `train_step` must be averaged over the ranks.
//
// Usage: trainer_methods OUT.safetensors BATCH [EPOCHS]  (64 synthetic samples, 8 features)
use anyhow::Result;
use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

struct Trainer {
    vs: nn::VarStore,
    net: nn::Sequential,
    opt: nn::Optimizer,
}

// ANCHOR: impl
#[tch_distributed::distributed]
impl Trainer {
    fn new() -> Result<Trainer> {
        let vs = nn::VarStore::new(Device::cuda_if_available());
        let root = vs.root();
        let net = nn::seq()
            .add(nn::linear(&root / "l1", 8, 16, Default::default()))
            .add_fn(|x| x.tanh())
            .add(nn::linear(&root / "l2", 16, 1, Default::default()));
        let opt = nn::Sgd {
            momentum: 0.9,
            ..Default::default()
        }
        .build(&vs, 0.05)?;
        Ok(Trainer { vs, net, opt })
    }

    fn train_step(&mut self, x: &Tensor, y: &Tensor) -> f64 {
        let device = self.vs.device();
        let loss = self
            .net
            .forward(&x.to_device(device))
            .mse_loss(&y.to_device(device), tch::Reduction::Mean);
        self.opt.backward_step(&loss);
        loss.double_value(&[])
    }

    fn fit(&mut self, xs: &Tensor, ys: &Tensor, batch: i64, epochs: i64, out: &str) -> Result<()> {
        for epoch in 1..=epochs {
            let mut sum = 0.0;
            let mut batches = 0;
            for (bx, by) in Iter2::new(xs, ys, batch) {
                sum += self.train_step(&bx, &by);
                batches += 1;
            }
            println!(
                "epoch: {epoch:3} batches: {batches} loss: {:8.5}",
                sum / batches as f64
            );
        }
        self.vs.save(out)?;
        Ok(())
    }
}
// ANCHOR_END: impl

fn main() -> Result<()> {
    tch::set_num_threads(1);
    tch::manual_seed(7);
    let args: Vec<String> = std::env::args().collect();
    let out = &args[1];
    let batch: i64 = args[2].parse()?;
    let epochs: i64 = args.get(3).map_or(Ok(3), |e| e.parse())?;
    let xs = Tensor::randn([64, 8], (Kind::Float, Device::Cpu));
    let ys = (xs.narrow(1, 0, 4) * xs.narrow(1, 4, 4))
        .sum_dim_intlist(1, true, Kind::Float)
        .sin();
    let mut trainer = Trainer::new()?;
    trainer.fit(&xs, &ys, batch, epochs, out)
}
