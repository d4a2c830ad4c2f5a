//! LoRA fine-tuning, the FSDP/DeepSpeed guide's job in Rust: a small character-level
//! GPT in min-gpt's shape (token and position embeddings, blocks of causal
//! self-attention and an MLP, layer norms, a head) is pretrained on the first 90% of
//! tinyshakespeare (`pretrain`), then low-rank adapters beside the attention's `query`
//! and `value` projections are trained on the text after it (`train`), the base frozen,
//! as PEFT's `LoraModel` does (`lora_A`: r × in, random; `lora_B`: out × r, zeros; the
//! output `x·Aᵀ·Bᵀ·alpha/r` added to the projection's). The last 2% of the text is held
//! out: `train` prints its loss under the base model and under the fine-tuned one.
//!
//! `train` runs under the guide's `ds_config.json` (`tchrun --deepspeed
//! examples/ds_config.json`: ZeRO-2, the optimizer offloaded where there is a GPU,
//! bf16, gradient clipping, AdamW) with each block's activations recomputed in the
//! backward pass (`checkpointed_t`) and gradient accumulation (`--grad-accum`), and
//! writes the guide's layout in `--output-dir`:
//!
//! ```text
//! checkpoint-40/  checkpoint-80/ …   resumable checkpoints (model, optimizer, step)
//! final_model/adapter_model.safetensors   the adapters, named as PEFT names them
//! final_model/adapter_config.json         PEFT's LoraConfig
//! final_model/model.safetensors, config.json   the whole model and its shape
//! logs/                                   TensorBoard events, metrics.jsonl, loss.png
//! training_config.json                    the run's arguments and settings
//! ```
//!
//! `scripts/finetune.sh` runs both stages on 2 CPU ranks. The one line added for data
//! parallelism is the attribute on each stage's function.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand};
use tch::data::TextData;
use tch::nn::{self, OptimizerConfig};
use tch::{Device, IndexOp, Kind, Tensor};
use tch_distributed::{
    checkpointed_t, CheckpointedT, Checkpointer, DataLoader, TensorDataset, Tracker, TrainState,
};

/// The model's shape: min-gpt's, small enough for 2 CPU ranks.
#[derive(Clone, Copy, Debug, serde::Serialize)]
struct Config {
    vocab_size: i64,
    n_embd: i64,
    n_head: i64,
    n_layer: i64,
    block_size: i64,
}

/// The adapters: PEFT's `LoraConfig(r, lora_alpha, target_modules)`.
const LORA_R: i64 = 8;
const LORA_ALPHA: f64 = 16.0;
const TARGET_MODULES: [&str; 2] = ["query", "value"];
/// The share of the text pretraining reads, and the share held out at the end.
const PRETRAIN_SHARE: f64 = 0.90;
const HELD_OUT_SHARE: f64 = 0.02;

#[derive(Parser, Debug)]
#[command(
    about = "LoRA fine-tuning of a small GPT on tinyshakespeare, data-parallel over tch-distributed"
)]
struct Cli {
    #[command(subcommand)]
    stage: Stage,
}

#[derive(Subcommand, Debug)]
enum Stage {
    /// Trains the whole model on the text's first 90%.
    Pretrain(PretrainArgs),
    /// Trains LoRA adapters on the text after it, the base frozen.
    Train(TrainArgs),
}

#[derive(clap::Args, Debug, serde::Serialize)]
struct PretrainArgs {
    #[arg(long)]
    data: PathBuf,
    /// Where the base model is written (safetensors).
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 300)]
    steps: usize,
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
}

#[derive(clap::Args, Debug, serde::Serialize)]
struct TrainArgs {
    #[arg(long)]
    data: PathBuf,
    /// The pretrained base model.
    #[arg(long)]
    base: PathBuf,
    #[arg(long)]
    output_dir: PathBuf,
    /// Optimizer steps.
    #[arg(long, default_value_t = 120)]
    steps: u64,
    /// Sequences per micro-batch and rank.
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// The learning rate given to the optimizer (DeepSpeed's `"auto"` takes it).
    #[arg(long, default_value_t = 1e-2)]
    lr: f64,
    /// A resumable checkpoint every this many steps (`checkpoint-N/`).
    #[arg(long, default_value_t = 40)]
    save_steps: u64,
}

/// A linear layer, with a LoRA adapter beside it when its name is a target.
#[derive(Debug)]
struct Linear {
    ws: Tensor,
    bs: Tensor,
    /// `(lora_A [r, in], lora_B [out, r])`.
    adapter: Option<(Tensor, Tensor)>,
}

fn linear(p: nn::Path, name: &str, inputs: i64, outputs: i64, adapters: bool) -> Linear {
    let p = &p / name;
    let adapter = (adapters && TARGET_MODULES.contains(&name)).then(|| {
        (
            (&p / "lora_A").randn(
                "weight",
                &[LORA_R, inputs],
                0.0,
                1.0 / (inputs as f64).sqrt(),
            ),
            (&p / "lora_B").zeros("weight", &[outputs, LORA_R]),
        )
    });
    Linear {
        ws: p.randn("weight", &[outputs, inputs], 0.0, 0.02),
        bs: p.zeros("bias", &[outputs]),
        adapter,
    }
}

impl nn::Module for Linear {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let out = xs.matmul(&self.ws.tr()) + &self.bs;
        match &self.adapter {
            Some((a, b)) => out + xs.matmul(&a.tr()).matmul(&b.tr()) * (LORA_ALPHA / LORA_R as f64),
            None => out,
        }
    }
}

fn block(p: &nn::Path, cfg: Config, adapters: bool) -> nn::FuncT<'static> {
    let ln1 = nn::layer_norm(p / "ln1", vec![cfg.n_embd], Default::default());
    let ln2 = nn::layer_norm(p / "ln2", vec![cfg.n_embd], Default::default());
    let attn = p / "attn";
    let (query, key, value, proj) = (
        linear(attn.clone(), "query", cfg.n_embd, cfg.n_embd, adapters),
        linear(attn.clone(), "key", cfg.n_embd, cfg.n_embd, adapters),
        linear(attn.clone(), "value", cfg.n_embd, cfg.n_embd, adapters),
        linear(attn, "proj", cfg.n_embd, cfg.n_embd, adapters),
    );
    let fc1 = linear(p / "mlp", "fc1", cfg.n_embd, 4 * cfg.n_embd, adapters);
    let fc2 = linear(p / "mlp", "fc2", 4 * cfg.n_embd, cfg.n_embd, adapters);
    // Lower triangular: position t attends to positions 0..=t.
    let mask = Tensor::ones([cfg.block_size, cfg.block_size], (Kind::Float, p.device())).tril(0);
    nn::func_t(move |xs, _train| {
        let (b, t, c) = xs.size3().unwrap();
        let heads = [b, t, cfg.n_head, c / cfg.n_head];
        let h = xs.apply(&ln1);
        let q = h.apply(&query).view(heads).transpose(1, 2);
        let k = h.apply(&key).view(heads).transpose(1, 2);
        let v = h.apply(&value).view(heads).transpose(1, 2);
        let att = q.matmul(&k.transpose(-2, -1)) * (1.0 / (heads[3] as f64).sqrt());
        let att = att
            .masked_fill(&mask.i((..t, ..t)).eq(0.), f64::NEG_INFINITY)
            .softmax(-1, Kind::Float);
        let y = att.matmul(&v).transpose(1, 2).contiguous().view([b, t, c]);
        let xs = xs + y.apply(&proj);
        let ys = xs.apply(&ln2).apply(&fc1).gelu("none").apply(&fc2);
        xs + ys
    })
}

/// Where the model lives in its `VarStore`: PEFT's wrapper's path, so that the
/// adapters' names are PEFT's (`base_model.model.blocks.0.attn.query.lora_A.weight`).
fn model_path(vs: &nn::VarStore) -> nn::Path<'_> {
    vs.root() / "base_model" / "model"
}

/// The GPT; each block's activations recomputed in the backward pass.
struct Gpt {
    tok_emb: nn::Embedding,
    pos_emb: Tensor,
    blocks: Vec<CheckpointedT<nn::FuncT<'static>>>,
    ln_f: nn::LayerNorm,
    head: Linear,
}

impl Gpt {
    fn new(p: &nn::Path, cfg: Config, adapters: bool) -> Gpt {
        Gpt {
            tok_emb: nn::embedding(
                p / "tok_emb",
                cfg.vocab_size,
                cfg.n_embd,
                Default::default(),
            ),
            pos_emb: p.zeros("pos_emb", &[1, cfg.block_size, cfg.n_embd]),
            blocks: (0..cfg.n_layer)
                .map(|i| checkpointed_t(block(&(p / "blocks" / i), cfg, adapters)))
                .collect(),
            ln_f: nn::layer_norm(p / "ln_f", vec![cfg.n_embd], Default::default()),
            head: linear(p.clone(), "head", cfg.n_embd, cfg.vocab_size, false),
        }
    }

    /// The mean cross-entropy of predicting each next label of `windows` ([batch,
    /// block_size + 1] labels).
    fn loss(&self, windows: &Tensor, train: bool) -> Tensor {
        let t = windows.size()[1] - 1;
        let (xs, ys) = (windows.narrow(1, 0, t), windows.narrow(1, 1, t));
        let h = xs.apply(&self.tok_emb) + self.pos_emb.i((.., ..t, ..));
        let h = self.blocks.iter().fold(h, |h, b| h.apply_t(b, train));
        let logits = h.apply(&self.ln_f).apply(&self.head);
        logits
            .view([-1, logits.size()[2]])
            .cross_entropy_for_logits(&ys.reshape([-1]))
    }
}

/// The text's labels, and the model's shape for its vocabulary.
fn text(path: &Path) -> Result<(Tensor, Config)> {
    let data = TextData::new(path).with_context(|| format!("reading {}", path.display()))?;
    let cfg = Config {
        vocab_size: data.labels(),
        n_embd: 64,
        n_head: 4,
        n_layer: 2,
        block_size: 32,
    };
    Ok((data.data().to_kind(Kind::Int64), cfg))
}

/// The labels from `from` to `to` (shares of the text) cut into windows of
/// `block_size + 1`: `[windows, block_size + 1]`.
fn windows(labels: &Tensor, from: f64, to: f64, cfg: Config) -> Tensor {
    let n = labels.size()[0] as f64;
    let (start, end) = ((n * from) as i64, (n * to) as i64);
    let w = cfg.block_size + 1;
    let count = (end - start) / w;
    labels.narrow(0, start, count * w).view([count, w])
}

/// This rank's batches of `windows`, a new shuffle every epoch.
fn loader(windows: &Tensor, batch_size: usize) -> Result<DataLoader<TensorDataset>> {
    let ys = Tensor::zeros([windows.size()[0]], (Kind::Int64, Device::Cpu));
    Ok(
        DataLoader::new(TensorDataset::new(windows, &ys)?, batch_size)?
            .to_device(Device::cuda_if_available()),
    )
}

/// The mean loss over `windows`, in batches.
fn evaluate(model: &Gpt, windows: &Tensor) -> f64 {
    let device = Device::cuda_if_available();
    tch::no_grad(|| {
        let losses: Vec<f64> = windows
            .split(64, 0)
            .iter()
            .map(|w| model.loss(&w.to_device(device), false).double_value(&[]) * w.size()[0] as f64)
            .collect();
        losses.iter().sum::<f64>() / windows.size()[0] as f64
    })
}

#[tch_distributed::distributed]
fn pretrain(args: &PretrainArgs) -> Result<()> {
    let (labels, cfg) = text(&args.data)?;
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let model = Gpt::new(&model_path(&vs), cfg, false);
    let train = loader(&windows(&labels, 0.0, PRETRAIN_SHARE, cfg), args.batch_size)?;
    let mut opt = nn::AdamW::default().build(&vs, args.lr)?;
    let mut step = 0;
    'training: loop {
        for batch in &train {
            let (windows, _) = batch?;
            let loss = model.loss(&windows, true);
            opt.backward_step_clip_norm(&loss, 1.0);
            step += 1;
            if step % 50 == 0 {
                println!(
                    "pretrain step {step:4} | loss {:.4}",
                    loss.double_value(&[])
                );
            }
            if step == args.steps {
                break 'training;
            }
        }
    }
    vs.save(&args.out)?;
    println!("pretrained {step} steps; wrote {}", args.out.display());
    Ok(())
}

#[tch_distributed::distributed]
fn train(args: &TrainArgs) -> Result<()> {
    let (labels, cfg) = text(&args.data)?;
    let mut vs = nn::VarStore::new(Device::cuda_if_available());
    let model = Gpt::new(&model_path(&vs), cfg, true);
    let missing = vs.load_partial(&args.base)?;
    for (name, var) in vs.variables() {
        if !name.contains(".lora_") {
            let _ = var.set_requires_grad(false);
        }
    }
    let held_out = windows(&labels, 1.0 - HELD_OUT_SHARE, 1.0, cfg);
    let base_loss = evaluate(&model, &held_out);
    let train = loader(
        &windows(&labels, PRETRAIN_SHARE, 1.0 - HELD_OUT_SHARE, cfg),
        args.batch_size,
    )?;
    let mut opt = nn::AdamW::default().build(&vs, args.lr)?;
    let checkpoints = Checkpointer::new(&args.output_dir).named("checkpoint-");
    let mut tracker = Tracker::new(args.output_dir.join("logs"))?.average_over_ranks();
    tracker.batch_size(args.batch_size)?;
    tracker.config("args", args)?;
    let mut step = 0;
    if let Some(state) = checkpoints.load_state(&mut vs, &mut opt)? {
        step = state.step;
        println!("resumed at step {step}");
    }
    println!(
        "{} adapter variables ({} parameters) trained, the base's {} frozen",
        missing.len(),
        vs.variables()
            .values()
            .filter(|t| t.requires_grad())
            .map(Tensor::numel)
            .sum::<usize>(),
        vs.variables().len() - missing.len()
    );
    'training: while step < args.steps {
        for batch in &train {
            let (windows, _) = batch?;
            let loss = model.loss(&windows, true);
            opt.backward_step(&loss);
            // A micro-batch inside an accumulation cycle is not a step.
            if opt.steps_taken() == step {
                continue;
            }
            step = opt.steps_taken();
            tracker.log(step, &[("loss", loss.double_value(&[]))])?;
            if step % 20 == 0 {
                println!("step {step:4} | loss {:.4}", loss.double_value(&[]));
            }
            if step % args.save_steps == 0 {
                let state = TrainState {
                    step,
                    config: serde_json::to_value(args)?,
                    ..TrainState::default()
                };
                checkpoints.save_state(&vs, &mut opt, &state)?;
            }
            if step == args.steps {
                break 'training;
            }
        }
    }
    let tuned_loss = evaluate(&model, &held_out);
    println!("held-out loss: base {base_loss:.4}, fine-tuned {tuned_loss:.4}");
    tracker.config(
        "held_out_loss",
        serde_json::json!({ "base": base_loss, "fine_tuned": tuned_loss }),
    )?;
    tracker.finish()?;
    // The adapters alone, named as PEFT names them, and the whole model: rank 0 writes
    // each between barriers.
    let dir = args.output_dir.join("final_model");
    tch_distributed::save_trainable(&vs, dir.join("adapter_model.safetensors"))?;
    vs.save(dir.join("model.safetensors"))?;
    if tch_distributed::current().map_or(true, |c| c.is_main_process()) {
        write_configs(args, cfg)?;
    }
    Ok(())
}

/// PEFT's `adapter_config.json` and the model's `config.json` in `final_model/`, and
/// `training_config.json`.
fn write_configs(args: &TrainArgs, cfg: Config) -> Result<()> {
    let dir = args.output_dir.join("final_model");
    let adapter_config = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": LORA_R,
        "lora_alpha": LORA_ALPHA,
        "lora_dropout": 0.0,
        "target_modules": TARGET_MODULES,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "modules_to_save": null,
        "base_model_name_or_path": args.base,
    });
    std::fs::write(
        dir.join("adapter_config.json"),
        serde_json::to_string_pretty(&adapter_config)?,
    )?;
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&cfg)?)?;
    let settings = tch_distributed::current().map(|c| {
        serde_json::json!({ "world_size": c.world_size(), "device": format!("{:?}", c.device()) })
    });
    let training = serde_json::json!({ "args": args, "model": cfg, "run": settings });
    std::fs::write(
        args.output_dir.join("training_config.json"),
        serde_json::to_string_pretty(&training)?,
    )?;
    println!("wrote {}", dir.display());
    Ok(())
}

fn main() -> Result<()> {
    tch::manual_seed(42);
    match Cli::parse().stage {
        Stage::Pretrain(args) => pretrain(&args),
        Stage::Train(args) => train(&args),
    }
}
