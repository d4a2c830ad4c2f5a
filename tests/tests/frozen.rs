//! Frozen variables under sharding: a LoRA-style program (a base frozen after it is
//! built, trainable low-rank adapters; `src/bin/frozen_worker.rs`) at ZeRO stages 1, 2
//! and 3, with and without `fully_shard` units, on 2 and 4 ranks, against DDP on the
//! same ranks and data. Reading the variables between steps, inside
//! `summon_full_params` and after the function returns.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tch_distributed_tests::compare::{files as compare, files_where, named_where, read};

use tch_distributed_tests::{run_with, scratch_dir, tchrun};

const WORKER: &str = env!("CARGO_BIN_EXE_frozen_worker");
const TIMEOUT: Duration = Duration::from_secs(120);

/// `frozen_worker DIR OUT` on `ranks` ranks with `TCH_DISTRIBUTED_ZERO=zero` and
/// `env`; returns rank 0's stdout.
fn run(dir: &Path, ranks: usize, zero: u8, out: &str, env: &[(&str, &str)]) -> String {
    let mut cmd = Command::new(tchrun());
    cmd.args(["--nproc-per-node", &ranks.to_string(), WORKER])
        .args([dir.to_str().unwrap(), out])
        .env("TCH_DISTRIBUTED_ZERO", zero.to_string())
        .envs(env.iter().copied());
    let run = run_with(cmd, dir, TIMEOUT, |_, _| {});
    run.assert_success();
    run.stdout
}

/// The largest difference between two files' tensors of one name, relative to the
/// largest magnitude in the first file's tensor (the average is taken in another order
/// on each side, so the last bits differ).
fn relative(a: &Path, b: &Path) -> f64 {
    let (a, b) = (read(a), read(b));
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(&b)
        .map(|((na, x), (nb, y))| {
            assert_eq!(na, nb);
            let scale = x.abs().max().double_value(&[]).max(f64::MIN_POSITIVE);
            (x - y).abs().max().double_value(&[]) / scale
        })
        .fold(0.0, f64::max)
}

fn is_base(name: &str) -> bool {
    name.contains(".base.")
}

/// Every stage trains the adapters as DDP does (DDP averages only the variables that
/// require a gradient), and leaves the frozen base exactly as it was built: stage 3
/// shards the base with its unit and gathers it around the unit's passes, stages 1 and
/// 2 leave it out of the shards; on 4 ranks, hybrid sharding (2 shard groups of 2) too.
/// `save_trainable` writes the adapters alone.
#[test]
fn a_frozen_base_with_adapters_trains_as_ddp_at_every_stage() {
    let dir = scratch_dir("frozen");
    for ranks in [2, 4] {
        let ddp = format!("ddp{ranks}.safetensors");
        run(&dir, ranks, 0, &ddp, &[("INIT_OUT", "1")]);
        let init = dir.join(format!("{ddp}.init.safetensors"));
        // The adapters trained; the base did not move.
        let moved = files_where(&init, &dir.join(&ddp), |n| !is_base(n));
        assert!(moved.max_abs > 1e-3, "DDP trained the adapters: {moved:?}");
        assert!(files_where(&init, &dir.join(&ddp), is_base).is_exact());
        let mut runs = vec![
            (1, false, false),
            (2, false, false),
            (2, true, false),
            (3, false, false),
            (3, true, false),
        ];
        if ranks == 4 {
            // Hybrid sharding: 2 shard groups of 2 ranks.
            runs.extend([(2, false, true), (3, true, true)]);
        }
        for (zero, units, hybrid) in runs {
            let out = format!("zero{zero}-units{units}-hybrid{hybrid}-{ranks}.safetensors");
            let mut env = vec![("INIT_OUT", "1")];
            if units {
                env.push(("UNITS", "1"));
            }
            if hybrid {
                env.push(("TCH_DISTRIBUTED_SHARD_GROUP", "2"));
            }
            let stdout = run(&dir, ranks, zero, &out, &env);
            assert!(stdout.contains(&format!("ZeRO stage {zero} (")), "{stdout}");
            // Stage 3's units are sharded as they are built, from the values every
            // rank would have drawn unsharded.
            let sharded = if (zero, units) == (3, true) { 12 } else { 0 };
            assert!(
                stdout.contains(&format!("variables sharded as built: {sharded}\n")),
                "{stdout}"
            );
            let init_here = dir.join(format!("{out}.init.safetensors"));
            assert!(
                compare(&init, &init_here).is_exact(),
                "{out}: another start"
            );
            let diff = relative(&dir.join(&ddp), &dir.join(&out));
            eprintln!("{out}: {diff:e} relative");
            assert!(diff < 1e-6, "{out}: {diff:e}");
            let base = files_where(&init, &dir.join(&out), is_base);
            assert!(base.is_exact(), "the base moved: {base:?}");
            // The adapters' file: the trainable variables, as the model has them.
            let adapters = read(&dir.join(format!("{out}.adapter.safetensors")));
            let names: Vec<&str> = adapters.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(
                names,
                [
                    "layers.0.lora_a",
                    "layers.0.lora_b",
                    "layers.1.lora_a",
                    "layers.1.lora_b",
                    "layers.2.lora_a",
                    "layers.2.lora_b"
                ]
            );
            let mut model = read(&dir.join(&out));
            model.retain(|(n, _)| !is_base(n));
            assert!(named_where(&model, &adapters, |_| true).is_exact());
        }
    }
}

/// Reading every variable directly after each step gives its value, or (a stage-3
/// unit's, resharded) an error that names it: never a signal. Inside
/// `summon_full_params` every variable reads whole, with the values DDP has after the
/// same step; after the function returns, every rank holds the whole model, DDP's.
#[test]
fn variables_read_between_steps_and_after_the_return() {
    let dir = scratch_dir("frozen-read");
    let read_env = [("READ", "1"), ("UNITS", "1")];
    run(&dir, 2, 0, "ddp.safetensors", &read_env);
    run(&dir, 2, 3, "zero3.safetensors", &read_env);
    let sums = |out: &str, rank: usize| -> Vec<Vec<(String, f64)>> {
        std::fs::read_to_string(dir.join(format!("{out}.sums-{rank}")))
            .unwrap()
            .lines()
            .map(|line| {
                line.split(' ')
                    .map(|pair| {
                        let (name, value) = pair.split_once('=').unwrap();
                        (name.to_string(), value.parse().unwrap())
                    })
                    .collect()
            })
            .collect()
    };
    let reference = sums("ddp.safetensors", 0);
    assert_eq!(reference.len(), 8, "a line a step");
    for rank in 0..2 {
        let ours = sums("zero3.safetensors", rank);
        assert_eq!(ours.len(), 8);
        for (step, (a, b)) in reference.iter().zip(&ours).enumerate() {
            assert_eq!(a.len(), 12, "every variable read");
            for ((na, x), (nb, y)) in a.iter().zip(b) {
                assert_eq!(na, nb);
                assert!(
                    (x - y).abs() <= 1e-5 * x.abs().max(1.0),
                    "rank {rank}, step {step}, {na}: {x} vs {y}"
                );
            }
        }
        // After the return, the whole model on every rank.
        let after = dir.join(format!("zero3.safetensors.after-{rank}.safetensors"));
        let diff = compare(&dir.join("ddp.safetensors"), &after);
        assert!(
            diff.max_abs < 1e-6,
            "rank {rank} after the return: {diff:?}"
        );
    }
}

/// The frozen base's unit (stage 3) with what else a fine-tuning job turns on: bf16
/// mixed precision (units gathered in bf16), gradient accumulation (full gradients kept
/// over the cycle), clipping, and every layer activation-checkpointed (the unit gathered
/// again for the recompute, whose inputs' gradients reshard it): each ends where DDP
/// with the same settings ends, the base exactly as built.
#[test]
fn a_frozen_base_trains_as_ddp_with_mixed_precision_accumulation_and_checkpointing() {
    let dir = scratch_dir("frozen-settings");
    let cases: [(&str, &[(&str, &str)]); 3] = [
        ("bf16", &[("TCH_DISTRIBUTED_MIXED_PRECISION", "bf16")]),
        ("accum", &[("TCH_DISTRIBUTED_GRAD_ACCUM", "2")]),
        ("checkpoint", &[("CHECKPOINT", "1")]),
    ];
    for (name, env) in cases {
        let env = [env, &[("UNITS", "1"), ("INIT_OUT", "1")]].concat();
        let ddp = format!("{name}-ddp.safetensors");
        run(&dir, 2, 0, &ddp, &env);
        let out = format!("{name}-zero3.safetensors");
        run(&dir, 2, 3, &out, &env);
        let diff = relative(&dir.join(&ddp), &dir.join(&out));
        eprintln!("{name}: {diff:e} relative");
        assert!(diff < 1e-6, "{name}: {diff:e}");
        let init = dir.join(format!("{ddp}.init.safetensors"));
        assert!(
            files_where(&init, &dir.join(&out), is_base).is_exact(),
            "{name}: the base moved"
        );
        let moved = files_where(&init, &dir.join(&out), |n| !is_base(n));
        assert!(
            moved.max_abs > 1e-3,
            "{name}: the adapters trained: {moved:?}"
        );
    }
}
