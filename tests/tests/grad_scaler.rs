//! The fp16 loss scaler on the paths the documentation promises but no other test
//! walks: its state through `Checkpointer::save_state`/`load_state` on 2 real ranks
//! (a resumed run continues exactly as the uninterrupted one, whose schedule is
//! checked against the closed form), the error after 100 skipped steps in a row (as a
//! `#[distributed(mixed_precision = "fp16")]` program shows it), and
//! `clip_grad_value` clipping the unscaled gradients (against closed forms).

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tch::nn::{self, VarStore};
use tch::{Device, Kind, Tensor};
use tch_distributed::{GradScaler, Optimizer};
use tch_distributed_tests::{run_tchrun, run_with, scratch_dir, without_launcher, Run};

const WORKER: &str = env!("CARGO_BIN_EXE_scaler_worker");
const TIMEOUT: Duration = Duration::from_secs(120);

/// `scaler_worker resume OUT CKPT STEPS [SAVE_AT]` on 2 ranks, which must succeed.
fn resume_run(out: &Path, ckpt: &Path, steps: &str, save_at: Option<&str>) -> Run {
    let mut args = vec![
        "--nproc-per-node",
        "2",
        WORKER,
        "resume",
        out.to_str().unwrap(),
        ckpt.to_str().unwrap(),
        steps,
    ];
    args.extend(save_at);
    let run = run_tchrun(out, &args, TIMEOUT, |_, _| {});
    run.assert_success();
    run
}

fn lines(out: &Path, rank: usize) -> Vec<String> {
    fs::read_to_string(out.join(format!("steps{rank}.txt")))
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

/// `(stepped, scale, tracker)` of a `step …` line.
fn schedule_of(line: &str) -> (bool, f64, i64) {
    let words: Vec<&str> = line.split(' ').collect();
    assert_eq!(words[0], "step", "{line}");
    assert_eq!(
        (words[2], words[4], words[6]),
        ("stepped", "scale", "tracker"),
        "{line}"
    );
    (
        words[3].parse().unwrap(),
        words[5].parse().unwrap(),
        words[7].parse().unwrap(),
    )
}

/// The closed form of `GradScaler(init_scale=8, growth_interval=3)` over the worker's
/// gradients (the huge one, 2^122, at steps 5, 10 and 11): `(stepped, scale, tracker)`
/// after each step. A scaled gradient overflows when `scale × 2^122 ≥ 2^128`, i.e. at
/// a scale of 64 or more; an overflow skips the step, halves the scale and resets the
/// tracker; the third clean step in a row doubles the scale and resets the tracker.
const SCHEDULE: [(bool, f64, i64); 12] = [
    (true, 8.0, 1),
    (true, 8.0, 2),
    (true, 16.0, 0),
    (true, 16.0, 1),
    (true, 16.0, 2), // 2^122 × 16 = 2^126: finite. The checkpoint is taken here.
    (true, 32.0, 0),
    (true, 32.0, 1),
    (true, 32.0, 2),
    (true, 64.0, 0),
    (false, 32.0, 0), // 2^122 × 64 overflows: skipped.
    (true, 32.0, 1),  // 2^122 × 32 = 2^127: finite.
    (true, 32.0, 2),
];

#[test]
fn an_fp16_run_resumed_from_a_checkpoint_continues_as_the_uninterrupted_one() {
    // Uninterrupted: 12 steps.
    let straight = scratch_dir("scaler-straight");
    resume_run(&straight, &straight.join("ckpt"), "12", None);
    let reference = lines(&straight, 0);
    assert_eq!(reference.len(), 12, "{reference:#?}");
    let schedule: Vec<(bool, f64, i64)> = reference.iter().map(|l| schedule_of(l)).collect();
    assert_eq!(schedule, SCHEDULE, "the scaler's schedule");
    assert_eq!(lines(&straight, 1), reference, "rank 1 vs rank 0");
    let p = |line: &str| line.split_once(" p ").unwrap().1.to_string();
    assert_eq!(p(&reference[9]), p(&reference[8]), "step 10 is skipped");
    assert_ne!(p(&reference[10]), p(&reference[9]), "step 11 steps");

    // Interrupted after step 5, with a checkpoint there; then resumed to step 12.
    let first = scratch_dir("scaler-first");
    let ckpt = first.join("ckpt");
    resume_run(&first, &ckpt, "5", Some("5"));
    assert_eq!(lines(&first, 0), reference[..5], "the first 5 steps");
    let state: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(ckpt.join("step-0000000005/state.json")).unwrap())
            .unwrap();
    // Neither the initial scale nor a fresh tracker: a resume that dropped either
    // would go on differently.
    assert_eq!(
        state["grad_scaler"],
        serde_json::json!([16.0, 2]),
        "the scaler's state in the checkpoint"
    );

    let resumed = scratch_dir("scaler-resumed");
    resume_run(&resumed, &ckpt, "12", None);
    for rank in 0..2 {
        let got = lines(&resumed, rank);
        assert_eq!(
            got[0], "resumed at step 5 scaler (16.0, 2)",
            "rank {rank}: the scale and the growth tracker are restored"
        );
        assert_eq!(
            got[1..],
            reference[5..],
            "rank {rank}: steps 6 to 12 after the resume vs the uninterrupted run"
        );
    }
}

/// `scaler_worker diverge CLEAN_AT`, one process.
fn diverge(clean_at: &str) -> Run {
    let dir = scratch_dir(&format!("scaler-diverge-{clean_at}"));
    let mut cmd = Command::new(WORKER);
    without_launcher(&mut cmd).args(["diverge", clean_at]);
    run_with(cmd, &dir, TIMEOUT, |_, _| {})
}

const WHAT_TO_DO: &str = "the loss has diverged or overflows fp16. Use bf16 (mixed_precision = \"bf16\"), lower the learning rate, or check the data";

#[test]
fn a_hundred_skipped_steps_in_a_row_stop_the_run_and_say_what_to_do() {
    // Every step overflows: steps 1 to 99 are skipped quietly, the 100th ends the run.
    let run = diverge("0");
    assert_eq!(run.status.code(), Some(1), "{run:?}");
    assert_eq!(
        run.stdout.lines().last(),
        Some("step 99"),
        "the run stops at step 100:\n{}",
        run.stdout
    );
    // 100 halvings of 2^16.
    let scale = 2f64.powi(16 - 100);
    let expected = format!(
        "Error: backward_step: fp16: 100 steps in a row had inf or NaN gradients and were skipped (the scale is now {scale}): {WHAT_TO_DO}"
    );
    assert!(
        run.stderr.contains(&expected),
        "{expected:?} not in:\n{}",
        run.stderr
    );
    assert!(!run.stderr.contains("panicked"), "{}", run.stderr);

    // One clean step at 100 resets the count: the run goes on to the 100th skipped
    // step after it, step 200 (199 skipped in all by then).
    let run = diverge("100");
    assert_eq!(run.status.code(), Some(1), "{run:?}");
    assert_eq!(
        run.stdout.lines().last(),
        Some("step 199"),
        "a clean step resets the count of skipped steps:\n{}",
        run.stdout
    );
    assert!(
        run.stderr
            .contains("fp16: 100 steps in a row had inf or NaN gradients and were skipped")
            && run.stderr.contains(WHAT_TO_DO),
        "{}",
        run.stderr
    );
}

/// A parameter `p = [1, 2, 3, 4]` under SGD with learning rate 1 and a scaler whose
/// scale is 1024: `loss = Σ p · g` has the gradient `g`, scaled to `1024 g`.
fn fixture(accumulate: usize) -> (VarStore, Tensor, Optimizer) {
    let vs = VarStore::new(Device::Cpu);
    let p = vs
        .root()
        .var_copy("p", &Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]));
    let opt = Optimizer::new(&nn::Sgd::default(), &vs, 1.0)
        .unwrap()
        .grad_scaler(GradScaler::new().init_scale(1024.0))
        .accumulate(accumulate);
    (vs, p, opt)
}

fn loss(p: &Tensor, g: [f32; 4]) -> Tensor {
    (p * Tensor::from_slice(&g)).sum(Kind::Float)
}

fn values(p: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(p).unwrap()
}

/// The gradient of the worked examples, and `p - clamp(g, -1, 1)` (all values
/// dyadic, so exact in float32). Clipping the scaled gradient `1024 g` instead would
/// clamp every element to ±1 and move `p` by ±1/1024.
const G: [f32; 4] = [0.5, -3.0, 2.0, -0.25];
const CLIPPED_STEP: [f32; 4] = [0.5, 3.0, 2.0, 4.25];

#[test]
fn clip_grad_value_with_a_scaler_clips_the_unscaled_gradients() {
    // backward_step_clip.
    let (_vs, p, mut opt) = fixture(1);
    assert!(opt.backward_step_clip(&loss(&p, G), 1.0).unwrap());
    assert_eq!(values(&p), CLIPPED_STEP);
    assert_eq!(opt.scaler().unwrap().state(), (1024.0, 1));

    // Spelled out: zero_grad, backward, clip_grad_value, step.
    let (_vs, p, mut opt) = fixture(1);
    opt.zero_grad().unwrap();
    opt.backward(&loss(&p, G)).unwrap();
    opt.clip_grad_value(1.0).unwrap();
    let unscaled_clipped = Vec::<f32>::try_from(p.grad()).unwrap();
    assert_eq!(
        unscaled_clipped,
        [0.5, -1.0, 1.0, -0.25],
        "the gradient after clip_grad_value: unscaled, then clamped"
    );
    assert!(opt.step().unwrap());
    assert_eq!(values(&p), CLIPPED_STEP, "the step does not unscale again");
}

#[test]
fn clip_grad_value_with_a_scaler_still_skips_an_overflowed_step() {
    // Clamping an inf gradient would make it finite: the scaler must have seen it first.
    let (_vs, p, mut opt) = fixture(1);
    let stepped = opt
        .backward_step_clip(&loss(&p, [f32::INFINITY, 1.0, 1.0, 1.0]), 1.0)
        .unwrap();
    assert!(!stepped, "an inf gradient skips the step, clipped or not");
    assert_eq!(values(&p), [1.0, 2.0, 3.0, 4.0], "p unchanged");
    assert_eq!(
        opt.scaler().unwrap().state(),
        (512.0, 0),
        "the scale halved"
    );
}

#[test]
fn clip_grad_value_with_a_scaler_and_accumulation_clips_the_cycles_gradient() {
    // Two micro-batches: the cycle's gradient is (g1 + g2) / 2 = [1, -1, -1, 0],
    // clamped to ±0.75 once, at the end of the cycle.
    let (_vs, p, mut opt) = fixture(2);
    let g2 = [1.5, 1.0, -4.0, 0.25];
    assert!(!opt.backward_step_clip(&loss(&p, G), 0.75).unwrap());
    assert_eq!(values(&p), [1.0, 2.0, 3.0, 4.0], "no step mid-cycle");
    assert!(opt.backward_step_clip(&loss(&p, g2), 0.75).unwrap());
    assert_eq!(values(&p), [0.25, 2.75, 3.75, 4.0]);
}
