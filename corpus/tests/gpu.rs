//! The corpus programs on a GPU: on one rank over NCCL, and on two ranks over Gloo
//! sharing the one GPU (`TCH_DISTRIBUTED_BACKEND=gloo`), with the corpus checks: one
//! banner naming the backend and CUDA, rank 0 alone prints, the ranks end with the
//! same parameters and buffers bit for bit, and every epoch's shards partition the
//! data.
//!
//! Not part of the default `cargo test`: built with `--features gpu` and run by
//! `scripts/test_gpu.sh` (here, or copied to a GPU machine with `--package`). Every
//! test first asserts that CUDA is available: without a GPU the suite fails, it never
//! skips. The programs are found beside the test executable (`target/<profile>/…`).

mod common;

use std::collections::HashSet;
use std::path::Path;

use common::*;
use tch_distributed_tests::binary;

/// The first check of every test: this suite needs a GPU. It also lets every process
/// the suite starts see the GPUs (the harness hides them from the CPU tests).
fn require_gpu() {
    tch_distributed_tests::gpu_suite();
    // Loads libtorch's CUDA library, which this executable does not link, then asks
    // `tch::Cuda::is_available()`.
    assert!(
        tch_distributed_tests::cuda_available(),
        "this suite needs a GPU: CUDA is not available here (tch::Cuda::is_available() is \
         false). Run it on a machine with an NVIDIA GPU, against a CUDA libtorch \
         (scripts/test_gpu.sh; LD_LIBRARY_PATH=<torch>/lib for a copied package)"
    );
}

/// One program's run: its arguments, what it prints, and how its data shards.
struct Case {
    args: Vec<String>,
    /// Lines rank 0 prints: (prefix, count).
    printed: Vec<(&'static str, usize)>,
    /// Models the function built an optimizer for.
    models: usize,
    batch: usize,
    per_epoch: usize,
    universe: HashSet<u64>,
    /// Sharded loop runs (one per epoch).
    loops: usize,
    /// The file that rank 0 saves, when it is the (first) model trained.
    saved_model: Option<String>,
}

/// Runs `case` of `program` on `ranks` ranks (1: the backend the SDK picks, NCCL;
/// more: Gloo, sharing the GPU) and checks it.
fn check(program: &str, ranks: usize, dir: &Path, case: &Case) {
    let (envs, backend): (&[(&str, &str)], &str) = if ranks == 1 {
        (&[], "nccl")
    } else {
        (&[("TCH_DISTRIBUTED_BACKEND", "gloo")], "gloo")
    };
    let exe = binary(program);
    let args: Vec<&str> = case.args.iter().map(String::as_str).collect();
    let run = run_ranks_with(exe.to_str().unwrap(), &args, ranks, dir, envs);
    let banner = format!("tch-distributed: backend {backend}, world size {ranks},");
    assert_printed(&run.stdout, &banner, 1);
    let line = run.stdout.lines().find(|l| l.starts_with(&banner)).unwrap();
    assert!(
        line.contains("devices cuda"),
        "{program}: not on CUDA: {line}"
    );
    for (prefix, count) in &case.printed {
        assert_printed(&run.stdout, prefix, *count);
    }
    // Batch norm's running statistics within 1e-5 (cuDNN's algorithms may differ
    // between the processes, see the function); everything else bit for bit.
    assert_eq!(
        assert_ranks_agree_with_statistics_within(dir, ranks, 1e-5),
        case.models,
        "{program}"
    );
    let loops = assert_shards_partition(dir, ranks, case.batch, case.per_epoch, &case.universe);
    assert_eq!(
        loops, case.loops,
        "{program}: one sharded loop run per epoch"
    );
    if let Some(out) = &case.saved_model {
        assert_same_tensors(
            &read_tensors(Path::new(out)),
            &read_tensors(&dir.join("record/rank-0-model-0.safetensors")),
            &format!("{program}: the saved model vs the model trained"),
        );
    }
    eprintln!(
        "{program}: {ranks} rank(s) over {backend} in {:?}",
        run.elapsed
    );
}

/// `make(dir)` builds the case in a fresh directory, once for one rank over NCCL and
/// once for two ranks over Gloo.
fn on_one_and_two_ranks(program: &str, make: impl Fn(&Path, usize) -> Case) {
    require_gpu();
    for ranks in [1, 2] {
        let dir = scratch_dir(&format!("gpu-corpus-{program}-{ranks}"));
        let case = make(&dir, ranks);
        check(program, ranks, &dir, &case);
    }
}

fn path(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

#[test]
fn a_cuda_is_available() {
    require_gpu();
}

#[test]
fn mnist_conv_on_the_gpu() {
    on_one_and_two_ranks("mnist_conv", |dir, _| {
        tch_distributed_tests::write_mnist(dir, 256, 64);
        let m = tch::vision::mnist::load_dir(dir).unwrap();
        Case {
            args: vec![path(dir), path(&dir.join("model.safetensors")), "2".into()],
            printed: vec![("epoch:", 2)],
            models: 1,
            batch: 32,
            per_epoch: 256,
            universe: fingerprints(&m.train_images),
            loops: 2,
            saved_model: None,
        }
    });
}

#[test]
fn char_rnn_on_the_gpu() {
    on_one_and_two_ranks("char_rnn", |dir, _| {
        // Windows of 17 labels in batches of 16, as in the program.
        let (input, universe, batches) = write_text_data(dir, 1050, 0x2545_f491_4f6c_dd1d, 17, 16);
        let out = path(&dir.join("model.safetensors"));
        Case {
            args: vec![path(&input), out.clone(), "2".into()],
            printed: vec![
                ("Dataset loaded, 30 labels.", 1),
                ("Epoch:", 2),
                ("Sample:", 2),
            ],
            models: 1,
            batch: 16,
            per_epoch: batches * 16,
            universe,
            loops: 2,
            saved_model: Some(out),
        }
    });
}

#[test]
fn min_gpt_on_the_gpu() {
    on_one_and_two_ranks("min_gpt", |dir, ranks| {
        // Windows of 17 labels in batches of 16, a checkpoint (and a print) every 20
        // steps, as in the program.
        let (input, universe, batches) = write_text_data(dir, 1300, 0x9e37_79b9_7f4a_7c15, 17, 16);
        let out = path(&dir.join("model.safetensors"));
        let prints = batches.div_ceil(ranks) * 2 / 20;
        Case {
            args: vec![
                path(&input),
                out.clone(),
                "2".into(),
                path(&dir.join("checkpoints")),
            ],
            printed: vec![
                ("Dataset loaded, 30 labels.", 1),
                ("Epoch:", prints),
                ("Sample:", prints),
            ],
            models: 1,
            batch: 16,
            per_epoch: batches * 16,
            universe,
            loops: 2,
            saved_model: Some(out),
        }
    });
}

#[test]
fn resnet_on_the_gpu() {
    on_one_and_two_ranks("resnet", |dir, _| {
        let (data, universe) = write_resnet_data(dir, 256, 64);
        Case {
            args: vec![data, path(&dir.join("model.safetensors")), "2".into()],
            printed: vec![("epoch:", 2)],
            models: 1,
            batch: 32,
            per_epoch: 256,
            universe,
            loops: 2,
            saved_model: None,
        }
    });
}

#[test]
fn gan_on_the_gpu() {
    on_one_and_two_ranks("gan", |dir, _| {
        tch_distributed_tests::write_mnist(dir, 256, 16);
        let m = tch::vision::mnist::load_dir(dir).unwrap();
        let out = path(&dir.join("generator.safetensors"));
        Case {
            args: vec![path(dir), out.clone(), "2".into()],
            printed: vec![("epoch:", 2)],
            // Generator and discriminator.
            models: 2,
            batch: 32,
            per_epoch: 256,
            universe: fingerprints(&(m.train_images.view([-1, 1, 28, 28]) * 2. - 1.)),
            loops: 2,
            saved_model: Some(out),
        }
    });
}

#[test]
fn finetune_on_the_gpu() {
    require_gpu();
    let program = binary("finetune");
    let program = program.to_str().unwrap().to_string();
    on_one_and_two_ranks("finetune", |dir, _| {
        // Pretrained as one process on the GPU.
        let (weights, universe) = write_finetune_data(&program, dir, 256);
        let out = path(&dir.join("model.safetensors"));
        Case {
            args: vec![path(dir), weights, out.clone(), "2".into()],
            printed: vec![("epoch:", 2)],
            models: 1,
            batch: 32,
            per_epoch: 256,
            universe,
            loops: 2,
            saved_model: Some(out),
        }
    });
}

/// LoRA fine-tuning (`lora`) on the GPU, 2 ranks sharing it over Gloo: at ZeRO stage 3
/// (each block a unit, sharded as it is built and loaded by rows) the adapters end where
/// DDP's end (within 1e-5), and the base is the pretrained one, bit for bit.
#[test]
fn lora_at_zero_3_on_the_gpu() {
    require_gpu();
    let program = binary("lora");
    let program = program.to_str().unwrap();
    let dir = tch_distributed_tests::scratch_dir("corpus-gpu-lora");
    let (input, _, _) = write_text_data(&dir, 2000, 0x2545_f491_4f6c_dd1d, 17, 16);
    let (input, base) = (path(&input), path(&dir.join("base.safetensors")));
    run_alone(program, &["pretrain", &input, &base, "20"], &dir);
    let train = |zero: &str| {
        let out = dir.join(format!("zero{zero}"));
        std::fs::create_dir_all(&out).unwrap();
        let model = path(&out.join("model.safetensors"));
        let envs = [
            ("TCH_DISTRIBUTED_BACKEND", "gloo"),
            ("TCH_DISTRIBUTED_ZERO", zero),
        ];
        let run = run_ranks_with(program, &[&input, &base, &model, "1"], 2, &out, &envs);
        assert!(run.stdout.contains("devices cuda"), "{}", run.stdout);
        read_tensors(&out.join("model.safetensors"))
    };
    let ddp = train("0");
    let sharded = train("3");
    assert_close(&ddp, &sharded, 1e-5, "ZeRO-3 against DDP on the GPU");
    let pretrained = read_tensors(Path::new(&base));
    let frozen: std::collections::BTreeMap<_, _> = sharded
        .into_iter()
        .filter(|(name, _)| !name.contains(".lora_"))
        .collect();
    assert_same_tensors(&frozen, &pretrained, "the base");
}
