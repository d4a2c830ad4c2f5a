//! Runs every listing of the guide as the book shows it: on one process, on several
//! ranks (self-launched, under `tchrun`, two "nodes" on this machine, and through the
//! SLURM script with stand-ins for `srun` and `scontrol`), each under a timeout that
//! kills the whole process tree.

use std::fs;
use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tch_distributed_tests::{
    all_ranks_stdout, free_port, run_with, scratch_dir, tchrun, Run, ALL_RANKS_STDOUT_VAR,
};

const TIMEOUT: Duration = Duration::from_secs(60);

/// A command for `program` without any launcher variables from the test's caller.
fn command(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new(program);
    for var in [
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TCH_DISTRIBUTED_NPROC",
        "TORCHELASTIC_USE_AGENT_STORE",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

/// `tchrun --all-ranks-stdout --nproc-per-node n listing args…`, which must succeed:
/// every rank's lines, each after `[rank N] `.
fn tchrun_listing(dir: &Path, n: usize, listing: &str, args: &[&str]) -> Run {
    let mut cmd = command(tchrun());
    cmd.args([
        "--all-ranks-stdout",
        "--nproc-per-node",
        &n.to_string(),
        listing,
    ])
    .args(args);
    let run = run_with(cmd, dir, TIMEOUT, |_, _| {});
    run.assert_success();
    run
}

fn run_ok(cmd: Command, dir: &Path) -> Run {
    let run = run_with(cmd, dir, TIMEOUT, |_, _| {});
    run.assert_success();
    run
}

#[test]
fn before_and_after_print_the_same_on_one_process() {
    let dir = scratch_dir("before-after");
    let mut before = command(env!("CARGO_BIN_EXE_single_gpu"));
    before.arg(dir.join("before.safetensors"));
    let before = run_ok(before, &dir);
    // With tch's arithmetic in the optimizer, the rewrite alone: the same bits.
    let mut after = command(env!("CARGO_BIN_EXE_data_parallel"));
    after
        .arg(dir.join("after.safetensors"))
        .env("TCH_DISTRIBUTED_OPTIMIZER", "tch");
    let after = run_ok(after, &dir);
    let (banner, rest) = after.stdout.split_once('\n').unwrap();
    assert!(
        banner.starts_with("tch-distributed: backend gloo, world size 1"),
        "{banner}"
    );
    assert_eq!(
        rest, before.stdout,
        "one process: the same losses, bit for bit"
    );
    assert!(
        before.stdout.contains("epoch 3: 16 batches"),
        "{}",
        before.stdout
    );
    let read = |f: &str| {
        let mut named = tch::Tensor::read_safetensors(dir.join(f)).unwrap();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        named
    };
    let (a, b) = (read("before.safetensors"), read("after.safetensors"));
    let diff = tch_distributed_tests::compare::named(&a, &b);
    assert!(diff.is_exact(), "not bit for bit equal: {diff:?}");
    // The default, torch.optim's fused Adam: the same losses as printed, the weights to
    // float32 rounding (2.4e-7 measured).
    let mut fused = command(env!("CARGO_BIN_EXE_data_parallel"));
    fused.arg(dir.join("fused.safetensors"));
    let fused = run_ok(fused, &dir);
    assert_eq!(
        fused.stdout, after.stdout,
        "the same losses to the printed digits"
    );
    let diff = tch_distributed_tests::compare::named(&read("fused.safetensors"), &a);
    diff.assert_within(1e-5, "the default optimizer against tch's");
}

#[test]
fn data_parallel_starts_two_ranks_itself() {
    let dir = scratch_dir("self-launch");
    let mut cmd = command(env!("CARGO_BIN_EXE_data_parallel"));
    cmd.arg(dir.join("model.safetensors"))
        .env("TCH_DISTRIBUTED_NPROC", "2");
    // Every rank's stdout: what only rank 0 prints is seen once.
    all_ranks_stdout(&mut cmd);
    let run = run_ok(cmd, &dir);
    assert!(run.stderr.contains("starting 2 ranks"), "{}", run.stderr);
    for once in [
        "tch-distributed: backend gloo, world size 2",
        "epoch 1: 8 batches",
        "epoch 3: 8 batches",
    ] {
        assert_eq!(
            run.stdout.matches(once).count(),
            1,
            "{once}: {}",
            run.stdout
        );
    }
    assert!(dir.join("model.safetensors").exists());
}

#[test]
fn hello_ranks_under_tchrun() {
    let dir = scratch_dir("hello");
    let run = tchrun_listing(&dir, 3, env!("CARGO_BIN_EXE_hello_ranks"), &[]);
    // As the launching chapter shows it: each line after the rank that wrote it.
    for rank in 0..3 {
        let line = format!("[rank {rank}] rank {rank} of 3: local rank {rank}, device Cpu\n");
        assert!(run.stdout.contains(&line), "{line}: {}", run.stdout);
    }
    assert!(
        run.stdout.contains("[rank 0] all_reduce: 6 (expected 6)\n"),
        "{}",
        run.stdout
    );
    assert_eq!(run.stdout.matches("tch-distributed: backend").count(), 1);
    assert!(
        run.stdout.contains("[rank 0] tch-distributed: backend"),
        "{}",
        run.stdout
    );
}

#[test]
fn two_nodes_by_hand_on_one_machine() {
    // The chapter's two per-node commands, with 127.0.0.1 as the first node.
    let dir = scratch_dir("two-nodes");
    let port = free_port().to_string();
    let node = |rank: &str| {
        let mut cmd = command(tchrun());
        cmd.args([
            "--nnodes",
            "2",
            "--node-rank",
            rank,
            "--nproc-per-node",
            "1",
        ])
        .args(["--master-addr", "127.0.0.1", "--master-port", &port])
        .arg("--all-ranks-stdout")
        .arg(env!("CARGO_BIN_EXE_hello_ranks"));
        cmd
    };
    let node1_dir = dir.join("node1");
    fs::create_dir_all(&node1_dir).unwrap();
    let node1 = std::thread::spawn({
        let cmd = node("1");
        move || run_ok(cmd, &node1_dir)
    });
    let node0 = run_ok(node("0"), &dir);
    let node1 = node1.join().unwrap();
    assert!(
        node0.stdout.contains("[rank 0] rank 0 of 2: local rank 0"),
        "{}",
        node0.stdout
    );
    assert!(
        node0.stdout.contains("all_reduce: 3 (expected 3)"),
        "{}",
        node0.stdout
    );
    assert!(
        node1.stdout.contains("[rank 1] rank 1 of 2: local rank 0"),
        "{}",
        node1.stdout
    );
}

/// Runs `slurm/<script>` on `hello_ranks` with `stand_ins` (name, shell body) ahead of
/// the real commands on PATH, and checks that two ranks met.
fn sbatch_with_stand_ins(
    name: &str,
    script: &str,
    stand_ins: &[(&str, String)],
    env: &[(&str, String)],
) {
    let dir = scratch_dir(name);
    let bin = dir.join("bin");
    fs::create_dir_all(&bin).unwrap();
    for (command, body) in stand_ins {
        let path = bin.join(command);
        fs::write(&path, format!("#!/bin/bash\n{body}\n")).unwrap();
        fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    }
    fs::copy(tchrun(), bin.join("tchrun")).unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
    let mut cmd = command("bash");
    cmd.arg(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("slurm")
            .join(script),
    )
    .arg(env!("CARGO_BIN_EXE_hello_ranks"))
    .env("PATH", path)
    .envs(env.iter().map(|(k, v)| (k, v)));
    let run = run_ok(cmd, &dir);
    for expected in ["rank 1 of 2: local rank 1", "all_reduce: 3 (expected 3)"] {
        assert!(run.stdout.contains(expected), "{script}: {}", run.stdout);
    }
}

#[test]
fn slurm_script_with_stand_ins_for_srun_and_scontrol() {
    // One node: srun runs its command once, as node 0 of 1.
    sbatch_with_stand_ins(
        "slurm",
        "train.sbatch",
        &[
            ("srun", "SLURM_NODEID=0 exec \"$@\"".into()),
            ("scontrol", "echo 127.0.0.1".into()),
        ],
        &[
            // tchrun shows every rank's lines.
            (ALL_RANKS_STDOUT_VAR, "true".into()),
            ("SLURM_JOB_NODELIST", "node[01-02]".into()),
            ("SLURM_NNODES", "1".into()),
            ("SLURM_GPUS_ON_NODE", "2".into()),
            ("MASTER_PORT", free_port().to_string()),
        ],
    );
}

#[test]
fn srun_script_with_a_stand_in_srun_that_starts_the_tasks() {
    // A job id whose port (15000 + its last 4 digits) is free.
    let start = std::process::id() as u16 % 10_000;
    let port = (0..10_000u16)
        .map(|i| 15_000 + (start + i) % 10_000)
        .find(|&p| TcpListener::bind(("127.0.0.1", p)).is_ok())
        .expect("a free port in 15000..25000");
    let job = 70_000 + u32::from(port - 15_000);
    // srun on one node with 2 tasks: each task gets SLURM's variables, as srun sets them.
    let srun = format!(
        "for task in 0 1; do\n\
           SLURM_PROCID=$task SLURM_LOCALID=$task SLURM_NODEID=0 SLURM_STEP_NUM_TASKS=2 \\\n\
           SLURM_STEP_TASKS_PER_NODE='2(x1)' SLURM_STEP_NODELIST=localhost SLURM_JOB_ID={job} \\\n\
           \"$@\" & pids=\"$pids $!\"\n\
         done\n\
         for p in $pids; do wait $p || exit 1; done"
    );
    sbatch_with_stand_ins("srun", "srun.sbatch", &[("srun", srun)], &[]);
}

#[test]
fn batch_math_prints_the_tables_the_book_shows() {
    let dir = scratch_dir("batch-math");
    let run = run_ok(command(env!("CARGO_BIN_EXE_batch_math")), &dir);
    let recorded = Path::new(env!("CARGO_MANIFEST_DIR")).join("output/batch_math.txt");
    if std::env::var_os("BLESS").is_some() {
        fs::write(&recorded, &run.stdout).unwrap();
    }
    let expected = fs::read_to_string(&recorded).unwrap();
    assert_eq!(
        run.stdout,
        expected,
        "the guide shows {} (re-record it with BLESS=1)",
        recorded.display()
    );
    // The figures of the multi-GPU guides.
    for row in [
        "| 1 | 4 | 7375 |",
        "| 2 | 8 | 3687 |",
        "| 4 | 16 | 1843 |",
        "| 8 | 32 | 921 |",
    ] {
        assert!(expected.contains(row), "{row}");
    }
}

#[test]
fn metrics_are_exact_on_any_number_of_ranks() {
    let dir = scratch_dir("data-loading");
    for n in [1, 2, 3] {
        let run = tchrun_listing(&dir, n, env!("CARGO_BIN_EXE_data_loading"), &[]);
        let expected = format!("accuracy 333/1001 = 0.3327 on {n} rank(s)");
        assert!(run.stdout.contains(&expected), "{expected}: {}", run.stdout);
        // Padded to a multiple of the world size: ceil(1001 / n) samples per rank.
        let per_rank = 1001usize.div_ceil(n);
        let read = format!("{per_rank} samples read");
        assert_eq!(
            run.stdout.matches(&read).count(),
            n,
            "{read}: {}",
            run.stdout
        );
    }
}

#[test]
fn a_dataset_downloaded_once_per_node() {
    let dir = scratch_dir("download-once");
    let cache = dir.join("cache");
    let cache = cache.to_str().unwrap();
    let listing = env!("CARGO_BIN_EXE_download_once");
    let run = tchrun_listing(&dir, 3, listing, &[cache]);
    // Local rank 0 downloads; ranks 1 and 2 wait for it, then find the file.
    assert!(run.stdout.contains("rank 0: downloaded"), "{}", run.stdout);
    assert_eq!(
        run.stdout.matches("downloaded").count(),
        1,
        "{}",
        run.stdout
    );
    assert_eq!(
        run.stdout.matches("found in cache").count(),
        2,
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("trained on 256 points"),
        "{}",
        run.stdout
    );
    // A second run finds it on every rank.
    let run = tchrun_listing(&dir, 2, listing, &[cache]);
    assert_eq!(
        run.stdout.matches("found in cache").count(),
        2,
        "{}",
        run.stdout
    );
}

#[test]
fn mixed_precision_accumulation_and_clipping() {
    let dir = scratch_dir("amp");
    let listing = env!("CARGO_BIN_EXE_mixed_precision");
    let run = tchrun_listing(&dir, 2, listing, &["auto"]);
    assert!(
        run.stdout.contains("mixed precision No (auto: CPU)"),
        "{}",
        run.stdout
    );
    // 256 samples, 2 ranks, batch 8: 16 micro-batches per rank, 4 per step.
    assert!(
        run.stdout.contains("16 micro-batches, 4 optimizer steps"),
        "{}",
        run.stdout
    );
    let run = tchrun_listing(&dir, 2, listing, &["bf16"]);
    assert!(
        run.stdout.contains("mixed precision Bf16"),
        "{}",
        run.stdout
    );
    let run = tchrun_listing(&dir, 2, listing, &["fp16"]);
    assert!(run.stdout.contains("loss scale "), "{}", run.stdout);
}

#[test]
fn resume_continues_from_the_last_checkpoint() {
    let dir = scratch_dir("resume");
    let ckpt = dir.join("checkpoints");
    let ckpt = ckpt.to_str().unwrap();
    let listing = env!("CARGO_BIN_EXE_resume");
    let run = tchrun_listing(&dir, 2, listing, &[ckpt, "7"]);
    assert!(
        run.stdout
            .contains("trained to step 7; checkpoints at steps [7, 5]"),
        "{}",
        run.stdout
    );
    let run = tchrun_listing(&dir, 2, listing, &[ckpt, "20"]);
    assert!(run.stdout.contains("resumed at step 7"), "{}", run.stdout);
    assert!(
        run.stdout.contains("checkpoints at steps [20, 15, 10]"),
        "{}",
        run.stdout
    );
}

#[test]
fn tchrun_config_prints_what_the_launching_chapter_shows() {
    // The default file, under a home of the test's own.
    let dir = scratch_dir("tchrun-config");
    let mut cmd = command(tchrun());
    cmd.args(["config", "--nproc-per-node", "2", "--gpus", "0,1"])
        .args(["--mixed-precision", "bf16", "--grad-accum", "4"])
        .env_remove("TCH_DISTRIBUTED_CONFIG")
        .env_remove("XDG_CONFIG_HOME")
        .env("HOME", &dir);
    let run = run_ok(cmd, &dir);
    let shown = format!(
        "$ tchrun config --nproc-per-node 2 --gpus 0,1 --mixed-precision bf16 --grad-accum 4\n{}",
        run.stdout.replace(dir.to_str().unwrap(), "~")
    );
    let recorded = Path::new(env!("CARGO_MANIFEST_DIR")).join("output/tchrun_config.txt");
    if std::env::var_os("BLESS").is_some() {
        fs::write(&recorded, &shown).unwrap();
    }
    assert_eq!(
        shown,
        fs::read_to_string(&recorded).unwrap(),
        "the guide shows {} (re-record it with BLESS=1)",
        recorded.display()
    );
    assert!(dir.join(".config/tch-distributed/config.toml").exists());
}

#[test]
fn tchrun_help_is_what_the_reference_shows() {
    let out =
        tch_distributed_tests::output_within(Command::new(tchrun()).arg("--help"), b"", TIMEOUT);
    assert!(out.status.success(), "{out:?}");
    let recorded = Path::new(env!("CARGO_MANIFEST_DIR")).join("output/tchrun_help.txt");
    let stdout = String::from_utf8(out.stdout).unwrap();
    if std::env::var_os("BLESS").is_some() {
        fs::write(&recorded, &stdout).unwrap();
    }
    assert_eq!(
        stdout,
        fs::read_to_string(&recorded).unwrap(),
        "the guide shows {} (re-record it with BLESS=1)",
        recorded.display()
    );
}

#[test]
fn watching_writes_one_set_of_metrics_from_rank_0() {
    let dir = scratch_dir("watching");
    let runs = dir.join("runs");
    let listing = env!("CARGO_BIN_EXE_watching");
    let run = tchrun_listing(&dir, 2, listing, &[runs.to_str().unwrap()]);
    // 512 samples, 2 ranks, batch 16: 16 steps per epoch, 3 epochs.
    let metrics = fs::read_to_string(runs.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 48, "{metrics}");
    for png in ["loss.png", "epoch.png"] {
        assert_eq!(run.stdout.matches(png).count(), 1, "{}", run.stdout);
        assert!(runs.join(png).is_file());
    }
    let events = fs::read_dir(&runs)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .contains("tfevents")
        })
        .count();
    assert_eq!(events, 1, "one event file, rank 0's");
    let config: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(runs.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["effective_batch_size"], 32, "{config}");
    assert_eq!(config["lr"], 1e-2, "{config}");
}

#[test]
fn batch_inference_on_three_ranks_prints_what_one_process_prints() {
    let dir = scratch_dir("batch-inference");
    let listing = env!("CARGO_BIN_EXE_batch_inference");
    let one = run_ok(command(listing), &dir);
    assert!(one.stdout.contains("50 predictions: ["), "{}", one.stdout);
    let three = tchrun_listing(&dir, 3, listing, &[]);
    // Rank 0 alone prints, past the banner: the same predictions, in the same order.
    let predictions = |s: &str| -> String {
        s.lines()
            .filter(|l| l.contains("predictions") || l.contains("per class"))
            .map(|l| l.trim_start_matches("[rank 0] "))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(predictions(&three.stdout), predictions(&one.stdout));
    assert_eq!(
        three.stdout.matches("predictions").count(),
        1,
        "{}",
        three.stdout
    );
}

#[test]
fn find_batch_size_halves_to_the_size_that_fits_on_every_rank() {
    let dir = scratch_dir("find-batch-size");
    let run = tchrun_listing(&dir, 2, env!("CARGO_BIN_EXE_find_batch_size"), &[]);
    for size in [256, 128, 64] {
        let line = format!(
            "out of memory at batch size {size} on ranks 0 and 1: every rank retries with \
             batch size {}",
            size / 2
        );
        assert!(run.stderr.contains(&line), "{line}: {}", run.stderr);
    }
    assert!(
        run.stdout
            .contains("trained at batch size 32 per rank: loss "),
        "{}",
        run.stdout
    );
}

/// The mean loss over every rank's batches: rank 0's own on one process, and another
/// number than rank 0's on two ranks, whose batches differ.
#[test]
fn the_mean_loss_over_every_ranks_batches() {
    let dir = scratch_dir("mean-loss");
    let listing = env!("CARGO_BIN_EXE_mean_loss");
    let means = |stdout: &str| -> Vec<(String, String)> {
        stdout
            .lines()
            .filter_map(|l| l.split_once("rank 0's mean loss "))
            .map(|(_, rest)| {
                let (own, every) = rest.split_once(", every rank's ").unwrap();
                (own.to_string(), every.trim().to_string())
            })
            .collect()
    };
    let one = means(&run_ok(command(listing), &dir).stdout);
    assert_eq!(one.len(), 3);
    assert!(one.iter().all(|(own, every)| own == every), "{one:?}");
    let two = means(&tchrun_listing(&dir, 2, listing, &[]).stdout);
    assert_eq!(two.len(), 3, "rank 0 prints");
    assert!(two.iter().all(|(own, every)| own != every), "{two:?}");
}
