//! Worker for the tests of stalled ranks: plain single-GPU tch code plus the attribute.
//! `stall_worker OUT_DIR` trains a small linear model on random batches, step after
//! step (a plain `for` over a range: the steps run DDP's gradient all-reduce and no
//! other collective), for up to 100 000 steps. Each rank writes its pid to
//! `OUT_DIR/pid{rank}` after its 5th step, so that a test can stop it (`SIGSTOP`)
//! mid-training. With `STOP_RANK=r`, rank `r` stops itself (`SIGSTOP`) right after
//! its 5th step instead, so that the others time out in the 6th step's all-reduce.

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[tch_distributed::distributed]
fn train(out: &str) -> anyhow::Result<()> {
    let device = Device::cuda_if_available();
    let vs = nn::VarStore::new(device);
    let net = nn::linear(vs.root(), 16, 16, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 1e-3)?;
    let rank = tch_distributed::current().map(|c| c.rank()).unwrap_or(0);
    let stop = std::env::var("STOP_RANK")
        .ok()
        .and_then(|r| r.parse::<usize>().ok());
    for step in 1..=100_000 {
        let xs = Tensor::randn([8, 16], (Kind::Float, device));
        let loss = net.forward(&xs).square().mean(None);
        opt.backward_step(&loss);
        if step == 5 {
            std::fs::write(format!("{out}/pid{rank}"), std::process::id().to_string())?;
            if stop == Some(rank) {
                unsafe { libc::raise(libc::SIGSTOP) };
            }
        }
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    let out = std::env::args()
        .nth(1)
        .expect("usage: stall_worker OUT_DIR");
    train(&out)
}
