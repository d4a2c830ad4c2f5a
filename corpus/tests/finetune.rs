//! Transfer learning (`src/bin/finetune.rs`) with the attribute: a backbone loaded from
//! a pretrained file and frozen (`vs.freeze()`), a head created after the freeze on the
//! same VarStore. On 2 ranks every rank ends with the same model, its backbone exactly
//! the pretrained one; one process equals the plain program.

mod common;

use std::path::Path;

use common::*;

const PROGRAM: &str = env!("CARGO_BIN_EXE_finetune");
const PLAIN: &str = env!("CARGO_BIN_EXE_finetune_plain");
const TRAIN: usize = 256;
const BATCH: usize = 32;

/// Writes the MNIST files and the pretrained weights (`finetune pretrain`, one process);
/// returns the weights' path and the fingerprints of the training images.
fn data(dir: &Path) -> (String, std::collections::HashSet<u64>) {
    write_finetune_data(PROGRAM, dir, TRAIN)
}

#[test]
fn finetune_on_2_ranks() {
    let ranks = 2;
    let dir = scratch_dir("corpus-finetune-2");
    let (weights, universe) = data(&dir);
    let out = dir.join("model.safetensors");
    let run = run_ranks(
        PROGRAM,
        &[dir.to_str().unwrap(), &weights, out.to_str().unwrap(), "2"],
        ranks,
        &dir,
    );
    assert_printed(&run.stdout, "epoch:", 2);
    assert_printed(&run.stdout, "tch-distributed: backend", 1);
    assert_eq!(assert_ranks_agree(&dir, ranks), 1);

    // Every rank's backbone is the pretrained one, bit for bit (frozen: broadcast once,
    // never all-reduced or stepped; batch norm in eval mode); the rest is the head.
    let pretrained = read_tensors(Path::new(&weights));
    let backbone: std::collections::BTreeMap<_, _> = pretrained
        .iter()
        .filter(|(name, _)| name.starts_with("backbone."))
        .map(|(name, t)| (name.clone(), t.shallow_clone()))
        .collect();
    assert!(backbone.contains_key("backbone.bn1.running_mean"));
    for rank in 0..ranks {
        let model = read_tensors(
            &dir.join("record")
                .join(format!("rank-{rank}-model-0.safetensors")),
        );
        let (model_backbone, head): (std::collections::BTreeMap<_, _>, _) = model
            .into_iter()
            .partition(|(name, _)| name.starts_with("backbone."));
        assert_same_tensors(
            &model_backbone,
            &backbone,
            &format!("rank {rank}'s backbone vs the pretrained file"),
        );
        let names: Vec<&String> = head.keys().collect();
        assert_eq!(names, ["head.bias", "head.weight"], "rank {rank}'s head");
    }
    assert_same_tensors(
        &read_tensors(&out),
        &read_tensors(&dir.join("record").join("rank-0-model-0.safetensors")),
        "saved model",
    );

    // 256 images in batches of 32: 8 batches an epoch, none dropped.
    let loops = assert_shards_partition(&dir, ranks, BATCH, TRAIN, &universe);
    assert_eq!(loops, 2, "one sharded loop run per epoch");
}

#[test]
fn finetune_alone_is_the_plain_program() {
    let dir = scratch_dir("corpus-finetune-alone");
    let (weights, _) = data(&dir);
    let data_dir = dir.to_str().unwrap().to_string();
    assert_single_process_matches_plain(
        PROGRAM,
        PLAIN,
        |out| {
            vec![
                data_dir.clone(),
                weights.clone(),
                out.to_string(),
                "2".into(),
            ]
        },
        &dir,
    );
}
