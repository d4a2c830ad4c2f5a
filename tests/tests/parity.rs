//! Numerical parity with PyTorch: the same 2-rank data-parallel training, written as
//! plain tch code under `#[distributed]` (`parity_worker`, under `tchrun`) and with
//! `torch.nn.parallel.DistributedDataParallel` and `torch.optim` (`tests/parity/torch_ddp.py`,
//! in the Python that `tch_distributed_tests::python` finds), both over gloo, from the
//! same initial weights and with the same per-rank batches, gives the same parameters
//! after 1, 10 and 100 steps of SGD with momentum, Adam, AdamW and RMSprop.
//!
//! Both sides run the same libtorch (2.11.0) kernels for the forward pass (`at::linear`,
//! `tanh`, `mse_loss`), the backward pass and the `c10d::Reducer` that averages the
//! gradients (each rank's gradient divided by 2, then one gloo all-reduce sum, which is
//! commutative for 2 operands), so the gradients are the same bits. What remains is the
//! optimizers' arithmetic, and it is the same too: the SDK's optimizer runs ATen's fused
//! kernels for SGD, Adam and AdamW and `torch.optim`'s multi-tensor arithmetic for
//! RMSprop by default, and the Python side asks for the same (`fused=True`,
//! `foreach=True`), so every parameter is bit for bit PyTorch's at every step checked.
//! (With tch's own arithmetic, `optimizer = "tch"`, Adam would differ by float32
//! rounding: C++ updates the first moment with `mul_` and `add_`, Python with `lerp_`;
//! `tests/tests/optimizer_parity.rs` measures it.)
//!
//! A second case, `batchnorm_convnet_matches_ddp_with_broadcast_buffers`
//! (`parity_bn_worker`, `tests/parity/torch_ddp_bn.py`), trains a convnet with batch
//! norms against `DistributedDataParallel(broadcast_buffers=True)` and compares the
//! running statistics too.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tch::{Kind, Tensor};
use tch_distributed_tests::compare::{files as compare, files_where as compare_where, Difference};
use tch_distributed_tests::{run_tchrun, run_with, scratch_dir};

const WORKER: &str = env!("CARGO_BIN_EXE_parity_worker");
const BN_WORKER: &str = env!("CARGO_BIN_EXE_parity_bn_worker");

/// Writes the BatchNorm case's `DIR/data.safetensors` (`x`: 80 × 1 × 8 × 8 images,
/// `y`: 80 class indices in 0..4, the quadrant of largest sum) and `DIR/init.safetensors`
/// (the convnet's weights, drawn as PyTorch's `nn.Conv2d`/`nn.Linear` draw them, its
/// batch norms' affine weights around 1 and biases around 0, and their running
/// statistics at their initial zeros and ones, under the VarStore's names).
fn write_bn_fixture(dir: &Path) {
    tch::manual_seed(20240608);
    let cpu = (Kind::Float, tch::Device::Cpu);
    let x = Tensor::randn([80, 1, 8, 8], cpu);
    let y = x
        .view([80, 2, 4, 2, 4])
        .sum_dim_intlist([2, 4].as_slice(), false, Kind::Float)
        .view([80, 4])
        .argmax(1, false);
    let uniform = |shape: &[i64], lo: f64, hi: f64| Tensor::rand(shape, cpu) * (hi - lo) + lo;
    let fan_in = |shape: &[i64], fan_in: f64| {
        let bound = 1.0 / fan_in.sqrt();
        uniform(shape, -bound, bound)
    };
    let weights = [
        ("c1.weight", fan_in(&[4, 1, 3, 3], 9.0)),
        ("c1.bias", fan_in(&[4], 9.0)),
        ("bn1.weight", uniform(&[4], 0.5, 1.5)),
        ("bn1.bias", uniform(&[4], -0.1, 0.1)),
        ("bn1.running_mean", Tensor::zeros([4], cpu)),
        ("bn1.running_var", Tensor::ones([4], cpu)),
        ("c2.weight", fan_in(&[8, 4, 3, 3], 36.0)),
        ("c2.bias", fan_in(&[8], 36.0)),
        ("bn2.weight", uniform(&[8], 0.5, 1.5)),
        ("bn2.bias", uniform(&[8], -0.1, 0.1)),
        ("bn2.running_mean", Tensor::zeros([8], cpu)),
        ("bn2.running_var", Tensor::ones([8], cpu)),
        ("l.weight", fan_in(&[4, 128], 128.0)),
        ("l.bias", fan_in(&[4], 128.0)),
    ];
    Tensor::write_safetensors(&[("x", &x), ("y", &y)], dir.join("data.safetensors")).unwrap();
    let weights: Vec<(&str, &Tensor)> = weights.iter().map(|(n, t)| (*n, t)).collect();
    Tensor::write_safetensors(&weights, dir.join("init.safetensors")).unwrap();
}

#[test]
fn sgd_adam_adamw_and_rmsprop_match_pytorch_ddp_on_two_ranks() {
    let dir = scratch_dir("parity");
    let d = dir.to_str().unwrap();
    tch_distributed_tests::write_mlp_fixture(&dir, 20240607, 64);

    let run = run_tchrun(
        &dir,
        &["--nproc-per-node", "2", WORKER, d],
        Duration::from_secs(120),
        |_, _| {},
    );
    run.assert_success();
    assert!(
        ["sgd", "adam", "adamw", "rmsprop"]
            .iter()
            .all(|kind| run.stdout.contains(&format!("{kind}: 100 steps"))),
        "{}",
        run.stdout
    );

    // Without PyTorch the comparison is recorded as skipped (a failure under CI=true).
    let Some(python) = tch_distributed_tests::python_or_skip("comparison with PyTorch DDP") else {
        return;
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("parity/torch_ddp.py");
    let mut cmd = Command::new(&python);
    cmd.arg(&script).arg(d);
    run_with(cmd, &dir, Duration::from_secs(120), |_, _| {}).assert_success();

    // The reference is the PyTorch of the libtorch this build links (2.11 for tch
    // 0.24, 2.13 for tch 0.26), not some other one.
    let torch =
        tch_distributed_tests::run_python("import torch; print(torch.__version__)", &[], "")
            .expect("the Python that ran the reference");
    let torch = torch.trim();
    assert!(
        torch.starts_with(tch_distributed::LIBTORCH_VERSION),
        "PyTorch {torch} against libtorch {}",
        tch_distributed::LIBTORCH_VERSION
    );
    let mut report = format!(
        "parity with PyTorch {torch} DDP (2 ranks, gloo), max |ours - theirs| of the parameters:\n",
    );
    let mut diffs = BTreeMap::new();
    for kind in ["sgd", "adam", "adamw", "rmsprop"] {
        for step in [1, 10, 100] {
            let file = |side: &str| dir.join(format!("{side}-{kind}-{step}.safetensors"));
            let diff = compare(&file("rust"), &file("torch"));
            report.push_str(&format!(
                "  {kind:7} step {step:3}: {:.3e} ({} of {} elements differ in their bits)\n",
                diff.max_abs, diff.differing, diff.elements
            ));
            diffs.insert((kind, step), diff);
        }
    }
    // Written to the stderr stream itself, which the test harness does not capture:
    // the numbers show with or without `--nocapture`.
    std::io::stderr().write_all(report.as_bytes()).unwrap();

    let trained = compare(
        &dir.join("init.safetensors"),
        &dir.join("rust-sgd-100.safetensors"),
    );
    assert!(trained.max_abs > 0.01, "the parameters moved: {trained:?}");
    for ((kind, step), diff) in &diffs {
        assert_eq!(
            diff.differing, 0,
            "{kind}, step {step}: bit for bit\n{report}"
        );
    }
}

/// ZeRO stage 1 against PyTorch's `ZeroRedundancyOptimizer`: the same 2-rank job with
/// `TCH_DISTRIBUTED_ZERO=1` on our side and each `torch.optim` optimizer (fused, or
/// foreach for RMSprop) wrapped in a `ZeroRedundancyOptimizer` on theirs. Each rank
/// updates its own share of the parameters with the same kernels and broadcasts it, so
/// the parameters are the same bits as each other's and as DDP's without ZeRO.
#[test]
fn zero_stage_1_matches_ddp_and_pytorchs_zero_redundancy_optimizer() {
    let dir = scratch_dir("parity-zero");
    let d = dir.to_str().unwrap();
    tch_distributed_tests::write_mlp_fixture(&dir, 20240607, 64);
    for (zero, prefix) in [("0", "rust"), ("1", "rust-zero")] {
        let mut cmd = Command::new(tch_distributed_tests::tchrun());
        cmd.args(["--nproc-per-node", "2", WORKER, d, prefix])
            .env("TCH_DISTRIBUTED_ZERO", zero);
        let run = run_with(cmd, &dir, Duration::from_secs(120), |_, _| {});
        run.assert_success();
        assert_eq!(
            run.stdout
                .contains("ZeRO stage 1 (optimizer state sharded over 2 ranks)"),
            zero == "1",
            "{}",
            run.stdout
        );
    }
    let Some(python) =
        tch_distributed_tests::python_or_skip("comparison with ZeroRedundancyOptimizer")
    else {
        return;
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("parity/torch_ddp.py");
    let mut cmd = Command::new(&python);
    cmd.arg(&script).arg(d).arg("zero");
    run_with(cmd, &dir, Duration::from_secs(180), |_, _| {}).assert_success();
    let mut report = String::from("ZeRO stage 1 (2 ranks, gloo), max |a - b| of the parameters:\n");
    let mut failures = Vec::new();
    for kind in ["sgd", "adam", "adamw", "rmsprop"] {
        for step in [1, 10, 100] {
            let file = |side: &str| dir.join(format!("{side}-{kind}-{step}.safetensors"));
            let ddp = compare(&file("rust"), &file("rust-zero"));
            let torch = compare(&file("torch-zero"), &file("rust-zero"));
            report += &format!(
                "  {kind:7} step {step:3}: ZeRO against DDP {:.3e}, against ZeroRedundancyOptimizer {:.3e}\n",
                ddp.max_abs, torch.max_abs
            );
            if ddp.differing != 0 || torch.differing != 0 {
                failures.push(format!("{kind} step {step}"));
            }
        }
    }
    std::io::stderr().write_all(report.as_bytes()).unwrap();
    assert!(
        failures.is_empty(),
        "not bit for bit: {failures:?}\n{report}"
    );
}

/// Gradient compression against PyTorch's hooks: the same 2-rank job with
/// `comm_hook = "fp16"` and `"bf16"` on our side (c10d's built-in `FP16_COMPRESS` hook,
/// and the shim's bf16 hook) and `fp16_compress_hook` / `bf16_compress_hook` (the
/// Python functions of `torch.distributed.algorithms.ddp_comm_hooks.default_hooks`) on
/// theirs. Both cast each bucket, divide it by 2, all-reduce it over Gloo and copy it
/// back, so the parameters are the same bits; and they differ from the uncompressed
/// run's by the compression's rounding.
#[test]
fn fp16_and_bf16_gradient_compression_match_pytorchs_comm_hooks() {
    let dir = scratch_dir("parity-hooks");
    let d = dir.to_str().unwrap();
    tch_distributed_tests::write_mlp_fixture(&dir, 20240607, 64);
    for (hook, prefix) in [
        ("none", "rust"),
        ("fp16", "rust-fp16"),
        ("bf16", "rust-bf16"),
    ] {
        let mut cmd = Command::new(tch_distributed_tests::tchrun());
        cmd.args([
            "--nproc-per-node",
            "2",
            "--comm-hook",
            hook,
            WORKER,
            d,
            prefix,
        ]);
        run_with(cmd, &dir, Duration::from_secs(120), |_, _| {}).assert_success();
    }
    let Some(python) =
        tch_distributed_tests::python_or_skip("comparison with PyTorch's comm hooks")
    else {
        return;
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("parity/torch_ddp.py");
    for hook in ["fp16", "bf16"] {
        let mut cmd = Command::new(&python);
        cmd.arg(&script).arg(d).arg(hook);
        run_with(cmd, &dir, Duration::from_secs(180), |_, _| {}).assert_success();
    }
    let mut report =
        String::from("gradient compression (2 ranks, gloo), max |a - b| of the parameters:\n");
    let mut failures = Vec::new();
    for hook in ["fp16", "bf16"] {
        for kind in ["sgd", "adam"] {
            for step in [1, 10, 100] {
                let file = |side: &str| dir.join(format!("{side}-{kind}-{step}.safetensors"));
                let ours = file(&format!("rust-{hook}"));
                let torch = compare(&file(&format!("torch-{hook}")), &ours);
                let uncompressed = compare(&file("rust"), &ours);
                report += &format!(
                    "  {hook} {kind:4} step {step:3}: against PyTorch's hook {:.3e}, against no hook {:.3e}\n",
                    torch.max_abs, uncompressed.max_abs
                );
                if torch.differing != 0 {
                    failures.push(format!("{hook} {kind} step {step}: not PyTorch's bits"));
                }
                if step == 100 && uncompressed.differing == 0 {
                    failures.push(format!("{hook} {kind}: the same as without compression"));
                }
            }
        }
    }
    std::io::stderr().write_all(report.as_bytes()).unwrap();
    assert!(failures.is_empty(), "{failures:?}\n{report}");
}

/// The BatchNorm case: a small convnet (conv → batch norm → relu, twice, then a linear
/// layer) trained in train mode with SGD and momentum for 10 steps, against
/// `DistributedDataParallel(broadcast_buffers=True)`. The batch norms' running
/// statistics are buffers (variables that are not trainable): PyTorch broadcasts rank
/// 0's at the start of each forward pass that follows a synchronized one, the SDK at the
/// end of each synchronized backward pass; either way every forward pass starts from
/// the same values, and rank 0's running statistics after the last step are the same.
/// PyTorch's rank 1 keeps its own last update, which the next forward pass would
/// replace; ours has rank 0's already, so only PyTorch's rank 0 is compared.
///
/// A forward pass in train mode normalizes with the batch's statistics and only
/// updates the running ones, so the parameters and rank 0's running statistics do not
/// depend on the broadcast at all. What does: rank 1's running statistics (checked
/// equal to rank 0's, which they are not without the broadcast, the ranks' batches
/// being different) and an evaluation forward pass on each rank after training, which
/// normalizes with them (compared with PyTorch's through DDP, which broadcasts rank 0's
/// buffers before it).
#[test]
fn batchnorm_convnet_matches_ddp_with_broadcast_buffers() {
    let dir = scratch_dir("parity-bn");
    let d = dir.to_str().unwrap();
    write_bn_fixture(&dir);

    let run = run_tchrun(
        &dir,
        &["--nproc-per-node", "2", BN_WORKER, d],
        Duration::from_secs(120),
        |_, _| {},
    );
    run.assert_success();
    assert!(run.stdout.contains("bn: 10 steps"), "{}", run.stdout);

    let is_stat = |name: &str| name.contains(".running_");
    let (rank0, rank1) = (
        dir.join("rust-rank0.safetensors"),
        dir.join("rust-rank1.safetensors"),
    );
    let saved = compare(&dir.join("rust.safetensors"), &rank0);
    assert_eq!(saved.differing, 0, "vs.save wrote rank 0's variables");
    let params = compare_where(&rank0, &rank1, |n| !is_stat(n));
    let stats = compare_where(&rank0, &rank1, is_stat);
    let mut report = format!(
        "BatchNorm convnet (2 ranks, gloo, 10 steps), ours, rank 1 against rank 0: \
         parameters {:.3e}, running statistics {:.3e}\n",
        params.max_abs, stats.max_abs
    );
    let init = dir.join("init.safetensors");
    let moved = (
        compare_where(&init, &rank0, |n| !is_stat(n)),
        compare_where(&init, &rank0, is_stat),
    );
    assert!(
        moved.0.max_abs > 0.01 && moved.1.max_abs > 0.01,
        "the parameters and the running statistics moved: {moved:?}"
    );
    assert_eq!(
        params.differing, 0,
        "every rank has the same parameters\n{report}"
    );
    assert_eq!(
        stats.differing, 0,
        "every rank has rank 0's running statistics\n{report}"
    );

    // As in `sgd_adam_adamw_and_rmsprop_match_pytorch_ddp_on_two_ranks`.
    let Some(python) = tch_distributed_tests::python_or_skip("comparison with PyTorch DDP") else {
        std::io::stderr().write_all(report.as_bytes()).unwrap();
        return;
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("parity/torch_ddp_bn.py");
    let mut cmd = Command::new(&python);
    cmd.arg(&script).arg(d);
    run_with(cmd, &dir, Duration::from_secs(120), |_, _| {}).assert_success();

    let theirs = dir.join("torch.safetensors");
    let params = compare_where(&rank0, &theirs, |n| !is_stat(n));
    let stats = compare_where(&rank0, &theirs, is_stat);
    report.push_str(&format!(
        "  against PyTorch DDP(broadcast_buffers=True), rank 0, max |ours - theirs|: \
         parameters {:.3e} ({} of {} elements differ in their bits), \
         running statistics {:.3e} ({} of {} differ)\n",
        params.max_abs,
        params.differing,
        params.elements,
        stats.max_abs,
        stats.differing,
        stats.elements
    ));
    let eval: Vec<Difference> = (0..2)
        .map(|r| {
            let file = |side: &str| dir.join(format!("{side}-eval-rank{r}.safetensors"));
            compare(&file("rust"), &file("torch"))
        })
        .collect();
    for (r, diff) in eval.iter().enumerate() {
        report.push_str(&format!(
            "  evaluation logits (running statistics in use), rank {r}: {:.3e} ({} of {} differ)\n",
            diff.max_abs, diff.differing, diff.elements
        ));
    }
    std::io::stderr().write_all(report.as_bytes()).unwrap();
    assert!(params.max_abs <= 1e-6, "parameters\n{report}");
    assert!(stats.max_abs <= 1e-6, "running statistics\n{report}");
    for (r, diff) in eval.iter().enumerate() {
        assert!(diff.max_abs <= 1e-6, "evaluation on rank {r}\n{report}");
    }
}
