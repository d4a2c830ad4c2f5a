//! Sharded loops agree on their shuffle explicitly: whatever each rank drew from
//! libtorch's generator before the loop (a data-dependent amount, a rank-0-only
//! branch), every epoch's shards are disjoint and cover the data.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::time::Duration;

use tch_distributed_tests::{run_with, scratch_dir, tchrun};

const WORKER: &str = env!("CARGO_BIN_EXE_shuffle_worker");

#[test]
fn ranks_that_drew_different_random_numbers_still_share_each_epochs_shuffle() {
    let (rows, epochs, ranks) = (96, 4, 2);
    let dir = scratch_dir("shuffles");
    let mut cmd = Command::new(tchrun());
    cmd.args(["--nproc-per-node", &ranks.to_string(), WORKER])
        .args([rows.to_string(), epochs.to_string()])
        .env("TCH_DISTRIBUTED_RECORD", dir.join("record"));
    run_with(cmd, &dir, Duration::from_secs(120), |_, _| {}).assert_success();

    // Sample i is the row [i]: its fingerprint identifies it.
    let ids: BTreeMap<u64, i64> = (0..rows)
        .map(|i| {
            let row = tch::Tensor::from_slice(&[i as f32]).view([1, 1]);
            (tch_distributed::record::fingerprint_rows(&row)[0], i)
        })
        .collect();
    let mut epochs_seen: BTreeMap<u64, Vec<Vec<i64>>> = BTreeMap::new();
    for rank in 0..ranks {
        let text = std::fs::read_to_string(dir.join(format!("record/rank-{rank}.jsonl"))).unwrap();
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let samples = v["rows"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| ids[&f.as_u64().unwrap()])
                .collect();
            epochs_seen
                .entry(v["run"].as_u64().unwrap())
                .or_default()
                .push(samples);
        }
    }
    assert_eq!(epochs_seen.len(), epochs, "one loop run per epoch");
    let mut orders = BTreeSet::new();
    for (epoch, shards) in &epochs_seen {
        assert_eq!(shards.len(), ranks);
        let all: Vec<i64> = shards.concat();
        let distinct: BTreeSet<i64> = all.iter().copied().collect();
        assert_eq!(
            all.len(),
            distinct.len(),
            "epoch {epoch}: {} samples went to both ranks",
            all.len() - distinct.len()
        );
        assert_eq!(
            distinct,
            (0..rows).collect(),
            "epoch {epoch}: the shards do not cover the data"
        );
        orders.insert(shards[0].clone());
    }
    assert_eq!(orders.len(), epochs, "each epoch has its own shuffle");
}
