//! The DCGAN (`src/bin/gan.rs`) with the attribute: two VarStores and two optimizers,
//! trained in turns with `freeze`/`unfreeze`; both models (batch norm's statistics
//! included) agree across 2 ranks bit for bit, and one process equals the plain program.

mod common;

use common::*;

const PROGRAM: &str = env!("CARGO_BIN_EXE_gan");
const PLAIN: &str = env!("CARGO_BIN_EXE_gan_plain");
const TRAIN: usize = 256;
const BATCH: usize = 32;

/// Writes the MNIST files; returns the fingerprints of the real images as the program
/// iterates over them (scaled to [-1, 1]).
fn data(dir: &std::path::Path) -> std::collections::HashSet<u64> {
    tch_distributed_tests::write_mnist(dir, TRAIN, 16);
    let m = tch::vision::mnist::load_dir(dir).unwrap();
    fingerprints(&(m.train_images.view([-1, 1, 28, 28]) * 2. - 1.))
}

#[test]
fn gan_on_2_ranks() {
    let ranks = 2;
    let dir = scratch_dir("corpus-gan-2");
    let universe = data(&dir);
    let out = dir.join("generator.safetensors");
    let run = run_ranks(
        PROGRAM,
        &[dir.to_str().unwrap(), out.to_str().unwrap(), "2"],
        ranks,
        &dir,
    );
    assert_printed(&run.stdout, "epoch:", 2);
    assert_printed(&run.stdout, "tch-distributed: backend", 1);
    // Generator and discriminator, in the order their optimizers were built.
    assert_eq!(assert_ranks_agree(&dir, ranks), 2);
    let record = dir.join("record");
    let generator = read_tensors(&record.join("rank-0-model-0.safetensors"));
    let discriminator = read_tensors(&record.join("rank-0-model-1.safetensors"));
    assert!(generator.contains_key("tr1.weight") && generator.contains_key("bn1.running_var"));
    assert!(
        discriminator.contains_key("conv1.weight")
            && discriminator.contains_key("bn2.running_mean")
    );
    // What rank 0 saved is what every rank ended with.
    assert_same_tensors(&read_tensors(&out), &generator, "saved generator");
    assert_same_tensors(
        &read_tensors(&dir.join("generator.discriminator.safetensors")),
        &discriminator,
        "saved discriminator",
    );
    // 256 images in batches of 32: 8 batches an epoch, none dropped.
    let loops = assert_shards_partition(&dir, ranks, BATCH, TRAIN, &universe);
    assert_eq!(loops, 2, "one sharded loop run per epoch");
}

#[test]
fn gan_alone_is_the_plain_program() {
    let dir = scratch_dir("corpus-gan-alone");
    data(&dir);
    let data_dir = dir.to_str().unwrap().to_string();
    assert_single_process_matches_plain(
        PROGRAM,
        PLAIN,
        |out| vec![data_dir.clone(), out.to_string(), "1".into()],
        &dir,
    );
    // The discriminator too (the harness compares the generator, OUT), with tch's
    // arithmetic in the optimizer.
    let discriminator =
        |run: &str| read_tensors(&dir.join(run).join("out.discriminator.safetensors"));
    assert_same_tensors(
        &discriminator("distributed-tch"),
        &discriminator("plain"),
        "one process with the attribute vs without: discriminator",
    );
}
