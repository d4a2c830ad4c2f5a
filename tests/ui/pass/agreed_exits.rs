// Exits of a sharded loop that the ranks agree on, in the shapes programs write them:
// a `break` in a `let`'s `match`, a labeled `continue` and `break` of the loop, a
// `break` in a loop nested in it (the nested loop's own), and a `return` whose value
// every rank has.
use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[tch_distributed::distributed]
fn train() -> anyhow::Result<()> {
    let xs = Tensor::rand([64, 2], (Kind::Float, Device::Cpu));
    let ys = xs.sum_dim_intlist(1, true, Kind::Float);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root(), 2, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    let limits = [Some(1.0), None];
    'batches: for (step, (x, y)) in Iter2::new(&xs, &ys, 8).enumerate() {
        let limit = match limits[step % 2] {
            Some(l) => l,
            None => continue 'batches,
        };
        let loss = net.forward(&x).mse_loss(&y, tch::Reduction::Mean);
        opt.backward_step(&loss);
        for _ in 0..3 {
            break;
        }
        if loss.double_value(&[]) > limit * 100.0 {
            return Ok(());
        }
        if let Some(2) = Some(step) {
            break 'batches;
        }
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    train()
}
