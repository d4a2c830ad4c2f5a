//! Worker of `tests/tests/shuffles.rs`' check of `AgreedSeed::enter`: each rank seeds
//! its own generator differently (`manual_seed(100 + rank)`), then draws 4 numbers
//! inside `AgreedSeed::enter(7)`, 4 inside `AgreedSeed::enter(8)`, and 4 after both
//! guards are gone. Rank R writes the three draws, a line each, to DIR/rank-R.
//!
//! Usage: agreed_seed_worker DIR
use tch::{Device, Kind, Tensor};
use tch_distributed::AgreedSeed;

fn draw() -> String {
    let t = Tensor::rand([4], (Kind::Float, Device::Cpu));
    let values: Vec<f32> = Vec::try_from(&t).expect("floats");
    values
        .iter()
        .map(|v| v.to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

#[tch_distributed::distributed]
fn run(dir: &str) -> anyhow::Result<()> {
    let rank = tch_distributed::current().map_or(0, |c| c.rank());
    tch::manual_seed(100 + rank as i64);
    let seven = {
        let _agreed = AgreedSeed::enter(7)?;
        draw()
    };
    let eight = {
        let _agreed = AgreedSeed::enter(8)?;
        draw()
    };
    let after = draw();
    std::fs::write(
        format!("{dir}/rank-{rank}"),
        format!("{seven}\n{eight}\n{after}\n"),
    )?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    tch::set_num_threads(1);
    let dir = std::env::args()
        .nth(1)
        .expect("usage: agreed_seed_worker DIR");
    run(&dir)
}
