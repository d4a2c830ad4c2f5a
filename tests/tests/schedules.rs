//! Learning-rate schedules: every step of a 1,000-step schedule equals the same
//! schedule computed by PyTorch's `LambdaLR` with the references' formulas
//! (transformers' `optimization.py`, DeepSpeed's `lr_schedules.py`, typed out in the
//! script below), and by DeepSpeed's own `lr_schedules.py` where `import deepspeed`
//! works in the tests' Python; a run stopped and resumed from a checkpoint takes the
//! same rates and ends with the same parameters as one that never stopped.
//!
//! Without PyTorch the comparison is skipped (`scripts/test.sh` lists it at its end);
//! under `CI=true` it fails.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tch_distributed::{LrSchedule, WarmupType};
use tch_distributed_tests::{run_python, run_with, scratch_dir, tchrun};

/// The steps compared.
const STEPS: u64 = 1_000;
/// The optimizer's rate.
const BASE_LR: f64 = 3e-4;

/// The schedules compared: each as the script's input line (kind, then its
/// parameters in the order the script reads them) and as the SDK's value.
fn cases() -> Vec<(String, LrSchedule)> {
    use LrSchedule::*;
    let mut cases = Vec::new();
    let types = [(WarmupType::Log, "log"), (WarmupType::Linear, "linear")];
    for (warmup_type, ty) in types {
        // Warmups of 1 (DeepSpeed's max(2, W) makes it 2), 100; totals of 1,000 (the
        // end is the last step) and 700 (300 steps past the end).
        for (warmup, total) in [(100, 1000), (1, 700), (250, 700)] {
            for (min, max) in [(0.0, None), (1e-5, Some(1e-3))] {
                let max_text = max.map_or("none".to_string(), |m: f64| format!("{m:?}"));
                cases.push((
                    format!("warmup_lr {min:?} {max_text} {warmup} {ty}"),
                    WarmupLr {
                        warmup_min_lr: min,
                        warmup_max_lr: max,
                        warmup_num_steps: warmup,
                        warmup_type,
                    },
                ));
                cases.push((
                    format!("warmup_decay_lr {total} {min:?} {max_text} {warmup} {ty}"),
                    WarmupDecayLr {
                        total_num_steps: total,
                        warmup_min_lr: min,
                        warmup_max_lr: max,
                        warmup_num_steps: warmup,
                        warmup_type,
                    },
                ));
            }
            for (min_ratio, cos_min_ratio) in [(0.0, 1e-4), (0.1, 0.05)] {
                cases.push((
                    format!(
                        "warmup_cosine_lr {total} {min_ratio:?} {warmup} {cos_min_ratio:?} {ty}"
                    ),
                    WarmupCosineLr {
                        total_num_steps: total,
                        warmup_min_ratio: min_ratio,
                        warmup_num_steps: warmup,
                        cos_min_ratio,
                        warmup_type,
                    },
                ));
            }
        }
    }
    for (warmup, total) in [(0, 1000), (1, 1000), (100, 1000), (250, 700)] {
        cases.push((
            format!("constant {warmup}"),
            LrSchedule::constant_with_warmup(warmup),
        ));
        cases.push((
            format!("linear {warmup} {total}"),
            LrSchedule::linear_with_warmup(warmup, total),
        ));
        for cycles in [0.5, 1.5] {
            cases.push((
                format!("cosine {warmup} {total} {cycles:?}"),
                CosineWithWarmup {
                    num_warmup_steps: warmup,
                    num_training_steps: total,
                    num_cycles: cycles,
                },
            ));
        }
    }
    cases
}

/// For each input line, the `STEPS` rates of `LambdaLR` over an SGD optimizer at rate
/// `BASE_LR`, read after each `scheduler.step()`, as the optimizer steps take them; then,
/// when DeepSpeed imports, the DeepSpeed cases' rates from DeepSpeed's own classes,
/// after a line `deepspeed`.
const SCRIPT: &str = r#"
import math, sys
from functools import partial
import torch
from torch.optim.lr_scheduler import LambdaLR

steps, base = int(sys.argv[1]), float(sys.argv[2])

# transformers/optimization.py
def constant(s, *, w):
    if s < w:
        return float(s) / float(max(1.0, w))
    return 1.0

def linear(s, *, w, t):
    if s < w:
        return float(s) / float(max(1, w))
    return max(0.0, float(t - s) / float(max(1, t - w)))

def cosine(s, *, w, t, cycles):
    if s < w:
        return float(s) / float(max(1, w))
    progress = float(s - w) / float(max(1, t - w))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(cycles) * 2.0 * progress)))

# deepspeed/runtime/lr_schedules.py, as ratios of the optimizer's rate (LambdaLR
# multiplies them by it). W = max(2, warmup_num_steps).
def gamma(s, w, ty):
    if ty == "log":
        return (1.0 / math.log(w)) * math.log(s + 1)
    return s / w

def warmup_lr(s, *, lo, hi, w, ty):
    w = max(2, w)
    g = gamma(s, w, ty) if s < w else 1.0
    return (lo + (hi - lo) * g) / base

def warmup_decay_lr(s, *, t, lo, hi, w, ty):
    w = max(2, w)
    if s < w:
        g = gamma(s, w, ty)
    else:
        g = max(0.0, float(t - s) / float(max(1.0, t - w)))
    return (lo + (hi - lo) * g) / base

def warmup_cosine_lr(s, *, t, min_ratio, w, cos_min, ty):
    w = max(2, w)
    if s < w:
        return min_ratio + gamma(s, w, ty) * (1.0 - min_ratio)
    progress = min(1.0, (s - w + 1) / max(1, t - w))
    ratio = (1 + math.cos(math.pi * progress)) / 2
    return max(0.0, cos_min + (1.0 - cos_min) * ratio)

def lr_lambda(kind, p):
    if kind == "constant":
        return partial(constant, w=int(p[0]))
    if kind == "linear":
        return partial(linear, w=int(p[0]), t=int(p[1]))
    if kind == "cosine":
        return partial(cosine, w=int(p[0]), t=int(p[1]), cycles=float(p[2]))
    hi = lambda v: base if v == "none" else float(v)
    if kind == "warmup_lr":
        return partial(warmup_lr, lo=float(p[0]), hi=hi(p[1]), w=int(p[2]), ty=p[3])
    if kind == "warmup_decay_lr":
        return partial(warmup_decay_lr, t=int(p[0]), lo=float(p[1]), hi=hi(p[2]), w=int(p[3]), ty=p[4])
    if kind == "warmup_cosine_lr":
        return partial(warmup_cosine_lr, t=int(p[0]), min_ratio=float(p[1]), w=int(p[2]),
                       cos_min=float(p[3]), ty=p[4])
    raise ValueError(kind)

def rates(opt, step):
    out = []
    for _ in range(steps):
        out.append(float(opt.param_groups[0]["lr"]))
        step()
    return out

cases = [line.split() for line in sys.stdin if line.strip()]
for kind, *p in cases:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base)
    sched = LambdaLR(opt, lr_lambda(kind, p))
    print(" ".join(map(repr, rates(opt, sched.step))))

try:
    from deepspeed.runtime import lr_schedules as ds
except ImportError as e:
    print(f"no deepspeed: {e}", file=sys.stderr)
    sys.exit(0)
print("deepspeed")
for kind, *p in cases:
    if not kind.startswith("warmup_"):
        continue
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base)
    hi = lambda v: base if v == "none" else float(v)
    if kind == "warmup_lr":
        sched = ds.WarmupLR(opt, warmup_min_lr=float(p[0]), warmup_max_lr=hi(p[1]),
                            warmup_num_steps=int(p[2]), warmup_type=p[3])
    elif kind == "warmup_decay_lr":
        sched = ds.WarmupDecayLR(opt, total_num_steps=int(p[0]), warmup_min_lr=float(p[1]),
                                 warmup_max_lr=hi(p[2]), warmup_num_steps=int(p[3]),
                                 warmup_type=p[4])
    else:
        sched = ds.WarmupCosineLR(opt, total_num_steps=int(p[0]), warmup_min_ratio=float(p[1]),
                                  warmup_num_steps=int(p[2]), cos_min_ratio=float(p[3]),
                                  warmup_type=p[4])
    # DeepSpeed's scheduler starts at last_batch_iteration -1; its value at step s is
    # get_lr() after s + 1 calls of step().
    sched.step()
    print(" ".join(map(repr, rates(opt, sched.step))))
"#;

/// Finite, and equal to 1e-12 of the larger magnitude (zeros exactly).
fn assert_close(ours: f64, theirs: f64, what: &str) {
    let scale = ours.abs().max(theirs.abs());
    assert!(
        ours.is_finite() && theirs.is_finite() && (ours - theirs).abs() <= 1e-12 * scale,
        "{what}: ours {ours:?}, Python's {theirs:?}"
    );
}

fn parse(line: &str) -> Vec<f64> {
    line.split(' ').map(|v| v.parse().unwrap()).collect()
}

#[test]
fn every_step_equals_lambda_lr_and_deepspeed() {
    let cases = cases();
    let input: String = cases.iter().map(|(line, _)| format!("{line}\n")).collect();
    let args = [STEPS.to_string(), format!("{BASE_LR:?}")];
    let Some(stdout) = run_python(SCRIPT, &[&args[0], &args[1]], &input) else {
        return;
    };
    let mut lines = stdout.lines();
    for (line, schedule) in &cases {
        let theirs = parse(lines.next().expect("a line per schedule"));
        assert_eq!(theirs.len() as u64, STEPS, "{line}");
        for (step, theirs) in (0..STEPS).zip(theirs) {
            let what = format!("{line}, step {step} (LambdaLR)");
            assert_close(schedule.lr(BASE_LR, step), theirs, &what);
        }
    }
    match lines.next() {
        None => eprintln!(
            "note: DeepSpeed does not import in the tests' Python: compared with LambdaLR \
             and the reference formulas only"
        ),
        Some(marker) => {
            assert_eq!(marker, "deepspeed");
            for (line, schedule) in cases.iter().filter(|(l, _)| l.starts_with("warmup_")) {
                let theirs = parse(lines.next().expect("a line per DeepSpeed schedule"));
                for (step, theirs) in (0..STEPS).zip(theirs) {
                    let what = format!("{line}, step {step} (DeepSpeed)");
                    assert_close(schedule.lr(BASE_LR, step), theirs, &what);
                }
            }
        }
    }
    assert_eq!(
        lines.next(),
        None,
        "Python printed more lines than schedules"
    );
}

const WORKER: &str = env!("CARGO_BIN_EXE_checkpoint_worker");

/// `checkpoint_worker` with `SCHEDULE=1` on 2 ranks, 13 steps (checkpoints at 4, 8, 12).
fn train(dir: &Path, env: &[(&str, &str)]) {
    let mut cmd = Command::new(tchrun());
    let ckpt = dir.join("ckpt");
    cmd.args(["--nproc-per-node", "2", WORKER])
        .args([dir.to_str().unwrap(), ckpt.to_str().unwrap(), "13", "adam"])
        .env("SCHEDULE", "1")
        .envs(env.iter().copied());
    let run = run_with(cmd, dir, Duration::from_secs(120), |_, _| {});
    if env.iter().any(|(k, _)| *k == "KILL_AT") {
        assert!(!run.status.success(), "the kill fails the job");
    } else {
        run.assert_success();
    }
}

/// The rate of each step that rank 0 logged (the last run's, for a step run twice).
fn rates(dir: &Path) -> BTreeMap<u64, f64> {
    let log = std::fs::read_to_string(dir.join("lr")).unwrap();
    log.lines()
        .map(|l| {
            let (step, lr) = l
                .strip_prefix("step ")
                .and_then(|l| l.split_once(": lr "))
                .unwrap();
            (step.parse().unwrap(), lr.parse().unwrap())
        })
        .collect()
}

/// Rank 1 is killed after step 6; the relaunch resumes from the checkpoint at step 4
/// and takes the schedule's rates from step 4 on, bit for bit, so that its parameters
/// end bit for bit where the run that never stopped ends.
#[test]
fn a_resumed_run_takes_the_same_rates_and_ends_with_the_same_parameters() {
    let straight = scratch_dir("schedule-straight");
    train(&straight, &[]);
    let killed = scratch_dir("schedule-killed");
    train(&killed, &[("KILL_AT", "6"), ("KILL_RANK", "1")]);
    let before = std::fs::read_to_string(killed.join("lr")).unwrap();
    train(&killed, &[]);
    let after = std::fs::read_to_string(killed.join("lr")).unwrap();
    assert!(
        after[before.len()..].starts_with("step 5: lr "),
        "the relaunch resumes at step 4: {after}"
    );

    let (ours, resumed) = (rates(&straight), rates(&killed));
    assert_eq!(ours.len(), 13);
    let schedule = LrSchedule::linear_with_warmup(3, 13);
    for (&step, &lr) in &ours {
        assert_eq!(lr, schedule.lr(0.01, step - 1), "step {step}");
        assert_eq!(resumed[&step].to_bits(), lr.to_bits(), "step {step}");
    }
    for file in ["final0", "final1", "probe0"] {
        let read = |dir: &Path| {
            let mut named =
                tch::Tensor::read_safetensors(dir.join(format!("{file}.safetensors"))).unwrap();
            named.sort_by(|a, b| a.0.cmp(&b.0));
            named
        };
        let diff = tch_distributed_tests::compare::named(&read(&straight), &read(&killed));
        assert!(diff.is_exact(), "{file}: not bit for bit equal: {diff:?}");
    }
}
