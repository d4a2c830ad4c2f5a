//! tch-rs's MNIST conv net (`src/bin/mnist_conv.rs`) with the attribute: on 2 and 3
//! ranks, and as one process against the same program without the attribute.

mod common;

use common::*;

const PROGRAM: &str = env!("CARGO_BIN_EXE_mnist_conv");
const PLAIN: &str = env!("CARGO_BIN_EXE_mnist_conv_plain");
const TRAIN: usize = 256;
const BATCH: usize = 32;

fn data(dir: &std::path::Path) -> std::collections::HashSet<u64> {
    tch_distributed_tests::write_mnist(dir, TRAIN, 64);
    let m = tch::vision::mnist::load_dir(dir).unwrap();
    fingerprints(&m.train_images)
}

#[test]
fn mnist_conv_on_2_and_3_ranks() {
    for ranks in [2, 3] {
        let dir = scratch_dir(&format!("corpus-mnist-{ranks}"));
        let universe = data(&dir);
        let out = dir.join("model.safetensors");
        let run = run_ranks(
            PROGRAM,
            &[dir.to_str().unwrap(), out.to_str().unwrap(), "2"],
            ranks,
            &dir,
        );
        assert_printed(&run.stdout, "epoch:", 2);
        assert_printed(&run.stdout, "tch-distributed: backend", 1);
        assert_eq!(assert_ranks_agree(&dir, ranks), 1);
        // 256 images in batches of 32: 8 batches an epoch, none dropped.
        let loops = assert_shards_partition(&dir, ranks, BATCH, TRAIN, &universe);
        assert_eq!(loops, 2, "one sharded loop run per epoch");
        assert!(out.exists(), "rank 0 saved the model");
    }
}

#[test]
fn mnist_conv_alone_is_the_plain_program() {
    let dir = scratch_dir("corpus-mnist-alone");
    data(&dir);
    let data_dir = dir.to_str().unwrap().to_string();
    assert_single_process_matches_plain(
        PROGRAM,
        PLAIN,
        |out| vec![data_dir.clone(), out.to_string(), "1".into()],
        &dir,
    );
}
