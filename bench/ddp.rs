//! DDP training-step benchmark, Rust side: plain tch code with `#[distributed]` on the
//! training function. `bench/python/ddp_bench.py` is the same benchmark on PyTorch's
//! `DistributedDataParallel`; `scripts/bench.sh` runs both and compares them.
//!
//! ```text
//! tchrun --nproc-per-node 2 target/release/ddp --workload mlp
//! ```
//!
//! Workloads (every rank has its own pool of `--pool` synthetic batches, or windows of
//! tinyshakespeare, and cycles through it; SGD, one libtorch thread per rank):
//! - `mlp`: 784-1024-1024-10 with ReLU, cross-entropy;
//! - `cnn`: tch-rs's MNIST conv net (conv 1→32 k5, max-pool 2, conv 32→64 k5, max-pool
//!   2, fc 1024→1024, ReLU, fc 1024→10) on 1×28×28 inputs, cross-entropy;
//! - `transformer`: a 3.2 M-parameter character-level transformer (token and position
//!   embeddings, 4 pre-norm blocks of d = 256, 4 heads of causal attention and a 4d GELU
//!   MLP, final layer norm, linear head) on 64-character windows of tinyshakespeare;
//! - `linear200`: 200 `Linear(64, 64)` in sequence with ReLU between, MSE loss: 400
//!   small parameters, one autograd hook each.
//!
//! Each step is timed in three phases: forward (with `zero_grad` and the loss),
//! backward (which under DDP ends by waiting for the last bucket's all-reduce), and the
//! optimizer step. Synchronized steps alternate with steps whose backward runs under
//! DDP's `no_sync` (no all-reduce), so that both kinds see the same load on a shared
//! machine: `--warmup` pairs, then `--steps` timed pairs. Every figure is a median over
//! steps, which bursts of other load disturb least: samples/s is world size × batch /
//! the slowest rank's median synchronized step; the all-reduce time left exposed after
//! backward is the median synchronized backward minus the median backward under
//! `no_sync` (each averaged over ranks). Rank 0 prints
//! `BENCH {json}` with these figures (the same fields as the Python side).

use std::time::Instant;

use anyhow::{Context as _, Result};
use clap::{Parser, ValueEnum};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Reduction, Tensor};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Workload {
    Mlp,
    Cnn,
    Transformer,
    Linear200,
}

#[derive(Parser, Debug)]
#[command(about = "DDP training-step benchmark (Rust side; see bench/python/ddp_bench.py)")]
struct Args {
    #[arg(long, value_enum)]
    workload: Workload,
    /// Samples per step and rank.
    #[arg(long, default_value_t = 64)]
    batch: i64,
    /// Synchronized and no_sync steps (each) run before timing.
    #[arg(long, default_value_t = 10)]
    warmup: usize,
    /// Timed synchronized steps (gradients all-reduced), each followed by one under
    /// `no_sync` (gradients not all-reduced).
    #[arg(long, default_value_t = 100)]
    steps: usize,
    /// SGD learning rate.
    #[arg(long, default_value_t = 0.01)]
    lr: f64,
    /// Distinct batches per rank, used in turn.
    #[arg(long, default_value_t = 8)]
    pool: usize,
    /// Characters per sequence (transformer).
    #[arg(long, default_value_t = 64)]
    context: i64,
    /// The text of the transformer workload.
    #[arg(long, default_value = "data/tinyshakespeare.txt")]
    data: std::path::PathBuf,
}

// ---------------------------------------------------------------- the models

#[derive(Debug)]
struct Mlp {
    fc1: nn::Linear,
    fc2: nn::Linear,
    fc3: nn::Linear,
}

impl Mlp {
    fn new(p: &nn::Path) -> Self {
        Mlp {
            fc1: nn::linear(p / "fc1", 784, 1024, Default::default()),
            fc2: nn::linear(p / "fc2", 1024, 1024, Default::default()),
            fc3: nn::linear(p / "fc3", 1024, 10, Default::default()),
        }
    }
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> Tensor {
        xs.apply(&self.fc1)
            .relu()
            .apply(&self.fc2)
            .relu()
            .apply(&self.fc3)
    }
}

/// tch-rs's MNIST conv net, without its dropout.
#[derive(Debug)]
struct Cnn {
    conv1: nn::Conv2D,
    conv2: nn::Conv2D,
    fc1: nn::Linear,
    fc2: nn::Linear,
}

impl Cnn {
    fn new(p: &nn::Path) -> Self {
        Cnn {
            conv1: nn::conv2d(p / "conv1", 1, 32, 5, Default::default()),
            conv2: nn::conv2d(p / "conv2", 32, 64, 5, Default::default()),
            fc1: nn::linear(p / "fc1", 1024, 1024, Default::default()),
            fc2: nn::linear(p / "fc2", 1024, 10, Default::default()),
        }
    }
}

impl Module for Cnn {
    fn forward(&self, xs: &Tensor) -> Tensor {
        xs.apply(&self.conv1)
            .max_pool2d_default(2)
            .apply(&self.conv2)
            .max_pool2d_default(2)
            .view([-1, 1024])
            .apply(&self.fc1)
            .relu()
            .apply(&self.fc2)
    }
}

/// Pre-norm transformer block: causal self-attention, then a 4d GELU MLP.
#[derive(Debug)]
struct Block {
    heads: i64,
    ln1: nn::LayerNorm,
    qkv: nn::Linear,
    proj: nn::Linear,
    ln2: nn::LayerNorm,
    fc: nn::Linear,
    out: nn::Linear,
}

impl Block {
    fn new(p: &nn::Path, d: i64, heads: i64) -> Self {
        Block {
            heads,
            ln1: nn::layer_norm(p / "ln1", vec![d], Default::default()),
            qkv: nn::linear(p / "qkv", d, 3 * d, Default::default()),
            proj: nn::linear(p / "proj", d, d, Default::default()),
            ln2: nn::layer_norm(p / "ln2", vec![d], Default::default()),
            fc: nn::linear(p / "fc", d, 4 * d, Default::default()),
            out: nn::linear(p / "out", 4 * d, d, Default::default()),
        }
    }
}

impl Module for Block {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let (b, t, d) = xs.size3().expect("[batch, time, d]");
        let h = self.heads;
        let qkv = xs
            .apply(&self.ln1)
            .apply(&self.qkv)
            .view([b, t, 3, h, d / h])
            .permute([2, 0, 3, 1, 4])
            .unbind(0);
        let y = Tensor::scaled_dot_product_attention(
            &qkv[0],
            &qkv[1],
            &qkv[2],
            None::<Tensor>,
            0.0,
            true,
            None,
            false,
        );
        let xs = xs + y.transpose(1, 2).reshape([b, t, d]).apply(&self.proj);
        &xs + xs
            .apply(&self.ln2)
            .apply(&self.fc)
            .gelu("none")
            .apply(&self.out)
    }
}

/// Token and position embeddings, 4 blocks, final layer norm, linear head.
#[derive(Debug)]
struct CharTransformer {
    tok: nn::Embedding,
    pos: nn::Embedding,
    blocks: Vec<Block>,
    ln: nn::LayerNorm,
    head: nn::Linear,
}

impl CharTransformer {
    fn new(p: &nn::Path, vocab: i64, context: i64) -> Self {
        let (d, layers, heads) = (256, 4, 4);
        CharTransformer {
            tok: nn::embedding(p / "tok", vocab, d, Default::default()),
            pos: nn::embedding(p / "pos", context, d, Default::default()),
            blocks: (0..layers)
                .map(|i| Block::new(&(p / "blocks" / i), d, heads))
                .collect(),
            ln: nn::layer_norm(p / "ln", vec![d], Default::default()),
            head: nn::linear(p / "head", d, vocab, Default::default()),
        }
    }
}

impl Module for CharTransformer {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let t = xs.size()[1];
        let positions = Tensor::arange(t, (Kind::Int64, xs.device()));
        let mut x = xs.apply(&self.tok) + positions.apply(&self.pos);
        for block in &self.blocks {
            x = x.apply(block);
        }
        x.apply(&self.ln).apply(&self.head)
    }
}

/// 200 `Linear(64, 64)` in sequence, ReLU between.
#[derive(Debug)]
struct Deep {
    layers: Vec<nn::Linear>,
}

impl Deep {
    fn new(p: &nn::Path) -> Self {
        Deep {
            layers: (0..200)
                .map(|i| nn::linear(p / i, 64, 64, Default::default()))
                .collect(),
        }
    }
}

impl Module for Deep {
    fn forward(&self, xs: &Tensor) -> Tensor {
        let mut x = xs.shallow_clone();
        for (i, layer) in self.layers.iter().enumerate() {
            x = x.apply(layer);
            if i + 1 < self.layers.len() {
                x = x.relu();
            }
        }
        x
    }
}

/// A workload's model, its rank's pool of (input, target) batches, and its loss.
struct Workbench {
    model: Box<dyn Module>,
    batches: Vec<(Tensor, Tensor)>,
    mse: bool,
}

impl Workbench {
    fn new(p: &nn::Path, args: &Args, rank: usize) -> Result<Self> {
        // Each rank its own data; the model's initial weights come from rank 0 anyway.
        tch::manual_seed(1000 + rank as i64);
        let b = args.batch;
        let f = (Kind::Float, Device::Cpu);
        let pool = 0..args.pool;
        let labels = |classes| Tensor::randint(classes, [b], (Kind::Int64, Device::Cpu));
        let (model, batches, mse): (Box<dyn Module>, _, _) = match args.workload {
            Workload::Mlp => {
                let batches = pool
                    .map(|_| (Tensor::randn([b, 784], f), labels(10)))
                    .collect();
                tch::manual_seed(42);
                (Box::new(Mlp::new(p)), batches, false)
            }
            Workload::Cnn => {
                let batches = pool
                    .map(|_| (Tensor::randn([b, 1, 28, 28], f), labels(10)))
                    .collect();
                tch::manual_seed(42);
                (Box::new(Cnn::new(p)), batches, false)
            }
            Workload::Transformer => {
                let text = tch::data::TextData::new(&args.data)
                    .with_context(|| format!("reading {}", args.data.display()))?;
                let tokens = text.data().to_kind(Kind::Int64);
                let n = tokens.size()[0];
                let offsets = Tensor::arange(args.context + 1, (Kind::Int64, Device::Cpu));
                let batches = pool
                    .map(|_| {
                        let start = Tensor::randint(
                            n - args.context - 1,
                            [b, 1],
                            (Kind::Int64, Device::Cpu),
                        );
                        let window = tokens.take(&(start + &offsets));
                        (
                            window.narrow(1, 0, args.context),
                            window.narrow(1, 1, args.context),
                        )
                    })
                    .collect();
                tch::manual_seed(42);
                let model = CharTransformer::new(p, text.labels(), args.context);
                (Box::new(model), batches, false)
            }
            Workload::Linear200 => {
                let batches = pool
                    .map(|_| (Tensor::randn([b, 64], f), Tensor::randn([b, 64], f)))
                    .collect();
                tch::manual_seed(42);
                (Box::new(Deep::new(p)), batches, true)
            }
        };
        Ok(Workbench {
            model,
            batches,
            mse,
        })
    }

    fn loss(&self, xs: &Tensor, ys: &Tensor) -> Tensor {
        let out = self.model.forward(xs);
        if self.mse {
            out.mse_loss(ys, Reduction::Mean)
        } else {
            let classes = *out.size().last().expect("logits");
            out.reshape([-1, classes]).cross_entropy_loss(
                &ys.reshape([-1]),
                None::<Tensor>,
                Reduction::Mean,
                -100,
                0.0,
            )
        }
    }
}

// ---------------------------------------------------------------- the training function

/// Seconds of each phase of every timed step of one kind (synchronized or no_sync):
/// forward (with `zero_grad` and the loss), backward, optimizer step; and their CPU
/// seconds and minor page faults in all.
#[derive(Default)]
struct Phases {
    forward: Vec<f64>,
    backward: Vec<f64>,
    step: Vec<f64>,
    total: Vec<f64>,
    cpu: f64,
    faults: f64,
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

#[tch_distributed::distributed]
fn train(args: &Args) -> Result<()> {
    let ctx = tch_distributed::current().context("no process group")?;
    let (rank, world) = (ctx.rank(), ctx.world_size());
    let device = Device::cuda_if_available();
    let vs = nn::VarStore::new(device);
    let bench = Workbench::new(&vs.root(), args, rank)?;
    let params: i64 = vs
        .trainable_variables()
        .iter()
        .map(|t| t.numel() as i64)
        .sum();
    let mut opt = nn::Sgd::default().build(&vs, args.lr)?;

    // Warm-up, then the timed steps; both alternate a synchronized step with one
    // under no_sync, so that the two kinds see the same load on a shared machine.
    let mut timed = [Phases::default(), Phases::default()]; // [synchronized, no_sync]
    let mut last_loss = f64::NAN;
    for (run, steps) in [args.warmup, args.steps].into_iter().enumerate() {
        ctx.barrier()?;
        for i in 0..2 * steps {
            let local = i % 2 == 1;
            let (xs, ys) = &bench.batches[(i / 2) % bench.batches.len()];
            let (cpu0, faults0) = (cpu_seconds(), minor_faults());
            let t0 = Instant::now();
            opt.zero_grad();
            let loss = bench.loss(xs, ys);
            let t1 = Instant::now();
            if local {
                // PyTorch's `with ddp.no_sync(): loss.backward()`.
                let ddp = opt.ddp().context("the optimizer has no DDP")?;
                let _no_sync = ddp.no_sync();
                ddp.backward(&loss)?;
            } else {
                loss.backward();
            }
            let t2 = Instant::now();
            opt.step();
            let t3 = Instant::now();
            if run == 1 {
                let p = &mut timed[local as usize];
                p.forward.push((t1 - t0).as_secs_f64());
                p.backward.push((t2 - t1).as_secs_f64());
                p.step.push((t3 - t2).as_secs_f64());
                p.total.push((t3 - t0).as_secs_f64());
                p.cpu += cpu_seconds() - cpu0;
                p.faults += minor_faults() - faults0;
                if !local {
                    last_loss = loss.double_value(&[]);
                }
            }
        }
    }
    ctx.barrier()?;
    let [sync, local] = &timed;
    let n = args.steps.max(1) as f64;
    let mine = Tensor::from_slice(&[
        sync.total.iter().sum::<f64>(),
        median(&sync.total),
        median(&sync.forward),
        median(&sync.backward),
        median(&sync.step),
        median(&local.backward),
        peak_rss_kb(),
        sync.cpu / n,
        last_loss,
        local.cpu / n,
        sync.faults / n,
        local.faults / n,
    ]);
    let every = ctx.process_group().all_gather(&mine)?;
    let rows: Vec<Vec<f64>> = every
        .iter()
        .map(|t| Vec::<f64>::try_from(t).context("gathered timings"))
        .collect::<Result<_>>()?;
    let buckets = opt.ddp().map(|d| d.bucket_sizes()).transpose()?;
    let report = report(args, world, params, &rows, buckets);
    println!("BENCH {report}");
    Ok(())
}

/// The fields both sides print; `rows` are every rank's gathered figures: seconds of
/// the timed synchronized steps in all, median seconds of a step and of its forward, backward
/// and optimizer step, median backward under `no_sync`, peak RSS (KiB), CPU seconds
/// per step, last loss, CPU seconds per `no_sync` step, minor page faults per step and
/// per `no_sync` step.
fn report(
    args: &Args,
    world: usize,
    params: i64,
    rows: &[Vec<f64>],
    buckets: Option<Vec<usize>>,
) -> serde_json::Value {
    let max = |k: usize| rows.iter().map(|r| r[k]).fold(f64::NAN, f64::max);
    let mean = |k: usize| rows.iter().map(|r| r[k]).sum::<f64>() / rows.len() as f64;
    let samples = (world as f64) * (args.batch as f64);
    serde_json::json!({
        "side": "rust",
        "workload": format!("{:?}", args.workload).to_lowercase(),
        "world": world,
        "batch": args.batch,
        "warmup": args.warmup,
        "steps": args.steps,
        "params": params,
        "sync_steps_s": max(0),
        "samples_per_s": samples / max(1),
        "samples_per_s_mean": samples * (args.steps as f64) / max(0),
        "step_ms": 1e3 * max(1),
        "forward_ms": 1e3 * mean(2),
        "backward_ms": 1e3 * mean(3),
        "optimizer_ms": 1e3 * mean(4),
        "backward_nosync_ms": 1e3 * mean(5),
        "exposed_allreduce_ms": 1e3 * (mean(3) - mean(5)),
        "rss_mb": rows.iter().map(|r| r[6] / 1024.0).collect::<Vec<_>>(),
        "cpu_ms_per_step": 1e3 * mean(7),
        "cpu_ms_per_nosync_step": 1e3 * mean(9),
        "minor_faults_per_step": mean(10),
        "minor_faults_per_nosync_step": mean(11),
        "loss": rows[0][8],
        "finite": rows.iter().all(|r| r[8].is_finite()),
        "buckets": buckets,
    })
}

/// User and system CPU seconds of this process so far (all its threads).
fn cpu_seconds() -> f64 {
    let u = rusage();
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    secs(u.ru_utime) + secs(u.ru_stime)
}

/// Minor page faults of this process so far.
fn minor_faults() -> f64 {
    rusage().ru_minflt as f64
}

fn rusage() -> libc::rusage {
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    usage
}

/// Peak resident set size of this process in KiB (`getrusage`'s `ru_maxrss`, as
/// Python's `resource.getrusage(RUSAGE_SELF).ru_maxrss`).
fn peak_rss_kb() -> f64 {
    rusage().ru_maxrss as f64
}

fn main() -> Result<()> {
    let args = Args::parse();
    tch::set_num_threads(1);
    train(&args)
}
