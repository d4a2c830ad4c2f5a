//! Worker of `tests/tests/activation.rs`: an MLP of 4 blocks (Linear(16, 16), tanh,
//! dropout 0.2) and a head (16 → 1), SGD with momentum, 6 steps under
//! `#[distributed]`, each rank on its own batch of 8 rows. With `CHECKPOINT=1` each
//! block is checkpointed (`tch_distributed::checkpointed_t`), the first on the data
//! itself; with `UNITS=1` each block's linear layer is a unit of `fully_shard` (for
//! `TCH_DISTRIBUTED_ZERO=3`); with `SHARED=1` the 4 blocks share one linear layer (as
//! ALBERT's). Rank 0 writes the parameters to DIR/OUT.
//!
//! Usage: activation_worker DIR OUT
use tch::nn::{self, Module, ModuleT, OptimizerConfig};
use tch::{Device, Kind, Tensor};

/// A block's forward pass, checkpointed or not.
type Layer = Box<dyn Fn(&Tensor) -> Tensor>;

// ANCHOR: block
/// Linear, tanh, dropout.
#[derive(Debug)]
struct Block {
    linear: Box<dyn Module>,
}

impl ModuleT for Block {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.linear.forward(xs).tanh().dropout(0.2, train)
    }
}
// ANCHOR_END: block

#[tch_distributed::distributed]
fn train(dir: &str, out: &str) -> anyhow::Result<()> {
    let rank = tch_distributed::current().map_or(0, |c| c.rank()) as i64;
    let checkpointed = std::env::var("CHECKPOINT").is_ok_and(|v| v == "1");
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let shared = std::env::var("SHARED").is_ok().then(|| {
        let linear = nn::linear(&root / "b0", 16, 16, Default::default());
        move || nn::Linear {
            ws: linear.ws.shallow_clone(),
            bs: linear.bs.as_ref().map(Tensor::shallow_clone),
        }
    });
    let blocks: Vec<Block> = (0..4)
        .map(|i| {
            let path = &root / format!("b{i}");
            let linear = match &shared {
                Some(same) => same(),
                None => nn::linear(&path, 16, 16, Default::default()),
            };
            let linear: Box<dyn Module> = match std::env::var("UNITS").is_ok() {
                true => Box::new(tch_distributed::fully_shard(linear, &path)),
                false => Box::new(linear),
            };
            Block { linear }
        })
        .collect();
    let head = nn::linear(&root / "head", 16, 1, Default::default());
    let blocks: Vec<Layer> = blocks
        .into_iter()
        .map(|block| -> Layer {
            match checkpointed {
                // ANCHOR: checkpointed
                true => {
                    let block = tch_distributed::checkpointed_t(block);
                    Box::new(move |x| block.forward_t(x, true))
                }
                // ANCHOR_END: checkpointed
                false => Box::new(move |x| block.forward_t(x, true)),
            }
        })
        .collect();
    let mut opt = nn::Sgd {
        momentum: 0.9,
        ..Default::default()
    }
    .build(&vs, 0.05)?;
    tch::manual_seed(1 + rank);
    for _ in 0..6 {
        let x = Tensor::randn([8, 16], (Kind::Float, Device::Cpu));
        let y = x.sum_dim_intlist(1, true, Kind::Float).sin();
        let hidden = blocks.iter().fold(x, |h, block| block(&h));
        let loss = head.forward(&hidden).mse_loss(&y, tch::Reduction::Mean);
        opt.backward_step(&loss);
    }
    vs.save(format!("{dir}/{out}"))?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    let args: Vec<String> = std::env::args().collect();
    train(&args[1], &args[2])
}
