//! What every corpus program is checked for: run on several ranks under `tchrun` with
//! `TCH_DISTRIBUTED_RECORD`, and as one process against its plain twin.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

use tch::Tensor;
pub use tch_distributed_tests::{compare, run_with, scratch_dir, tchrun, without_launcher, Run};

/// Held while a test draws from the process's random generator (libtorch's global
/// CPU generator, shared by a test binary's threads) where the draws must be
/// reproducible, such as a seed followed by a model's initialisation.
pub static RNG: Mutex<()> = Mutex::new(());

/// Per run: multi-process runs on 2 CPU cores take seconds, a hang is killed here.
pub const TIMEOUT: Duration = Duration::from_secs(240);

/// Runs `program args…` on `ranks` ranks under `tchrun`, recording into `dir/record`
/// (`TCH_DISTRIBUTED_RECORD`); panics with the output unless it exits 0. The run's
/// stdout is every rank's (`--all-ranks-stdout`), as the ranks wrote it, so that
/// [`assert_printed`] sees what each rank printed.
pub fn run_ranks(program: &str, args: &[&str], ranks: usize, dir: &Path) -> Run {
    run_ranks_with(program, args, ranks, dir, &[])
}

/// `run_ranks` with `envs` added to the ranks' environment (the GPU suite sets
/// `TCH_DISTRIBUTED_BACKEND` with it).
pub fn run_ranks_with(
    program: &str,
    args: &[&str],
    ranks: usize,
    dir: &Path,
    envs: &[(&str, &str)],
) -> Run {
    let mut cmd = Command::new(tchrun());
    cmd.arg("--all-ranks-stdout")
        .arg("--nproc-per-node")
        .arg(ranks.to_string())
        .arg(program)
        .args(args)
        .env("TCH_DISTRIBUTED_RECORD", dir.join("record"))
        .env_remove("TCH_DISTRIBUTED_NPROC")
        .envs(envs.iter().copied());
    let run = run_with(cmd, dir, TIMEOUT, |_, _| {}).without_rank_prefixes();
    run.assert_success();
    // Every program here steps its optimizer where the attribute sees it: no
    // sharded loop trains without averaging its gradients over the ranks.
    assert!(
        !run.stderr.contains("averaged no gradients over them"),
        "{}",
        run.stderr
    );
    run
}

/// Runs `program args…` as one process without a launcher.
pub fn run_alone(program: &str, args: &[&str], dir: &Path) -> Run {
    let mut cmd = Command::new(program);
    without_launcher(&mut cmd).args(args);
    let run = run_with(cmd, dir, TIMEOUT, |_, _| {});
    run.assert_success();
    run
}

/// The tensors of a safetensors file, by name.
pub fn read_tensors(path: &Path) -> BTreeMap<String, Tensor> {
    Tensor::read_safetensors(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .into_iter()
        .collect()
}

/// Asserts that two sets of named tensors are equal bit for bit: the same names, dtypes,
/// shapes and bits, through the suite's one comparison
/// (`tch_distributed_tests::compare`), for which NaN or infinity on either side is a
/// failure, never a match.
pub fn assert_same_tensors(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>, what: &str) {
    // The comparison's own panic (printed above this one) says which tensor and why.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| difference(a, b)));
    let diff = result.unwrap_or_else(|_| panic!("{what}: the comparison failed (above)"));
    assert!(diff.is_exact(), "{what}: not bit for bit equal: {diff:?}");
}

/// Asserts that every rank ended with the same parameters and buffers, bit for bit,
/// for every model the function built an optimizer for; returns how many there were.
pub fn assert_ranks_agree(dir: &Path, ranks: usize) -> usize {
    assert_ranks_agree_with_statistics_within(dir, ranks, 0.0)
}

/// Whether a model's variable is a running statistic (batch norm's buffers).
fn running_statistic(name: &str) -> bool {
    name.ends_with("running_mean") || name.ends_with("running_var")
}

/// [`assert_ranks_agree`], with the running statistics (batch norm's `running_mean`
/// and `running_var`) within `tolerance` of rank 0's instead of bit for bit: on a GPU,
/// a forward pass after the last broadcast of the buffers (a GAN's discriminator in the
/// generator's step) updates them from the same batch on every rank, but cuDNN may
/// choose a different convolution algorithm in each process, and those round
/// differently. Every other variable is still compared bit for bit.
pub fn assert_ranks_agree_with_statistics_within(
    dir: &Path,
    ranks: usize,
    tolerance: f64,
) -> usize {
    let record = dir.join("record");
    let mut models = 0;
    while record
        .join(format!("rank-0-model-{models}.safetensors"))
        .exists()
    {
        let rank0 = read_tensors(&record.join(format!("rank-0-model-{models}.safetensors")));
        assert!(!rank0.is_empty(), "model {models} has no variables");
        for rank in 1..ranks {
            let other =
                read_tensors(&record.join(format!("rank-{rank}-model-{models}.safetensors")));
            let what = format!("model {models}, rank {rank} vs rank 0");
            if tolerance == 0.0 {
                assert_same_tensors(&rank0, &other, &what);
                continue;
            }
            let list = |m| -> Vec<(&String, &Tensor)> { BTreeMap::iter(m).collect() };
            let exact =
                compare::named_where(&list(&rank0), &list(&other), |n| !running_statistic(n));
            assert!(exact.is_exact(), "{what}: not bit for bit equal: {exact:?}");
            compare::named_where(&list(&rank0), &list(&other), running_statistic)
                .assert_within(tolerance, &format!("{what}, running statistics"));
        }
        models += 1;
    }
    assert!(models > 0, "no model recorded in {}", record.display());
    models
}

/// One run of one sharded loop: the sample fingerprints each rank was given.
#[derive(Debug)]
pub struct LoopRun {
    pub site: u64,
    pub run: u64,
    pub per_rank: Vec<Vec<u64>>,
}

/// Every sharded loop's runs, in the order of their sites' first appearance and runs.
pub fn loop_runs(dir: &Path, ranks: usize) -> Vec<LoopRun> {
    let mut runs: BTreeMap<(u64, u64), Vec<Option<Vec<u64>>>> = BTreeMap::new();
    for rank in 0..ranks {
        let path = dir.join("record").join(format!("rank-{rank}.jsonl"));
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let key = (v["loop"].as_u64().unwrap(), v["run"].as_u64().unwrap());
            let rows: Vec<u64> = v["rows"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r.as_u64().unwrap())
                .collect();
            let slot = runs.entry(key).or_insert_with(|| vec![None; ranks]);
            assert!(slot[rank].is_none(), "rank {rank} ran loop {key:?} twice");
            slot[rank] = Some(rows);
        }
    }
    runs.into_iter()
        .map(|((site, run), per_rank)| LoopRun {
            site,
            run,
            per_rank: per_rank
                .into_iter()
                .enumerate()
                .map(|(r, rows)| {
                    rows.unwrap_or_else(|| panic!("rank {r} did not run loop {site} run {run}"))
                })
                .collect(),
        })
        .collect()
}

/// Asserts, for each run of each sharded loop, that the ranks got the same number of
/// samples, disjoint but for `Sharded`'s padding (at most `ranks - 1` repeated
/// batches of `batch` rows), that together they are `per_epoch` distinct samples,
/// all from `universe` (the fingerprints of every sample the data holds). Returns the
/// number of loop runs checked.
pub fn assert_shards_partition(
    dir: &Path,
    ranks: usize,
    batch: usize,
    per_epoch: usize,
    universe: &HashSet<u64>,
) -> usize {
    let runs = loop_runs(dir, ranks);
    assert!(!runs.is_empty(), "no sharded loop was recorded");
    for r in &runs {
        let what = format!("loop {} run {}", r.site, r.run);
        let sizes: Vec<usize> = r.per_rank.iter().map(Vec::len).collect();
        assert!(
            sizes.iter().all(|&s| s == sizes[0]),
            "{what}: uneven shards {sizes:?}"
        );
        let all: Vec<u64> = r.per_rank.concat();
        let distinct: HashSet<u64> = all.iter().copied().collect();
        let repeated = all.len() - distinct.len();
        assert!(
            repeated <= (ranks - 1) * batch,
            "{what}: {repeated} samples given to more than one rank (overlapping shards; padding allows {})",
            (ranks - 1) * batch
        );
        assert_eq!(
            distinct.len(),
            per_epoch,
            "{what}: the shards do not cover the epoch"
        );
        let foreign = distinct.difference(universe).count();
        assert_eq!(foreign, 0, "{what}: {foreign} samples are not in the data");
    }
    runs.len()
}

/// Asserts that `stdout` holds exactly `count` lines starting with `prefix` (rank 0's,
/// once each: [`run_ranks`] shows every rank's lines).
pub fn assert_printed(stdout: &str, prefix: &str, count: usize) {
    let n = stdout.lines().filter(|l| l.starts_with(prefix)).count();
    assert_eq!(n, count, "lines starting with {prefix:?} in:\n{stdout}");
}

/// stdout without the SDK's own lines (the banner).
pub fn program_output(stdout: &str) -> String {
    stdout
        .lines()
        .filter(|l| !l.starts_with("tch-distributed:"))
        .map(|l| format!("{l}\n"))
        .collect()
}

/// Runs `program` (with the attribute) and `plain` (the same file without it) as one
/// process each, `args(out)` naming the file each writes. With the optimizer on tch's
/// arithmetic (`TCH_DISTRIBUTED_OPTIMIZER=tch`), asserts that both print the same and
/// write the same tensors, bit for bit: the rewrite changes nothing. With the default
/// (`torch.optim`'s fused or foreach kernels), asserts that the tensors are the same to
/// `tolerance` (the largest difference of an element): the updates' float32 rounding,
/// carried through the training.
pub fn assert_single_process_matches_plain(
    program: &str,
    plain: &str,
    args: impl Fn(&str) -> Vec<String>,
    dir: &Path,
) {
    assert_single_process_matches_plain_within(program, plain, args, dir, 1e-4)
}

/// [`assert_single_process_matches_plain`] with the default optimizer's `tolerance`.
pub fn assert_single_process_matches_plain_within(
    program: &str,
    plain: &str,
    args: impl Fn(&str) -> Vec<String>,
    dir: &Path,
    tolerance: f64,
) {
    let run = |name: &str, exe: &str, optimizer: Option<&str>| {
        let sub = dir.join(name);
        std::fs::create_dir_all(&sub).unwrap();
        let out = sub.join("out.safetensors");
        let args = args(out.to_str().unwrap());
        let mut cmd = Command::new(exe);
        without_launcher(&mut cmd).args(&args);
        if let Some(o) = optimizer {
            cmd.env("TCH_DISTRIBUTED_OPTIMIZER", o);
        }
        let run = run_with(cmd, &sub, TIMEOUT, |_, _| {});
        run.assert_success();
        (run, out)
    };
    let plain_run = run("plain", plain, None);
    let tch = run("distributed-tch", program, Some("tch"));
    assert_eq!(
        program_output(&tch.0.stdout),
        program_output(&plain_run.0.stdout),
        "one process prints differently with the attribute"
    );
    assert_same_tensors(
        &read_tensors(&tch.1),
        &read_tensors(&plain_run.1),
        "one process with the attribute (tch's arithmetic) vs without",
    );
    let fused = run("distributed", program, None);
    assert_close(
        &read_tensors(&fused.1),
        &read_tensors(&plain_run.1),
        tolerance,
        "one process with the attribute (default optimizer) vs without",
    );
}

/// How far apart two sets of named tensors are, tensor by tensor under the same name,
/// through `tch_distributed_tests::compare`: panics on NaN, infinity, a missing name
/// or a shape mismatch.
pub fn difference(
    a: &BTreeMap<String, Tensor>,
    b: &BTreeMap<String, Tensor>,
) -> compare::Difference {
    let list = |m| -> Vec<(&String, &Tensor)> { BTreeMap::iter(m).collect() };
    compare::named(&list(a), &list(b))
}

/// Asserts that two sets of named tensors are within `tolerance` of each other (the
/// largest difference of an element, by [`difference`]); prints the difference.
pub fn assert_close(
    a: &BTreeMap<String, Tensor>,
    b: &BTreeMap<String, Tensor>,
    tolerance: f64,
    what: &str,
) {
    let diff = difference(a, b);
    eprintln!("{what}: {diff:?}");
    diff.assert_within(tolerance, what);
}

/// The fingerprints of the rows of `t` (see `tch_distributed::record`).
pub fn fingerprints(t: &Tensor) -> HashSet<u64> {
    tch_distributed::record::fingerprint_rows(t)
        .into_iter()
        .collect()
}

/// Writes `chars` characters from a fixed xorshift stream (`seed`) over 30 characters
/// (no newline, so that a sample stays on its line) to `dir/input.txt`, for programs
/// that read it with `TextData` and loop over `iter_shuffle(window, batch)`. Returns
/// its path, the fingerprints of every window such a loop can yield (asserting that
/// they are all distinct, and of `TextDataIter`'s dtype and shape), and how many
/// batches an epoch has (`TextDataIter` drops the incomplete last batch).
pub fn write_text_data(
    dir: &Path,
    chars: usize,
    seed: u64,
    window: i64,
    batch: usize,
) -> (PathBuf, HashSet<u64>, usize) {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz ,.;";
    let mut state = seed;
    let text: Vec<u8> = (0..chars)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ALPHABET[(state % ALPHABET.len() as u64) as usize]
        })
        .collect();
    let path = dir.join("input.txt");
    std::fs::write(&path, text).unwrap();
    let data = tch::data::TextData::new(&path).unwrap();
    let windows = data.data().unfold(0, window, 1);
    let _rng = RNG.lock().unwrap_or_else(|e| e.into_inner());
    let n = windows.size()[0] as usize;
    assert_eq!(n, chars + 1 - window as usize, "windows of {window}");
    let first = data.iter_shuffle(window, batch as i64).next().unwrap();
    assert_eq!(first.kind(), windows.kind(), "TextDataIter's dtype");
    assert_eq!(first.size(), [batch as i64, window]);
    let universe = fingerprints(&windows);
    assert_eq!(universe.len(), n, "every window of the text is distinct");
    assert!(fingerprints(&first).is_subset(&universe));
    (path, universe, n / batch)
}

/// Ten well separated base colours, one per class (`write_resnet_data`).
const PALETTE: [[u8; 3]; 10] = [
    [200, 40, 40],
    [40, 200, 40],
    [40, 40, 200],
    [200, 200, 40],
    [200, 40, 200],
    [40, 200, 200],
    [120, 120, 120],
    [230, 230, 230],
    [30, 30, 30],
    [230, 130, 30],
];

/// The side of `write_resnet_data`'s images.
const RESNET_SIZE: i64 = 16;

/// `n` distinct one-colour images (uint8, [n, 3, RESNET_SIZE, RESNET_SIZE]) and their
/// labels.
fn one_colour_images(n: usize, state: &mut u64, seen: &mut HashSet<[u8; 3]>) -> (Tensor, Tensor) {
    let mut next = || {
        *state ^= *state >> 12;
        *state ^= *state << 25;
        *state ^= *state >> 27;
        state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33
    };
    let mut colours = Vec::with_capacity(n * 3);
    let mut labels = Vec::with_capacity(n);
    while labels.len() < n {
        let k = (next() % 10) as usize;
        let colour = PALETTE[k].map(|c| (c as i64 + (next() % 49) as i64 - 24).clamp(0, 255) as u8);
        if seen.insert(colour) {
            colours.extend(colour);
            labels.push(k as i64);
        }
    }
    let images = Tensor::from_slice(&colours)
        .view([n as i64, 3, 1, 1])
        .expand([n as i64, 3, RESNET_SIZE, RESNET_SIZE], false)
        .contiguous();
    (images, Tensor::from_slice(&labels))
}

/// Writes the `resnet` program's data file (`dir/cifar.safetensors`, `train` and
/// `test` distinct one-colour images, each labelled with the palette colour it was
/// jittered from); returns its path and the fingerprints of its training images as
/// the program sees them (scaled to [0, 1]).
pub fn write_resnet_data(dir: &Path, train: usize, test: usize) -> (String, HashSet<u64>) {
    let mut state = 0x9e37_79b9_7f4a_7c15;
    let mut seen = HashSet::new();
    let (train_images, train_labels) = one_colour_images(train, &mut state, &mut seen);
    let (test_images, test_labels) = one_colour_images(test, &mut state, &mut seen);
    let path = dir.join("cifar.safetensors");
    Tensor::write_safetensors(
        &[
            ("train_images", &train_images),
            ("train_labels", &train_labels),
            ("test_images", &test_images),
            ("test_labels", &test_labels),
        ],
        &path,
    )
    .unwrap();
    let universe = fingerprints(&(train_images.to_kind(tch::Kind::Float) / 255.0));
    assert_eq!(universe.len(), train, "the training images are distinct");
    (path.to_str().unwrap().to_string(), universe)
}

/// Writes the `finetune` program's data: the MNIST files (`train` training and 64 test
/// images) and the pretrained weights (`program pretrain`, one process, 1 epoch);
/// returns the weights' path and the fingerprints of the training images.
pub fn write_finetune_data(program: &str, dir: &Path, train: usize) -> (String, HashSet<u64>) {
    tch_distributed_tests::write_mnist(dir, train, 64);
    let m = tch::vision::mnist::load_dir(dir).unwrap();
    let weights = dir.join("pretrained.safetensors");
    let pre = dir.join("pretrain");
    std::fs::create_dir_all(&pre).unwrap();
    let run = run_alone(
        program,
        &[
            "pretrain",
            dir.to_str().unwrap(),
            weights.to_str().unwrap(),
            "1",
        ],
        &pre,
    );
    assert_printed(&run.stdout, "pretrain epoch:", 1);
    (
        weights.to_str().unwrap().to_string(),
        fingerprints(&m.train_images),
    )
}
