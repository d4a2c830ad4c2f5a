//! Worker for `debug = "detail"` (`TCH_DISTRIBUTED_DEBUG=detail`): `debug_worker MODE
//! OUT_DIR`, under a launcher.
//!
//! - `shape`: every rank all-reduces a tensor of `rank + 3` floats: a mismatch of
//!   shapes, which Gloo alone aborts on;
//! - `order`: rank 0 all-reduces while the others broadcast: collectives in different
//!   orders, which hang until the deadlock check alone;
//! - `train`: 10 DDP steps of a small model; writes the parameters to
//!   `OUT_DIR/rank{r}.safetensors`, to compare with a run without checks.
//!
//! A collective's error is written to `OUT_DIR/rank{r}.txt` and the rank exits 0.

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use tch_distributed::{DdpOptions, DistributedDataParallel, Optimizer, ReduceOp};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (mode, out) = (args[1].as_str(), args[2].clone());
    tch::set_num_threads(1);
    let ctx = tch_distributed::init()?;
    let (rank, group) = (ctx.rank(), ctx.process_group());
    let result = match mode {
        "shape" => {
            let mut t = Tensor::ones([rank as i64 + 3], (Kind::Float, Device::Cpu));
            group.all_reduce(&mut t, ReduceOp::Sum)
        }
        "order" => {
            let mut t = Tensor::ones([4], (Kind::Float, Device::Cpu));
            match rank {
                0 => group.all_reduce(&mut t, ReduceOp::Sum),
                _ => group.broadcast(&mut t, 0),
            }
        }
        "train" => {
            tch::manual_seed(0);
            let vs = nn::VarStore::new(Device::Cpu);
            let net = nn::seq()
                .add(nn::linear(vs.root() / "l1", 4, 8, Default::default()))
                .add_fn(|x| x.relu())
                .add(nn::linear(vs.root() / "l2", 8, 1, Default::default()));
            let ddp = DistributedDataParallel::new(&vs, group, DdpOptions::default())?;
            let mut opt = Optimizer::new(&nn::Adam::default(), &vs, 1e-2)?.distributed(ddp);
            for step in 0..10 {
                let x = Tensor::arange(32, (Kind::Float, Device::Cpu)).view([8, 4])
                    * ((step + 1) * (rank + 1)) as f64
                    / 100.0;
                let y = x.sum_dim_intlist(1, true, Kind::Float).sin();
                opt.backward_step(&net.forward(&x).mse_loss(&y, tch::Reduction::Mean))?;
            }
            vs.save(format!("{out}/rank{rank}.safetensors"))?;
            Ok(())
        }
        other => anyhow::bail!("unknown mode {other:?}"),
    };
    if let Err(e) = result {
        std::fs::write(format!("{out}/rank{rank}.txt"), e.to_string())?;
    }
    Ok(())
}
