//! The `Tracker` on 2 ranks under `tchrun` (`tracker_worker`): rank 0 alone writes one
//! set of files; the JSONL and the configuration parse back; with averaging, each
//! logged value is the mean of the ranks' own; TensorBoard's own event reader (Python's
//! `tensorboard`, from the project's virtualenv) reads back the steps and values
//! logged; each metric has a non-trivial PNG.

use std::fs;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use tch_distributed_tests::{run_python, run_tchrun, scratch_dir};

const WORKER: &str = env!("CARGO_BIN_EXE_tracker_worker");
const TIMEOUT: Duration = Duration::from_secs(120);

/// Reads every scalar of the event files in a directory with TensorBoard's
/// `EventAccumulator`; prints `tag step value` per line.
const READ_EVENTS: &str = r#"
import sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
acc.Reload()
for tag in sorted(acc.Tags()["scalars"]):
    for e in acc.Scalars(tag):
        print(tag, e.step, repr(e.value))
"#;

fn lines(path: &Path) -> Vec<String> {
    fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(str::to_string)
        .collect()
}

/// Each rank's own losses, in step order.
fn local_losses(dir: &Path, rank: usize) -> Vec<f64> {
    lines(&dir.join(format!("local{rank}.txt")))
        .iter()
        .map(|l| l.parse().unwrap())
        .collect()
}

/// The JSONL's records.
fn records(run: &Path) -> Vec<serde_json::Map<String, Value>> {
    lines(&run.join("metrics.jsonl"))
        .iter()
        .map(|l| match serde_json::from_str(l) {
            Ok(Value::Object(m)) => m,
            other => panic!("not a JSON object: {l:?} ({other:?})"),
        })
        .collect()
}

fn train(dir: &Path, extra: &[&str]) {
    let d = dir.to_str().unwrap();
    let mut args = vec!["--nproc-per-node", "2", WORKER, d];
    args.extend(extra);
    run_tchrun(dir, &args, TIMEOUT, |_, _| {}).assert_success();
}

#[test]
fn two_ranks_log_the_mean_once_as_jsonl_tensorboard_png_and_config() {
    let dir = scratch_dir("tracker");
    train(&dir, &[]);
    let run = dir.join("run");

    // One set of files, from rank 0.
    let mut names: Vec<String> = fs::read_dir(&run)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    let events: Vec<&String> = names.iter().filter(|n| n.contains("tfevents")).collect();
    assert_eq!(events.len(), 1, "one event file: {names:?}");
    let expected = [
        "config.json",
        "loss.png",
        "metrics.jsonl",
        "rank.png",
        events[0],
    ];
    let mut expected: Vec<String> = expected.iter().map(|s| s.to_string()).collect();
    expected.sort();
    assert_eq!(names, expected);

    // 16 samples per rank, batch 4: 4 steps. The logged loss is the ranks' mean.
    let (l0, l1) = (local_losses(&dir, 0), local_losses(&dir, 1));
    assert_eq!((l0.len(), l1.len()), (4, 4));
    let records = records(&run);
    assert_eq!(records.len(), 4, "{records:?}");
    for (i, r) in records.iter().enumerate() {
        assert_eq!(r["step"], i as u64 + 1, "{r:?}");
        let loss = r["loss"].as_f64().unwrap();
        let mean = (l0[i] + l1[i]) / 2.0;
        assert!(
            (loss - mean).abs() <= 1e-12 * mean.abs(),
            "step {}: {loss} vs {mean}",
            i + 1
        );
        assert!(
            l0[i] != l1[i],
            "the ranks' batches differ, so their losses do"
        );
        assert_eq!(r["rank"], 0.5, "the mean of ranks 0 and 1");
        assert!(
            r["time"].as_f64().unwrap() > 1.7e9,
            "seconds since the epoch: {r:?}"
        );
    }

    // TensorBoard reads the same steps and values (float32 in event files).
    if let Some(out) = run_python(READ_EVENTS, &[run.to_str().unwrap()], "") {
        let mut seen = Vec::new();
        for line in out.lines() {
            let mut f = line.split(' ');
            let (tag, step, value) = (f.next().unwrap(), f.next().unwrap(), f.next().unwrap());
            let step: usize = step.parse().unwrap();
            let value: f64 = value.parse().unwrap();
            let logged = records[step - 1][tag].as_f64().unwrap();
            assert_eq!(value, logged as f32 as f64, "{tag} at step {step}");
            seen.push((tag.to_string(), step));
        }
        let want: Vec<(String, usize)> = ["loss", "rank"]
            .iter()
            .flat_map(|t| (1..=4).map(move |s| (t.to_string(), s)))
            .collect();
        assert_eq!(seen, want, "TensorBoard's scalars:\n{out}");
    }

    // The configuration parses back, with what the run was.
    let config: Value = serde_json::from_str(&fs::read_to_string(run.join("config.json")).unwrap())
        .expect("config.json is JSON");
    assert_eq!(config["world_size"], 2);
    assert_eq!(config["backend"], "gloo");
    assert_eq!(config["batch_size_per_rank"], 4);
    assert_eq!(config["effective_batch_size"], 8, "4 per rank × 2 ranks");
    assert_eq!(config["mixed_precision"], "no");
    // The settings given, as their variables hold them: tchrun's flag reached the ranks.
    assert_eq!(config["settings"]["nproc_per_node"], "2", "{config}");
    assert_eq!(config["args"][1], dir.to_str().unwrap());
    assert_eq!(config["tch"], tch_distributed::TCH_VERSION);

    // A plot per metric: a PNG, larger than an empty canvas would compress to.
    for png in ["loss.png", "rank.png"] {
        let bytes = fs::read(run.join(png)).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{png} is a PNG");
        assert!(bytes.len() > 5_000, "{png}: {} bytes", bytes.len());
    }
}

#[test]
fn without_averaging_rank_0_logs_its_own_values() {
    let dir = scratch_dir("tracker-own");
    train(&dir, &["--no-average"]);
    let l0 = local_losses(&dir, 0);
    let records = records(&dir.join("run"));
    assert_eq!(records.len(), 4);
    assert_eq!(l0.len(), records.len(), "a local loss per record");
    for (r, own) in records.iter().zip(&l0) {
        assert_eq!(r["loss"].as_f64().unwrap(), *own);
        assert_eq!(r["rank"], 0.0);
    }
}
