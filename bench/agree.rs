//! What agreeing costs in a sharded loop (the book's "When ranks take different
//! paths"): a small MLP's training step, on 2 ranks over Gloo, in three loops that
//! differ only in what the ranks agree on. `plain`: no exit and no count-changing
//! adaptor, so nothing is agreed (the rewrite adds nothing); `exit`: an early-stop
//! `break` on the rank's own loss (never taken), agreed after its statement; `filter`:
//! behind a `filter` (keeping every batch), whose end is agreed before each step.
//!
//!   scripts/bench.sh agree [STEPS] [ROUNDS]
//!
//! Without a launcher it starts 2 ranks itself; rank 0 prints, per loop, the median
//! over ROUNDS (default 5) of the time per step over STEPS (default 2000) steps, and
//! the difference from `plain`.

use std::time::Instant;

use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tch_distributed::distributed(nproc_per_node = 2)]
fn bench(steps: i64, rounds: usize) -> anyhow::Result<()> {
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let net = nn::seq()
        .add(nn::linear(&root / "l1", 32, 64, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&root / "l2", 64, 1, Default::default()));
    let mut opt = nn::Sgd::default().build(&vs, 1e-3)?;
    // Every rank gets `steps` batches of 16.
    let xs = Tensor::randn([2 * steps * 16, 32], (Kind::Float, Device::Cpu));
    let ys = xs.sum_dim_intlist(1, true, Kind::Float);
    let mut times: [Vec<f64>; 3] = Default::default();
    for _ in 0..rounds {
        let start = Instant::now();
        for (x, y) in Iter2::new(&xs, &ys, 16) {
            let loss = net.forward(&x).mse_loss(&y, tch::Reduction::Mean);
            opt.backward_step(&loss);
        }
        times[0].push(start.elapsed().as_secs_f64() / steps as f64);

        let start = Instant::now();
        for (x, y) in Iter2::new(&xs, &ys, 16) {
            let loss = net.forward(&x).mse_loss(&y, tch::Reduction::Mean);
            opt.backward_step(&loss);
            if loss.double_value(&[]) < 0.0 {
                break;
            }
        }
        times[1].push(start.elapsed().as_secs_f64() / steps as f64);

        let start = Instant::now();
        for (x, y) in Iter2::new(&xs, &ys, 16).filter(|(x, _)| x.numel() > 0) {
            let loss = net.forward(&x).mse_loss(&y, tch::Reduction::Mean);
            opt.backward_step(&loss);
        }
        times[2].push(start.elapsed().as_secs_f64() / steps as f64);
    }
    let [plain, exit, filter] = times.map(median);
    println!("agree: 2 ranks over Gloo, {steps} steps a rank, median of {rounds} rounds");
    println!("plain   {:8.1} µs/step", plain * 1e6);
    println!(
        "exit    {:8.1} µs/step  ({:+.1} µs: one all-reduce of one number a step)",
        exit * 1e6,
        (exit - plain) * 1e6
    );
    println!(
        "filter  {:8.1} µs/step  ({:+.1} µs: one all-reduce of one number a step)",
        filter * 1e6,
        (filter - plain) * 1e6
    );
    Ok(())
}

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    let args: Vec<String> = std::env::args().collect();
    let steps = args.get(1).map_or(Ok(2000), |s| s.parse())?;
    let rounds = args.get(2).map_or(Ok(5), |s| s.parse())?;
    bench(steps, rounds)
}
