//! Worker for the unaveraged-loop warning: a trainer struct whose `#[distributed] fn
//! fit(&mut self)` trains in a sharded loop. `helper_step_worker helper` steps
//! `self.opt` in a method that `fit` calls (`self.train_step(…)`), where the attribute
//! cannot see it, so the ranks train apart; `helper_step_worker direct` steps it in
//! `fit` itself. Two epochs of 8 batches over 64 synthetic samples; prints each rank's
//! parameter sum as `rank R sum S`, then the reference as `reference sum S`: one plain
//! process (tch's own optimizer, outside the attribute) on the global batches, which
//! are the ranks' batches of each step together (the loop deals batches round-robin:
//! on 2 ranks, step k is rows 16k..16k+16).

use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

struct Trainer {
    vs: nn::VarStore,
    net: nn::Linear,
    opt: nn::Optimizer,
}

impl Trainer {
    /// The sum of every parameter, in float64.
    fn parameter_sum(&self) -> f64 {
        self.vs
            .trainable_variables()
            .iter()
            .map(|t| t.sum(Kind::Double).double_value(&[]))
            .sum()
    }

    fn train_step(&mut self, x: &Tensor, y: &Tensor) {
        let loss = self.net.forward(x).mse_loss(y, tch::Reduction::Mean);
        self.opt.backward_step(&loss);
    }

    #[tch_distributed::distributed]
    fn fit(&mut self, xs: &Tensor, ys: &Tensor, helper: bool) -> anyhow::Result<()> {
        for _epoch in 0..2 {
            for (x, y) in Iter2::new(xs, ys, 8) {
                if helper {
                    self.train_step(&x, &y);
                } else {
                    let loss = self.net.forward(&x).mse_loss(&y, tch::Reduction::Mean);
                    self.opt.backward_step(&loss);
                }
            }
        }
        let rank = tch_distributed::current().map_or(0, |c| c.rank());
        let sum = self.parameter_sum();
        // Every rank says it (`eprintln!` would be rank 0's alone).
        let line = format!("rank {rank} sum {sum:.9}\n");
        std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes())?;
        Ok(())
    }
}

/// The data and an untrained trainer, the same on every rank and in the reference.
fn setup() -> anyhow::Result<(Tensor, Tensor, Trainer)> {
    tch::manual_seed(3);
    let xs = Tensor::randn([64, 4], (Kind::Float, Device::Cpu));
    let ys = xs.sum_dim_intlist(1, true, Kind::Float);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root(), 4, 1, Default::default());
    let opt = nn::Sgd::default().build(&vs, 0.05)?;
    Ok((xs, ys, Trainer { vs, net, opt }))
}

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    let helper = std::env::args().nth(1).as_deref() == Some("helper");
    let (xs, ys, mut trainer) = setup()?;
    trainer.fit(&xs, &ys, helper)?;

    let world = tch_distributed::current().map_or(1, |c| c.world_size()) as i64;
    let (xs, ys, mut reference) = setup()?;
    for _epoch in 0..2 {
        for (x, y) in Iter2::new(&xs, &ys, 8 * world) {
            reference.train_step(&x, &y);
        }
    }
    // One write, as the ranks' lines: `eprintln!` writes its pieces one by one, and
    // another rank's line landed between them (a flaky parse of this line).
    let line = format!("reference sum {:.9}\n", reference.parameter_sum());
    std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes())?;
    Ok(())
}
