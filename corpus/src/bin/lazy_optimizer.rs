// A trainer that makes its optimizer on first use: the field is an
// `Option<nn::Optimizer>`, filled by a helper function that returns a tch optimizer, and
// the training step is spelled out on `self.opt.as_mut().unwrap()` (`zero_grad`,
// `backward`, `step`). The one line added for data parallelism is the attribute on
// `fit`: the optimizer comes from a helper and sits in an `Option`, and its gradients
// must still be averaged over the ranks.
//
// Usage: lazy_optimizer OUT.safetensors BATCH [EPOCHS]  (64 synthetic samples, 8 features)
use anyhow::Result;
use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

struct Trainer {
    vs: nn::VarStore,
    net: nn::Sequential,
    opt: Option<nn::Optimizer>,
}

/// The optimizer, as a helper makes it.
fn make_optimizer(vs: &nn::VarStore) -> Result<nn::Optimizer> {
    Ok(nn::Adam::default().build(vs, 0.01)?)
}

impl Trainer {
    fn new() -> Trainer {
        let vs = nn::VarStore::new(Device::cuda_if_available());
        let root = vs.root();
        let net = nn::seq()
            .add(nn::linear(&root / "l1", 8, 16, Default::default()))
            .add_fn(|x| x.relu())
            .add(nn::linear(&root / "l2", 16, 1, Default::default()));
        Trainer { vs, net, opt: None }
    }

    #[tch_distributed::distributed]
    fn fit(&mut self, xs: &Tensor, ys: &Tensor, batch: i64, epochs: i64, out: &str) -> Result<()> {
        if self.opt.is_none() {
            self.opt = Some(make_optimizer(&self.vs)?);
        }
        let device = self.vs.device();
        for epoch in 1..=epochs {
            let mut sum = 0.0;
            let mut batches = 0;
            for (bx, by) in Iter2::new(xs, ys, batch) {
                let loss = self
                    .net
                    .forward(&bx.to_device(device))
                    .mse_loss(&by.to_device(device), tch::Reduction::Mean);
                self.opt.as_mut().unwrap().zero_grad();
                loss.backward();
                self.opt.as_mut().unwrap().step();
                sum += loss.double_value(&[]);
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

fn main() -> Result<()> {
    tch::set_num_threads(1);
    tch::manual_seed(13);
    let args: Vec<String> = std::env::args().collect();
    let out = &args[1];
    let batch: i64 = args[2].parse()?;
    let epochs: i64 = args.get(3).map_or(Ok(3), |e| e.parse())?;
    let xs = Tensor::randn([64, 8], (Kind::Float, Device::Cpu));
    let ys = (xs.narrow(1, 0, 4) * xs.narrow(1, 4, 4))
        .sum_dim_intlist(1, true, Kind::Float)
        .tanh();
    let mut trainer = Trainer::new();
    trainer.fit(&xs, &ys, batch, epochs, out)
}
