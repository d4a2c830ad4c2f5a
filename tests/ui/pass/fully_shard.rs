// `zero = 3` with units: every Linear is a unit of fully sharded training
// (`fully_shard`, as FSDP2's), whose parameters hold memory only around its forward and
// backward passes; the embedding no unit claims is the root unit's. One process shards
// nothing: the same run as without it.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_distributed::{fully_shard, FullyShard};

// ANCHOR: model
struct Model {
    embed: nn::Embedding,
    layers: Vec<FullyShard<nn::Linear>>,
}

impl Model {
    fn new(root: &nn::Path, vocab: i64, width: i64, depth: usize) -> Model {
        let embed = nn::embedding(root / "embed", vocab, width, Default::default());
        let layers = (0..depth)
            .map(|i| {
                let path = root / "layers" / i;
                // The unit's variables are those under its path.
                fully_shard(nn::linear(&path, width, width, Default::default()), &path)
            })
            .collect();
        Model { embed, layers }
    }

    fn forward(&self, tokens: &Tensor) -> Tensor {
        let x = self.embed.forward(tokens);
        self.layers.iter().fold(x, |x, layer| layer.forward(&x).relu())
    }
}
// ANCHOR_END: model

// ANCHOR: train
#[tch_distributed::distributed(zero = 3)]
fn train() -> anyhow::Result<f64> {
    let vs = nn::VarStore::new(Device::cuda_if_available());
    // Units first, then the optimizer: building it claims them.
    let model = Model::new(&vs.root(), 100, 32, 4);
    let mut opt = nn::Adam::default().build(&vs, 1e-3)?;
    let tokens = Tensor::arange(8, (Kind::Int64, vs.device()));
    let mut loss = 0.0;
    for _ in 0..3 {
        let l = model.forward(&tokens).square().mean(Kind::Float);
        opt.backward_step(&l);
        loss = l.double_value(&[]);
    }
    Ok(loss)
}
// ANCHOR_END: train

fn main() -> anyhow::Result<()> {
    let loss = train()?;
    assert!(loss.is_finite() && loss > 0.0, "{loss}");
    Ok(())
}
