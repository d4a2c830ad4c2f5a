//! The optimizer's state as tensors: checkpoints of tch-distributed 0.1 (libtorch's
//! optimizer archive, `optimizer.pt`) still resume bit for bit; the state's memory is
//! what the arithmetic says; a state of another algorithm or model is refused with a
//! message that says what to do.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tch::nn::{self, Module};
use tch::{Device, Reduction, Tensor};
use tch_distributed::{Checkpointer, Implementation, Optimizer};
use tch_distributed_tests::compare::named;
use tch_distributed_tests::{output_within, scratch_dir};

/// The fixture's model: l1 (4 → 8) in group 0, l2 (8 → 2) in group 1.
fn model() -> (nn::VarStore, nn::Linear, nn::Linear) {
    let vs = nn::VarStore::new(Device::Cpu);
    let l1 = nn::linear(vs.root() / "l1", 4, 8, Default::default());
    let l2 = nn::linear(vs.root().set_group(1) / "l2", 8, 2, Default::default());
    (vs, l1, l2)
}

fn load(vs: &nn::VarStore, path: &Path) {
    let values = Tensor::read_safetensors(path).unwrap();
    tch::no_grad(|| {
        let mut vars = vs.variables();
        for (name, value) in &values {
            vars.get_mut(name).unwrap().copy_(value);
        }
    });
}

fn named_variables(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

/// `tests/fixtures/checkpoint-0.1` was written by tch-distributed 0.1 (whose optimizer
/// was libtorch's C++ one, saved as `optimizer.pt`): for Adam (AMSGrad, weight decay)
/// and SGD (momentum), two groups with their own learning rates, 10 steps on
/// `data.safetensors` from `NAME-init.safetensors`, a checkpoint after step 5, the
/// parameters after step 10 in `NAME-final.safetensors`. Resuming from the checkpoint
/// with this version and taking the 5 remaining steps must end on the same bits.
///
/// The last bits of a matrix product depend on which code path MKL takes, and MKL picks
/// it by CPU: on an AVX-512 Xeon, 4 of the 58 parameters end 1 ulp away from the
/// fixture's. The fixture is MKL's `COMPATIBLE` path (the one it takes on CPUs it does
/// not tune for), which gives the same bits on every x86-64 CPU. MKL reads `MKL_CBWR`
/// once, at its first call, so the test runs itself again in a child process with it set.
#[test]
fn a_checkpoint_of_version_0_1_resumes_bit_for_bit() {
    const NAME: &str = "a_checkpoint_of_version_0_1_resumes_bit_for_bit";
    if std::env::var("MKL_CBWR").as_deref() != Ok("COMPATIBLE") {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["--exact", NAME, "--nocapture"])
            .env("MKL_CBWR", "COMPATIBLE");
        let out = output_within(&mut cmd, b"", Duration::from_secs(60));
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success() && text.contains("1 passed"),
            "with MKL_CBWR=COMPATIBLE:\n{text}"
        );
        return;
    }
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/checkpoint-0.1");
    let data: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(fixture.join("data.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    let (x, y) = (&data["x"], &data["y"]);
    for name in ["adam", "sgd"] {
        // A copy: loading must not need to write, but the fixture stays as it was.
        let dir = scratch_dir(&format!("checkpoint-0.1-{name}"));
        let step_dir = dir.join("step-0000000005");
        std::fs::create_dir_all(&step_dir).unwrap();
        for entry in std::fs::read_dir(fixture.join(name).join("step-0000000005")).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), step_dir.join(entry.file_name())).unwrap();
        }
        let (mut vs, l1, l2) = model();
        load(&vs, &fixture.join(format!("{name}-init.safetensors")));
        let mut opt = match name {
            "adam" => Optimizer::new(
                &nn::Adam {
                    wd: 1e-3,
                    amsgrad: true,
                    ..Default::default()
                },
                &vs,
                0.01,
            ),
            _ => Optimizer::new(
                &nn::Sgd {
                    momentum: 0.9,
                    ..Default::default()
                },
                &vs,
                0.05,
            ),
        }
        .unwrap()
        // The arithmetic of 0.1's optimizer (libtorch's C++ one), to continue its run
        // to the bit.
        .with_implementation(Implementation::Tch)
        .unwrap();
        opt.set_lr_group(1, 0.005).unwrap();
        let state = Checkpointer::new(&dir)
            .load_state(&mut vs, &mut opt)
            .unwrap()
            .expect("the checkpoint");
        assert_eq!(state.step, 5);
        assert!(
            opt.state_bytes() > 0,
            "{name}: the archive's state was read"
        );
        for _ in 6..=10 {
            let loss = l2
                .forward(&l1.forward(x).tanh())
                .mse_loss(y, Reduction::Mean);
            opt.backward_step(&loss).unwrap();
        }
        let expected =
            Tensor::read_safetensors(fixture.join(format!("{name}-final.safetensors"))).unwrap();
        let diff = named(&named_variables(&vs), &expected);
        assert!(diff.is_exact(), "{name}: {diff:?}");
        // Without the optimizer's state the run differs: the test can see it.
        let (vs2, l1, l2) = model();
        load(&vs2, &step_dir.join("model.safetensors"));
        let mut fresh = Optimizer::new(&nn::Adam::default(), &vs2, 0.01).unwrap();
        for _ in 6..=10 {
            let loss = l2
                .forward(&l1.forward(x).tanh())
                .mse_loss(y, Reduction::Mean);
            fresh.backward_step(&loss).unwrap();
        }
        assert!(!named(&named_variables(&vs2), &expected).is_exact());
    }
}

#[test]
fn state_bytes_are_two_float32_tensors_per_parameter_for_adam() {
    let (vs, l1, l2) = model();
    let x = Tensor::ones([3, 4], (tch::Kind::Float, Device::Cpu));
    let params: usize = vs.trainable_variables().iter().map(Tensor::numel).sum();
    assert_eq!(params, 4 * 8 + 8 + 8 * 2 + 2);
    for (implementation, extra) in [(Implementation::Tch, 0), (Implementation::Fused, 4 * 4)] {
        let mut opt = Optimizer::new(&nn::Adam::default(), &vs, 0.01)
            .unwrap()
            .with_implementation(implementation)
            .unwrap();
        assert_eq!(opt.state_bytes(), 0, "no state before the first step");
        opt.backward_step(&l2.forward(&l1.forward(&x)).sum(tch::Kind::Float))
            .unwrap();
        // exp_avg and exp_avg_sq: 8 bytes a parameter; the fused kernels' step counts:
        // one float32 scalar per parameter tensor.
        assert_eq!(opt.state_bytes(), 8 * params + extra, "{implementation:?}");
    }
    let mut amsgrad = Optimizer::new(
        &nn::Adam {
            amsgrad: true,
            ..Default::default()
        },
        &vs,
        0.01,
    )
    .unwrap();
    amsgrad
        .backward_step(&l2.forward(&l1.forward(&x)).sum(tch::Kind::Float))
        .unwrap();
    // Fused by default: the step counts too.
    assert_eq!(
        amsgrad.state_bytes(),
        12 * params + 4 * 4,
        "AMSGrad keeps a third"
    );
}

#[test]
fn a_state_of_another_algorithm_or_model_is_refused_naming_both() {
    let (vs, l1, l2) = model();
    let x = Tensor::ones([3, 4], (tch::Kind::Float, Device::Cpu));
    let mut sgd = Optimizer::new(
        &nn::Sgd {
            momentum: 0.9,
            ..Default::default()
        },
        &vs,
        0.1,
    )
    .unwrap();
    sgd.backward_step(&l2.forward(&l1.forward(&x)).sum(tch::Kind::Float))
        .unwrap();
    let saved = sgd.state().unwrap();
    let mut adam = Optimizer::new(&nn::Adam::default(), &vs, 0.01).unwrap();
    let err = adam.load_state(&saved).unwrap_err().to_string();
    assert!(
        err.contains("state of SGD") && err.contains("this optimizer is Adam"),
        "{err}"
    );
    // The same algorithm over another model: the groups' sizes differ.
    let other = nn::VarStore::new(Device::Cpu);
    let _ = nn::linear(other.root() / "l1", 4, 8, Default::default());
    let mut small = Optimizer::new(&nn::Sgd::default(), &other, 0.1).unwrap();
    let err = small.load_state(&saved).unwrap_err().to_string();
    assert!(
        err.contains("parameter groups hold [2, 2] parameters"),
        "{err}"
    );
    assert!(small.load_state(b"not a state").is_err());
    // RMSprop has no fused kernel.
    let err = Optimizer::new(&nn::RmsProp::default(), &vs, 0.01)
        .unwrap()
        .with_implementation(Implementation::Fused)
        .unwrap_err()
        .to_string();
    assert!(err.contains("RMSprop has no fused kernel"), "{err}");
}
