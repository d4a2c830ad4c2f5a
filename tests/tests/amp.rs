//! `GradScaler` against PyTorch's `torch.amp.GradScaler` (run by the Python that
//! `tch_distributed_tests::python` finds) on the same gradient sequence, and its
//! found-inf agreement across real ranks.

use std::time::Duration;

use tch::nn::{self, VarStore};
use tch::{Device, Kind, Tensor};
use tch_distributed::{GradScaler, Optimizer};
use tch_distributed_tests::{run_python, run_tchrun_all_ranks, scratch_dir};

/// Per step: the gradient the unscaled loss would give (inf and NaN included).
const GRADS: &[[f32; 3]] = &[
    [0.5, -1.0, 2.0],
    [f32::INFINITY, 0.0, 1.0],
    [0.25, 0.25, -0.5],
    [1.0, f32::NAN, 0.0],
    [0.1, 0.2, 0.3],
    [0.1, 0.2, 0.3],
    [0.1, 0.2, 0.3],
    [-0.3, 0.7, 1.5],
    [0.1, 0.2, 0.3],
];

/// After each step: the scale and the parameter's values, with `scaler`.
fn ours(mut scaler: GradScaler) -> Vec<(f64, Vec<f32>)> {
    let vs = VarStore::new(Device::Cpu);
    let p = vs
        .root()
        .var_copy("p", &Tensor::from_slice(&[1.0f32, 2.0, 3.0]));
    let mut opt = Optimizer::new(&nn::Sgd::default(), &vs, 0.1).unwrap();
    let mut out = Vec::new();
    for g in GRADS {
        opt.zero_grad().unwrap();
        // d(scale · Σ p·g)/dp = scale · g.
        let loss = (&p * Tensor::from_slice(g)).sum(Kind::Float);
        scaler.scale(&loss).backward();
        scaler.step(&mut opt).unwrap();
        scaler.update().unwrap();
        out.push((scaler.scale_value(), Vec::<f32>::try_from(&p).unwrap()));
    }
    out
}

/// What PyTorch's `torch.amp.GradScaler('cpu', {args})` gives on [`GRADS`], as
/// [`ours`] does; `None` when no PyTorch is found (a skip, a failure under CI).
fn theirs(args: &str) -> Option<Vec<(f64, Vec<f32>)>> {
    let grads: Vec<String> = GRADS
        .iter()
        .map(|g| format!("[{}]", g.map(|v| format!("float('{v}')")).join(",")))
        .collect();
    let script = format!(
        "import torch\n\
         p = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))\n\
         opt = torch.optim.SGD([p], lr=0.1)\n\
         scaler = torch.amp.GradScaler('cpu', {args})\n\
         for g in [{}]:\n    \
             opt.zero_grad()\n    \
             scaler.scale((p * torch.tensor(g)).sum()).backward()\n    \
             scaler.step(opt)\n    \
             scaler.update()\n    \
             print(scaler.get_scale(), ' '.join(repr(v) for v in p.tolist()))\n",
        grads.join(",")
    );
    let stdout = run_python(&script, &[], "")?;
    Some(
        stdout
            .lines()
            .map(|l| {
                let mut f = l.split(' ');
                let scale = f.next().unwrap().parse().unwrap();
                (scale, f.map(|v| v.parse::<f64>().unwrap() as f32).collect())
            })
            .collect(),
    )
}

#[test]
fn same_scales_and_steps_as_pytorch() {
    let ours = ours(GradScaler::new().init_scale(1024.0).growth_interval(2));
    // The schedule on its own: halve on each overflow, double after 2 clean steps.
    let scales: Vec<f64> = ours.iter().map(|(s, _)| *s).collect();
    assert_eq!(
        scales,
        [1024.0, 512.0, 512.0, 256.0, 256.0, 512.0, 512.0, 1024.0, 1024.0]
    );
    assert_eq!(ours[1].1, ours[0].1, "the inf step is skipped");

    let Some(theirs) = theirs("init_scale=1024.0, growth_interval=2") else {
        return;
    };
    assert_eq!(ours, theirs, "scale and parameters after each step");
}

/// Every setting of the builder reaches the schedule, whatever the order of the calls.
#[test]
fn a_scaler_built_with_other_factors_matches_pytorch_built_with_them() {
    let ours = ours(
        GradScaler::new()
            .growth_factor(4.0)
            .init_scale(1024.0)
            .backoff_factor(0.25)
            .growth_interval(2)
            .max_consecutive_skips(3),
    );
    // Quartered on each overflow, quadrupled after 2 clean steps.
    let scales: Vec<f64> = ours.iter().map(|(s, _)| *s).collect();
    assert_eq!(
        scales,
        [1024.0, 256.0, 256.0, 64.0, 64.0, 256.0, 256.0, 1024.0, 1024.0]
    );
    let Some(theirs) =
        theirs("init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=2")
    else {
        return;
    };
    assert_eq!(ours, theirs, "scale and parameters after each step");
}

/// `max_consecutive_skips(2)`: the second overflow in a row ends the run, not the 100th.
#[test]
fn max_consecutive_skips_is_the_limit_that_update_enforces() {
    let vs = VarStore::new(Device::Cpu);
    let p = vs.root().var_copy("p", &Tensor::from_slice(&[1.0f32]));
    let mut opt = Optimizer::new(&nn::Sgd::default(), &vs, 0.1).unwrap();
    let mut scaler = GradScaler::new().max_consecutive_skips(2).init_scale(8.0);
    let mut step = |g: f32| {
        opt.zero_grad().unwrap();
        scaler.scale(&(&p * g as f64).sum(Kind::Float)).backward();
        scaler.step(&mut opt).unwrap();
        scaler.update()
    };
    assert!(step(f32::INFINITY).is_ok(), "one skip is allowed");
    let err = step(f32::INFINITY).unwrap_err().to_string();
    assert!(err.contains("2 steps in a row"), "{err}");
}

#[test]
fn an_overflow_on_one_rank_skips_the_step_on_every_rank() {
    let dir = scratch_dir("amp");
    let worker = env!("CARGO_BIN_EXE_amp_worker");
    let run = run_tchrun_all_ranks(
        &dir,
        &["--nproc-per-node", "2", worker],
        Duration::from_secs(60),
        |_, _| {},
    );
    run.assert_success();
    for rank in 0..2 {
        assert!(
            run.stdout
                .contains(&format!("rank {rank}: stepped false, scale 32768")),
            "rank {rank} skipped and halved:\n{}",
            run.stdout
        );
    }
}
