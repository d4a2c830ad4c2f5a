//! The `DataLoader` at the two places where an epoch is cut short, on real ranks
//! (`loader_worker` under `tchrun`):
//!
//! - a checkpoint taken mid-epoch (in the second epoch) and resumed with another number
//!   of ranks: the loader's position, counted in samples, is converted to the new world
//!   size (rounded down to whole batches), so that over the epoch every sample is
//!   trained on once, but for the rounding and the sampler's padding, which the book
//!   documents, and the next epoch is whole;
//! - gradient accumulation when an epoch's batches are not a multiple of the
//!   accumulation count: the epoch's last micro-batch ends a short cycle that steps
//!   (its loss still divided by the count, as in Accelerate), against the same updates
//!   computed in plain tch on one process.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;
use std::time::Duration;

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_distributed_tests::{run_tchrun, scratch_dir, Run};

const WORKER: &str = env!("CARGO_BIN_EXE_loader_worker");
const TIMEOUT: Duration = Duration::from_secs(120);

fn tchrun_ok(dir: &Path, ranks: usize, args: &[&str]) -> Run {
    let ranks = ranks.to_string();
    let mut all = vec!["--nproc-per-node", &ranks, WORKER];
    all.extend(args);
    let run = run_tchrun(dir, &all, TIMEOUT, |_, _| {});
    run.assert_success();
    run
}

fn numbers(text: &str) -> Vec<i64> {
    text.split(['[', ']', ','])
        .filter_map(|s| s.trim().parse().ok())
        .collect()
}

/// The `epoch E: [ids…]` lines of a `seen{rank}.txt`, by epoch, and its other lines.
type Seen = (BTreeMap<u64, Vec<i64>>, Vec<String>);

fn seen(out: &Path, rank: usize) -> Seen {
    let text = fs::read_to_string(out.join(format!("seen{rank}.txt"))).unwrap();
    let mut epochs = BTreeMap::new();
    let mut other = Vec::new();
    for line in text.lines() {
        match line
            .strip_prefix("epoch ")
            .and_then(|rest| rest.split_once(": "))
        {
            Some((epoch, ids)) => {
                epochs.insert(epoch.parse().unwrap(), numbers(ids));
            }
            None => other.push(line.to_string()),
        }
    }
    (epochs, other)
}

/// The epoch's order, position by position, as `w` ranks read it: rank r reads
/// positions r, r + w, r + 2w, … (PyTorch's DistributedSampler) from `first_batch` on.
fn order_of(per_rank: &[Vec<i64>], first_batch: usize, batch: usize) -> BTreeMap<usize, i64> {
    let w = per_rank.len();
    let mut order = BTreeMap::new();
    for (rank, ids) in per_rank.iter().enumerate() {
        for (j, &id) in ids.iter().enumerate() {
            order.insert((first_batch * batch + j) * w + rank, id);
        }
    }
    order
}

/// Trains `N = 50` samples, batch 4 per rank, on `w1` ranks through epoch 0 and `k`
/// steps into epoch 1 (a checkpoint there), then resumes on `w2` ranks to the end of
/// epoch 2. `repeats`: how many of epoch 1's samples the book's rules say are
/// trained on twice (the position rounded down to whole batches of the new world
/// size, plus the new world size's padding).
fn resume_case(w1: usize, k: usize, w2: usize, repeats: usize) {
    let (n, batch) = (50usize, 4usize);
    let what = format!("{w1} ranks to step {k} of epoch 1, then {w2}");
    let dir = scratch_dir(&format!("loader-resume-{w1}-{k}-{w2}"));
    let ckpt = dir.join("ckpt");
    let (first, resumed) = (dir.join("first"), dir.join("resumed"));
    fs::create_dir_all(&first).unwrap();
    fs::create_dir_all(&resumed).unwrap();
    let steps_per_epoch = n.div_ceil(w1).div_ceil(batch);
    let stop = steps_per_epoch + k;
    let args = |out: &Path, stop: usize, epochs: &str| {
        let v: Vec<String> = vec![
            "resume".into(),
            out.to_str().unwrap().into(),
            ckpt.to_str().unwrap().into(),
            n.to_string(),
            batch.to_string(),
            stop.to_string(),
            epochs.into(),
        ];
        v
    };
    let a = args(&first, stop, "2");
    tchrun_ok(
        &first,
        w1,
        &a.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let a = args(&resumed, 0, "3");
    tchrun_ok(
        &resumed,
        w2,
        &a.iter().map(String::as_str).collect::<Vec<_>>(),
    );

    let before: Vec<BTreeMap<u64, Vec<i64>>> = (0..w1).map(|r| seen(&first, r).0).collect();
    let after: Vec<Seen> = (0..w2).map(|r| seen(&resumed, r)).collect();
    let epoch = |runs: &[&BTreeMap<u64, Vec<i64>>], e: u64| -> Vec<Vec<i64>> {
        runs.iter().map(|m| m[&e].clone()).collect()
    };
    let before_refs: Vec<&BTreeMap<u64, Vec<i64>>> = before.iter().collect();
    let after_refs: Vec<&BTreeMap<u64, Vec<i64>>> = after.iter().map(|a| &a.0).collect();

    // Epoch 0, whole on w1 ranks (its order, for comparison below).
    let order0: Vec<i64> = order_of(&epoch(&before_refs, 0), 0, batch)
        .into_values()
        .take(n)
        .collect();

    // Epoch 1: k batches per rank on w1 ranks, then the rest in whole batches of w2.
    let consumed = k * batch * w1;
    for (rank, (_, other)) in after.iter().enumerate() {
        assert_eq!(
            other,
            &[format!(
                "resumed at step {stop} epoch 1 samples {consumed} world size {w1}"
            )],
            "{what}: rank {rank}"
        );
    }
    let first_part = epoch(&before_refs, 1);
    assert!(
        first_part.iter().all(|ids| ids.len() == k * batch),
        "{what}: {k} batches per rank before the stop: {first_part:?}"
    );
    let per_rank = n.div_ceil(w2);
    let skipped_batches = consumed / (batch * w2);
    let second_part = epoch(&after_refs, 1);
    assert!(
        second_part
            .iter()
            .all(|ids| ids.len() == per_rank - skipped_batches * batch),
        "{what}: the resumed ranks read the rest of epoch 1 in whole batches: {second_part:?}"
    );
    // A position read before and after the resume holds the same sample in both, and
    // positions past the end (the padding) repeat the order's first ones.
    let mut order = order_of(&first_part, 0, batch);
    for (p, id) in order_of(&second_part, skipped_batches, batch) {
        let p = if p < n { p } else { p - n };
        if let Some(&before) = order.get(&p) {
            assert_eq!(before, id, "{what}: position {p} of epoch 1's order");
        }
        order.insert(p, id);
    }
    // Every position of epoch 1 was read, and they hold every sample once: the resumed
    // run went on with the same shuffle, from where the first run stopped.
    assert_eq!(
        order.keys().copied().collect::<Vec<_>>(),
        (0..n).collect::<Vec<_>>(),
        "{what}: positions of epoch 1 never read"
    );
    let order1: Vec<i64> = order.values().copied().collect();
    let samples: BTreeSet<i64> = order1.iter().copied().collect();
    assert_eq!(
        samples,
        (0..n as i64).collect(),
        "{what}: epoch 1 is not a permutation of the data"
    );
    let trained: usize = first_part.iter().chain(&second_part).map(Vec::len).sum();
    assert_eq!(
        trained,
        n + repeats,
        "{what}: samples trained on in epoch 1 (the data, and {repeats} of them twice)"
    );
    assert_ne!(order1, order0, "{what}: epoch 1 has a shuffle of its own");

    // Epoch 2 is whole, on the new world size, with its own shuffle.
    let next = epoch(&after_refs, 2);
    assert!(
        next.iter().all(|ids| ids.len() == per_rank),
        "{what}: {next:?}"
    );
    let order2: Vec<i64> = order_of(&next, 0, batch).into_values().take(n).collect();
    assert_eq!(
        order2.iter().copied().collect::<BTreeSet<i64>>(),
        samples,
        "{what}: epoch 2 covers the data"
    );
    assert_ne!(order2, order1, "{what}: epoch 2 reshuffles");
}

#[test]
fn a_checkpoint_from_2_ranks_mid_epoch_resumes_on_3_ranks() {
    // 24 samples consumed = 2 batches of 12 on 3 ranks: nothing read twice but the
    // padding of 50 samples to 51.
    resume_case(2, 3, 3, 1);
}

#[test]
fn a_checkpoint_from_2_ranks_mid_epoch_resumes_on_1_rank() {
    // 24 samples = 6 batches of 4: every sample exactly once.
    resume_case(2, 3, 1, 0);
}

#[test]
fn a_checkpoint_from_3_ranks_resumes_on_2_rounded_down_to_whole_batches() {
    // 12 samples consumed, 8 per batch on 2 ranks: 1 batch is skipped, so the 4
    // samples at positions 8 to 11 are read again.
    resume_case(3, 1, 2, 4);
}

/// `loader_worker`'s data, rebuilt the same way: `x = [id, 0.025 id]`, `y = cos(3 ×
/// 0.025 id)`.
fn data(n: i64) -> (Tensor, Tensor) {
    let ids = Tensor::arange(n, (Kind::Float, Device::Cpu)).view([n, 1]);
    let feature = &ids * 0.025;
    let ys = (&feature * 3.0).cos();
    (Tensor::cat(&[&ids, &feature], 1), ys)
}

#[test]
fn an_epoch_that_ends_mid_cycle_steps_on_its_last_micro_batch() {
    // 40 samples on 2 ranks in batches of 4: 5 micro-batches per rank and epoch,
    // accumulated 3 at a time: a full cycle, then a short one of 2 that the end of the
    // epoch closes; 2 epochs.
    let (n, epochs, accum, ranks) = (40i64, 2, 3, 2);
    let dir = scratch_dir("loader-accum");
    let d = dir.to_str().unwrap();
    tchrun_ok(&dir, ranks, &["accum", d, "40", "4", "3", "2"]);

    // micro[rank][epoch][m]: the ids of each micro-batch.
    let mut micro: Vec<Vec<Vec<Vec<i64>>>> = Vec::new();
    let mut params = Vec::new();
    for rank in 0..ranks {
        let text = fs::read_to_string(dir.join(format!("accum{rank}.txt"))).unwrap();
        let mut per_epoch = vec![Vec::new(); epochs];
        let mut stepped = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("epoch ") {
                let (epoch, rest) = rest.split_once(" stepped ").unwrap();
                let (s, ids) = rest.split_once(" ids ").unwrap();
                stepped.push(s.parse::<bool>().unwrap());
                per_epoch[epoch.parse::<usize>().unwrap()].push(numbers(ids));
            } else if let Some(p) = line.strip_prefix("params ") {
                params.push(p.to_string());
            } else {
                assert_eq!(
                    line, "stats synced 4 local 6",
                    "rank {rank}: one all-reduce per cycle, 2 cycles per epoch"
                );
            }
        }
        assert_eq!(
            stepped,
            [false, false, true, false, true].repeat(epochs),
            "rank {rank}: which micro-batches step"
        );
        micro.push(per_epoch);
    }
    assert_eq!(params.len(), ranks);
    assert_eq!(
        params[0], params[1],
        "the ranks end with the same parameters"
    );

    // The same updates in plain tch on one process: per cycle, the sum over both ranks'
    // micro-batches of (mean squared error) / 3 / 2 ranks, then one SGD step.
    let (xs, ys) = data(n);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root(), 1, 1, Default::default());
    tch::no_grad(|| {
        let _ = net.ws.shallow_clone().fill_(0.3);
        let _ = net.bs.as_ref().unwrap().shallow_clone().fill_(-0.2);
    });
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    for epoch in 0..epochs {
        for cycle in [0..3, 3..5] {
            let mut total = Tensor::zeros([], (Kind::Float, Device::Cpu));
            for rank_batches in &micro {
                for m in cycle.clone() {
                    let idx = Tensor::from_slice(&rank_batches[epoch][m]);
                    let (x, y) = (xs.index_select(0, &idx), ys.index_select(0, &idx));
                    let loss = net
                        .forward(&x.narrow(1, 1, 1))
                        .mse_loss(&y, tch::Reduction::Mean);
                    total += loss / (accum * ranks) as f64;
                }
            }
            opt.backward_step(&total);
        }
    }
    let reference: Vec<f64> = vs
        .trainable_variables()
        .iter()
        .flat_map(|t| Vec::<f32>::try_from(t.reshape([-1])).unwrap())
        .map(f64::from)
        .collect();
    let ours: Vec<f64> = numbers_f64(&params[0]);
    tch_distributed_tests::compare::tensors(
        &Tensor::from_slice(&ours),
        &Tensor::from_slice(&reference),
    )
    .assert_within(1e-6, "2 ranks against one process");
}

fn numbers_f64(text: &str) -> Vec<f64> {
    text.split(['[', ']', ','])
        .filter_map(|s| s.trim().parse().ok())
        .collect()
}
