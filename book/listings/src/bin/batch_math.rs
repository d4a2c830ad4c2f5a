//! The arithmetic of batch sizes, steps per epoch and learning rates across GPU
//! counts, with the SDK's functions. Its output is `book/listings/output/batch_math.txt`
//! (the test checks that it still is).

use tch_distributed::{
    global_batch_size, per_rank_batch_size, DistributedSampler, LrScaling, LrSchedule, WarmupType,
};

// ANCHOR: steps
/// Steps per epoch on each rank for `len` samples at `batch` samples per rank and
/// step, as the `DataLoader` counts them.
fn steps_per_epoch(len: usize, world_size: usize, batch: usize, drop_last: bool) -> usize {
    let sampler = DistributedSampler::new(len, 0, world_size)
        .expect("a valid rank and a non-empty dataset")
        .drop_last(drop_last);
    if drop_last {
        sampler.num_samples() / batch
    } else {
        sampler.num_samples().div_ceil(batch)
    }
}
// ANCHOR_END: steps

fn main() -> tch_distributed::Result<()> {
    // The output is Markdown; the guide includes its tables by these anchors.
    println!("<!-- ANCHOR: steps_table -->");
    println!("| ranks | global batch | steps per epoch (drop_last) | steps per epoch (padded) |");
    println!("|---|---|---|---|");
    for world in [1, 2, 4, 8] {
        println!(
            "| {world} | {} | {} | {} |",
            global_batch_size(4, world, 1),
            steps_per_epoch(29_500, world, 4, true),
            steps_per_epoch(29_500, world, 4, false),
        );
    }

    println!("<!-- ANCHOR_END: steps_table -->");
    println!("<!-- ANCHOR: per_rank_table -->");
    println!("| ranks | per-rank batch | with 4 accumulation steps |");
    println!("|---|---|---|");
    for world in [1, 2, 4, 8] {
        // ANCHOR: per_rank
        let per_rank = per_rank_batch_size(256, world)?;
        let accumulating = per_rank_batch_size(256, world * 4)?;
        // ANCHOR_END: per_rank
        println!("| {world} | {per_rank} | {accumulating} × 4 |");
    }
    println!("<!-- ANCHOR_END: per_rank_table -->");
    // ANCHOR: indivisible
    if let Err(e) = per_rank_batch_size(100, 8) {
        println!("<!-- ANCHOR: indivisible_error -->");
        println!("{e}");
        println!("<!-- ANCHOR_END: indivisible_error -->");
    }
    // ANCHOR_END: indivisible

    println!("<!-- ANCHOR: lr_table -->");
    println!("| ranks | global batch | SGD, linear | Adam, square root |");
    println!("|---|---|---|---|");
    for world in [1, 2, 4, 8] {
        // ANCHOR: scale
        let batch = global_batch_size(32, world, 1);
        let sgd_lr = LrScaling::Linear.scale(0.1, 32, batch)?;
        let adam_lr = LrScaling::Sqrt.scale(1e-3, 32, batch)?;
        // ANCHOR_END: scale
        println!("| {world} | {batch} | {sgd_lr} | {adam_lr:.6} |");
    }

    println!("<!-- ANCHOR_END: lr_table -->");
    println!("<!-- ANCHOR: warmup_table -->");
    // ANCHOR: warmup
    // The rate of 8 ranks above, warmed up over the first 500 of 10,000 steps.
    let peak = LrScaling::Linear.scale(0.1, 32, 256)?;
    let schedules = [
        LrSchedule::constant_with_warmup(500),
        LrSchedule::linear_with_warmup(500, 10_000),
        LrSchedule::cosine_with_warmup(500, 10_000),
        LrSchedule::warmup_lr(500, WarmupType::Log),
    ];
    for schedule in &schedules {
        schedule.check()?;
    }
    // ANCHOR_END: warmup
    println!("| step | constant | linear decay | cosine decay | DeepSpeed's WarmupLR, log |");
    println!("|---|---|---|---|---|");
    for step in [0, 1, 100, 250, 499, 500, 5_000, 9_999, 10_000] {
        // ANCHOR: lr
        let rates = schedules.map(|schedule| schedule.lr(peak, step));
        // ANCHOR_END: lr
        let [constant, linear, cosine, log] = rates;
        println!("| {step} | {constant:.4} | {linear:.4} | {cosine:.4} | {log:.4} |");
    }
    println!("<!-- ANCHOR_END: warmup_table -->");
    Ok(())
}
