//! tch-rs's char-rnn (`src/bin/char_rnn.rs`) with the attribute: on 2 and 3 ranks, and
//! as one process against the same program without the attribute. Its `println!`
//! draws a sample with `multinomial` after every epoch, on rank 0 alone before the SDK
//! evaluated `println!` arguments on every rank: rank 0's generator then moved and its
//! next `iter_shuffle` permutation differed from the others', so from the second epoch
//! on the ranks trained on overlapping shards. The partition check below catches that.

mod common;

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use common::*;

const PROGRAM: &str = env!("CARGO_BIN_EXE_char_rnn");
const PLAIN: &str = env!("CARGO_BIN_EXE_char_rnn_plain");
/// As in the program: windows of `SEQ_LEN + 1` labels, in batches of `BATCH`.
const SEQ_LEN: i64 = 16;
const BATCH: usize = 16;
const CHARS: usize = 1050;
const EPOCHS: usize = 3;

/// Writes the text; returns its path, the fingerprints of every window the program's
/// `iter_shuffle` can yield, and how many distinct windows an epoch trains on.
fn data(dir: &Path) -> (PathBuf, HashSet<u64>, usize) {
    let (path, universe, batches) =
        write_text_data(dir, CHARS, 0x2545_f491_4f6c_dd1d, SEQ_LEN + 1, BATCH);
    (path, universe, batches * BATCH)
}

#[test]
fn char_rnn_on_2_and_3_ranks() {
    for ranks in [2, 3] {
        let dir = scratch_dir(&format!("corpus-char-rnn-{ranks}"));
        let (input, universe, per_epoch) = data(&dir);
        let out = dir.join("model.safetensors");
        let epochs = EPOCHS.to_string();
        let run = run_ranks(
            PROGRAM,
            &[input.to_str().unwrap(), out.to_str().unwrap(), &epochs],
            ranks,
            &dir,
        );
        assert_printed(&run.stdout, "tch-distributed: backend", 1);
        assert_printed(&run.stdout, "Dataset loaded, 30 labels.", 1);
        assert_printed(&run.stdout, "Epoch:", EPOCHS);
        assert_printed(&run.stdout, "Sample:", EPOCHS);
        assert_eq!(assert_ranks_agree(&dir, ranks), 1);
        // 1034 windows in batches of 16: 64 batches (1024 windows) an epoch, the last
        // 10 windows dropped; every epoch's shards disjoint, including after a sample.
        let loops = assert_shards_partition(&dir, ranks, BATCH, per_epoch, &universe);
        assert_eq!(loops, EPOCHS, "one sharded loop run per epoch");
        assert_same_tensors(
            &read_tensors(&out),
            &read_tensors(&dir.join("record/rank-0-model-0.safetensors")),
            "the saved model vs the model trained",
        );
    }
}

#[test]
fn char_rnn_alone_is_the_plain_program() {
    let dir = scratch_dir("corpus-char-rnn-alone");
    let (input, _, _) = data(&dir);
    let input = input.to_str().unwrap().to_string();
    assert_single_process_matches_plain(
        PROGRAM,
        PLAIN,
        |out| vec![input.clone(), out.to_string(), EPOCHS.to_string()],
        &dir,
    );
}
