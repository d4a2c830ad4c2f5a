//! ZeRO stage 1 (`zero = 1`, `TCH_DISTRIBUTED_ZERO=1`): the optimizer's state sharded
//! over the ranks, as PyTorch's `ZeroRedundancyOptimizer`.
//!
//! `zero_worker` trains Adam with every rank on the same whole batch, so that the
//! averaged gradient is the same bits at 1, 2 or 4 ranks (sums of 2 or 4 equal values
//! and their halving or quartering are exact): the parameters must then be the same
//! bits whatever the world size, with or without ZeRO, and across a checkpoint that
//! changes both. The reference is one process without ZeRO (no collective at all).

use std::path::Path;
use std::time::Duration;

use tch_distributed_tests::compare::files as compare;
use tch_distributed_tests::{
    copy_dir, run_tchrun_all_ranks, run_with, scratch_dir, state_bytes, tchrun, without_launcher,
};

const WORKER: &str = env!("CARGO_BIN_EXE_zero_worker");
const TIMEOUT: Duration = Duration::from_secs(120);

/// `zero_worker DIR OUT ARGS…` on `ranks` ranks (one process, no launcher, for 1),
/// with `TCH_DISTRIBUTED_ZERO` set to `zero`.
fn run(dir: &Path, ranks: usize, zero: bool, out: &str, args: &[&str]) {
    let d = dir.to_str().unwrap();
    let zero = if zero { "1" } else { "0" };
    if ranks == 1 {
        let mut cmd = std::process::Command::new(WORKER);
        without_launcher(&mut cmd)
            .args([d, out])
            .args(args)
            .env("TCH_DISTRIBUTED_ZERO", zero);
        run_with(cmd, dir, TIMEOUT, |_, _| {}).assert_success();
        return;
    }
    let mut cmd = std::process::Command::new(tchrun());
    cmd.args(["--nproc-per-node", &ranks.to_string(), WORKER, d, out])
        .args(args)
        .env("TCH_DISTRIBUTED_ZERO", zero);
    let run = run_with(cmd, dir, TIMEOUT, |_, _| {});
    run.assert_success();
    if ranks > 1 && zero == "1" {
        assert!(
            run.stdout.contains(&format!(
                "ZeRO stage 1 (optimizer state sharded over {ranks} ranks)"
            )),
            "the banner says so: {}",
            run.stdout
        );
    }
}

#[test]
fn zero_gives_ddps_parameters_bit_for_bit_with_a_share_of_the_state_on_each_rank() {
    let dir = scratch_dir("zero");
    tch_distributed_tests::write_mlp_fixture(&dir, 20251126, 32);
    run(&dir, 1, false, "alone.safetensors", &["10"]);
    let whole = state_bytes(&dir, "alone.safetensors", 0);
    // Adam (fused): two float32 tensors per parameter, and a step count per tensor.
    assert_eq!(whole, 8 * (32 * 8 + 32 + 4 * 32 + 4) + 4 * 4);
    let moved = compare(
        &dir.join("init.safetensors"),
        &dir.join("alone.safetensors"),
    );
    assert!(moved.max_abs > 1e-3, "trained: {moved:?}");
    for ranks in [2, 4] {
        for zero in [false, true] {
            let out = format!("ranks{ranks}-zero{zero}.safetensors");
            run(&dir, ranks, zero, &out, &["10"]);
            let diff = compare(&dir.join("alone.safetensors"), &dir.join(&out));
            assert!(diff.is_exact(), "{ranks} ranks, zero {zero}: {diff:?}");
            let bytes: Vec<usize> = (0..ranks).map(|r| state_bytes(&dir, &out, r)).collect();
            if zero {
                // Each rank holds its rows (dim 0, as torch.chunk cuts them: every
                // parameter's 32 or 4 rows divide by 2 and 4) of every parameter's
                // moments, exactly 1/N of them, and the step counts of the 4.
                for &b in &bytes {
                    assert_eq!(
                        (b - 4 * 4) * ranks,
                        whole - 4 * 4,
                        "{ranks} ranks: {bytes:?}"
                    );
                }
            } else {
                assert!(bytes.iter().all(|&b| b == whole), "{bytes:?}");
            }
        }
    }
}

/// A checkpoint of a ZeRO run holds one shard of the optimizer's state per rank; it
/// resumes on another number of ranks, with ZeRO or without, and in PyTorch (whose
/// `torch.optim.Adam` loads the shards together), each time to the uninterrupted run's
/// parameters, bit for bit.
#[test]
fn a_zero_checkpoint_resumes_on_other_world_sizes_with_or_without_zero_and_in_pytorch() {
    let dir = scratch_dir("zero-resume");
    tch_distributed_tests::write_mlp_fixture(&dir, 20251126, 32);
    run(&dir, 1, false, "uninterrupted.safetensors", &["10"]);
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    // 4 ranks with ZeRO: 5 steps and a checkpoint, then 5 more.
    run(&dir, 4, true, "zero4.safetensors", &["10", c, "5"]);
    let step = ckpt.join("step-0000000005");
    for r in 0..4 {
        // Each file names the chunk it holds, which loading checks and orders by.
        let file = std::fs::read(step.join(format!("optimizer-rank-{r}.safetensors"))).unwrap();
        let len = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&file[8..8 + len]).unwrap();
        let shard: serde_json::Value =
            serde_json::from_str(header["__metadata__"]["dim0_shard"].as_str().unwrap()).unwrap();
        assert_eq!(shard, serde_json::json!({ "rank": r, "world_size": 4 }));
    }
    assert!(!step.join("optimizer.safetensors").exists());
    let reference = dir.join("uninterrupted.safetensors");
    let same = |out: &str, what: &str| {
        let diff = compare(&reference, &dir.join(out));
        assert!(diff.is_exact(), "{what}: {diff:?}");
    };
    same(
        "zero4.safetensors",
        "4 ranks with ZeRO, through the checkpoint",
    );
    // Step 10 is in the checkpoints too now; resume from step 5 alone.
    for later in std::fs::read_dir(&ckpt).unwrap() {
        let later = later.unwrap().path();
        if later != step {
            std::fs::remove_dir_all(later).unwrap();
        }
    }
    let keep = dir.join("step-5");
    copy_dir(&step, &keep);
    for (ranks, zero, out) in [
        (2, true, "resumed-2-zero.safetensors"),
        (1, false, "resumed-1.safetensors"),
        (2, false, "resumed-2.safetensors"),
    ] {
        std::fs::remove_dir_all(&ckpt).unwrap();
        copy_dir(&keep, &step);
        run(&dir, ranks, zero, out, &["10", c, "0"]);
        same(out, &format!("resumed on {ranks} ranks, zero {zero}"));
    }

    let Some(python) =
        tch_distributed_tests::python_or_skip("resuming a ZeRO checkpoint in PyTorch")
    else {
        return;
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("parity/torch_resume.py");
    let mut cmd = std::process::Command::new(python);
    cmd.arg(script)
        .arg(&dir)
        .arg(&keep)
        .arg("5")
        .arg("torch-resumed.safetensors");
    run_with(cmd, &dir, TIMEOUT, |_, _| {}).assert_success();
    same(
        "torch-resumed.safetensors",
        "resumed in PyTorch from the shards",
    );
}

#[test]
fn zero_in_a_world_of_one_shards_nothing() {
    // As ZeroRedundancyOptimizer on one rank: the whole state stays with the one rank,
    // and a checkpoint keeps it in `optimizer.safetensors`, not in shards.
    let ctx = tch_distributed_tests::init_on_cpu();
    assert_eq!(ctx.world_size(), 1);
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let _layer = tch::nn::linear(vs.root(), 2, 2, Default::default());
    let opt = tch_distributed::Optimizer::new(&tch::nn::Adam::default(), &vs, 0.01)
        .unwrap()
        .zero(1)
        .unwrap();
    assert_eq!(opt.zero_stage(), None);
}

#[test]
fn a_variable_created_after_a_zero_optimizer_without_ddp_joins_the_partition() {
    // Through the optimizer's own API, without DDP (so not refused as under DDP): the
    // late variable must be owned by some rank, which updates it and shares it.
    let dir = scratch_dir("zero-late");
    let args = [
        "--nproc-per-node",
        "2",
        env!("CARGO_BIN_EXE_ddp_worker"),
        "zero_late",
    ];
    let run = run_tchrun_all_ranks(&dir, &args, TIMEOUT, |_, _| {});
    run.assert_success();
    assert_eq!(
        run.stdout.matches("ok zero_late").count(),
        2,
        "{}",
        run.stdout
    );
}
