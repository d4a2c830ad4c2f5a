//! Batch inference over a dataset, split between the ranks: each rank runs the model on
//! its own contiguous part of the dataset, in batches, and every rank gets all the
//! predictions back in the dataset's order. `batch_inference` (one process, or under a
//! launcher).

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

fn main() -> anyhow::Result<()> {
    // ANCHOR: inference
    let ctx = tch_distributed::init()?;
    let device = ctx.device();
    // The model: trained elsewhere; here, the same seeded weights on every rank.
    tch::manual_seed(0);
    let vs = nn::VarStore::new(device);
    let model = nn::seq()
        .add(nn::linear(vs.root() / "l1", 2, 16, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "l2", 16, 3, Default::default()));
    // The dataset: 50 points on a curve, [50, 2].
    let x = Tensor::linspace(-3.0, 3.0, 50, (Kind::Float, Device::Cpu));
    let points = Tensor::stack(&[&x, &((&x * 2.0).sin() * 3.0)], 1);

    // Rank r runs the model on its part only (17, 17 and 16 points on 3 ranks), in
    // batches of 8; every rank gets the 50 predictions, in the dataset's order.
    let classes = tch_distributed::split_between_processes(&points, |mine| {
        let batches: Vec<Tensor> = tch::no_grad(|| {
            mine.split(8, 0)
                .iter()
                .map(|batch| model.forward(&batch.to_device(device)).argmax(1, false))
                .collect()
        });
        Tensor::cat(&batches, 0).to_device(Device::Cpu)
    })?;
    // ANCHOR_END: inference
    if ctx.is_main_process() {
        let classes = Vec::<i64>::try_from(&classes)?;
        let counts: Vec<usize> = (0..3)
            .map(|c| classes.iter().filter(|&&k| k == c).count())
            .collect();
        println!("{} predictions: {classes:?}", classes.len());
        println!("per class: {counts:?}");
    }
    Ok(())
}
