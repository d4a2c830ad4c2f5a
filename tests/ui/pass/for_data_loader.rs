// `for` over the SDK's own `DataLoader`: it shards through its sampler, so the loop is
// left as written; each loop is the next epoch.
use tch::{Device, Kind, Tensor};
use tch_distributed::{DataLoader, TensorDataset};

// ANCHOR: train
#[tch_distributed::distributed]
fn train() -> anyhow::Result<Vec<i64>> {
    let ids = Tensor::arange(10, (Kind::Int64, Device::Cpu));
    let loader = DataLoader::new(TensorDataset::new(&ids, &ids)?, 4)?.num_workers(1);
    let mut seen = Vec::new();
    for _epoch in 0..2 {
        for batch in &loader {
            let (x, _) = batch?;
            seen.extend(Vec::<i64>::try_from(&x)?);
        }
    }
    Ok(seen)
}
// ANCHOR_END: train

fn main() -> anyhow::Result<()> {
    let mut seen = train()?;
    assert_ne!(seen[..10], seen[10..], "a new shuffle each epoch");
    seen.sort();
    let twice: Vec<i64> = (0..10).flat_map(|i| [i, i]).collect();
    assert_eq!(seen, twice);
    Ok(())
}
