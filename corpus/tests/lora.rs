//! LoRA fine-tuning (`src/bin/lora.rs`) with the attribute: a base pretrained in one
//! process, loaded into the model with adapters (`vs.load_partial`) and frozen, each
//! block a `fully_shard` unit. On 2 ranks under DDP and under ZeRO stages 2 and 3 (the
//! program unchanged) it ends with the same adapters, within 1e-6, and the base
//! exactly the pretrained one; the fine-tuning lowers the loss; `save_trainable` writes
//! the adapters alone. One process equals the plain program.

mod common;

use std::path::Path;

use common::*;

const PROGRAM: &str = env!("CARGO_BIN_EXE_lora");
const PLAIN: &str = env!("CARGO_BIN_EXE_lora_plain");

/// Writes the text and the pretrained base (20 steps, one process); returns their
/// paths.
fn data(dir: &Path) -> (String, String) {
    let (input, _, _) = write_text_data(dir, 2000, 0x2545_f491_4f6c_dd1d, 17, 16);
    let base = dir.join("base.safetensors");
    run_alone(
        PROGRAM,
        &[
            "pretrain",
            input.to_str().unwrap(),
            base.to_str().unwrap(),
            "20",
        ],
        dir,
    );
    (
        input.to_str().unwrap().into(),
        base.to_str().unwrap().into(),
    )
}

/// The loss before and after fine-tuning, as the program prints it.
fn losses(stdout: &str) -> (f64, f64) {
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("loss on the first windows: base "))
        .unwrap_or_else(|| panic!("no loss line: {stdout}"));
    let (before, after) = line.split_once(", fine-tuned ").unwrap();
    (before.parse().unwrap(), after.parse().unwrap())
}

#[test]
fn lora_on_2_ranks_under_ddp_and_zero_2_and_3() {
    let ranks = 2;
    let dir = scratch_dir("corpus-lora-2");
    let (input, base) = data(&dir);
    let pretrained = read_tensors(Path::new(&base));
    let train = |zero: &str| {
        let out = dir.join(format!("zero{zero}"));
        std::fs::create_dir_all(&out).unwrap();
        let run = run_ranks_with(
            PROGRAM,
            &[
                &input,
                &base,
                out.join("model.safetensors").to_str().unwrap(),
                "2",
            ],
            ranks,
            &out,
            &[("TCH_DISTRIBUTED_ZERO", zero)],
        );
        assert_printed(&run.stdout, "8 adapter variables are not in the base", 1);
        if zero != "0" {
            assert!(
                run.stdout.contains(&format!("ZeRO stage {zero} (")),
                "{}",
                run.stdout
            );
        }
        let (before, after) = losses(&run.stdout);
        assert!(
            after < before,
            "zero {zero}: fine-tuning did not help: {before} -> {after}"
        );
        let model = read_tensors(&out.join("model.safetensors"));
        let adapters = read_tensors(&out.join("adapter_model.safetensors"));
        // The base is the pretrained one, bit for bit; the adapters are the rest.
        let (frozen, trained): (std::collections::BTreeMap<_, _>, _) = model
            .into_iter()
            .partition(|(name, _)| !name.contains(".lora_"));
        assert_same_tensors(&frozen, &pretrained, &format!("zero {zero}: the base"));
        assert_same_tensors(&trained, &adapters, &format!("zero {zero}: adapter_model"));
        assert_eq!(adapters.len(), 8, "zero {zero}: {:?}", adapters.keys());
        adapters
    };
    let ddp = train("0");
    for zero in ["2", "3"] {
        assert_close(
            &ddp,
            &train(zero),
            1e-6,
            &format!("ZeRO-{zero} against DDP"),
        );
    }
}

#[test]
fn lora_alone_is_the_plain_program() {
    let dir = scratch_dir("corpus-lora-alone");
    let (input, base) = data(&dir);
    assert_single_process_matches_plain(
        PROGRAM,
        PLAIN,
        |out| vec![input.clone(), base.clone(), out.to_string(), "1".into()],
        &dir,
    );
}
