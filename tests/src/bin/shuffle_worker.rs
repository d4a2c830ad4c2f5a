//! Worker for `tests/tests/shuffles.rs`: plain tch code under `#[distributed]` whose
//! ranks draw different amounts of random numbers between (and during) epochs, as real
//! programs do: a masking step whose size depends on the batch (as BERT-style masking
//! over a batch's real tokens), and a rank-0-only branch that samples. The sharded
//! loop's shuffle must still be the same on every rank in every epoch.
//! `shuffle_worker ROWS EPOCHS`; run with `TCH_DISTRIBUTED_RECORD`. `SEED=s` seeds
//! libtorch in `main`, before the function; `SEED_BY_RANK=s` seeds it inside the
//! function with `s + rank` (each rank its own seed: a mistake the SDK reports).

use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[tch_distributed::distributed]
fn train(rows: i64, epochs: i64) -> anyhow::Result<()> {
    let xs = Tensor::arange(rows, (Kind::Float, Device::Cpu)).view([rows, 1]);
    let ys = &xs * 0.5;
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let net = nn::linear(vs.root(), 1, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 1e-4)?;
    let rank = tch_distributed::current().map_or(0, |c| c.rank());
    if let Some(seed) = std::env::var("SEED_BY_RANK")
        .ok()
        .and_then(|s| s.parse::<i64>().ok())
    {
        tch::manual_seed(seed + rank as i64);
    }
    let main = rank == 0;
    for _ in 0..epochs {
        for (bx, by) in Iter2::new(&xs, &ys, 4).shuffle() {
            // As many random numbers as the batch says: a different count per rank.
            let tokens = 1 + bx.sum(Kind::Float).double_value(&[]) as i64 % 13;
            let masked = Tensor::rand([tokens], (Kind::Float, Device::Cpu)).lt(0.15);
            let loss = (net.forward(&bx) - &by).square().mean(Kind::Float)
                * (1.0 + masked.sum(Kind::Float).double_value(&[]));
            opt.backward_step(&loss);
        }
        if main {
            // Rank 0 alone samples something between epochs.
            let _ = Tensor::randn([17], (Kind::Float, Device::Cpu));
        }
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args: Vec<i64> = std::env::args()
        .skip(1)
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    if let Some(seed) = std::env::var("SEED").ok().and_then(|s| s.parse().ok()) {
        tch::manual_seed(seed);
    }
    train(args[0], args[1])
}
