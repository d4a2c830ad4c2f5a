//! `Checkpointer` across real ranks (`checkpoint_worker` under `tchrun`): exact resume
//! after a killed rank, skipping incomplete and corrupt checkpoints.

use std::fs;
use std::path::Path;
use std::time::Duration;

use std::process::Command;

use tch_distributed_tests::{
    copy_dir, run_python, run_with, scratch_dir, tchrun, wait_until, without_launcher, Run,
};

const WORKER: &str = env!("CARGO_BIN_EXE_checkpoint_worker");
const TIMEOUT: Duration = Duration::from_secs(120);

fn train(dir: &Path, ckpt: &str, steps: &str, kind: &str, kill_at: Option<&str>) -> Run {
    let kill = kill_at.map(|step| [("KILL_AT", step), ("KILL_RANK", "1")]);
    train_with(
        dir,
        ckpt,
        steps,
        kind,
        kill.as_ref().map_or(&[], |k| &k[..]),
    )
}

/// `train` on 2 ranks with `env` set (tchrun passes its environment to the ranks).
fn train_with(dir: &Path, ckpt: &str, steps: &str, kind: &str, env: &[(&str, &str)]) -> Run {
    let mut cmd = Command::new(tchrun());
    cmd.args([
        "--nproc-per-node",
        "2",
        WORKER,
        dir.to_str().unwrap(),
        ckpt,
        steps,
        kind,
    ]);
    cmd.envs(env.iter().copied());
    run_with(cmd, dir, TIMEOUT, |_, _| {})
}

fn params(dir: &Path, file: &str) -> Vec<(String, tch::Tensor)> {
    let mut named = tch::Tensor::read_safetensors(dir.join(format!("{file}.safetensors"))).unwrap();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

/// Bit for bit, through `tch_distributed_tests::compare` (names, shapes, dtypes; NaN
/// or infinity fails).
fn assert_equal(a: &[(String, tch::Tensor)], b: &[(String, tch::Tensor)], what: &str) {
    let diff = tch_distributed_tests::compare::named(a, b);
    assert!(diff.is_exact(), "{what}: not bit for bit equal: {diff:?}");
}

/// Final parameters, and the parameters after two more steps (which depend on the
/// optimizer's state), are bit-for-bit equal between the runs and the ranks.
fn assert_same(a: &Path, b: &Path, what: &str) {
    for file in ["final0", "probe0"] {
        assert_equal(
            &params(a, file),
            &params(b, file),
            &format!("{what}: {file}"),
        );
    }
    for dir in [a, b] {
        assert_equal(
            &params(dir, "probe0"),
            &params(dir, "probe1"),
            &format!("{what}: ranks"),
        );
    }
}

/// Rank 1 is SIGKILLed after step 6, between checkpoints: the relaunch resumes from
/// step 4 and ends bit for bit where an uninterrupted run ends, with SGD and Adam, and
/// with Adam at ZeRO stage 3 (each rank's chunks of the state in its own file).
///
/// With gradient accumulation (3 micro-batches a step, a cycle ending early at each
/// epoch's end, 5 micro-batches an epoch), the checkpoints of steps 4 and 12 are
/// saved in the middle of a cycle (1 and 2 of its micro-batches done) and that of
/// step 8 at a cycle's end: the relaunch resumes step 4's cycle with its gradients
/// (DDP's `no_sync` ones, and the full ones that stage 3 keeps over a cycle), bit for
/// bit too. Without them it ended 4.5e-3 away.
#[test]
fn resume_after_a_killed_rank_is_bit_for_bit() {
    let cases = [
        ("sgd", "0", "1"),
        ("adam", "0", "1"),
        ("adam", "3", "1"),
        ("sgd", "0", "3"),
        ("adam", "3", "3"),
    ];
    for (kind, zero, accumulation) in cases {
        let what = format!("{kind}, zero {zero}, accumulation {accumulation}");
        let zero_env = ("TCH_DISTRIBUTED_ZERO", zero);
        let accumulation_env = ("TCH_DISTRIBUTED_GRAD_ACCUM", accumulation);
        let name = format!("{kind}-{zero}-{accumulation}");
        // Uninterrupted: 13 steps (checkpoints at 4, 8, 12).
        let straight = scratch_dir(&format!("straight-{name}"));
        let ckpt = straight.join("ckpt");
        let env = [zero_env, accumulation_env];
        let run = train_with(&straight, ckpt.to_str().unwrap(), "13", kind, &env);
        run.assert_success();
        assert_eq!(
            run.stdout.contains("ZeRO stage 3 ("),
            zero == "3",
            "{}",
            run.stdout
        );

        // Rank 1 is SIGKILLed after step 6; the relaunch resumes from step 4, in the
        // middle of epoch 0 (5 steps per epoch).
        let killed = scratch_dir(&format!("killed-{name}"));
        let ckpt = killed.join("ckpt");
        let kill = [
            zero_env,
            accumulation_env,
            ("KILL_AT", "6"),
            ("KILL_RANK", "1"),
        ];
        let run = train_with(&killed, ckpt.to_str().unwrap(), "13", kind, &kill);
        assert!(!run.status.success(), "the kill fails the job");
        let run = train_with(&killed, ckpt.to_str().unwrap(), "13", kind, &env);
        run.assert_success();
        assert!(
            run.stdout.contains("resumed at step 4, epoch 0"),
            "{}",
            run.stdout
        );
        assert_same(&straight, &killed, &what);
        // keep_last(2): only steps 8 and 12 remain.
        let mut left: Vec<String> = fs::read_dir(&ckpt)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, ["step-0000000008", "step-0000000012"], "{what}");
        let sharded = ckpt.join("step-0000000012/optimizer-rank-1.safetensors");
        assert_eq!(sharded.exists(), zero == "3", "{what}");
        // The cycle's gradients: in the middle of one only.
        for (step, mid_cycle) in [(8, false), (12, accumulation == "3")] {
            let grads = ckpt.join(format!("step-{step:010}/grads-rank-1.safetensors"));
            assert_eq!(grads.exists(), mid_cycle, "{what}: step {step}");
        }
    }
}

/// `checkpoint_worker` as one process, no launcher (a world of one): rank 0 alone makes,
/// writes and completes each checkpoint.
fn train_alone(dir: &Path, ckpt: &str, steps: &str, env: &[(&str, &str)]) -> Run {
    let mut cmd = Command::new(WORKER);
    without_launcher(&mut cmd)
        .args([dir.to_str().unwrap(), ckpt, steps, "adam"])
        .envs(env.iter().copied());
    run_with(cmd, dir, TIMEOUT, |_, _| {})
}

#[test]
fn one_process_resumes_bit_for_bit_too() {
    let straight = scratch_dir("alone-straight");
    let ckpt = straight.join("ckpt");
    train_alone(&straight, ckpt.to_str().unwrap(), "13", &[]).assert_success();

    let killed = scratch_dir("alone-killed");
    let ckpt = killed.join("ckpt");
    let c = ckpt.to_str().unwrap();
    let kill = [("KILL_AT", "6"), ("KILL_RANK", "0")];
    assert!(!train_alone(&killed, c, "13", &kill).status.success());
    let run = train_alone(&killed, c, "13", &[]);
    run.assert_success();
    // 10 steps per epoch on one rank: step 4 is in epoch 0.
    assert!(
        run.stdout.contains("resumed at step 4, epoch 0"),
        "{}",
        run.stdout
    );
    // Nothing was skipped, so no warning names the checkpoint used.
    assert!(!run.stderr.contains("resumed from"), "{}", run.stderr);
    for file in ["final0", "probe0"] {
        assert_equal(&params(&straight, file), &params(&killed, file), file);
    }
}

/// A checkpoint saved by 2 ranks one micro-batch into an accumulation cycle resumes in
/// one process with the 2 ranks' mean gradient (each rank saved its own sum, not yet
/// averaged), bit for bit, so that the average at the cycle's end counts the saved
/// micro-batches as the 2 ranks' average would; a run that accumulates another number
/// of micro-batches starts a new cycle instead, and the warning says so.
#[test]
fn a_cycle_in_progress_resumes_on_another_world_size_with_the_ranks_mean_gradient() {
    let dir = scratch_dir("cycle-world-size");
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    let accumulate = ("TCH_DISTRIBUTED_GRAD_ACCUM", "3");
    // Step 4's checkpoint is one micro-batch into a cycle; rank 1 dies after step 6.
    let kill = [accumulate, ("KILL_AT", "6"), ("KILL_RANK", "1")];
    assert!(!train_with(&dir, c, "13", "adam", &kill).status.success());
    let saved = ckpt.join("step-0000000004");
    let (rank0, rank1) = (
        params(&saved, "grads-rank-0"),
        params(&saved, "grads-rank-1"),
    );
    assert!(!rank0.is_empty());
    let mean: Vec<(String, tch::Tensor)> = rank0
        .iter()
        .zip(&rank1)
        .map(|((name, a), (other, b))| {
            assert_eq!(name, other);
            (name.clone(), (a + b) / 2.0)
        })
        .collect();
    let diff = tch_distributed_tests::compare::named(&rank0, &rank1);
    assert!(
        !diff.is_exact(),
        "each rank saved its own micro-batch's gradients"
    );

    let resumed = [("RESUMED_GRADS", "1"), ("TCH_DISTRIBUTED_GRAD_ACCUM", "2")];
    let run = train_alone(&dir, c, "5", &resumed);
    run.assert_success();
    assert!(
        run.stderr.contains(
            "was saved after 1 of the 3 micro-batches of an accumulation cycle, and this run \
             accumulates 2"
        ),
        "{}",
        run.stderr
    );
    assert!(params(&dir, "resumed-grads0").is_empty(), "a new cycle");

    let run = train_alone(&dir, c, "5", &[("RESUMED_GRADS", "1"), accumulate]);
    run.assert_success();
    assert!(run.stdout.contains("resumed at step 4"), "{}", run.stdout);
    assert_equal(&params(&dir, "resumed-grads0"), &mean, "the ranks' mean");
}

/// Under DDP with `find_unused_parameters`, a head that only the first micro-batch of
/// each accumulation cycle uses (`BRANCH=1`): the Reducer averages its gradient in a
/// cycle's last pass only because it saw an earlier pass use it, which a resumed
/// run's Reducer did not. Resumed one micro-batch into a cycle, every rank takes the
/// ranks' mean gradient: the ranks stay equal, bit for bit, and end within 1e-6 of the
/// uninterrupted run (each with its own, the ranks ended 5e-4 apart, silently).
#[test]
fn a_cycle_resumed_under_find_unused_parameters_keeps_the_ranks_equal() {
    let env = [
        ("TCH_DISTRIBUTED_GRAD_ACCUM", "3"),
        ("TCH_DISTRIBUTED_FIND_UNUSED_PARAMETERS", "1"),
        ("BRANCH", "1"),
    ];
    let straight = scratch_dir("branch-straight");
    let ckpt = straight.join("ckpt");
    train_with(&straight, ckpt.to_str().unwrap(), "13", "adam", &env).assert_success();
    let killed = scratch_dir("branch-killed");
    let ckpt = killed.join("ckpt");
    let c = ckpt.to_str().unwrap();
    let kill = [&env[..], &[("KILL_AT", "6"), ("KILL_RANK", "1")]].concat();
    assert!(!train_with(&killed, c, "13", "adam", &kill).status.success());
    let run = train_with(&killed, c, "13", "adam", &env);
    run.assert_success();
    assert!(run.stdout.contains("resumed at step 4"), "{}", run.stdout);
    for file in ["final", "probe"] {
        let ranks = [
            params(&killed, &format!("{file}0")),
            params(&killed, &format!("{file}1")),
        ];
        assert_equal(&ranks[0], &ranks[1], &format!("{file}: the ranks"));
        let diff = tch_distributed_tests::compare::named(
            &params(&straight, &format!("{file}0")),
            &ranks[0],
        );
        diff.assert_within(1e-6, &format!("{file}: against the uninterrupted run"));
    }
}

/// The epoch a checkpoint records: the loader's position when the program names none,
/// the program's own when it does (`TrainState { epoch, .. }`); the loader resumes from
/// its own position either way.
#[test]
fn a_checkpoint_records_the_program_s_epoch_or_else_the_loader_s() {
    let mut finals = Vec::new();
    for (epoch, expected) in [(None, 1), (Some("7"), 7)] {
        let dir = scratch_dir(&format!("epoch-{}", epoch.unwrap_or("loader")));
        let ckpt = dir.join("ckpt");
        let c = ckpt.to_str().unwrap();
        let given: Vec<(&str, &str)> = epoch.iter().map(|e| ("EPOCH", *e)).collect();
        let kill = [given.clone(), vec![("KILL_AT", "14"), ("KILL_RANK", "0")]].concat();
        assert!(!train_alone(&dir, c, "16", &kill).status.success());
        let run = train_alone(&dir, c, "16", &given);
        run.assert_success();
        // 10 steps per epoch on one rank: the checkpoint of step 12 is in epoch 1.
        let line = format!("resumed at step 12, epoch {expected}");
        assert!(run.stdout.contains(&line), "{line}: {}", run.stdout);
        finals.push(params(&dir, "final0"));
    }
    assert_equal(&finals[0], &finals[1], "the resumed runs' parameters");
}

#[test]
fn a_checkpoint_of_another_model_shape_names_the_variable_and_both_shapes() {
    let dir = scratch_dir("other-shape");
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    train_alone(&dir, c, "5", &[]).assert_success();
    let run = train_alone(&dir, c, "9", &[("HIDDEN", "8")]);
    assert_eq!(run.status.code(), Some(1), "{}", run.stderr);
    assert!(
        run.stderr
            .contains("model.safetensors: `l1.bias` has shape [16], the model [8]"),
        "{}",
        run.stderr
    );
    assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
    // The warning as each checkpoint is skipped, in a world of one too.
    assert!(
        run.stderr.contains("tch-distributed: skipping checkpoint "),
        "{}",
        run.stderr
    );
}

/// Ranks whose listings of the checkpoint directory differ (nodes whose shared file
/// system has not caught up): rank 1 already sees step 12, rank 0 only step 8. Every
/// rank resumes from the same step, rank 0's choice, and the run ends as an
/// uninterrupted one; a rank resuming from its own listing would train from another
/// step than the others.
#[test]
fn ranks_that_list_different_checkpoints_resume_from_the_same_one() {
    // Checkpoints at steps 8 and 12 (keep_last(2)), and the end of an uninterrupted run
    // of 11 steps.
    let source = scratch_dir("views-source");
    train(
        &source,
        source.join("ckpt").to_str().unwrap(),
        "13",
        "adam",
        None,
    )
    .assert_success();
    let straight = scratch_dir("views-straight");
    let ckpt = straight.join("ckpt");
    train(&straight, ckpt.to_str().unwrap(), "11", "adam", None).assert_success();

    let views = scratch_dir("views");
    let ckpt = views.join("ckpt");
    copy_dir(&source.join("ckpt"), &views.join("ckpt-rank1"));
    copy_dir(&source.join("ckpt"), &views.join("ckpt-rank0"));
    fs::remove_dir_all(views.join("ckpt-rank0/step-0000000012")).unwrap();
    // To step 11: no save after the resume (saves need rank 0's directory on every
    // rank).
    let mut cmd = Command::new(tchrun());
    cmd.args(["--nproc-per-node", "2", WORKER])
        .args([
            views.to_str().unwrap(),
            ckpt.to_str().unwrap(),
            "11",
            "adam",
        ])
        .env("CKPT_PER_RANK", "1")
        // Ranks at different steps would wait on each other's collectives.
        .env("TCH_DISTRIBUTED_TIMEOUT", "20");
    let run = run_with(cmd, &views, TIMEOUT, |_, _| {});
    run.assert_success();
    assert!(
        run.stdout.contains("resumed at step 8, epoch 1"),
        "{}",
        run.stdout
    );
    assert_same(&straight, &views, "different listings");
}

#[test]
fn incomplete_and_corrupt_checkpoints_are_skipped_with_a_warning() {
    let dir = scratch_dir("corrupt");
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    train(&dir, c, "8", "adam", None).assert_success();
    // What a crash mid-save can leave (a temporary directory), a checkpoint without
    // its COMPLETE marker, and a corrupt newest complete one.
    fs::create_dir_all(ckpt.join(".tmp-step-0000000012")).unwrap();
    fs::create_dir_all(ckpt.join("step-0000000016")).unwrap();
    fs::write(ckpt.join("step-0000000016/state.json"), "{}").unwrap();
    let model = ckpt.join("step-0000000008/model.safetensors");
    let mut bytes = fs::read(&model).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    fs::write(&model, bytes).unwrap();

    // Resumed at 4, one step more: no new checkpoint replaces the damaged ones.
    let run = train(&dir, c, "5", "adam", None);
    run.assert_success();
    assert!(run.stdout.contains("resumed at step 4"), "{}", run.stdout);
    for skipped in [
        "step-0000000016: incomplete",
        "step-0000000008: model.safetensors is corrupt",
    ] {
        assert!(
            run.stderr.contains(skipped),
            "warns about {skipped}:\n{}",
            run.stderr
        );
    }

    // After skipping, the checkpoint used is named, once (by rank 0).
    let resumed = format!(
        "resumed from {} (step 4)",
        ckpt.join("step-0000000004").display()
    );
    assert_eq!(run.stderr.matches(&resumed).count(), 1, "{}", run.stderr);
    // The same in a world of one (resuming a 2-rank checkpoint in one process).
    let run = train_alone(&dir, c, "5", &[]);
    run.assert_success();
    assert_eq!(run.stderr.matches(&resumed).count(), 1, "{}", run.stderr);

    // Nothing usable left: a clear error.
    fs::write(
        ckpt.join("step-0000000004/optimizer.safetensors"),
        "garbage",
    )
    .unwrap();
    let run = train(&dir, c, "5", "adam", None);
    assert!(!run.status.success());
    assert!(
        run.stderr.contains("no usable checkpoint in"),
        "{}",
        run.stderr
    );
}

/// How a preemption signal reaches a job.
#[derive(Clone, Copy, Debug)]
enum Delivery {
    /// To the launcher's pid alone (a scheduler, `kill PID`): it forwards it.
    Launcher,
    /// To the launcher's whole process group, as a terminal delivers Ctrl-C.
    ForegroundGroup,
    /// To the launcher and to each rank by its pid, as SLURM's `--signal` and a
    /// cluster's preemption reach every process of a job step (cgroup process
    /// tracking); the launcher forwards its copy too.
    EveryProcess,
}

/// The pids of `pid`'s child processes (Linux's `/proc/PID/task/PID/children`).
fn children(pid: u32) -> Vec<i32> {
    fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect()
}

/// How the job's 2 ranks are started.
#[derive(Clone, Copy, Debug)]
enum Launch {
    Tchrun,
    /// The `#[distributed]` function starts its own ranks (`TCH_DISTRIBUTED_NPROC=2`).
    SelfLaunch,
}

/// Runs `checkpoint_worker` on 2 ranks for 1,000,000 steps and, once step 6 is done,
/// sends `signal` as `delivery` says. Asserts that the job exits with 128 + the
/// signal within a minute, every rank stopped once at the same step, and that one
/// complete checkpoint holds it; returns that step.
fn preempt(dir: &Path, launch: Launch, signal: i32, delivery: Delivery) -> u64 {
    let ckpt = dir.join("ckpt");
    let job = [
        dir.to_str().unwrap(),
        ckpt.to_str().unwrap(),
        "1000000",
        "adam",
    ];
    let cmd = match launch {
        Launch::Tchrun => {
            let mut cmd = Command::new(tchrun());
            cmd.args(["--nproc-per-node", "2", WORKER]).args(job);
            cmd
        }
        Launch::SelfLaunch => {
            let mut cmd = Command::new(WORKER);
            without_launcher(&mut cmd)
                .args(job)
                .env("TCH_DISTRIBUTED_NPROC", "2");
            cmd
        }
    };
    let run = run_with(cmd, dir, TIMEOUT, |pid, dir| {
        let progress = dir.join("progress");
        wait_until(
            "step 6 in the progress file",
            Duration::from_secs(60),
            || {
                fs::read_to_string(&progress)
                    .unwrap_or_default()
                    .trim()
                    .parse::<u64>()
                    .unwrap_or(0)
                    >= 6
            },
        );
        // run_with starts the launcher as the leader of its own process group.
        let targets = match delivery {
            Delivery::Launcher => vec![pid as i32],
            Delivery::ForegroundGroup => vec![-(pid as i32)],
            Delivery::EveryProcess => {
                let ranks = children(pid);
                assert_eq!(ranks.len(), 2, "the launcher's 2 ranks: {ranks:?}");
                [vec![pid as i32], ranks].concat()
            }
        };
        for target in targets {
            unsafe { libc::kill(target, signal) };
        }
    });
    let what = format!("{launch:?}, signal {signal} to the {delivery:?}");
    assert_eq!(run.status.code(), Some(128 + signal), "{what}: {run:?}");
    assert!(
        run.elapsed < Duration::from_secs(60),
        "{what}: {:?}",
        run.elapsed
    );
    let preempted = |rank: usize| -> Vec<u64> {
        let prefix = format!("rank {rank}: preempted at step ");
        run.stderr
            .lines()
            .filter_map(|l| l.strip_prefix(&prefix)?.split(',').next()?.parse().ok())
            .collect()
    };
    let step = match preempted(0)[..] {
        [step] => step,
        _ => panic!("{what}: not one preemption on rank 0:\n{}", run.stderr),
    };
    assert_eq!(preempted(1), [step], "{what}:\n{}", run.stderr);
    let name = format!("step-{step:010}");
    assert!(
        ckpt.join(&name).join("COMPLETE").exists(),
        "{what}: no complete {name}"
    );
    step
}

#[test]
fn sigterm_checkpoints_at_the_next_step_and_exits_143() {
    let dir = scratch_dir("preempt");
    let step = preempt(&dir, Launch::Tchrun, libc::SIGTERM, Delivery::Launcher);
    // And the run resumes from it, mid-epoch (5 steps an epoch), to the parameters
    // and optimizer state of a run that was not preempted, bit for bit: the loader
    // continues where it stopped.
    let ckpt = dir.join("ckpt");
    let last = (step + 7).to_string();
    let run = train(&dir, ckpt.to_str().unwrap(), &last, "adam", None);
    run.assert_success();
    assert!(
        run.stdout.contains(&format!("resumed at step {step},")),
        "{}",
        run.stdout
    );
    let whole = scratch_dir("preempt-whole");
    let ckpt = whole.join("ckpt");
    train(&whole, ckpt.to_str().unwrap(), &last, "adam", None).assert_success();
    assert_same(&dir, &whole, "preempted and resumed against not preempted");
}

/// Ctrl-C in a terminal: SIGINT to the whole foreground process group, the launcher
/// and (unless they are kept out of it) every rank, which the launcher then forwards
/// to again. Each rank must still take it as one request: one checkpoint, exit 130.
/// Five times for each launcher, since the double delivery is a race.
#[test]
fn ctrl_c_in_a_terminal_checkpoints_once_and_exits_130_under_tchrun_and_self_launch() {
    for launch in [Launch::Tchrun, Launch::SelfLaunch] {
        for attempt in 0..5 {
            let dir = scratch_dir(&format!("ctrl-c-{launch:?}-{attempt}"));
            preempt(&dir, launch, libc::SIGINT, Delivery::ForegroundGroup);
        }
    }
}

/// A scheduler's preemption signal (SLURM's `--signal`, a cluster's SIGTERM): to every
/// process of the job, the launcher included, which forwards it again. Each rank must
/// take the two copies as one request (the second comes from another sender): one
/// checkpoint, exit 143. Five times for each launcher.
#[test]
fn a_signal_to_every_process_of_the_job_checkpoints_once_and_exits_143() {
    for launch in [Launch::Tchrun, Launch::SelfLaunch] {
        for attempt in 0..5 {
            let dir = scratch_dir(&format!("every-process-{launch:?}-{attempt}"));
            preempt(&dir, launch, libc::SIGTERM, Delivery::EveryProcess);
        }
    }
}

#[test]
fn a_two_rank_checkpoint_loads_in_one_process_and_in_pytorch() {
    let dir = scratch_dir("portable");
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    train(&dir, c, "8", "adam", None).assert_success();

    // One process, no launcher: resumes at step 8 (world size 2 → 1) and stops there.
    let one = scratch_dir("portable-one");
    let mut cmd = Command::new(WORKER);
    cmd.args([one.to_str().unwrap(), c, "8", "adam"])
        .env_remove("TCH_DISTRIBUTED_NPROC");
    let run = run_with(cmd, &one, TIMEOUT, |_, _| {});
    run.assert_success();
    assert!(run.stdout.contains("resumed at step 8"), "{}", run.stdout);
    assert_equal(&params(&dir, "final0"), &params(&one, "final0"), "1 rank");
    // Two more full-batch steps: averaging two ranks' identical gradients is exact,
    // so one process continues exactly as the two ranks did.
    assert_equal(
        &params(&dir, "probe0"),
        &params(&one, "probe0"),
        "1 rank, probe",
    );

    // PyTorch reads the same values with safetensors.torch.
    let model = ckpt.join("step-0000000008/model.safetensors");
    let script = "import sys\nfrom safetensors.torch import load_file\n\
        for name, t in sorted(load_file(sys.argv[1]).items()):\n    \
        print(name, ' '.join(repr(v) for v in t.flatten().tolist()))\n";
    let Some(stdout) = run_python(script, &[model.to_str().unwrap()], "") else {
        return;
    };
    let theirs: Vec<(String, Vec<f64>)> = stdout
        .lines()
        .map(|line| {
            let mut fields = line.split(' ');
            let name = fields.next().unwrap().to_string();
            (name, fields.map(|v| v.parse().unwrap()).collect())
        })
        .collect();
    let ours: Vec<(String, Vec<f64>)> = params(&dir, "final0")
        .into_iter()
        .map(|(name, t)| {
            let values: Vec<f32> = Vec::try_from(t.view([-1])).unwrap();
            (name, values.into_iter().map(f64::from).collect())
        })
        .collect();
    assert_eq!(theirs, ours, "PyTorch reads the parameters bit for bit");
}

#[test]
fn a_failed_save_names_the_path_and_keeps_the_previous_checkpoint() {
    let dir = scratch_dir("unwritable");
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    train(&dir, c, "5", "sgd", None).assert_success();
    // The save at step 8 cannot make its temporary directory (as with a full disk or
    // a denied permission, which root here would not see).
    let blocker = ckpt.join(".tmp-step-0000000008");
    fs::write(&blocker, "in the way").unwrap();
    let run = train(&dir, c, "9", "sgd", None);
    assert!(!run.status.success());
    assert!(
        run.stderr.contains(blocker.to_str().unwrap()),
        "the error names the path:\n{}",
        run.stderr
    );
    assert!(
        run.stderr.contains("another rank failed while preparing"),
        "{}",
        run.stderr
    );
    // The previous checkpoint is intact and the run resumes from it.
    fs::remove_file(&blocker).unwrap();
    let run = train(&dir, c, "5", "sgd", None);
    run.assert_success();
    assert!(run.stdout.contains("resumed at step 4"), "{}", run.stdout);
}

/// A save that fails after its temporary directory was written (here: the checkpoint it
/// replaces cannot be moved aside) removes that directory and leaves the previous
/// checkpoint as it was; in a world of one, where rank 0 alone cleans up.
#[test]
fn a_save_that_fails_late_leaves_no_temporary_directory() {
    let dir = scratch_dir("fails-late");
    let ckpt = dir.join("ckpt");
    let c = ckpt.to_str().unwrap();
    train_alone(&dir, c, "9", &[]).assert_success();
    let before = fs::read(ckpt.join("step-0000000008/model.safetensors")).unwrap();
    // Step 8 without its COMPLETE marker: the run resumes from step 4, and saving step
    // 8 again moves the old one aside to `.old-…`, where a file is in the way.
    fs::remove_file(ckpt.join("step-0000000008/COMPLETE")).unwrap();
    fs::write(ckpt.join(".old-step-0000000008"), "in the way").unwrap();
    let run = train_alone(&dir, c, "9", &[]);
    assert!(!run.status.success(), "{}", run.stderr);
    assert!(run.stderr.contains("moving aside"), "{}", run.stderr);
    assert!(
        !ckpt.join(".tmp-step-0000000008").exists(),
        "the temporary directory is left behind"
    );
    let after = fs::read(ckpt.join("step-0000000008/model.safetensors")).unwrap();
    assert_eq!(before, after, "the previous step 8 changed");
}

#[test]
fn a_killed_rank_under_max_restarts_resumes_and_ends_bit_for_bit() {
    let kind = "adam";
    let straight = scratch_dir("elastic-straight");
    let ckpt = straight.join("ckpt");
    train(&straight, ckpt.to_str().unwrap(), "13", kind, None).assert_success();

    // Rank 1 SIGKILLs itself after step 6 in the first attempt only; tchrun stops rank
    // 0, starts both again, and the worker's own `load_state` resumes from step 4.
    let elastic = scratch_dir("elastic");
    let ckpt = elastic.join("ckpt");
    let mut cmd = Command::new(tchrun());
    cmd.args(["--nproc-per-node", "2", "--max-restarts", "1", "sh", "-c"])
        .arg(
            "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then export KILL_AT=6 KILL_RANK=1; fi; \
             exec \"$0\" \"$@\"",
        )
        .args([WORKER, elastic.to_str().unwrap(), ckpt.to_str().unwrap()])
        .args(["13", kind]);
    let run = run_with(cmd, &elastic, TIMEOUT, |_, _| {});
    run.assert_success();
    for needle in [
        "rank 1 (local rank 1, pid ",
        "was killed by signal SIGKILL (9)",
        "restarting all 2 ranks (restart 1 of 1)",
    ] {
        assert!(
            run.stderr.contains(needle),
            "no {needle:?}:\n{}",
            run.stderr
        );
    }
    assert!(
        run.stdout.contains("resumed at step 4, epoch 0"),
        "{}",
        run.stdout
    );
    assert_same(&straight, &elastic, "restarted by tchrun");
}
