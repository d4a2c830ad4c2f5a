// What a rank-dependent branch may hold: anything that does not wait for the other
// ranks. Evaluation loops (they train nothing, so they are not sharded), an LR
// scheduler's `step`, a `break` of a loop that runs inside the branch, a `continue`
// with no collective after it, a `return` after the last collective.
use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

struct Schedule {
    steps: usize,
}

impl Schedule {
    fn step(&mut self) {
        self.steps += 1;
    }
}

// ANCHOR: train
#[tch_distributed::distributed]
fn train() -> anyhow::Result<usize> {
    let xs = Tensor::rand([16, 2], (Kind::Float, Device::Cpu));
    let ys = xs.sum_dim_intlist(1, true, Kind::Float);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root(), 2, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    let mut schedule = Schedule { steps: 0 };
    let is_main = tch_distributed::current().unwrap().is_main_process();
    let mut logged = 0;
    for (step, (x, y)) in Iter2::new(&xs, &ys, 4).enumerate() {
        let loss = net.forward(&x).mse_loss(&y, tch::Reduction::Mean);
        opt.backward_step(&loss);
        schedule.step();
        if !is_main || step % 2 == 1 {
            continue;
        }
        logged += 1;
    }
    if is_main {
        let mut sum = 0.0;
        for (x, _) in Iter2::new(&xs, &ys, 4) {
            sum += net.forward(&x).sum(Kind::Float).double_value(&[]);
        }
        for i in 0.. {
            if i == 3 {
                break;
            }
        }
        println!("evaluation sum {sum:.3}, {} steps", schedule.steps);
        return Ok(logged);
    }
    Ok(logged)
}
// ANCHOR_END: train

fn main() -> anyhow::Result<()> {
    assert_eq!(train()?, 2);
    Ok(())
}
