//! DDP training-step benchmark, Rust side: plain tch code with `#[distributed]` on the
//! training function. `bench/python/ddp_bench.py` is the same benchmark on PyTorch's
//! `DistributedDataParallel` (and, with `--mode plain`, on PyTorch without DDP);
//! `scripts/bench.sh` runs both on the CPU and compares them, `scripts/bench_gpu.sh`
//! on a GPU.
//!
//! ```text
//! tchrun --nproc-per-node 2 target/release/ddp --workload mlp
//! TCH_DISTRIBUTED_BACKEND=nccl tchrun --nproc-per-node 1 target/release/ddp \
//!     --device cuda --precision bf16 --workload linear4096 --batch 512
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
//!   small parameters, one autograd hook each;
//! - `linear4096`: 4 `Linear(4096, 4096)` in sequence with ReLU between, MSE loss: 67 M
//!   parameters, compute-bound on a GPU (the GPU benchmarks run it at batch 512).
//!
//! `--workload` takes a comma-separated list: each runs in turn in this process (one
//! `#[distributed]` call each) and prints its own result. `--precision` takes one
//! value: a process runs one job with the first function's settings, so `fp32` and
//! `bf16` (two attributes) run in two processes (`gpu_suite.py` does so).
//! `--device cuda` puts the model and the batches on the rank's GPU (the SDK picks it:
//! ranks share a single visible GPU); `--device cpu` (the default) hides the GPUs.
//! `--precision bf16` runs the same function under `mixed_precision = "bf16"` (the
//! forward pass and the loss under bf16 autocast).
//!
//! Each step is timed in three phases: forward (with `zero_grad` and the loss),
//! backward (which under DDP ends by waiting for the last bucket's all-reduce), and the
//! optimizer step. On CUDA the clock is read after `tch::Cuda::synchronize`: at the end
//! of every step, and with `--sync-phases` also between phases (which then are device
//! times; without it they are the host's launch times, and steps run unsynchronized
//! within themselves, as in training). Synchronized steps alternate with steps whose
//! backward runs under DDP's `no_sync` (no all-reduce), so that both kinds see the same
//! load on a shared machine: `--warmup` pairs, then `--steps` timed pairs. Every figure
//! is a median over steps, which bursts of other load disturb least: samples/s is world
//! size × batch / the slowest rank's median synchronized step; the all-reduce time left
//! exposed after backward is the median synchronized backward minus the median backward
//! under `no_sync` (each averaged over ranks). On CUDA each combination starts from an
//! emptied caching allocator with its peaks reset, and reports the allocator's peak
//! allocated and reserved bytes (`torch.cuda.max_memory_allocated()` and
//! `max_memory_reserved()` on the Python side), read through `csrc/cuda_memory.cpp`.
//! Rank 0 prints `BENCH {json}` with these figures (the same fields as the Python side).

use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use clap::{Parser, ValueEnum};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Reduction, Tensor};

mod memory;
use memory::{device_memory, load_libtorch_cuda, reset_device_memory};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Workload {
    Mlp,
    Cnn,
    Transformer,
    Linear200,
    Linear4096,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum DeviceArg {
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Precision {
    /// float32 throughout.
    Fp32,
    /// The attribute's `mixed_precision = "bf16"`: bf16 autocast.
    Bf16,
}

#[derive(Parser, Debug)]
#[command(about = "DDP training-step benchmark (Rust side; see bench/python/ddp_bench.py)")]
struct Args {
    /// Comma-separated workloads, run in turn.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        required_unless_present = "check"
    )]
    workload: Vec<Workload>,
    /// Where the model and the batches live: `cuda` is the rank's GPU; `cpu` hides the
    /// GPUs from this process.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    device: DeviceArg,
    /// The precision (one: a process runs one job with one set of settings).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "fp32")]
    precision: Vec<Precision>,
    /// On CUDA, also synchronize between the phases of a step (forward, backward and
    /// optimizer become device times; steps get slower).
    #[arg(long)]
    sync_phases: bool,
    /// Print `CHECK {json}` (CUDA devices visible, NCCL compiled in) and exit.
    #[arg(long)]
    check: bool,
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

/// `depth` `Linear(width, width)` in sequence, ReLU between.
#[derive(Debug)]
struct Deep {
    layers: Vec<nn::Linear>,
}

impl Deep {
    fn new(p: &nn::Path, depth: usize, width: i64) -> Self {
        Deep {
            layers: (0..depth)
                .map(|i| nn::linear(p / i, width, width, Default::default()))
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
    /// The model's parameters live in `p`'s VarStore; the batches are moved to
    /// `device`.
    fn new(
        p: &nn::Path,
        args: &Args,
        workload: Workload,
        rank: usize,
        device: Device,
    ) -> Result<Self> {
        // Each rank its own data; the model's initial weights come from rank 0 anyway.
        tch::manual_seed(1000 + rank as i64);
        let b = args.batch;
        let f = (Kind::Float, Device::Cpu);
        let pool = 0..args.pool;
        let labels = |classes| Tensor::randint(classes, [b], (Kind::Int64, Device::Cpu));
        let (model, batches, mse): (Box<dyn Module>, Vec<(Tensor, Tensor)>, _) = match workload {
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
            Workload::Linear200 | Workload::Linear4096 => {
                let (depth, width) = match workload {
                    Workload::Linear200 => (200, 64),
                    _ => (4, 4096),
                };
                let batches = pool
                    .map(|_| (Tensor::randn([b, width], f), Tensor::randn([b, width], f)))
                    .collect();
                tch::manual_seed(42);
                (Box::new(Deep::new(p, depth, width)), batches, true)
            }
        };
        let batches = batches
            .into_iter()
            .map(|(x, y)| (x.to_device(device), y.to_device(device)))
            .collect();
        Ok(Workbench {
            model,
            batches,
            mse,
        })
    }

    /// The loss of the model's output `out` against the targets `ys`.
    fn loss(&self, out: &Tensor, ys: &Tensor) -> Tensor {
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

// ---------------------------------------------------------------- timing

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

/// Reads the clock for the phases of a step: on CUDA after synchronizing the device
/// (at a step's end always, between phases with `--sync-phases`); on the CPU at once.
struct Clock {
    cuda: Option<i64>,
    sync_phases: bool,
}

impl Clock {
    fn new(device: Device, sync_phases: bool) -> Self {
        let cuda = match device {
            Device::Cuda(i) => Some(i as i64),
            _ => None,
        };
        Clock { cuda, sync_phases }
    }

    /// Waits for the work queued on the device.
    fn sync(&self) {
        if let Some(i) = self.cuda {
            tch::Cuda::synchronize(i);
        }
    }

    /// Between two phases of a step.
    fn phase(&self) -> Instant {
        if self.sync_phases {
            self.sync();
        }
        Instant::now()
    }

    /// At the end of a step.
    fn end(&self) -> Instant {
        self.sync();
        Instant::now()
    }
}

// ---------------------------------------------------------------- the training function

/// The training function, once per precision: `#[distributed]`'s `mixed_precision` is
/// an attribute argument, so the bf16 variant is the same body under another attribute.
macro_rules! training_function {
    ($name:ident, $precision:expr, $($attribute:tt)*) => {
        #[tch_distributed::distributed($($attribute)*)]
        fn $name(args: &Args, workload: Workload) -> Result<()> {
            let ctx = tch_distributed::current().context("no process group")?;
            let (rank, world) = (ctx.rank(), ctx.world_size());
            let device = Device::cuda_if_available();
            if args.device == DeviceArg::Cuda && !device.is_cuda() {
                bail!("--device cuda, but this rank's device is {device:?}: no CUDA device is visible");
            }
            reset_device_memory(device);
            let baseline = device_memory(device)[0];
            let vs = nn::VarStore::new(device);
            let bench = Workbench::new(&vs.root(), args, workload, rank, device)?;
            let params: i64 = vs
                .trainable_variables()
                .iter()
                .map(|t| t.numel() as i64)
                .sum();
            let mut opt = nn::Sgd::default().build(&vs, args.lr)?;
            let clock = Clock::new(device, args.sync_phases);

            // Warm-up, then the timed steps; both alternate a synchronized step with one
            // under no_sync, so that the two kinds see the same load on a shared machine.
            let mut timed = [Phases::default(), Phases::default()]; // [synchronized, no_sync]
            let mut last_loss = f64::NAN;
            for (run, steps) in [args.warmup, args.steps].into_iter().enumerate() {
                ctx.barrier()?;
                clock.sync();
                for i in 0..2 * steps {
                    let local = i % 2 == 1;
                    let (xs, ys) = &bench.batches[(i / 2) % bench.batches.len()];
                    let (cpu0, faults0) = (cpu_seconds(), minor_faults());
                    let t0 = Instant::now();
                    opt.zero_grad();
                    // Under `mixed_precision`, the attribute puts this `let` (a forward
                    // pass) under autocast.
                    let loss = bench.loss(&bench.model.forward(xs), ys);
                    let t1 = clock.phase();
                    if local {
                        // PyTorch's `with ddp.no_sync(): loss.backward()`.
                        let ddp = opt.ddp().context("the optimizer has no DDP")?;
                        let _no_sync = ddp.no_sync();
                        ddp.backward(&loss)?;
                    } else {
                        loss.backward();
                    }
                    let t2 = clock.phase();
                    opt.step();
                    let t3 = clock.end();
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
            let memory = device_memory(device);
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
                median(&local.total),
                memory[1],
                memory[3],
                baseline,
            ]);
            let every = ctx.process_group().all_gather(&mine)?;
            let rows: Vec<Vec<f64>> = every
                .iter()
                .map(|t| Vec::<f64>::try_from(t).context("gathered timings"))
                .collect::<Result<_>>()?;
            let buckets = opt.ddp().map(|d| d.bucket_sizes()).transpose()?;
            let run = Run {
                workload,
                precision: $precision,
                device,
                backend: ctx.backend().to_string(),
            };
            let report = report(args, &run, world, params, &rows, buckets);
            println!("BENCH {report}");
            Ok(())
        }
    };
}

training_function!(train_fp32, "fp32",);
training_function!(train_bf16, "bf16", mixed_precision = "bf16");

/// What one `#[distributed]` call ran.
struct Run {
    workload: Workload,
    precision: &'static str,
    device: Device,
    backend: String,
}

/// The fields both sides print; `rows` are every rank's gathered figures: seconds of
/// the timed synchronized steps in all, median seconds of a step and of its forward, backward
/// and optimizer step, median backward under `no_sync`, peak RSS (KiB), CPU seconds
/// per step, last loss, CPU seconds per `no_sync` step, minor page faults per step and
/// per `no_sync` step, median `no_sync` step, the CUDA allocator's peak allocated and
/// peak reserved bytes, and its allocated bytes before the model was built.
fn report(
    args: &Args,
    run: &Run,
    world: usize,
    params: i64,
    rows: &[Vec<f64>],
    buckets: Option<Vec<usize>>,
) -> serde_json::Value {
    let max = |k: usize| rows.iter().map(|r| r[k]).fold(f64::NAN, f64::max);
    let mean = |k: usize| rows.iter().map(|r| r[k]).sum::<f64>() / rows.len() as f64;
    let mib = |k: usize| {
        let m = max(k) / (1024.0 * 1024.0);
        if m.is_finite() {
            serde_json::json!(m)
        } else {
            serde_json::Value::Null
        }
    };
    let samples = (world as f64) * (args.batch as f64);
    serde_json::json!({
        "side": "rust",
        "mode": "ddp",
        "workload": format!("{:?}", run.workload).to_lowercase(),
        "device": if run.device.is_cuda() { "cuda" } else { "cpu" },
        "precision": run.precision,
        "backend": run.backend,
        "world": world,
        "batch": args.batch,
        "warmup": args.warmup,
        "steps": args.steps,
        "params": params,
        "phases_synchronized": !run.device.is_cuda() || args.sync_phases,
        "sync_steps_s": max(0),
        "samples_per_s": samples / max(1),
        "samples_per_s_mean": samples * (args.steps as f64) / max(0),
        "step_ms": 1e3 * max(1),
        "step_nosync_ms": 1e3 * max(12),
        "forward_ms": 1e3 * mean(2),
        "backward_ms": 1e3 * mean(3),
        "optimizer_ms": 1e3 * mean(4),
        "backward_nosync_ms": 1e3 * mean(5),
        "exposed_allreduce_ms": 1e3 * (mean(3) - mean(5)),
        "rss_mb": rows.iter().map(|r| r[6] / 1024.0).collect::<Vec<_>>(),
        "peak_allocated_mb": mib(13),
        "peak_reserved_mb": mib(14),
        "baseline_allocated_mb": mib(15),
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
    match args.device {
        // Before libtorch first asks CUDA for its devices: the SDK gives each rank a
        // GPU whenever it sees one.
        DeviceArg::Cpu => std::env::set_var("CUDA_VISIBLE_DEVICES", ""),
        // libtorch's CUDA support, loaded before libtorch first asks about CUDA.
        DeviceArg::Cuda => load_libtorch_cuda(),
    }
    tch::set_num_threads(1);
    if args.check {
        let check = serde_json::json!({
            "cuda_devices": tch::Cuda::device_count(),
            "nccl": tch_distributed::nccl_available(),
        });
        println!("CHECK {check}");
        return Ok(());
    }
    if args.precision.len() > 1 {
        bail!(
            "--precision takes one value: a process runs one job with the first \
             #[distributed] function's settings; run fp32 and bf16 in two processes"
        );
    }
    for &workload in &args.workload {
        for &precision in &args.precision {
            match precision {
                Precision::Fp32 => train_fp32(&args, workload)?,
                Precision::Bf16 => train_bf16(&args, workload)?,
            }
        }
    }
    Ok(())
}
