//! DistributedDataParallel over c10d::Reducer, as real 2- and 3-rank runs.

use std::time::Duration;

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use tch_distributed::{DdpOptions, DdpStats, DistributedDataParallel};
use tch_distributed_tests::{run_tchrun_all_ranks, scratch_dir, Run};

const WORKER: &str = env!("CARGO_BIN_EXE_ddp_worker");
const TIMEOUT: Duration = Duration::from_secs(90);

fn ddp(ranks: usize, args: &[&str]) -> Run {
    let dir = scratch_dir("ddp");
    let n = ranks.to_string();
    let mut all = vec!["--nproc-per-node", &n, WORKER];
    all.extend_from_slice(args);
    let run = run_tchrun_all_ranks(&dir, &all, TIMEOUT, |_, _| {});
    run.assert_success();
    run
}

fn count(run: &Run, line: &str) -> usize {
    run.stdout.lines().filter(|l| l.starts_with(line)).count()
}

#[test]
fn averaged_gradient_equals_single_process_gradient_and_parameters_come_from_rank_0() {
    for ranks in [2, 3] {
        let run = ddp(ranks, &["grad"]);
        assert_eq!(
            count(&run, "ok broadcast from rank 0"),
            ranks,
            "{}",
            run.stdout
        );
        assert_eq!(count(&run, "ok averaged gradient"), ranks, "{}", run.stdout);
    }
}

/// Every step kind trains as PyTorch DDP does: 20 steps of SGD with momentum on 2
/// ranks end, on both, within 1e-6 of one process that steps on each step's global
/// batch (both ranks' rows) with the gradient of its mean loss, clipped after it is
/// complete for `clip` and `clip_norm` (written out as `torch.nn.utils.clip_grad_*`
/// computes it); the parameters moved, and the clipping changed the result. See
/// `ddp_worker`'s `train_reference`.
#[test]
fn every_step_kind_equals_one_process_on_the_global_batch_after_20_steps() {
    for kind in ["plain", "clip", "clip_norm", "manual"] {
        let run = ddp(2, &["train", "--steps", "20", "--step-kind", kind]);
        assert_eq!(
            count(&run, "ok identical after 20 steps"),
            2,
            "{kind}: {}",
            run.stdout
        );
        assert_eq!(
            count(
                &run,
                &format!("ok equals one process on the global batch after 20 steps ({kind})")
            ),
            2,
            "{kind}: {}",
            run.stdout
        );
    }
}

#[test]
fn buckets_are_rebuilt_by_size_after_the_first_step() {
    let run = ddp(2, &["train", "--steps", "3"]);
    let line = run
        .stdout
        .lines()
        .find(|l| l.starts_with("buckets"))
        .unwrap();
    // 1 KiB-ish caps split the MLP's 4 parameters into more than one bucket.
    assert!(line.starts_with("buckets [3, 1]"), "{line}");
    assert!(line.contains("bucket_rebuilds: 1"), "{line}");
}

#[test]
fn no_sync_accumulates_locally_then_averages_once() {
    let run = ddp(2, &["accumulate"]);
    assert_eq!(
        count(&run, "ok accumulate with no_sync"),
        2,
        "{}",
        run.stdout
    );
}

/// With `find_unused_parameters`, a model with a layer the loss never uses, and one it
/// uses on one step of three, trains to the parameters of one process on the global
/// batch, the unused layer unchanged. (The set of unused parameters changing from one
/// step to the next made the Reducer log through a logger it did not have: SIGSEGV.)
#[test]
fn find_unused_parameters_trains_a_model_with_an_unused_layer() {
    let run = ddp(2, &["unused"]);
    assert_eq!(
        count(
            &run,
            "ok find_unused_parameters: equals one process on the global batch"
        ),
        2,
        "{}",
        run.stdout
    );
}

/// In a world of one (this test process, no launcher) DDP keeps the options it was
/// given, leaves backward's gradients as they are (nothing to average) and counts every
/// backward pass as synchronized.
#[test]
fn in_a_world_of_one_ddp_keeps_its_options_and_counts_its_backward_passes() {
    let ctx = tch_distributed_tests::init_on_cpu();
    assert_eq!(ctx.world_size(), 1);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root(), 3, 1, Default::default());
    let options = DdpOptions {
        bucket_cap_mb: 7.0,
        first_bucket_cap_mb: 2.0,
        find_unused_parameters: true,
        broadcast_buffers: false,
        static_graph: false,
        comm_hook: tch_distributed::CommHook::Bf16,
    };
    let ddp = DistributedDataParallel::new(&vs, ctx.process_group(), options.clone()).unwrap();
    assert_eq!(ddp.options(), &options);
    let x = Tensor::ones([2, 3], (Kind::Float, Device::Cpu));
    for _ in 0..3 {
        ddp.backward(&net.forward(&x).sum(Kind::Float)).unwrap();
    }
    let expected = DdpStats {
        synced_backward_passes: 3,
        local_backward_passes: 0,
        bucket_rebuilds: 0,
    };
    assert_eq!(ddp.stats(), expected);
    // Three passes accumulate: d(sum of 2 rows of x·w)/dw = 2 per pass, 6 in all.
    let grad = Vec::<f32>::try_from(net.ws.grad().reshape([-1])).unwrap();
    assert_eq!(grad, [6.0, 6.0, 6.0]);
}

/// A bucket cap that is no positive number of MiB (zero, negative, infinite, NaN) is
/// refused when the DDP is made, naming the option, rather than building buckets of
/// nothing or of everything.
#[test]
fn a_bucket_cap_that_is_no_positive_number_is_refused() {
    let ctx = tch_distributed_tests::init_on_cpu();
    let vs = nn::VarStore::new(Device::Cpu);
    let _net = nn::linear(vs.root(), 3, 1, Default::default());
    for bad in [0.0, -1.0, f64::INFINITY, f64::NAN] {
        for first in [false, true] {
            let mut options = DdpOptions::default();
            if first {
                options.first_bucket_cap_mb = bad;
            } else {
                options.bucket_cap_mb = bad;
            }
            let name = if first {
                "first_bucket_cap_mb"
            } else {
                "bucket_cap_mb"
            };
            match DistributedDataParallel::new(&vs, ctx.process_group(), options) {
                Err(e) => assert!(
                    e.to_string()
                        .contains(&format!("{name} must be a positive number of MiB")),
                    "{name} = {bad}: {e}"
                ),
                Ok(_) => panic!("{name} = {bad} was accepted"),
            }
        }
    }
}
