//! Sharded loops agree on their shuffle explicitly: whatever each rank drew from
//! libtorch's generator before the loop (a data-dependent amount, a rank-0-only
//! branch), every epoch's shards are disjoint and cover the data.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::time::Duration;

use tch_distributed_tests::{run_with, scratch_dir, tchrun};

const WORKER: &str = env!("CARGO_BIN_EXE_shuffle_worker");
const DISTRIBUTED_PROGRAM: &str = env!("CARGO_BIN_EXE_distributed_program");

/// Runs `worker args…` on 2 ranks under tchrun with `env`, recording into `dir/record`.
fn run_2_ranks(
    worker: &str,
    args: &[&str],
    env: &[(&str, &str)],
    dir: &std::path::Path,
) -> tch_distributed_tests::Run {
    let mut cmd = Command::new(tchrun());
    cmd.args(["--nproc-per-node", "2", worker])
        .args(args)
        .envs(env.iter().copied())
        .env("TCH_DISTRIBUTED_RECORD", dir.join("record"));
    run_with(cmd, dir, Duration::from_secs(120), |_, _| {})
}

/// What a recorded run trained on and ended with: rank 0's shards and its model file.
fn outcome(dir: &std::path::Path) -> (String, Vec<u8>) {
    let record = dir.join("record");
    (
        std::fs::read_to_string(record.join("rank-0.jsonl")).unwrap(),
        std::fs::read(record.join("rank-0-model-0.safetensors")).unwrap(),
    )
}

/// A seed set before the function (in `main`) or inside it, alike on every rank, gives
/// the same 2-rank run bit for bit, every time; another seed gives another run.
#[test]
fn seeded_runs_repeat_bit_for_bit_and_another_seed_changes_them() {
    for (worker, args, var) in [
        (WORKER, vec!["96", "3"], "SEED"), // shuffle_worker seeds in main
        (DISTRIBUTED_PROGRAM, vec![], "SEED"), // distributed_program seeds inside the function
    ] {
        let runs: Vec<(String, Vec<u8>)> = ["1", "1", "2"]
            .iter()
            .enumerate()
            .map(|(i, seed)| {
                let dir = scratch_dir(&format!("shuffles-seed-{i}"));
                let mut args: Vec<&str> = args.clone();
                let out = dir.to_str().unwrap().to_string();
                if worker == DISTRIBUTED_PROGRAM {
                    args = vec![&out, "24"];
                }
                run_2_ranks(worker, &args, &[(var, seed)], &dir).assert_success();
                outcome(&dir)
            })
            .collect();
        assert!(runs[0] == runs[1], "{worker}: two runs with seed 1 differ");
        assert!(
            runs[0].0 != runs[2].0,
            "{worker}: seed 2 shuffled as seed 1 did"
        );
        assert!(
            runs[0].1 != runs[2].1,
            "{worker}: seed 2 trained the model seed 1 did"
        );
    }
}

/// Ranks that seed libtorch each with its own seed inside the function would shuffle
/// differently: every rank stops at the loop with an error that says so.
#[test]
fn rank_dependent_seeds_before_a_sharded_loop_are_reported() {
    let dir = scratch_dir("shuffles-seed-by-rank");
    let run = run_2_ranks(WORKER, &["96", "2"], &[("SEED_BY_RANK", "5")], &dir);
    assert!(!run.status.success(), "{}", run.stdout);
    assert!(
        run.stderr
            .contains("Error: rank 0: starting a sharded loop: the ranks' first batches differ")
            && run.stderr.contains("seed libtorch alike on every rank"),
        "{}",
        run.stderr
    );
    assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
}

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

/// `AgreedSeed::enter(key)`, the public guard: on 2 ranks whose generators were seeded
/// apart, the numbers drawn inside the guard are the same on both ranks, another key
/// draws other numbers, and once the guards are gone each rank draws from its own
/// generator again, where it was before the guards (the numbers a process seeded as the
/// rank was draws first).
#[test]
fn agreed_seed_enter_gives_every_rank_the_same_numbers_then_its_own() {
    let dir = scratch_dir("agreed-seed");
    let mut cmd = std::process::Command::new(tchrun());
    cmd.args([
        "--nproc-per-node",
        "2",
        env!("CARGO_BIN_EXE_agreed_seed_worker"),
    ])
    .arg(dir.as_os_str());
    let run = run_with(cmd, &dir, std::time::Duration::from_secs(60), |_, _| {});
    run.assert_success();
    let lines = |rank: usize| -> Vec<String> {
        std::fs::read_to_string(dir.join(format!("rank-{rank}")))
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect()
    };
    let (zero, one) = (lines(0), lines(1));
    assert_eq!(
        zero[0], one[0],
        "inside enter(7): the same numbers on every rank"
    );
    assert_eq!(
        zero[1], one[1],
        "inside enter(8): the same numbers on every rank"
    );
    assert_ne!(zero[0], zero[1], "another key, other numbers");
    assert_ne!(
        zero[2], one[2],
        "after the guards: each rank its own numbers"
    );
    for (rank, drawn) in [(0, &zero), (1, &one)] {
        tch::manual_seed(100 + rank);
        let own = tch::Tensor::rand([4], (tch::Kind::Float, tch::Device::Cpu));
        let own: Vec<f32> = Vec::try_from(&own).unwrap();
        let own: Vec<String> = own.iter().map(|v| v.to_string()).collect();
        assert_eq!(
            drawn[2],
            own.join(" "),
            "rank {rank}: its generator as before the guards"
        );
    }
}
