//! ZeRO stages 2 and 3 (`zero = 2|3`, `TCH_DISTRIBUTED_ZERO`): parameters, gradients
//! and optimizer state sharded on dim 0, with FSDP2's semantics. The reference is DDP
//! (`zero = 0`) on the same ranks and data: the same arithmetic up to the order in
//! which the average is taken.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tch_distributed_tests::compare::files as compare;
use tch_distributed_tests::{
    copy_dir, run_with, scratch_dir, state_bytes, tchrun, without_launcher,
};

const WORKER: &str = env!("CARGO_BIN_EXE_sharding_worker");
const TIMEOUT: Duration = Duration::from_secs(120);

/// `sharding_worker DIR OUT` on `ranks` ranks with `TCH_DISTRIBUTED_ZERO=zero` and
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

/// Rank RANK's `Optimizer::sharding_stats` of run OUT: all-gathers, prefetched ones,
/// reduce-scatters, all-gathered bytes, reduce-scatters at the step.
fn stats_of(dir: &Path, out: &str, rank: usize) -> Vec<u64> {
    std::fs::read_to_string(dir.join(format!("{out}.stats-{rank}")))
        .unwrap()
        .split(' ')
        .map(|n| n.parse().unwrap())
        .collect()
}

/// Rank 0's [`stats_of`].
fn stats(dir: &Path, out: &str) -> Vec<u64> {
    stats_of(dir, out, 0)
}

#[test]
fn stages_2_and_3_train_as_ddp_with_and_without_units() {
    let dir = scratch_dir("sharding");
    for ranks in [2, 4] {
        let ddp = format!("ddp{ranks}.safetensors");
        run(&dir, ranks, 0, &ddp, &[("EVAL_FIRST", "1")]);
        let whole = state_bytes(&dir, &ddp, 0);
        for (zero, units) in [(2, false), (2, true), (3, false), (3, true)] {
            let out = format!("zero{zero}-units{units}-{ranks}.safetensors");
            let env: &[(&str, &str)] = if units {
                &[("UNITS", "1"), ("EVAL_FIRST", "1")]
            } else {
                &[("EVAL_FIRST", "1")]
            };
            let stdout = run(&dir, ranks, zero, &out, env);
            assert!(stdout.contains(&format!("ZeRO stage {zero} (")), "{stdout}");
            let diff = compare(&dir.join(&ddp), &dir.join(&out));
            eprintln!("{ranks} ranks, zero {zero}, units {units}: {diff:?}");
            // Before the optimizer: a stage-3 unit sharded at its declaration passes on
            // its own, to DDP's loss.
            for rank in 0..ranks {
                let loss = |out: &str| -> f64 {
                    let path = dir.join(format!("{out}.initial-loss-{rank}"));
                    std::fs::read_to_string(path).unwrap().parse().unwrap()
                };
                let (want, got) = (loss(&ddp), loss(&out));
                assert!(
                    (got - want).abs() <= 1e-6 * want.abs(),
                    "{out}, rank {rank}: the loss before the optimizer {got}, DDP's {want}"
                );
            }
            assert!(
                diff.max_abs < 1e-6,
                "{ranks} ranks, zero {zero}, units {units}: {diff:?}"
            );
            // Every rank holds a 1/N chunk (padded) of each parameter's state:
            // l1 (13 × 6, 13), l2 (7 × 13, 7), l3 (3 × 7, 3), Adam's two moments and
            // the fused kernels' step count per tensor.
            let rows = |n: usize| n.div_ceil(ranks);
            let elements = rows(13) * 7 + rows(7) * 14 + rows(3) * 8;
            for r in 0..ranks {
                assert_eq!(
                    state_bytes(&dir, &out, r),
                    8 * elements + 4 * 6,
                    "{out}, rank {r}"
                );
            }
            assert_eq!(whole, 8 * (13 * 7 + 7 * 14 + 3 * 8) + 4 * 6);
            // At stage 3, a unit's parameters hold memory only around its passes;
            // the root's (l1) stay gathered.
            let freed = std::fs::read_to_string(dir.join(format!("{out}.freed-0"))).unwrap();
            let expected = match (zero, units) {
                (3, true) => "l2.bias l2.weight l3.bias l3.weight",
                _ => "",
            };
            assert_eq!(freed, expected, "{out}");
            // Per step: a reduce-scatter per unit; an all-gather per unit after the
            // step, but at stage 3 for the root (l1) after the step and for l2 and
            // l3 around their forward and backward passes, the next unit's started
            // during the compute of the one before: l3's forward from l2's (from the
            // second step on, once the first forward pass gave the order), l2's
            // backward from l3's (FSDP's prefetch).
            // At stage 3 the evaluation before the optimizer gathers l2 and l3 once
            // more each.
            let expected = match (zero, units) {
                (3, true) => [52, 19, 30],
                (_, true) => [30, 0, 30],
                _ => [10, 0, 10],
            };
            let stats = stats(&dir, &out);
            assert_eq!(
                stats[..3],
                expected,
                "{out}: all-gathers, prefetched, reduce-scatters"
            );
            // Every unit was complete in the backward pass, which reduce-scattered it.
            assert_eq!(stats[4], 0, "{out}: reduce-scatters at the step");
        }
    }
}

/// Without units, the gradients are reduce-scattered in buckets of at most the bucket
/// cap (`bucket_cap_mb`), as they become ready in the backward pass (DeepSpeed ZeRO-2's
/// `reduce_bucket_size`): with a cap below every variable's size, one bucket a
/// variable, so 6 reduce-scatters a step, all in the backward pass; with the default
/// cap, one. Clipping sees the norm over every bucket. The parameters are DDP's. At
/// stage 3, no unit means no parameter sharded: rank 0 says so.
#[test]
fn without_units_gradients_are_reduce_scattered_in_buckets_of_the_cap() {
    let dir = scratch_dir("sharding-buckets");
    let tiny = [
        ("TCH_DISTRIBUTED_BUCKET_CAP_MB", "0.00001"),
        ("CLIP", "0.05"),
    ];
    run(&dir, 2, 0, "ddp.safetensors", &tiny);
    for zero in [2, 3] {
        let out = format!("zero{zero}.safetensors");
        let mut cmd = Command::new(tchrun());
        cmd.args(["--nproc-per-node", "2", WORKER])
            .args([dir.to_str().unwrap(), &out])
            .env("TCH_DISTRIBUTED_ZERO", zero.to_string())
            .envs(tiny);
        let ran = run_with(cmd, &dir, TIMEOUT, |_, _| {});
        ran.assert_success();
        // Stage 3 with no unit shards no parameter, and says so once, naming the fix.
        let warning = "ZeRO stage 3 with no fully_shard unit: the parameters stay whole";
        let said = ran.stderr.matches(warning).count();
        assert_eq!(said, usize::from(zero == 3), "zero {zero}: {}", ran.stderr);
        assert!(
            zero == 2
                || ran
                    .stderr
                    .contains("tch_distributed::fully_shard(block, &path)")
        );
        let diff = compare(&dir.join("ddp.safetensors"), &dir.join(&out));
        assert!(diff.max_abs < 1e-6, "zero {zero}: {diff:?}");
        let stats = stats(&dir, &out);
        assert_eq!(
            [stats[0], stats[2], stats[4]],
            [10, 60, 0],
            "{out}: all-gathers, reduce-scatters, at the step"
        );
    }
    // `reduce_bucket_mb` caps the buckets of stages 2 and 3 apart from DDP's
    // `bucket_cap_mb`: alone, as the tiny cap above; over a tiny `bucket_cap_mb`, one
    // bucket a step.
    for (cap, reduce_scatters) in [(None, 60), (Some("0.00001"), 10)] {
        let out = format!("zero2-reduce-bucket-{reduce_scatters}.safetensors");
        let mut cmd = Command::new(tchrun());
        cmd.args(["--nproc-per-node", "2", WORKER])
            .args([dir.to_str().unwrap(), &out])
            .env("TCH_DISTRIBUTED_ZERO", "2")
            .env("CLIP", "0.05");
        match cap {
            Some(cap) => cmd
                .env("TCH_DISTRIBUTED_BUCKET_CAP_MB", cap)
                .env("TCH_DISTRIBUTED_REDUCE_BUCKET_MB", "25"),
            None => cmd.env("TCH_DISTRIBUTED_REDUCE_BUCKET_MB", "0.00001"),
        };
        run_with(cmd, &dir, TIMEOUT, |_, _| {}).assert_success();
        let diff = compare(&dir.join("ddp.safetensors"), &dir.join(&out));
        assert!(diff.max_abs < 1e-6, "{out}: {diff:?}");
        let stats = stats(&dir, &out);
        assert_eq!(
            [stats[2], stats[4]],
            [reduce_scatters, 0],
            "{out}: reduce-scatters"
        );
    }
}

/// Clipping sees the global norm over every rank's shards (FSDP2's `clip_grad_norm_`),
/// and accumulation keeps the full gradients until the cycle's last micro-batch:
/// both end where DDP ends with the same settings.
#[test]
fn clipping_and_accumulation_on_shards_match_ddp() {
    let dir = scratch_dir("sharding-clip-accum");
    let cases: [(&str, &[(&str, &str)]); 2] = [
        ("clip", &[("CLIP", "0.05")]),
        ("accum", &[("TCH_DISTRIBUTED_GRAD_ACCUM", "2")]),
    ];
    for (name, env) in cases {
        let ddp = format!("{name}-ddp.safetensors");
        run(&dir, 2, 0, &ddp, env);
        let plain = format!("{name}-plain.safetensors");
        run(&dir, 2, 0, &plain, &[]);
        // The setting changes the run (the clip bites; accumulation steps half as often).
        let changed = compare(&dir.join(&plain), &dir.join(&ddp));
        assert!(
            changed.max_abs > 1e-4,
            "{name} changes nothing: {changed:?}"
        );
        for zero in ["2", "3"] {
            let out = format!("{name}-zero{zero}.safetensors");
            let env = [env, &[("UNITS", "1")]].concat();
            run(&dir, 2, zero.parse().unwrap(), &out, &env);
            let diff = compare(&dir.join(&ddp), &dir.join(&out));
            assert!(diff.max_abs < 1e-6, "{name}, zero {zero}: {diff:?}");
        }
    }
}

/// Under bf16 mixed precision, stage 3 all-gathers in bf16 (half the bytes) over the
/// fp32 shards the optimizer steps, as FSDP2's `MixedPrecisionPolicy(param_dtype=
/// torch.bfloat16)`: the units compute with the weights rounded to bf16, which is what
/// autocast does with DDP's fp32 weights in these layers, so it ends where DDP with
/// the same autocast ends. The model it saves is the fp32 one, gathered exactly.
#[test]
fn stage_3_gathers_in_bf16_under_mixed_precision() {
    let dir = scratch_dir("sharding-bf16");
    let bf16 = [("TCH_DISTRIBUTED_MIXED_PRECISION", "bf16"), ("UNITS", "1")];
    run(&dir, 2, 0, "ddp.safetensors", &bf16);
    run(&dir, 2, 3, "zero3.safetensors", &bf16);
    run(&dir, 2, 3, "fp32.safetensors", &[("UNITS", "1")]);
    let diff = compare(&dir.join("ddp.safetensors"), &dir.join("zero3.safetensors"));
    assert!(
        diff.max_abs < 1e-6,
        "against DDP with bf16 autocast: {diff:?}"
    );
    // bf16 rounds: the run differs from the fp32 one.
    let rounded = compare(
        &dir.join("fp32.safetensors"),
        &dir.join("zero3.safetensors"),
    );
    assert!(rounded.max_abs > 1e-4, "bf16 changed nothing: {rounded:?}");
    let (low, full) = (
        stats(&dir, "zero3.safetensors"),
        stats(&dir, "fp32.safetensors"),
    );
    // Rank 0's padded shards: l1 (the root) 7 × 6 + 7 = 49 elements, l2 4 × 13 + 4 =
    // 56, l3 2 × 7 + 2 = 16; per step the root is gathered once, l2 and l3 twice.
    // Under bf16 the root is gathered once more, as the model is built (rounded).
    assert_eq!(full[..3], [50, 19, 30]);
    assert_eq!(low[..3], [51, 19, 30]);
    let elements = |root: u64| root * 49 + 20 * 56 + 20 * 16;
    assert_eq!(full[3], 4 * elements(10), "fp32: 4 bytes an element");
    assert_eq!(low[3], 2 * elements(11), "bf16: 2 bytes an element");
    // The saved parameters are the fp32 shards', not their bf16 rounding.
    let saved = tch_distributed_tests::compare::read(&dir.join("zero3.safetensors"));
    let exact = saved
        .iter()
        .filter(|(_, t)| {
            let rounded = t.to_kind(tch::Kind::BFloat16).to_kind(tch::Kind::Float);
            rounded.not_equal_tensor(t).any().int64_value(&[]) != 0
        })
        .count();
    assert_eq!(
        exact,
        saved.len(),
        "every saved parameter holds fp32 values"
    );
}

/// Variables that get no gradient: one unused on some steps (a unit of its own, or
/// in the root), one used on rank 0 only (in a unit whose other members every rank
/// uses), one never. A variable no rank had a gradient for is left alone by the step,
/// and one some rank had counts as zero on the others, as DDP with
/// `find_unused_parameters` does. Alone and with accumulation, which must not count
/// a member's gradient from one micro-batch towards another's. At stage 2, a whole
/// unit used on rank 0 only: the reduce-scatters keep one order on every rank,
/// though rank 1 has that unit's (zero) gradients before its backward pass starts.
/// With l3 an activation-checkpointed block, the search sees behind it (the block's
/// node has an edge to each parameter it used): every unit completes in the backward
/// pass, as without the block.
#[test]
fn variables_without_gradients_train_as_ddp_with_find_unused_parameters() {
    let dir = scratch_dir("sharding-unused");
    let unused = [
        ("UNUSED", "1"),
        ("TCH_DISTRIBUTED_FIND_UNUSED_PARAMETERS", "true"),
    ];
    let accumulation = [unused.as_slice(), &[("TCH_DISTRIBUTED_GRAD_ACCUM", "2")]].concat();
    let rank_0 = [("UNUSED", "rank0"), unused[1]];
    let checkpointed = [unused.as_slice(), &[("CHECKPOINT", "1")]].concat();
    type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], &'a [u8]);
    let cases: [Case; 4] = [
        ("alone", &unused, &[2, 3]),
        ("accum", &accumulation, &[2, 3]),
        ("rank0", &rank_0, &[2]),
        ("checkpointed", &checkpointed, &[2, 3]),
    ];
    for (name, env, stages) in cases {
        let ddp = match name {
            // The plain model's DDP run ("alone"): the checkpointed block computes the
            // same, and the Reducer's graph search cannot see behind it.
            "checkpointed" => "alone-ddp.safetensors".to_string(),
            _ => {
                let ddp = format!("{name}-ddp.safetensors");
                run(&dir, 2, 0, &ddp, &[env, &[("INIT_OUT", "1")]].concat());
                ddp
            }
        };
        let runs = stages
            .iter()
            .flat_map(|&zero| [(zero, false), (zero, true)]);
        for (zero, units) in runs {
            let out = format!("{name}-zero{zero}-units{units}.safetensors");
            let env = match units {
                true => [env, &[("UNITS", "1")]].concat(),
                false => env.to_vec(),
            };
            run(&dir, 2, zero, &out, &env);
            let diff = compare(&dir.join(&ddp), &dir.join(&out));
            assert!(
                diff.max_abs < 1e-6,
                "{name}, zero {zero}, units {units}: {diff:?}"
            );
            // The reduce-scatters at the step, on ranks 0 and 1: none, every unit is
            // complete in the backward pass (a checkpointed block included).
            let at_step = [0, 1].map(|rank| stats_of(&dir, &out, rank)[4]);
            assert_eq!(at_step, [0, 0], "{name}, zero {zero}, units {units}");
        }
    }
    // Weight decay would move a variable the step did not skip: `never` kept its
    // first value, `l3.skip` did not.
    use tch_distributed_tests::compare::{named_where, read};
    let mut init = read(&dir.join("alone-ddp.safetensors.init.safetensors"));
    init.retain(|(name, _)| name != "x" && name != "y");
    let end = read(&dir.join("alone-zero3-unitstrue.safetensors"));
    assert_eq!(named_where(&init, &end, |n| n == "never").max_abs, 0.0);
    assert!(named_where(&init, &end, |n| n == "l3.skip").max_abs > 1e-3);
}

/// A stage-3 checkpoint holds each rank's chunks of the optimizer's state and the
/// whole model: it resumes bit for bit on the same ranks, and on other world sizes
/// and stages, or without sharding, where the whole run would have ended. The model
/// has a scalar parameter (`GAIN`), whose chunk is the whole scalar on rank 0 and
/// nothing on the others.
#[test]
fn a_sharded_checkpoint_resumes_bit_for_bit_and_on_other_world_sizes() {
    let dir = scratch_dir("sharding-checkpoint");
    let units = ("UNITS", "1");
    let gain = ("GAIN", "1");
    run(&dir, 2, 3, "straight.safetensors", &[units, gain]);
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    let stop = [units, gain, ("CKPT", c), ("SAVE_AT", "5"), ("STOP_AT", "5")];
    run(&dir, 2, 3, "stopped.safetensors", &stop);
    let step = ckpt.join("step-0000000005");
    for r in 0..2 {
        assert!(step
            .join(format!("optimizer-rank-{r}.safetensors"))
            .exists());
    }
    // Resumed as it stopped: the same bits as the run that did not stop.
    for (ranks, zero, units_on) in [(2, 3, true), (4, 2, false), (2, 0, false), (3, 3, true)] {
        let resumed = dir.join("resumed");
        let _ = std::fs::remove_dir_all(&resumed);
        copy_dir(&ckpt, &resumed);
        let r = resumed.to_str().unwrap();
        let out = format!("resumed-{ranks}-{zero}-{units_on}.safetensors");
        let mut env = vec![gain, ("CKPT", r)];
        if units_on {
            env.push(units);
        }
        let stdout = run(&dir, ranks, zero, &out, &env);
        assert!(stdout.contains("resumed at step 5"), "{stdout}");
        let diff = compare(&dir.join("straight.safetensors"), &dir.join(&out));
        if (ranks, zero, units_on) == (2, 3, true) {
            assert!(diff.is_exact(), "resumed as it stopped: {diff:?}");
        } else {
            assert!(diff.max_abs < 1e-6, "{ranks} ranks, zero {zero}: {diff:?}");
        }
    }
}

/// The export to PyTorch: a stage-3 checkpoint, loaded in one process without sharding,
/// gives the whole state (`Optimizer::state`, `torch.optim`'s `state_dict` layout) and
/// the model; PyTorch loads both into `torch.optim.Adam` and an `nn.Module` and, trained
/// on for the last 5 steps, ends where the uninterrupted sharded run ends.
#[test]
fn a_sharded_checkpoint_exports_whole_to_pytorch() {
    let dir = scratch_dir("sharding-export");
    let units = ("UNITS", "1");
    run(
        &dir,
        2,
        3,
        "straight.safetensors",
        &[units, ("INIT_OUT", "1")],
    );
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    run(
        &dir,
        2,
        3,
        "stopped.safetensors",
        &[units, ("CKPT", c), ("SAVE_AT", "5"), ("STOP_AT", "5")],
    );
    let mut cmd = Command::new(WORKER);
    without_launcher(&mut cmd)
        .args([dir.to_str().unwrap(), "export.safetensors"])
        .envs([units, ("CKPT", c), ("EXPORT", "1")]);
    let exported = run_with(cmd, &dir, TIMEOUT, |_, _| {});
    exported.assert_success();
    assert!(
        exported.stdout.contains("resumed at step 5"),
        "{}",
        exported.stdout
    );
    let script = r#"
import sys
import torch
from safetensors.torch import load_file, save_file
sys.path.insert(0, sys.argv[1])
from torch_optim import state_dict
init, model_file, state_file, out = sys.argv[2:6]
torch.set_num_threads(1)
data = load_file(init)
net = torch.nn.Sequential()
net.l1, net.l2, net.l3 = torch.nn.Linear(6, 13), torch.nn.Linear(13, 7), torch.nn.Linear(7, 3)
net.load_state_dict(load_file(model_file))
saved = state_dict(state_file)
params = dict(net.named_parameters())
groups = [{"params": [params[n] for n in g["param_names"]]} for g in saved["param_groups"]]
opt = torch.optim.Adam(groups)
opt.load_state_dict(saved)
for _ in range(5):
    opt.zero_grad()
    x = torch.tanh(net.l2(torch.tanh(net.l1(data["x"]))))
    torch.nn.functional.mse_loss(net.l3(x), data["y"]).backward()
    opt.step()
save_file({n: p.detach().clone() for n, p in net.named_parameters()}, out)
"#;
    let parity = concat!(env!("CARGO_MANIFEST_DIR"), "/parity");
    let file = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let args = [
        parity.to_string(),
        file("straight.safetensors.init.safetensors"),
        file("export.safetensors"),
        file("export.safetensors.optimizer.safetensors"),
        file("pytorch.safetensors"),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    if tch_distributed_tests::run_python(script, &args, "").is_none() {
        return;
    }
    let diff = compare(
        &dir.join("straight.safetensors"),
        &dir.join("pytorch.safetensors"),
    );
    eprintln!("PyTorch from the export: {diff:?}");
    assert!(diff.max_abs < 1e-6, "{diff:?}");
    let moved = compare(
        &dir.join("export.safetensors"),
        &dir.join("pytorch.safetensors"),
    );
    assert!(moved.max_abs > 1e-4, "PyTorch trained on: {moved:?}");
}

/// Against PyTorch's FSDP2 (`fully_shard` over Gloo on the CPU, the same libtorch):
/// the same model, data, units and Adam end within 1e-6, in fp32 and under bf16
/// (FSDP2's `MixedPrecisionPolicy(param_dtype=torch.bfloat16,
/// reduce_dtype=torch.float32)`, ours `mixed_precision = "bf16"`).
#[test]
fn stage_3_ends_where_pytorch_fsdp2_ends() {
    let dir = scratch_dir("sharding-fsdp2");
    // A file of its own: torch.multiprocessing's spawned ranks import the script.
    let script = dir.join("fsdp2_reference.py");
    std::fs::write(&script, include_str!("support/fsdp2_reference.py")).unwrap();
    let run_file =
        "import subprocess, sys; sys.exit(subprocess.call([sys.executable] + sys.argv[1:]))";
    for precision in ["fp32", "bf16"] {
        let ours = format!("ours-{precision}.safetensors");
        let mut env = vec![("UNITS", "1"), ("INIT_OUT", "1")];
        if precision == "bf16" {
            env.push(("TCH_DISTRIBUTED_MIXED_PRECISION", "bf16"));
        }
        run(&dir, 2, 3, &ours, &env);
        let init = dir.join(format!("{ours}.init.safetensors"));
        let theirs = dir.join(format!("fsdp2-{precision}.safetensors"));
        let args = [
            script.to_str().unwrap(),
            init.to_str().unwrap(),
            theirs.to_str().unwrap(),
            "2",
            precision,
        ];
        if tch_distributed_tests::run_python(run_file, &args, "").is_none() {
            return;
        }
        let diff = compare(&theirs, &dir.join(&ours));
        eprintln!("against FSDP2, {precision}: {diff:?}");
        assert!(diff.max_abs < 1e-6, "{precision}: {diff:?}");
        use tch_distributed_tests::compare::{named, read};
        let mut initial = read(&init);
        initial.retain(|(name, _)| name != "x" && name != "y");
        let moved = named(&read(&theirs), &initial);
        assert!(moved.max_abs > 1e-3, "trained: {moved:?}");
    }
    // The policy bites: bf16 and fp32 end apart.
    let apart = compare(
        &dir.join("fsdp2-fp32.safetensors"),
        &dir.join("fsdp2-bf16.safetensors"),
    );
    assert!(apart.max_abs > 1e-4, "{apart:?}");
}

/// Hybrid sharding (`shard_group = 2` on 4 ranks: the shape of 2 nodes × 2 ranks, on
/// one host; `multi_node.rs` runs it across hosts): each shard group holds one sharded
/// copy of the model, gradients are reduce-scattered within it and each shard is
/// all-reduced across the groups, as FSDP2's HSDP. The parameters are DDP's (1e-6),
/// every rank holds half of the state (as flat sharding on 2 ranks), and a checkpoint,
/// whose state the first shard group alone writes, resumes hybrid as it stopped and
/// flat on 2 ranks. A size that does not divide the world is an error that says so.
#[test]
fn hybrid_sharding_trains_as_ddp_with_half_the_state_on_each_rank() {
    let dir = scratch_dir("sharding-hybrid");
    let hybrid = ("TCH_DISTRIBUTED_SHARD_GROUP", "2");
    let units = ("UNITS", "1");
    run(&dir, 4, 0, "ddp.safetensors", &[]);
    for (zero, with_units) in [(2, false), (3, true)] {
        let out = format!("hybrid-{zero}.safetensors");
        let mut env = vec![hybrid];
        if with_units {
            env.push(units);
        }
        let stdout = run(&dir, 4, zero, &out, &env);
        let banner = "sharded over 2 ranks, replicated 2 times: hybrid sharding";
        assert!(stdout.contains(banner), "{stdout}");
        let diff = compare(&dir.join("ddp.safetensors"), &dir.join(&out));
        eprintln!("hybrid, zero {zero}: {diff:?}");
        assert!(diff.max_abs < 1e-6, "hybrid, zero {zero}: {diff:?}");
        // Half of every parameter's rows (padded), Adam's two moments and the step
        // counts: l1 (13 × 6, 13), l2 (7 × 13, 7), l3 (3 × 7, 3).
        let rows = |n: usize| n.div_ceil(2);
        let elements = rows(13) * 7 + rows(7) * 14 + rows(3) * 8;
        for r in 0..4 {
            assert_eq!(
                state_bytes(&dir, &out, r),
                8 * elements + 4 * 6,
                "{out}, rank {r}"
            );
        }
    }
    // Clipping, accumulation and bf16 autocast together, as DDP does them.
    let mixed = [
        ("CLIP", "0.05"),
        ("TCH_DISTRIBUTED_GRAD_ACCUM", "2"),
        ("TCH_DISTRIBUTED_MIXED_PRECISION", "bf16"),
        units,
    ];
    run(&dir, 4, 0, "mixed-ddp.safetensors", &mixed);
    run(
        &dir,
        4,
        3,
        "mixed-hybrid.safetensors",
        &[&mixed[..], &[hybrid]].concat(),
    );
    let diff = compare(
        &dir.join("mixed-ddp.safetensors"),
        &dir.join("mixed-hybrid.safetensors"),
    );
    assert!(diff.max_abs < 1e-6, "clip, accumulation, bf16: {diff:?}");
    // A checkpoint: the state once per shard, by the first shard group's ranks.
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    let stop = [
        hybrid,
        units,
        ("CKPT", c),
        ("SAVE_AT", "5"),
        ("STOP_AT", "5"),
    ];
    run(&dir, 4, 3, "stopped.safetensors", &stop);
    let step = ckpt.join("step-0000000005");
    let written: Vec<usize> = (0..4)
        .filter(|r| {
            step.join(format!("optimizer-rank-{r}.safetensors"))
                .exists()
        })
        .collect();
    assert_eq!(written, [0, 1], "the state files of {}", step.display());
    for (ranks, resume_hybrid) in [(4, true), (2, false)] {
        let resumed = dir.join("resumed");
        let _ = std::fs::remove_dir_all(&resumed);
        copy_dir(&ckpt, &resumed);
        let r = resumed.to_str().unwrap();
        let mut env = vec![units, ("CKPT", r)];
        if resume_hybrid {
            env.push(hybrid);
        }
        let out = format!("resumed-{ranks}.safetensors");
        let stdout = run(&dir, ranks, 3, &out, &env);
        assert!(stdout.contains("resumed at step 5"), "{stdout}");
        let diff = compare(&dir.join("hybrid-3.safetensors"), &dir.join(&out));
        match resume_hybrid {
            true => assert!(diff.is_exact(), "resumed as it stopped: {diff:?}"),
            false => assert!(diff.max_abs < 1e-6, "resumed flat on {ranks}: {diff:?}"),
        }
    }
    // Groups of 3 do not divide 4 ranks.
    let mut cmd = Command::new(tchrun());
    cmd.args(["--nproc-per-node", "4", WORKER])
        .args([dir.to_str().unwrap(), "uneven.safetensors"])
        .env("TCH_DISTRIBUTED_ZERO", "3")
        .env("TCH_DISTRIBUTED_SHARD_GROUP", "3");
    let uneven = run_with(cmd, &dir, TIMEOUT, |_, _| {});
    assert!(!uneven.status.success(), "{uneven:?}");
    assert!(
        uneven
            .stderr
            .contains("shard groups of 3 ranks do not divide the job's 4 ranks"),
        "{}",
        uneven.stderr
    );
}

/// CPU offload (`offload`, DeepSpeed's `offload_optimizer`, FSDP2's
/// `CPUOffloadPolicy`). On the CPU there is nothing to offload: the banner says so and
/// the run is the one without it, bit for bit. With the SDK's test switch that keeps
/// the stepped shards apart from the parameters on the CPU, as on a GPU
/// (`TCH_DISTRIBUTED_OFFLOAD_COPIES_ON_CPU`), every copy between them runs: the
/// gradient shards to the host after each reduce-scatter, the stepped shards back for
/// the all-gathers. At stage 2 (`optimizer`) and stage 3 with units (`all`, and
/// `optimizer` with clipping, accumulation and bf16), the parameters are those without
/// offload, bit for bit, and a checkpoint resumes as it stopped. With `zero = 1` it is
/// an error that names both settings.
#[test]
fn offloaded_shards_train_as_shards_on_the_device() {
    let dir = scratch_dir("sharding-offload");
    let apart = ("TCH_DISTRIBUTED_OFFLOAD_COPIES_ON_CPU", "1");
    let units = ("UNITS", "1");
    let optimizer = ("TCH_DISTRIBUTED_OFFLOAD", "optimizer");
    let all = ("TCH_DISTRIBUTED_OFFLOAD", "all");
    let mixed = [
        units,
        ("CLIP", "0.05"),
        ("TCH_DISTRIBUTED_GRAD_ACCUM", "2"),
        ("TCH_DISTRIBUTED_MIXED_PRECISION", "bf16"),
    ];
    let exact = |base: &str, out: &str| {
        let diff = compare(&dir.join(base), &dir.join(out));
        eprintln!("{out} against {base}: {diff:?}");
        assert!(diff.is_exact(), "{out} against {base}: {diff:?}");
    };
    run(&dir, 2, 2, "zero2.safetensors", &[]);
    let stdout = run(
        &dir,
        2,
        2,
        "zero2-optimizer.safetensors",
        &[optimizer, apart],
    );
    assert!(stdout.contains("optimizer offloaded ("), "{stdout}");
    exact("zero2.safetensors", "zero2-optimizer.safetensors");
    run(&dir, 2, 3, "zero3.safetensors", &[units]);
    let stdout = run(&dir, 2, 3, "zero3-all.safetensors", &[units, all, apart]);
    assert!(stdout.contains("everything offloaded ("), "{stdout}");
    exact("zero3.safetensors", "zero3-all.safetensors");
    // The state is in the same place: half of every parameter's rows on each rank.
    for r in 0..2 {
        assert_eq!(
            state_bytes(&dir, "zero3-all.safetensors", r),
            state_bytes(&dir, "zero3.safetensors", r)
        );
    }
    run(&dir, 2, 3, "mixed.safetensors", &mixed);
    let env = [&mixed[..], &[optimizer, apart]].concat();
    run(&dir, 2, 3, "mixed-optimizer.safetensors", &env);
    exact("mixed.safetensors", "mixed-optimizer.safetensors");
    // Nothing to offload on the CPU, whichever is asked for.
    let stdout = run(&dir, 2, 3, "zero3-cpu.safetensors", &[units, all]);
    assert!(
        stdout.contains("offload = all: nothing to offload on the CPU"),
        "{stdout}"
    );
    exact("zero3.safetensors", "zero3-cpu.safetensors");
    // So with `optimizer`; "none" says nothing.
    let stdout = run(&dir, 2, 2, "zero2-cpu.safetensors", &[optimizer]);
    assert!(
        stdout.contains("offload = optimizer: nothing to offload on the CPU"),
        "{stdout}"
    );
    exact("zero2.safetensors", "zero2-cpu.safetensors");
    let none = ("TCH_DISTRIBUTED_OFFLOAD", "none");
    let stdout = run(&dir, 2, 2, "zero2-none.safetensors", &[none, apart]);
    assert!(!stdout.contains("offload"), "{stdout}");
    exact("zero2.safetensors", "zero2-none.safetensors");
    // A checkpoint of offloaded shards resumes as it stopped.
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    let stop = [
        units,
        all,
        apart,
        ("CKPT", c),
        ("SAVE_AT", "5"),
        ("STOP_AT", "5"),
    ];
    run(&dir, 2, 3, "stopped.safetensors", &stop);
    let stdout = run(
        &dir,
        2,
        3,
        "resumed.safetensors",
        &[units, all, apart, ("CKPT", c)],
    );
    assert!(stdout.contains("resumed at step 5"), "{stdout}");
    exact("zero3.safetensors", "resumed.safetensors");
    // Offload moves what stages 2 and 3 shard.
    let mut cmd = Command::new(tchrun());
    cmd.args(["--nproc-per-node", "2", WORKER])
        .args([dir.to_str().unwrap(), "zero1.safetensors"])
        .env("TCH_DISTRIBUTED_ZERO", "1")
        .env("TCH_DISTRIBUTED_OFFLOAD", "optimizer");
    let refused = run_with(cmd, &dir, TIMEOUT, |_, _| {});
    assert!(!refused.status.success(), "{refused:?}");
    assert!(
        refused
            .stderr
            .contains("offload = \"optimizer\" with zero = 1: offload keeps the shards"),
        "{}",
        refused.stderr
    );
}
