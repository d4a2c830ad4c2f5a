//! `DistributedSampler` against PyTorch's own, run by the Python that
//! `tch_distributed_tests::python` finds. Without one the comparison is recorded as
//! skipped (`scripts/test.sh` lists it at its end); under `CI=true` it fails.

use tch_distributed::DistributedSampler;
use tch_distributed_tests::run_python;

const CASES: &[(usize, usize, u64, u64, bool, bool)] = &[
    // (len, world_size, seed, epoch, shuffle, drop_last)
    (10, 3, 0, 0, true, false),
    (10, 3, 7, 2, true, true),
    (13, 4, 1, 5, true, false),
    (5, 4, 3, 1, false, false),
    (29_500, 8, 42, 3, true, false),
    (1, 2, 0, 0, true, false),
];

#[test]
fn same_indices_and_steps_as_pytorch() {
    let script = r#"
import sys, torch
from torch.utils.data.distributed import DistributedSampler
for line in sys.stdin:
    n, w, seed, epoch, shuffle, drop = line.split()
    for r in range(int(w)):
        s = DistributedSampler(range(int(n)), num_replicas=int(w), rank=r, shuffle=shuffle == "true",
                               seed=int(seed), drop_last=drop == "true")
        s.set_epoch(int(epoch))
        print(len(s), ",".join(map(str, s)))
"#;
    let input: String = CASES
        .iter()
        .map(|(n, w, seed, epoch, shuffle, drop)| {
            format!("{n} {w} {seed} {epoch} {shuffle} {drop}\n")
        })
        .collect();
    let Some(stdout) = run_python(script, &[], &input) else {
        return;
    };
    let mut lines = stdout.lines();
    for &(n, w, seed, epoch, shuffle, drop) in CASES {
        for rank in 0..w {
            let mut sampler = DistributedSampler::new(n, rank, w)
                .unwrap()
                .seed(seed)
                .shuffle(shuffle)
                .drop_last(drop);
            sampler.set_epoch(epoch);
            let ours = sampler.indices().unwrap();
            let line = lines.next().expect("a line per rank");
            let (len, indices) = line.split_once(' ').unwrap_or((line, ""));
            let theirs: Vec<usize> = indices
                .split(',')
                .filter(|s| !s.is_empty())
                .map(|s| s.parse().unwrap())
                .collect();
            assert_eq!(sampler.num_samples(), len.parse::<usize>().unwrap());
            assert_eq!(
                ours, theirs,
                "len {n}, world {w}, rank {rank}, seed {seed}, epoch {epoch}"
            );
        }
    }
    assert_eq!(
        lines.next(),
        None,
        "PyTorch printed more ranks than asked for"
    );
}

#[test]
fn steps_per_epoch_shrink_with_world_size_as_the_guides_say() {
    // 29,500 samples at batch 4: 7,375 steps on 1 rank, 3,687 on 2, 1,843 on 4, 921 on 8
    // (the guides' figures: `drop_last` in the sampler and for the last partial batch).
    for (world, steps) in [(1, 7375), (2, 3687), (4, 1843), (8, 921)] {
        let sampler = DistributedSampler::new(29_500, 0, world)
            .unwrap()
            .drop_last(true);
        assert_eq!(sampler.num_samples() / 4, steps, "world size {world}");
    }
    // Padded instead (the default), a rank can get one more batch: ceil(29,500 / 8) = 3,688.
    let padded = DistributedSampler::new(29_500, 0, 8).unwrap();
    assert_eq!(padded.num_samples() / 4, 922);
}

/// What the sampler reports about itself (its rank, the epoch set on it, its length),
/// which the loader and user code read back. Found missing by `scripts/mutants.sh
/// sampler`: these getters could return constants and every other test passed.
#[test]
fn the_sampler_reports_its_rank_epoch_and_length() {
    for (rank, epoch) in [(0, 0), (2, 5), (3, 1)] {
        let mut sampler = DistributedSampler::new(10, rank, 4).unwrap();
        sampler.set_epoch(epoch);
        assert_eq!(sampler.rank(), rank);
        assert_eq!(sampler.world_size(), 4);
        assert_eq!(sampler.epoch(), epoch);
        assert_eq!(sampler.len(), 10);
        assert!(!sampler.is_empty());
    }
}
