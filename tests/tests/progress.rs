//! Rank 0's progress bar (`tracker_worker` on 2 ranks under `tchrun`, without
//! averaging, so each rank's last logged values differ: `rank 0.0000` on rank 0,
//! `rank 1.0000` on rank 1). Under a pseudo-terminal (`script`), the bar is drawn by
//! rank 0 alone, for the attribute's sharded loop (steps counted) and for the SDK's
//! `DataLoader` (steps out of the epoch's); without a terminal, or with
//! `TCH_DISTRIBUTED_PROGRESS=0`, nothing is drawn.

use std::process::Command;
use std::time::Duration;

use tch_distributed_tests::{
    on_path, run_tchrun_all_ranks, run_with, scratch_dir, skip, tchrun, Run,
};

const WORKER: &str = env!("CARGO_BIN_EXE_tracker_worker");
const TIMEOUT: Duration = Duration::from_secs(120);

/// `tchrun --nproc-per-node 2 tracker_worker DIR --no-average ARGS` under `script`,
/// which gives it a pseudo-terminal; the terminal's output is the run's stdout. `None`
/// (after `skip`) without `script`.
fn under_a_terminal(name: &str, env: &str, args: &str) -> Option<Run> {
    if !on_path("script") {
        skip("the pseudo-terminal test: no `script` (util-linux) here");
        return None;
    }
    let dir = scratch_dir(name);
    let line = format!(
        "{env} {} --nproc-per-node 2 {WORKER} {} --no-average {args}",
        tchrun().display(),
        dir.display()
    );
    let mut cmd = Command::new("script");
    cmd.args(["-qec", &line, "/dev/null"]);
    let run = run_with(cmd, &dir, TIMEOUT, |_, _| {});
    run.assert_success();
    Some(run)
}

#[test]
fn under_a_terminal_only_rank_0_draws_the_bar_of_a_sharded_loop() {
    let Some(run) = under_a_terminal("bar-loop", "", "") else {
        return;
    };
    let out = &run.stdout;
    // Four steps of epoch 0 (tch's Iter2 does not say how many it yields: no total),
    // with rank 0's last values.
    assert!(out.contains("epoch 0"), "{out}");
    assert!(out.contains("step 4 "), "{out}");
    assert!(out.contains("rank 0.0000"), "{out}");
    assert!(!out.contains("rank 1.0000"), "rank 1 drew a bar:\n{out}");
}

#[test]
fn under_a_terminal_the_data_loaders_bar_counts_the_epochs_steps() {
    let Some(run) = under_a_terminal("bar-loader", "", "--loader") else {
        return;
    };
    let out = &run.stdout;
    // 32 samples, 2 ranks, batch 4: 4 steps per rank.
    assert!(out.contains("epoch 0"), "{out}");
    assert!(out.contains(" 4/4 "), "{out}");
    assert!(out.contains("rank 0.0000"), "{out}");
    assert!(!out.contains("rank 1.0000"), "rank 1 drew a bar:\n{out}");
}

#[test]
fn tch_distributed_progress_0_turns_the_bar_off() {
    let Some(run) = under_a_terminal("bar-off", "TCH_DISTRIBUTED_PROGRESS=0", "") else {
        return;
    };
    assert!(run.stdout.contains("backend gloo"), "{}", run.stdout);
    assert!(!run.stdout.contains("epoch 0"), "{}", run.stdout);
}

#[test]
fn without_a_terminal_nothing_is_drawn() {
    for extra in [None, Some("--loader")] {
        let dir = scratch_dir("bar-none");
        let d = dir.to_str().unwrap();
        let mut args = vec!["--nproc-per-node", "2", WORKER, d, "--no-average"];
        args.extend(extra);
        // Every rank's stdout and stderr.
        let run = run_tchrun_all_ranks(&dir, &args, TIMEOUT, |_, _| {});
        run.assert_success();
        for text in [&run.stdout, &run.stderr] {
            assert!(!text.contains("epoch 0"), "{text}");
            assert!(!text.contains('\r') && !text.contains('\x1b'), "{text:?}");
        }
    }
}
