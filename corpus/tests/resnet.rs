//! tch-rs's CIFAR ResNet (`src/bin/resnet.rs`) with the attribute: batch norm's running
//! statistics agree across 2 and 3 ranks bit for bit, and one process equals the plain
//! program.
//!
//! tch's `augmentation` draws its flips and crops from `rand::thread_rng` (seeded by the
//! OS, not by `tch::manual_seed`), so the data makes both the identity: every image is
//! one colour (constant per channel; reflection padding keeps it so), the label is the
//! palette colour it was jittered from.

mod common;

use std::collections::HashSet;
use std::path::Path;

use common::*;

const PROGRAM: &str = env!("CARGO_BIN_EXE_resnet");
const PLAIN: &str = env!("CARGO_BIN_EXE_resnet_plain");
const TRAIN: usize = 256;
const TEST: usize = 64;
const BATCH: usize = 32;

/// Writes the data file; returns its path and the fingerprints of its training images.
fn data(dir: &Path) -> (String, HashSet<u64>) {
    write_resnet_data(dir, TRAIN, TEST)
}

#[test]
fn resnet_on_2_and_3_ranks() {
    for ranks in [2, 3] {
        let dir = scratch_dir(&format!("corpus-resnet-{ranks}"));
        let (data, universe) = data(&dir);
        let out = dir.join("model.safetensors");
        let run = run_ranks(PROGRAM, &[&data, out.to_str().unwrap(), "2"], ranks, &dir);
        assert_printed(&run.stdout, "epoch:", 2);
        assert_printed(&run.stdout, "tch-distributed: backend", 1);
        assert_eq!(assert_ranks_agree(&dir, ranks), 1);
        // The recorded model holds batch norm's statistics, and training moved them.
        let model = read_tensors(&dir.join("record").join("rank-0-model-0.safetensors"));
        for stat in ["running_mean", "running_var"] {
            let name = format!("layer2.b2.{stat}");
            let t = model.get(&name).unwrap_or_else(|| panic!("no {name}"));
            let initial = if stat == "running_mean" { 0.0 } else { 1.0 };
            assert!(
                !t.equal(&t.full_like(initial)),
                "{name} is still at its initial value"
            );
        }
        // 256 images in batches of 32: 8 batches an epoch (3 ranks: one repeated).
        let loops = assert_shards_partition(&dir, ranks, BATCH, TRAIN, &universe);
        assert_eq!(loops, 2, "one sharded loop run per epoch");
        assert!(out.exists(), "rank 0 saved the model");
    }
}

#[test]
fn resnet_alone_is_the_plain_program() {
    let dir = scratch_dir("corpus-resnet-alone");
    let (data, _) = data(&dir);
    assert_single_process_matches_plain(
        PROGRAM,
        PLAIN,
        |out| vec![data.clone(), out.to_string(), "2".into()],
        &dir,
    );
}

/// At ZeRO stage 2 (the program unchanged: no `fully_shard` unit, so the parameters stay
/// whole and the gradients and SGD's momentum are sharded), batch norm's statistics are
/// each rank's own, as under FSDP: rank 0's, which its save writes, are DDP's rank 0's,
/// and so are the parameters.
#[test]
fn resnet_under_zero_2_saves_ddps_model_and_statistics() {
    let train = |zero: &str| {
        let dir = scratch_dir(&format!("corpus-resnet-zero{zero}"));
        let (data, _) = data(&dir);
        let out = dir.join("model.safetensors");
        let run = run_ranks_with(
            PROGRAM,
            &[&data, out.to_str().unwrap(), "1"],
            2,
            &dir,
            &[("TCH_DISTRIBUTED_ZERO", zero)],
        );
        if zero != "0" {
            assert!(run.stdout.contains("ZeRO stage 2 ("), "{}", run.stdout);
        }
        read_tensors(&out)
    };
    let ddp = train("0");
    assert!(
        ddp.contains_key("layer2.b2.running_mean"),
        "{:?}",
        ddp.keys()
    );
    assert_close(&ddp, &train("2"), 1e-5, "ZeRO-2 against DDP");
}
