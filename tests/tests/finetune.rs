//! The second main job, LoRA fine-tuning (`examples/finetune.rs`, `scripts/finetune.sh`):
//! a short real run of both stages on 2 ranks under the guide's `ds_config.json`, with
//! accumulation and recomputed activations. The fine-tuned model's loss on the held-out
//! text is below the base model's; the base is unmoved; the guide's layout is written,
//! the adapters named as PEFT names them.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use tch_distributed_tests::{example, run_with, scratch_dir, tchrun};

const TIMEOUT: Duration = Duration::from_secs(300);

/// The first 60 kB of tinyshakespeare (the workplace's copy, or the repository's), else
/// a text of the same flavour.
fn text(dir: &Path) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let found = [
        root.join("../shared/data/tinyshakespeare.txt"),
        root.join("data/tinyshakespeare.txt"),
    ]
    .into_iter()
    .find_map(|p| std::fs::read(p).ok());
    let text = match found {
        Some(bytes) => bytes[..60_000.min(bytes.len())].to_vec(),
        None => (0..1200)
            .map(|i| {
                format!(
                    "CITIZEN {}:\nWe are accounted poor citizens, the patricians good.\n",
                    i % 7
                )
            })
            .collect::<String>()
            .into_bytes(),
    };
    let path = dir.join("input.txt");
    std::fs::write(&path, text).unwrap();
    path
}

fn run(dir: &Path, args: &[&str]) -> tch_distributed_tests::Run {
    let mut cmd = Command::new(tchrun());
    cmd.args(args);
    let run = run_with(cmd, dir, TIMEOUT, |_, _| {});
    run.assert_success();
    run
}

#[test]
fn adapters_fine_tuned_under_the_guides_ds_config_lower_the_held_out_loss() {
    let dir = scratch_dir("finetune");
    let data = text(&dir);
    let (data, bin) = (data.to_str().unwrap(), example("finetune"));
    let bin = bin.to_str().unwrap();
    let base = dir.join("base.safetensors");
    let out = dir.join("out");
    run(
        &dir,
        &[
            "--nproc-per-node",
            "2",
            bin,
            "pretrain",
            "--data",
            data,
            "--out",
            base.to_str().unwrap(),
            "--steps",
            "200",
        ],
    );
    let guide = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/ds_config.json");
    let stdout = run(
        &dir,
        &[
            "--nproc-per-node",
            "2",
            "--grad-accum",
            "2",
            "--deepspeed",
            guide.to_str().unwrap(),
            bin,
            "train",
            "--data",
            data,
            "--base",
            base.to_str().unwrap(),
            "--output-dir",
            out.to_str().unwrap(),
            "--steps",
            "40",
            "--save-steps",
            "20",
        ],
    )
    .stdout;
    // The held-out loss, before and after.
    let line = stdout
        .lines()
        .find(|l| l.starts_with("held-out loss: base "))
        .unwrap_or_else(|| panic!("no held-out loss in:\n{stdout}"));
    let losses: Vec<f64> = line
        .replace("held-out loss: base ", "")
        .replace(" fine-tuned ", "")
        .split(',')
        .map(|v| v.trim().parse().unwrap())
        .collect();
    eprintln!("{line}");
    assert!(losses[1] < losses[0], "{line}");
    // The guide's layout.
    for path in [
        "checkpoint-20/model.safetensors",
        "checkpoint-40/COMPLETE",
        "final_model/adapter_model.safetensors",
        "final_model/adapter_config.json",
        "final_model/model.safetensors",
        "final_model/config.json",
        "logs/metrics.jsonl",
        "training_config.json",
    ] {
        assert!(out.join(path).exists(), "{path} is missing");
    }
    let events = std::fs::read_dir(out.join("logs"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("events.out.tfevents.")
        })
        .count();
    assert_eq!(events, 1, "TensorBoard's event file in logs/");
    // The adapters alone, as PEFT names them: lora_A [r, in], lora_B [out, r].
    let adapters =
        tch::Tensor::read_safetensors(out.join("final_model/adapter_model.safetensors")).unwrap();
    let mut names: Vec<(String, Vec<i64>)> = adapters
        .iter()
        .map(|(n, t)| (n.clone(), t.size()))
        .collect();
    names.sort();
    let mut want = Vec::new();
    for block in 0..2 {
        for module in ["query", "value"] {
            let path = format!("base_model.model.blocks.{block}.attn.{module}");
            want.push((format!("{path}.lora_A.weight"), vec![8, 64]));
            want.push((format!("{path}.lora_B.weight"), vec![64, 8]));
        }
    }
    want.sort();
    assert_eq!(names, want);
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("final_model/adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(config["peft_type"], "LORA");
    assert_eq!(config["r"], 8);
    assert_eq!(
        config["target_modules"],
        serde_json::json!(["query", "value"])
    );
    // The base is unmoved: every variable of the base file, bit for bit.
    let before = tch::Tensor::read_safetensors(&base).unwrap();
    let after: std::collections::HashMap<String, tch::Tensor> =
        tch::Tensor::read_safetensors(out.join("final_model/model.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    for (name, t) in &before {
        assert!(after[name].equal(t), "{name} moved");
    }
    // The adapters trained: lora_B left zero.
    let b = &adapters
        .iter()
        .find(|(n, _)| n.ends_with("lora_B.weight"))
        .unwrap()
        .1;
    assert!(b.abs().sum(tch::Kind::Float).double_value(&[]) > 0.0);
}
