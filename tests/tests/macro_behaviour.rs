//! `#[distributed]` on a function written in single-GPU style, as real 1- and 3-rank
//! runs (work in progress of the macro issue: these are the behaviours already in).

use std::collections::BTreeSet;
use std::fs;
use std::time::Duration;

use tch_distributed_tests::{run_tchrun, scratch_dir};

const WORKER: &str = env!("CARGO_BIN_EXE_macro_worker");

#[test]
fn three_ranks_get_disjoint_equal_shards_identical_parameters_and_one_printer() {
    let dir = scratch_dir("macro");
    let d = dir.to_str().unwrap();
    // 30 samples, batch 4: 8 batches per epoch; groups of 3 ranks leave 2 batches out.
    let run = run_tchrun(
        &dir,
        &["--nproc-per-node", "3", WORKER, d, "30"],
        Duration::from_secs(90),
        |_, _| {},
    );
    run.assert_success();
    assert_eq!(
        run.stdout.matches("epoch 0 done").count(),
        1,
        "only rank 0 prints:\n{}",
        run.stdout
    );
    assert_eq!(
        run.stdout
            .matches("tch-distributed: backend gloo, world size 3")
            .count(),
        1,
        "banner once:\n{}",
        run.stdout
    );

    let mut params = BTreeSet::new();
    for epoch in 0..2 {
        let mut union = BTreeSet::new();
        let mut total = 0;
        for rank in 0..3 {
            let log = fs::read_to_string(dir.join(format!("seen{rank}.txt"))).unwrap();
            assert!(
                log.contains("steps 4"),
                "rank {rank} ran a different number of steps:\n{log}"
            );
            let line = log
                .lines()
                .find(|l| l.starts_with(&format!("epoch {epoch}:")))
                .unwrap();
            let ids: Vec<i64> = line
                .split(['[', ']', ','])
                .filter_map(|s| s.trim().parse().ok())
                .collect();
            total += ids.len();
            union.extend(ids);
        }
        assert_eq!(total, 24, "epoch {epoch}: 6 of 8 batches of 4 are used");
        assert_eq!(union.len(), total, "epoch {epoch}: shards overlap");
        assert!(union.iter().all(|i| (0..30).contains(i)));
    }
    for rank in 0..3 {
        params.insert(fs::read_to_string(dir.join(format!("params{rank}.txt"))).unwrap());
    }
    assert_eq!(
        params.len(),
        1,
        "ranks ended with different parameters: {params:?}"
    );
    let entries: Vec<_> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(entries.contains(&"model.safetensors".to_string()));
    assert!(
        !entries.iter().any(|e| e.starts_with(".tmp-")),
        "a temporary file was left: {entries:?}"
    );
}
