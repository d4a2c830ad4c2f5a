//! tch-rs's min-gpt (`src/bin/min_gpt.rs`) with the attribute: on 2 ranks, and as one
//! process against the same program without the attribute. Besides what every corpus
//! program is checked for: the causal mask (a non-trainable variable, so a buffer)
//! agrees on every rank and is still the mask, and the periodic checkpoints that
//! `vs.save` writes inside the training loop are exactly the expected files, each a
//! valid safetensors file of the whole model.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use common::*;
use tch::{Kind, Tensor};

const PROGRAM: &str = env!("CARGO_BIN_EXE_min_gpt");
const PLAIN: &str = env!("CARGO_BIN_EXE_min_gpt_plain");
/// As in the program: windows of `BLOCK_SIZE + 1` labels, in batches of `BATCH`, a
/// checkpoint every `CHECKPOINT_EVERY` steps, `N_LAYER` blocks.
const BLOCK_SIZE: i64 = 16;
const BATCH: usize = 16;
const CHECKPOINT_EVERY: usize = 20;
const N_LAYER: usize = 2;
const CHARS: usize = 1300;
const EPOCHS: usize = 2;

/// Writes the text; returns its path, the fingerprints of every window the program's
/// `iter_shuffle` can yield, and how many batches an epoch has.
fn data(dir: &Path) -> (PathBuf, HashSet<u64>, usize) {
    write_text_data(dir, CHARS, 0x9e37_79b9_7f4a_7c15, BLOCK_SIZE + 1, BATCH)
}

/// The names of the checkpoints a rank that takes `steps` optimizer steps writes.
fn expected_checkpoints(steps: usize) -> Vec<String> {
    let mut names: Vec<String> = (1..=steps / CHECKPOINT_EVERY)
        .map(|k| format!("gpt{}.safetensors", k * CHECKPOINT_EVERY))
        .collect();
    names.sort();
    names
}

/// The files in `dir`, sorted.
fn files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

fn same_shapes(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>, what: &str) {
    let names = |m: &BTreeMap<String, Tensor>| m.keys().cloned().collect::<Vec<_>>();
    assert_eq!(names(a), names(b), "{what}: different variables");
    for (name, x) in a {
        assert_eq!(x.kind(), b[name].kind(), "{what}: {name} dtype");
        assert_eq!(x.size(), b[name].size(), "{what}: {name} shape");
    }
}

#[test]
fn min_gpt_on_2_ranks() {
    let ranks = 2;
    let dir = scratch_dir("corpus-min-gpt-2");
    let (input, universe, batches) = data(&dir);
    let out = dir.join("model.safetensors");
    let checkpoints = dir.join("checkpoints");
    let epochs = EPOCHS.to_string();
    let run = run_ranks(
        PROGRAM,
        &[
            input.to_str().unwrap(),
            out.to_str().unwrap(),
            &epochs,
            checkpoints.to_str().unwrap(),
        ],
        ranks,
        &dir,
    );
    // 1284 windows in batches of 16: 80 batches an epoch (the last 4 windows dropped),
    // 40 steps an epoch on each rank, 80 in all: checkpoints at steps 20, 40, 60, 80.
    let steps = batches.div_ceil(ranks) * EPOCHS;
    let expected = expected_checkpoints(steps);
    assert_eq!(expected.len(), 4);
    assert_printed(&run.stdout, "tch-distributed: backend", 1);
    assert_printed(&run.stdout, "Dataset loaded, 30 labels.", 1);
    assert_printed(&run.stdout, "Epoch:", expected.len());
    assert_printed(&run.stdout, "Sample:", expected.len());
    assert_eq!(assert_ranks_agree(&dir, ranks), 1);
    let loops = assert_shards_partition(&dir, ranks, BATCH, batches * BATCH, &universe);
    assert_eq!(loops, EPOCHS, "one sharded loop run per epoch");

    // The model as every rank ended it: the masks are buffers, the same on both ranks
    // (checked above) and still lower triangular ones.
    let model = read_tensors(&dir.join("record/rank-0-model-0.safetensors"));
    let masks: Vec<&String> = model.keys().filter(|n| n.ends_with(".mask")).collect();
    assert_eq!(masks.len(), N_LAYER, "one mask per block: {masks:?}");
    let causal = Tensor::ones([BLOCK_SIZE, BLOCK_SIZE], (Kind::Float, tch::Device::Cpu)).tril(0);
    for name in masks {
        assert!(model[name].equal(&causal), "{name} is not the causal mask");
    }
    let head_bias = &model["gpt.head.bias"];
    assert!(
        head_bias.equal(&head_bias.zeros_like()),
        "the head's bias is not trained"
    );
    assert_same_tensors(
        &read_tensors(&out),
        &model,
        "the saved model vs the model trained",
    );

    // The periodic checkpoints: written once each (by rank 0, no temporary file left),
    // each a whole model, each different from the one before, the last (step 80, the
    // last step) the final model.
    assert_eq!(files(&checkpoints), expected, "checkpoint files");
    let mut previous: Option<BTreeMap<String, Tensor>> = None;
    for name in &expected {
        let checkpoint = read_tensors(&checkpoints.join(name));
        same_shapes(&checkpoint, &model, name);
        if let Some(previous) = &previous {
            assert!(
                checkpoint.iter().any(|(n, t)| !t.equal(&previous[n])),
                "{name}: the same weights as the checkpoint before"
            );
        }
        previous = Some(checkpoint);
    }
    assert_eq!(steps % CHECKPOINT_EVERY, 0);
    assert_same_tensors(
        &previous.unwrap(),
        &model,
        "the last checkpoint vs the model trained",
    );
}

#[test]
fn min_gpt_alone_is_the_plain_program() {
    let dir = scratch_dir("corpus-min-gpt-alone");
    let (input, _, batches) = data(&dir);
    let input = input.to_str().unwrap().to_string();
    let checkpoints = |out: &str| Path::new(out).parent().unwrap().join("checkpoints");
    // The default optimizer (fused AdamW) against tch's: the updates' rounding, carried
    // through 160 steps of a transformer, which amplifies it (1.2e-3 measured; tch's
    // arithmetic against torch.optim's foreach, which differ only by lerp, too).
    assert_single_process_matches_plain_within(
        PROGRAM,
        PLAIN,
        |out| {
            vec![
                input.clone(),
                out.to_string(),
                EPOCHS.to_string(),
                checkpoints(out).to_str().unwrap().to_string(),
            ]
        },
        &dir,
        5e-3,
    );
    // The periodic checkpoints of both runs (with tch's arithmetic): the same files,
    // the same tensors.
    let expected = expected_checkpoints(batches * EPOCHS);
    assert_eq!(expected.len(), 8);
    let ours = dir.join("distributed-tch/checkpoints");
    let plain = dir.join("plain/checkpoints");
    assert_eq!(files(&ours), expected, "checkpoints with the attribute");
    assert_eq!(files(&plain), expected, "checkpoints without the attribute");
    for name in &expected {
        assert_same_tensors(
            &read_tensors(&ours.join(name)),
            &read_tensors(&plain.join(name)),
            &format!("{name} with the attribute vs without"),
        );
    }
}

/// Under ZeRO stages 2 and 3 (`TCH_DISTRIBUTED_ZERO`, the program unchanged), min-gpt on
/// 2 ranks ends where it ends under DDP: AdamW steps each rank's shards of the
/// parameters, and the periodic `vs.save` inside the loop writes the whole model,
/// gathered. One epoch: 40 steps, checkpoints at steps 20 and 40.
#[test]
fn min_gpt_under_zero_2_and_3_ends_where_ddp_ends() {
    let ranks = 2;
    let dir = scratch_dir("corpus-min-gpt-zero");
    let (input, _, _) = data(&dir);
    let train = |zero: &str| {
        let run_dir = dir.join(format!("zero{zero}"));
        std::fs::create_dir_all(&run_dir).unwrap();
        let (out, checkpoints) = (
            run_dir.join("model.safetensors"),
            run_dir.join("checkpoints"),
        );
        let run = run_ranks_with(
            PROGRAM,
            &[
                input.to_str().unwrap(),
                out.to_str().unwrap(),
                "1",
                checkpoints.to_str().unwrap(),
            ],
            ranks,
            &run_dir,
            &[("TCH_DISTRIBUTED_ZERO", zero)],
        );
        if zero != "0" {
            assert_printed(&run.stdout, "tch-distributed: backend", 1);
            assert!(
                run.stdout.contains(&format!("ZeRO stage {zero} (")),
                "{}",
                run.stdout
            );
        }
        assert_eq!(
            files(&checkpoints),
            expected_checkpoints(40),
            "checkpoint files"
        );
        let last = read_tensors(&checkpoints.join("gpt40.safetensors"));
        (read_tensors(&out), last)
    };
    let (ddp, _) = train("0");
    for zero in ["2", "3"] {
        let (model, last) = train(zero);
        // Measured: bit for bit on 2 ranks (each average is the same a + b, halved).
        assert_close(&ddp, &model, 1e-6, &format!("ZeRO-{zero} against DDP"));
        assert_same_tensors(&last, &model, "the last checkpoint vs the model trained");
    }
}
