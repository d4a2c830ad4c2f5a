//! Worker for the `#[distributed]` tests: plain single-GPU tch code plus the attribute.
//! `macro_worker OUT_DIR ROWS` trains a linear model for 2 epochs over `ROWS` samples
//! (batch 4, shuffled, smaller last batch kept) and writes, per rank, the sample ids it
//! saw per epoch to `OUT_DIR/seen{rank}.txt`, its final parameters to
//! `OUT_DIR/params{rank}.txt`, and the model to `OUT_DIR/model.safetensors`.

use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[tch_distributed::distributed]
fn train(out: &str, rows: i64) -> anyhow::Result<()> {
    let device = Device::cuda_if_available();
    let xs = Tensor::arange(rows, (Kind::Float, Device::Cpu)).view([rows, 1]);
    let ys = &xs * 2.0 + 1.0;
    let vs = nn::VarStore::new(device);
    let net = nn::linear(vs.root(), 1, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 1e-4)?;
    let mut log = String::new();
    let mut steps = 0;
    for epoch in 0..2 {
        let mut seen = Vec::new();
        for (bx, by) in Iter2::new(&xs, &ys, 4)
            .shuffle()
            .return_smaller_last_batch()
        {
            seen.extend(
                Vec::<f32>::try_from(bx.view([-1]))?
                    .into_iter()
                    .map(|v| v as i64),
            );
            let loss = net
                .forward(&bx.to_device(device))
                .mse_loss(&by.to_device(device), tch::Reduction::Mean);
            opt.backward_step(&loss);
            steps += 1;
        }
        log.push_str(&format!("epoch {epoch}: {seen:?}\n"));
        println!("epoch {epoch} done");
    }
    let rank = tch_distributed::current().map(|c| c.rank()).unwrap_or(0);
    log.push_str(&format!("steps {steps}\n"));
    std::fs::write(format!("{out}/seen{rank}.txt"), log)?;
    let params: Vec<f32> = vs
        .trainable_variables()
        .iter()
        .flat_map(|t| Vec::<f32>::try_from(t.view([-1])).unwrap())
        .collect();
    std::fs::write(format!("{out}/params{rank}.txt"), format!("{params:?}"))?;
    vs.save(format!("{out}/model.safetensors"))?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    let args: Vec<String> = std::env::args().collect();
    train(&args[1], args[2].parse()?)
}
