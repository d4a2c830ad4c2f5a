//! A character-level LSTM language model on tinyshakespeare, in the spirit of tch-rs's
//! `char-rnn` example: plain single-GPU tch code plus one attribute, `#[distributed]`,
//! on the training function.
//!
//! ```text
//! cargo run --release --example shakespeare -- --data data/tinyshakespeare.txt   # one process (or every GPU)
//! TCH_DISTRIBUTED_NPROC=2 cargo run --release --example shakespeare -- --data …  # 2 CPU ranks, self-launched
//! tchrun --nproc-per-node 2 target/release/examples/shakespeare --data …
//! torchrun --standalone --nproc-per-node 2 --no-python target/release/examples/shakespeare --data …
//! ```
//!
//! Under `#[distributed]` each rank trains on its own share of every epoch's batches,
//! the gradients are averaged during backward, and only rank 0 prints and writes the
//! checkpoint. Removing the attribute gives back the single-process program.

use anyhow::{Context as _, Result};
use clap::Parser;
use std::time::Instant;
use tch::data::TextData;
use tch::nn::{self, Module, OptimizerConfig, RNN};
use tch::{Device, Kind, Tensor};
use tch_distributed::{Checkpointer, LrSchedule, LrScheduler, Tracker, TrainState};

#[derive(Parser, Debug, serde::Serialize)]
#[command(about = "Character-level LSTM on tinyshakespeare, data-parallel over tch-distributed")]
struct Args {
    /// The training text.
    #[arg(long, default_value = "data/tinyshakespeare.txt")]
    data: std::path::PathBuf,
    /// Optimizer steps (every rank runs each step on its own batch).
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// Sequences per step and process (under `#[distributed]` the global batch is
    /// this times the world size).
    #[arg(long, default_value_t = 32)]
    batch_size: i64,
    /// Characters per sequence.
    #[arg(long, default_value_t = 64)]
    seq_len: i64,
    /// LSTM hidden size.
    #[arg(long, default_value_t = 256)]
    hidden: i64,
    /// Adam learning rate.
    #[arg(long, default_value_t = 0.003)]
    lr: f64,
    /// Optimizer steps over which the learning rate rises linearly from 0 to `--lr`,
    /// then stays there (transformers' constant schedule with warmup); 0 trains at
    /// `--lr` from the first step. With more than 0 the rate is also a metric (`lr`).
    #[arg(long, default_value_t = 0)]
    warmup_steps: u64,
    /// Print every this many steps.
    #[arg(long, default_value_t = 20)]
    log_every: usize,
    /// Where the trained weights are written (safetensors; by rank 0).
    #[arg(long, default_value = "shakespeare.safetensors")]
    checkpoint: std::path::PathBuf,
    /// Seed of the initial weights and of the data order.
    #[arg(long, default_value_t = 42)]
    seed: i64,
    /// Keep resumable checkpoints (model, optimizer, step) here, every
    /// `--checkpoint-every` steps, and resume from the newest on start: under
    /// `tchrun --max-restarts K`, a run whose rank failed picks up where it stopped.
    #[arg(long)]
    checkpoint_dir: Option<std::path::PathBuf>,
    /// Steps between resumable checkpoints (with `--checkpoint-dir`).
    #[arg(long, default_value_t = 100)]
    checkpoint_every: usize,
    /// Metrics (metrics.jsonl, TensorBoard event files, loss.png) and the run's
    /// configuration (config.json) go here, from rank 0: `tensorboard --logdir DIR`.
    #[arg(long, default_value = "runs/shakespeare")]
    runs: std::path::PathBuf,
}

struct CharLstm {
    embed: nn::Embedding,
    lstm: nn::LSTM,
    head: nn::Linear,
}

impl CharLstm {
    fn new(vs: &nn::Path, labels: i64, hidden: i64) -> Self {
        let embed = nn::embedding(vs / "embed", labels, 64, Default::default());
        let lstm = nn::lstm(vs / "lstm", 64, hidden, Default::default());
        let head = nn::linear(vs / "head", hidden, labels, Default::default());
        CharLstm { embed, lstm, head }
    }

    /// `xs`: [batch, seq] character labels → logits [batch, seq, labels].
    fn forward(&self, xs: &Tensor) -> Tensor {
        let (out, _) = self.lstm.seq(&self.embed.forward(xs));
        self.head.forward(&out)
    }

    fn sample(&self, data: &TextData, len: usize, device: Device) -> String {
        let mut state = self.lstm.zero_state(1);
        let mut label = Tensor::from_slice(&[0i64]).to_device(device);
        let mut text = String::new();
        for _ in 0..len {
            let input = self.embed.forward(&label);
            state = self.lstm.step(&input, &state);
            let logits = self.head.forward(&state.h().squeeze_dim(0));
            label = logits
                .softmax(-1, Kind::Float)
                .multinomial(1, false)
                .view([1]);
            text.push(data.label_to_char(label.int64_value(&[0])));
        }
        text
    }
}

// ANCHOR: train
#[tch_distributed::distributed]
fn train(args: &Args) -> Result<()> {
    tch::manual_seed(args.seed);
    let device = Device::cuda_if_available();
    let data = TextData::new(&args.data).with_context(|| {
        format!(
            "reading {} (the README's run command downloads it; or pass --data PATH)",
            args.data.display()
        )
    })?;
    let labels = data.labels();
    let mut vs = nn::VarStore::new(device);
    let model = CharLstm::new(&vs.root(), labels, args.hidden);
    let mut opt = nn::Adam::default().build(&vs, args.lr)?;
    let checkpoints = args
        .checkpoint_dir
        .as_ref()
        .map(|dir| Checkpointer::new(dir).keep_last(2));
    let params: i64 = vs
        .trainable_variables()
        .iter()
        .map(|t| t.numel() as i64)
        .sum();
    println!(
        "{} characters, {labels} labels, {params} parameters, batch {}",
        data.data().size()[0],
        args.batch_size
    );

    // The global loss (averaged over ranks) each step; rank 0 writes it.
    let mut tracker = Tracker::new(&args.runs)?.average_over_ranks();
    tracker.batch_size(args.batch_size as usize)?;
    tracker.config("args", args)?;

    let start = Instant::now();
    let (mut window, mut loss_sum, mut losses) = (Instant::now(), 0.0, 0);
    // ANCHOR: resume
    let (mut step, mut first_epoch) = (0, 1);
    if let Some(checkpoints) = &checkpoints {
        // What a restartable job needs: resume from the newest complete checkpoint,
        // if there is one (a restart after a failure, or a rerun). The batch loop
        // below resumes by itself (the same shuffle, past the batches already
        // trained on); the step and epoch counters are the program's own.
        if let Some(state) = checkpoints.load_state(&mut vs, &mut opt)? {
            (step, first_epoch) = (state.step as usize, state.epoch);
            println!("resumed from step {step}");
        }
    }
    // ANCHOR_END: resume
    let first_step = step;
    // ANCHOR: schedule
    // The rate of each optimizer step. Built after the resume: the schedule goes on
    // from the optimizer's count of steps, which the checkpoint restored.
    let schedule = LrSchedule::constant_with_warmup(args.warmup_steps);
    let mut lr_schedule = LrScheduler::new(&mut opt, schedule, args.lr)?;
    // ANCHOR_END: schedule
    'training: for epoch in first_epoch.. {
        for batch in data.iter_shuffle(args.seq_len + 1, args.batch_size) {
            if step >= args.steps {
                break 'training;
            }
            let batch = batch.to_kind(Kind::Int64).to_device(device);
            let xs = batch.narrow(1, 0, args.seq_len);
            let ys = batch.narrow(1, 1, args.seq_len);
            let logits = model.forward(&xs);
            let loss = logits
                .view([-1, labels])
                .cross_entropy_for_logits(&ys.reshape([-1]));
            // ANCHOR: schedule_step
            // This step's rate; after the step, the next one's.
            let lr = lr_schedule.lr();
            opt.backward_step_clip_norm(&loss, 0.5);
            lr_schedule.step(&mut opt)?;
            // ANCHOR_END: schedule_step

            step += 1;
            let loss = loss.double_value(&[]);
            if args.warmup_steps > 0 {
                tracker.log(step as u64, &[("loss", loss), ("lr", lr)])?;
            } else {
                tracker.log(step as u64, &[("loss", loss)])?;
            }
            loss_sum += loss;
            losses += 1;
            if step % args.log_every == 0 || step == args.steps {
                let tokens = (losses as i64 * args.batch_size * args.seq_len) as f64;
                println!(
                    "epoch {epoch} step {step:5} | loss {:.4} | {:.0} tokens/s per process | {:.1} s",
                    loss_sum / losses as f64,
                    tokens / window.elapsed().as_secs_f64(),
                    start.elapsed().as_secs_f64()
                );
                (window, loss_sum, losses) = (Instant::now(), 0.0, 0);
            }
            if let Some(checkpoints) = &checkpoints {
                // Every `checkpoint_every` steps, and the last: a later run with more
                // `--steps` continues from there.
                if step % args.checkpoint_every == 0 || step >= args.steps {
                    let state = TrainState {
                        step: step as u64,
                        epoch,
                        ..Default::default()
                    };
                    checkpoints.save_state(&vs, &mut opt, &state)?;
                }
            }
            if step >= args.steps {
                break 'training;
            }
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    // The steps this run trained: a resumed run's rate counts only its own.
    let trained = step - first_step;
    let tokens = (trained as i64 * args.batch_size * args.seq_len) as f64;
    vs.save(&args.checkpoint)?;
    let resumed = match first_step {
        0 => String::new(),
        from => format!(" ({trained} in this run, resumed from step {from})"),
    };
    println!(
        "trained {step} steps{resumed} in {elapsed:.1} s: {:.0} tokens/s per process; wrote {}",
        tokens / elapsed,
        args.checkpoint.display()
    );
    for plot in tracker.finish()? {
        println!("plotted {}", plot.display());
    }
    let sample = tch::no_grad(|| model.sample(&data, 200, device));
    println!("sample:\n{sample}");
    Ok(())
}
// ANCHOR_END: train

// ANCHOR: main
fn main() -> Result<()> {
    train(&Args::parse())
}
// ANCHOR_END: main
