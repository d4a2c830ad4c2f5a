//! A character-level LSTM language model trained data-parallel on tinyshakespeare,
//! in the spirit of tch-rs's `char-rnn` example.
//!
//! ```text
//! tchrun --nproc-per-node 2 target/release/examples/shakespeare --data data/tinyshakespeare.txt
//! ```
//!
//! Run alone (no launcher) it trains on one process exactly as plain tch would.
//! Rank 0 prints the loss and throughput, writes the checkpoint and samples text.

use anyhow::{Context as _, Result};
use clap::Parser;
use std::time::Instant;
use tch::data::TextData;
use tch::nn::{self, Module, OptimizerConfig, RNN};
use tch::{Device, Kind, Tensor};
use tch_distributed::{DistributedDataParallel, ReduceOp};

#[derive(Parser, Debug)]
#[command(about = "Character-level LSTM on tinyshakespeare, data-parallel over tch-distributed")]
struct Args {
    /// The training text.
    #[arg(long, default_value = "data/tinyshakespeare.txt")]
    data: std::path::PathBuf,
    /// Optimizer steps (each rank runs every step on its own batches).
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// Sequences per rank and step (the global batch is this times the world size).
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
    /// Print every this many steps.
    #[arg(long, default_value_t = 20)]
    log_every: usize,
    /// Where rank 0 writes the trained weights (safetensors).
    #[arg(long, default_value = "shakespeare.safetensors")]
    checkpoint: std::path::PathBuf,
    /// Seed of the initial weights and of the data order.
    #[arg(long, default_value_t = 42)]
    seed: i64,
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

fn main() -> Result<()> {
    let args = Args::parse();
    let ctx = tch_distributed::init()?;
    let (rank, world) = (ctx.rank(), ctx.world_size());
    let device = ctx.device();
    if ctx.is_main_process() {
        println!("{}", ctx.banner());
    }
    let data = TextData::new(&args.data).with_context(|| {
        format!(
            "reading {} (the README's run command downloads it; or pass --data PATH)",
            args.data.display()
        )
    })?;
    let labels = data.labels();

    tch::manual_seed(args.seed);
    let vs = nn::VarStore::new(device);
    let model = CharLstm::new(&vs.root(), labels, args.hidden);
    let mut opt = nn::Adam::default().build(&vs, args.lr)?;
    let ddp = DistributedDataParallel::new(&vs, ctx.process_group(), Default::default())?;
    if ctx.is_main_process() {
        let params: i64 = vs
            .trainable_variables()
            .iter()
            .map(|t| t.numel() as i64)
            .sum();
        println!(
            "{} characters, {labels} labels, {params} parameters, global batch {} ({} per rank)",
            data.data().size()[0],
            args.batch_size * world as i64,
            args.batch_size
        );
    }

    // Every rank draws the same shuffle (same seed); rank r takes batches r, r+W, …
    let mut batches = {
        tch::manual_seed(args.seed + 1);
        data.iter_shuffle(args.seq_len + 1, args.batch_size)
            .skip(rank)
            .step_by(world)
    };
    let start = Instant::now();
    let mut window = (Instant::now(), 0.0, 0usize);
    for step in 1..=args.steps {
        let batch = batches
            .next()
            .context("the text is too short for this many steps")?
            .to_kind(Kind::Int64)
            .to_device(device);
        let xs = batch.narrow(1, 0, args.seq_len);
        let ys = batch.narrow(1, 1, args.seq_len);
        let logits = model.forward(&xs);
        let loss = logits
            .view([-1, labels])
            .cross_entropy_for_logits(&ys.reshape([-1]));
        ddp.backward_step_clip_norm(&mut opt, &loss, 0.5)?;

        window.1 += loss.double_value(&[]);
        window.2 += 1;
        if step % args.log_every == 0 || step == args.steps {
            // The mean loss over ranks, so the log shows the global picture.
            let mut mean = Tensor::from_slice(&[window.1 / window.2 as f64]);
            ctx.process_group().all_reduce(&mut mean, ReduceOp::Avg)?;
            let tokens = (window.2 as i64 * args.batch_size * args.seq_len * world as i64) as f64;
            if ctx.is_main_process() {
                println!(
                    "step {step:5} | loss {:.4} | {:.0} tokens/s | {:.1} s",
                    mean.double_value(&[0]),
                    tokens / window.0.elapsed().as_secs_f64(),
                    start.elapsed().as_secs_f64()
                );
            }
            window = (Instant::now(), 0.0, 0);
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    let total_tokens = (args.steps as i64 * args.batch_size * args.seq_len * world as i64) as f64;
    tch_distributed::save_var_store(&ctx, &vs, &args.checkpoint)?;
    if ctx.is_main_process() {
        println!(
            "trained {} steps in {elapsed:.1} s: {:.0} tokens/s over {world} rank(s); wrote {}",
            args.steps,
            total_tokens / elapsed,
            args.checkpoint.display()
        );
        let sample = tch::no_grad(|| model.sample(&data, 200, device));
        println!("sample:\n{sample}");
    }
    Ok(())
}
