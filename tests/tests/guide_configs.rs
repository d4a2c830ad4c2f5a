//! The guides' own configuration files: `deepspeed = FILE` (`tchrun --deepspeed FILE`,
//! `TCH_DISTRIBUTED_DEEPSPEED`), DeepSpeed's JSON, and `tchrun --config
//! default_config.yaml`, Accelerate's, read into the run's settings, against the same
//! run with those settings spelled out (each key's documented meaning) and, for
//! clipping, the program's own.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use tch_distributed_tests::compare::files as compare;
use tch_distributed_tests::{run_with, scratch_dir, tchrun, Run};

const WORKER: &str = env!("CARGO_BIN_EXE_sharding_worker");
const TIMEOUT: Duration = Duration::from_secs(120);

/// The FSDP/DeepSpeed guide's `ds_config.json`, verbatim.
fn guide() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/ds_config.json")
}

/// `tchrun ARGS sharding_worker DIR OUT` on 2 ranks with `env`.
fn run(dir: &Path, args: &[&str], out: &str, env: &[(&str, &str)]) -> Run {
    run_as(dir, &[&["--nproc-per-node", "2"], args].concat(), out, env)
}

/// `tchrun ARGS sharding_worker DIR OUT` with `env`.
fn run_as(dir: &Path, args: &[&str], out: &str, env: &[(&str, &str)]) -> Run {
    let mut cmd = Command::new(tchrun());
    cmd.args(args)
        .arg(WORKER)
        .args([dir.to_str().unwrap(), out])
        .envs(env.iter().copied());
    run_with(cmd, dir, TIMEOUT, |_, _| {})
}

/// The guide's file, as it is: ZeRO-2 with the optimizer offloaded (nothing to offload
/// on the CPU), bf16, gradient clipping at 1.0, 2e8-element buckets, AdamW over the
/// program's Adam (its options "auto": the program's), WarmupLR with its "auto"
/// params (DeepSpeed's defaults: log warmup from 0 to the program's rate over 1000
/// steps), "auto" for the rest. The run is the one with those settings given one by one, bit for bit, and
/// its clipping is the program's own `clip_grad_norm(1.0)` at each step, bit for bit.
/// The keys that change nothing here are listed once.
#[test]
fn the_guides_ds_config_is_its_settings_spelled_out() {
    let dir = scratch_dir("deepspeed");
    let guide = guide();
    let from_file = run(
        &dir,
        &["--deepspeed", guide.to_str().unwrap()],
        "file.safetensors",
        &[],
    );
    from_file.assert_success();
    for needle in [
        "ZeRO stage 2 (",
        "mixed precision bf16",
        "offload = optimizer: nothing to offload on the CPU",
        "DeepSpeed configuration ",
    ] {
        assert!(
            from_file.stdout.contains(needle),
            "{needle}: {}",
            from_file.stdout
        );
    }
    assert!(
        from_file
            .stderr
            .contains("these keys change nothing here: ")
            && from_file.stderr.contains("zero_optimization.overlap_comm"),
        "{}",
        from_file.stderr
    );
    let spelled = [
        ("ADAMW", "1"),
        ("WARMUP_LR", "1000"),
        ("TCH_DISTRIBUTED_ZERO", "2"),
        ("TCH_DISTRIBUTED_OFFLOAD", "optimizer"),
        ("TCH_DISTRIBUTED_MIXED_PRECISION", "bf16"),
        ("TCH_DISTRIBUTED_GRADIENT_CLIPPING", "1"),
        ("TCH_DISTRIBUTED_REDUCE_BUCKET_MB", "762.939453125"),
    ];
    run(&dir, &[], "spelled.safetensors", &spelled).assert_success();
    let diff = compare(
        &dir.join("spelled.safetensors"),
        &dir.join("file.safetensors"),
    );
    assert!(diff.is_exact(), "the file against its settings: {diff:?}");
    // The program clipping at 1.0 itself, without the setting.
    let program = [&spelled[..5], &[("CLIP", "1.0")]].concat();
    run(&dir, &[], "program.safetensors", &program).assert_success();
    let diff = compare(
        &dir.join("program.safetensors"),
        &dir.join("file.safetensors"),
    );
    assert!(
        diff.is_exact(),
        "gradient_clipping against clip_grad_norm: {diff:?}"
    );
    // Clipping did something: without it the run ends elsewhere.
    run(&dir, &[], "unclipped.safetensors", &spelled[..5]).assert_success();
    let diff = compare(
        &dir.join("unclipped.safetensors"),
        &dir.join("file.safetensors"),
    );
    assert!(diff.max_abs > 1e-4, "clipping changed nothing: {diff:?}");
    // The schedule did something: without it the run ends elsewhere.
    let constant = [&spelled[..1], &spelled[2..]].concat();
    run(&dir, &[], "constant.safetensors", &constant).assert_success();
    let diff = compare(
        &dir.join("constant.safetensors"),
        &dir.join("file.safetensors"),
    );
    assert!(
        diff.max_abs > 1e-4,
        "the scheduler changed nothing: {diff:?}"
    );
}

/// A setting given both by the file and by the run, to other values, and batch sizes
/// that do not multiply out, are errors that name both places or all three values.
#[test]
fn a_conflict_with_the_run_and_inconsistent_batch_sizes_are_errors() {
    let dir = scratch_dir("deepspeed-errors");
    let guide = guide();
    let conflict = run(
        &dir,
        &["--deepspeed", guide.to_str().unwrap(), "--zero", "3"],
        "conflict.safetensors",
        &[],
    );
    assert!(!conflict.status.success(), "{conflict:?}");
    assert!(
        conflict
            .stderr
            .contains("zero_optimization.stage gives zero = 2, and the run gives zero = 3"),
        "{}",
        conflict.stderr
    );
    let file = dir.join("batch.json");
    std::fs::write(
        &file,
        r#"{"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}"#,
    )
    .unwrap();
    let batch = run(
        &dir,
        &["--deepspeed", file.to_str().unwrap()],
        "batch.safetensors",
        &[],
    );
    assert!(!batch.status.success(), "{batch:?}");
    assert!(
        batch.stderr.contains(
            "train_batch_size 10 is not train_micro_batch_size_per_gpu 4 × \
             gradient_accumulation_steps 1 × 2 ranks = 8"
        ),
        "{}",
        batch.stderr
    );
}

/// Files written by Accelerate 1.15 itself (`examples/accelerate/`, by its own
/// `ClusterConfig.to_yaml_file`): `multi_cpu.yaml` (MULTI_CPU, 2 processes) launches 2
/// ranks over Gloo, as `--nproc-per-node 2` does, bit for bit; `fsdp.yaml` (FSDP2,
/// `reshard_after_forward: true`, bf16, 2 processes) runs ZeRO-3 in bf16 on 2 ranks, as
/// those settings spelled out do, bit for bit.
#[test]
fn accelerates_own_config_files_launch_the_job_they_describe() {
    let dir = scratch_dir("accelerate-configs");
    let file = |name: &str| {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../examples/accelerate")
            .join(name)
            .to_str()
            .unwrap()
            .to_string()
    };
    let cpu = run_as(
        &dir,
        &["--config", &file("multi_cpu.yaml")],
        "cpu.safetensors",
        &[],
    );
    cpu.assert_success();
    assert!(
        cpu.stdout.contains("backend gloo, world size 2,"),
        "{}",
        cpu.stdout
    );
    run(&dir, &[], "two.safetensors", &[]).assert_success();
    let diff = compare(&dir.join("two.safetensors"), &dir.join("cpu.safetensors"));
    assert!(diff.is_exact(), "multi_cpu.yaml: {diff:?}");
    let fsdp = run_as(
        &dir,
        &["--config-file", &file("fsdp.yaml")],
        "fsdp.safetensors",
        &[],
    );
    fsdp.assert_success();
    assert!(fsdp.stdout.contains("ZeRO stage 3 ("), "{}", fsdp.stdout);
    assert!(
        fsdp.stderr.contains("fsdp_config.fsdp_auto_wrap_policy"),
        "{}",
        fsdp.stderr
    );
    let spelled = [
        ("TCH_DISTRIBUTED_ZERO", "3"),
        ("TCH_DISTRIBUTED_MIXED_PRECISION", "bf16"),
    ];
    run(&dir, &[], "zero3.safetensors", &spelled).assert_success();
    let diff = compare(
        &dir.join("zero3.safetensors"),
        &dir.join("fsdp.safetensors"),
    );
    assert!(diff.is_exact(), "fsdp.yaml: {diff:?}");
}
