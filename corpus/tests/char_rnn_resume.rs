//! tch-rs's char-rnn made restartable (`src/bin/char_rnn_resume.rs`: a `Checkpointer`,
//! `load_state` at the start, `save_state` every 4 steps, nothing about the batch
//! loop). On 2 ranks under `tchrun --max-restarts 1`, a rank SIGKILLed mid-epoch
//! costs only the steps since the last checkpoint: the job ends with the weights of
//! a run that was not interrupted, bit for bit. A checkpoint of 2 ranks resumed on 3
//! continues the epoch from the same global batch: each batch of the resumed run is
//! the one the uninterrupted run had at that place in the epoch (from the record), so
//! none is seen twice or skipped.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

const PROGRAM: &str = env!("CARGO_BIN_EXE_char_rnn_resume");
/// As in the program: windows of `SEQ_LEN + 1` labels, in batches of `BATCH`.
const SEQ_LEN: i64 = 16;
const BATCH: usize = 16;
const CHARS: usize = 1050;

/// `tchrun --nproc-per-node ranks [flags] PROGRAM input out ckpt` in `dir`, recording;
/// once `ckpt` holds a complete checkpoint of step 8, one rank is SIGKILLed.
fn killed_after_step_8(dir: &Path, input: &Path, ranks: usize, flags: &[&str]) -> Run {
    let ckpt = dir.join("ckpt");
    let mut cmd = Command::new(tchrun());
    cmd.arg("--nproc-per-node")
        .arg(ranks.to_string())
        .args(flags)
        .arg(PROGRAM)
        .arg(input)
        .arg(dir.join("model.safetensors"))
        .arg(&ckpt)
        .env("TCH_DISTRIBUTED_RECORD", dir.join("record"))
        .env_remove("TCH_DISTRIBUTED_NPROC");
    run_with(cmd, dir, TIMEOUT, |pid, _| {
        let deadline = Instant::now() + Duration::from_secs(120);
        while !ckpt.join("step-0000000008/COMPLETE").exists() {
            assert!(Instant::now() < deadline, "no checkpoint of step 8");
            std::thread::sleep(Duration::from_millis(5));
        }
        let ranks = tch_distributed_tests::children(pid);
        unsafe { libc_kill(*ranks.iter().max().unwrap() as i32, 9) };
    })
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, signal: i32) -> i32;
}

#[test]
fn a_killed_rank_resumes_bit_exactly_and_a_third_rank_continues_the_epoch() {
    let dir = scratch_dir("corpus-char-rnn-resume");
    let (input, _, batches) =
        write_text_data(&dir, CHARS, 0x2545_f491_4f6c_dd1d, SEQ_LEN + 1, BATCH);
    assert!(
        batches > 24,
        "an epoch of {batches} batches has room for step 8 mid-epoch"
    );

    // Not interrupted: the weights, and the epoch's batches in their global order
    // (rank r's j-th batch is the epoch's batch r + 2j).
    let whole = dir.join("whole");
    std::fs::create_dir_all(&whole).unwrap();
    run_ranks(
        PROGRAM,
        &[
            input.to_str().unwrap(),
            whole.join("model.safetensors").to_str().unwrap(),
            whole.join("ckpt").to_str().unwrap(),
        ],
        2,
        &whole,
    );
    let first_epoch = loop_runs(&whole, 2)
        .into_iter()
        .find(|r| r.run == 0)
        .expect("the loop's first run");
    let mut order: HashMap<usize, Vec<u64>> = HashMap::new();
    for (rank, rows) in first_epoch.per_rank.iter().enumerate() {
        for (j, batch) in rows.chunks(BATCH).enumerate() {
            order.insert(rank + 2 * j, batch.to_vec());
        }
    }

    // Killed after step 8 and restarted: the same weights.
    let killed = dir.join("killed");
    std::fs::create_dir_all(&killed).unwrap();
    let run = killed_after_step_8(&killed, &input, 2, &["--max-restarts", "1"]);
    run.assert_success();
    assert!(run.stdout.contains("resumed from step"), "{}", run.stdout);
    let same = compare::files(
        &killed.join("model.safetensors"),
        &whole.join("model.safetensors"),
    );
    assert_eq!(
        same.max_abs, 0.0,
        "resumed against not interrupted: {same:?}"
    );

    // Killed after step 8 with no restart, then resumed on 3 ranks.
    let moved = dir.join("moved");
    std::fs::create_dir_all(&moved).unwrap();
    let run = killed_after_step_8(&moved, &input, 2, &[]);
    assert!(!run.status.success(), "the job fails without a restart");
    let _ = std::fs::remove_dir_all(moved.join("record"));
    let run = run_ranks(
        PROGRAM,
        &[
            input.to_str().unwrap(),
            moved.join("model.safetensors").to_str().unwrap(),
            moved.join("ckpt").to_str().unwrap(),
        ],
        3,
        &moved,
    );
    let step: usize = run
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("resumed from step "))
        .unwrap_or_else(|| panic!("no resume in:\n{}", run.stdout))
        .trim()
        .parse()
        .unwrap();
    assert!(
        step >= 8 && step % 4 == 0 && step < batches / 2,
        "resumed from step {step}"
    );
    // 2 ranks had dealt 2 × step batches of the epoch; the 3 ranks go on from there.
    let resumed = loop_runs(&moved, 3)
        .into_iter()
        .find(|r| r.run == 0)
        .expect("the resumed run of the loop's first run");
    let mut checked = 0;
    for (rank, rows) in resumed.per_rank.iter().enumerate() {
        for (j, batch) in rows.chunks(BATCH).enumerate() {
            let at = 2 * step + rank + 3 * j;
            if at < batches {
                assert_eq!(
                    Some(&batch.to_vec()),
                    order.get(&at),
                    "rank {rank}'s batch {j} on 3 ranks is the epoch's batch {at}"
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, batches - 2 * step, "every remaining batch, once");
}
