//! `DataLoader` and `gather_for_metrics` across real ranks (`data_loading_worker` under
//! `tchrun`, Gloo on CPU).

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;
use std::time::Duration;

use tch_distributed_tests::{run_tchrun, run_tchrun_all_ranks, scratch_dir};

const WORKER: &str = env!("CARGO_BIN_EXE_data_loading_worker");
const TIMEOUT: Duration = Duration::from_secs(90);

fn seen(dir: &Path, rank: usize, epoch: usize) -> Vec<i64> {
    let log = fs::read_to_string(dir.join(format!("seen{rank}.txt"))).unwrap();
    log.lines()
        .find(|l| l.starts_with(&format!("epoch {epoch}:")))
        .unwrap()
        .split(['[', ']', ','])
        .filter_map(|s| s.trim().parse().ok())
        .collect()
}

#[test]
fn every_world_size_covers_the_dataset_plus_exactly_the_padding() {
    let (n, batch) = (31usize, 4usize);
    for world in 1..=4 {
        let dir = scratch_dir(&format!("data{world}"));
        let d = dir.to_str().unwrap();
        run_tchrun(
            &dir,
            &[
                "--nproc-per-node",
                &world.to_string(),
                WORKER,
                "loader",
                d,
                &n.to_string(),
                &batch.to_string(),
            ],
            TIMEOUT,
            |_, _| {},
        )
        .assert_success();
        let per_rank = n.div_ceil(world);
        let mut orders = Vec::new();
        for epoch in 0..2 {
            let mut all = Vec::new();
            for rank in 0..world {
                let mine = seen(&dir, rank, epoch);
                assert_eq!(mine.len(), per_rank, "world {world}, rank {rank}");
                all.extend(mine);
            }
            let distinct: BTreeSet<i64> = all.iter().copied().collect();
            assert_eq!(
                distinct,
                (0..n as i64).collect(),
                "world {world}: the whole dataset"
            );
            assert_eq!(
                all.len() - n,
                per_rank * world - n,
                "world {world}: only the padding repeats"
            );
            orders.push(all);
        }
        assert_ne!(
            orders[0], orders[1],
            "world {world}: epochs shuffle differently"
        );
        for rank in 0..world {
            let log = fs::read_to_string(dir.join(format!("seen{rank}.txt"))).unwrap();
            assert!(log.starts_with(&format!("steps per epoch {}\n", per_rank.div_ceil(batch))));
            // The exact single-process accuracy: samples whose id is not 1 mod 3.
            let exact = (0..n).filter(|i| i % 3 != 1).count() as f64 / n as f64;
            let metric = fs::read_to_string(dir.join(format!("metric{rank}.txt"))).unwrap();
            let (rows, value) = metric.split_once(' ').unwrap();
            assert_eq!(
                rows.parse::<usize>().unwrap(),
                n,
                "world {world}: padding dropped"
            );
            let value: f64 = value.parse().unwrap();
            assert!(
                (value - exact).abs() < 1e-6,
                "world {world}: {value} != {exact}"
            );
            let resumed = fs::read_to_string(dir.join(format!("resumed{rank}.txt"))).unwrap();
            assert_eq!(
                resumed.parse::<usize>().unwrap(),
                n.saturating_sub(2 * batch * world),
                "world {world}: resumed mid-epoch, the rest without the padding"
            );
        }
    }
}

#[test]
fn datasets_of_different_lengths_fail_before_training() {
    let dir = scratch_dir("data-uneven");
    // Every rank's stdout: none built a loader.
    let run = run_tchrun_all_ranks(
        &dir,
        &["--nproc-per-node", "2", WORKER, "uneven"],
        TIMEOUT,
        |_, _| {},
    );
    assert!(!run.status.success());
    assert!(
        run.stderr.contains("rank 0: 10, rank 1: 11"),
        "the error names each rank's length:\n{}",
        run.stderr
    );
    assert!(!run.stdout.contains("built a loader"), "{}", run.stdout);
    assert!(run.elapsed < Duration::from_secs(30), "{:?}", run.elapsed);
}
