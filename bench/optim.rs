//! The optimizer step alone, one process: tch's `nn::Optimizer` (libtorch's C++
//! `torch::optim`, one set of kernels per parameter: what the SDK ran before it owned
//! its optimizer) against the SDK's `Optimizer` with each [`Implementation`] (`tch`:
//! the same arithmetic in `_foreach_*` kernels; `foreach`: `torch.optim`'s; `fused`:
//! ATen's fused kernels), on the benchmark suite's parameter shapes, with the gradients
//! fixed so that only the update is timed. With `--python`, the same steps in
//! `torch.optim` (`foreach=True`, `fused=True`) in that Python, for comparison.
//!
//! ```text
//! scripts/bench.sh optim                          # CPU, one thread, every workload
//! scripts/bench.sh optim --device cuda --python python3
//! ```
//!
//! Workloads: `mlp` (784-1024-1024-10: 6 tensors, 1.86 M parameters), `linear200`
//! (200 × Linear(64, 64): 400 tensors, 0.83 M), `big` (8 × Linear(2560, 2560): 16
//! tensors, 52 M, for memory). Optimizers: SGD with momentum 0.9, Adam. Each timing is
//! the median of `--steps` steps after `--warmup` (on CUDA, synchronized around each
//! step). Prints a table, and `BENCH {json}` per row.

use std::process::Command;
use std::time::Instant;

use clap::Parser;
use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tch_distributed::{Implementation, Optimizer, OptimizerKind};

#[derive(Parser)]
struct Args {
    /// Comma-separated workloads: mlp, linear200, big.
    #[arg(long, default_value = "mlp,linear200")]
    workload: String,
    /// cpu or cuda.
    #[arg(long, default_value = "cpu")]
    device: String,
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    #[arg(long, default_value_t = 100)]
    steps: usize,
    /// A Python with torch, to time torch.optim's foreach and fused steps too.
    #[arg(long)]
    python: Option<String>,
}

/// The parameter shapes of a workload.
fn shapes(workload: &str) -> Vec<Vec<i64>> {
    let linear = |i: i64, o: i64| vec![vec![o], vec![o, i]];
    match workload {
        "mlp" => [linear(784, 1024), linear(1024, 1024), linear(1024, 10)].concat(),
        "linear200" => (0..200).flat_map(|_| linear(64, 64)).collect(),
        "big" => (0..8).flat_map(|_| linear(2560, 2560)).collect(),
        other => panic!("unknown workload {other}: mlp, linear200 or big"),
    }
}

/// A store with the workload's parameters and gradients on `device`.
fn store(workload: &str, device: Device) -> nn::VarStore {
    let vs = nn::VarStore::new(device);
    for (i, shape) in shapes(workload).iter().enumerate() {
        let v = vs.root().randn(&format!("p{i}"), shape, 0.0, 0.02);
        let g = Tensor::randn(shape.as_slice(), (Kind::Float, device)) * 1e-3;
        // The gradient, fixed at `g`: every step updates from it.
        (&v * &g).sum(Kind::Float).backward();
    }
    vs
}

fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

/// The median milliseconds of `step`.
fn time(device: Device, warmup: usize, steps: usize, mut step: impl FnMut()) -> f64 {
    for _ in 0..warmup {
        step();
    }
    sync(device);
    let mut ms: Vec<f64> = (0..steps)
        .map(|_| {
            let t = Instant::now();
            step();
            sync(device);
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    ms[ms.len() / 2]
}

const PYTHON: &str = r#"
import json, sys, time, torch
torch.set_num_threads(1)
shapes, device, warmup, steps, name, kw = json.loads(sys.argv[1])
params = [torch.nn.Parameter(torch.randn(s, device=device) * 0.02) for s in shapes]
for p in params: p.grad = torch.randn(p.shape, device=device) * 1e-3
opt = getattr(torch.optim, name)(params, **kw)
def sync():
    if device.startswith("cuda"): torch.cuda.synchronize()
for _ in range(warmup): opt.step()
sync(); ms = []
for _ in range(steps):
    t = time.perf_counter(); opt.step(); sync(); ms.append((time.perf_counter() - t) * 1e3)
ms.sort(); print(ms[len(ms) // 2])
"#;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tch::set_num_threads(1);
    let device = match args.device.as_str() {
        "cuda" => Device::Cuda(0),
        _ => Device::Cpu,
    };
    let sgd = nn::Sgd {
        momentum: 0.9,
        ..Default::default()
    };
    let adam = nn::Adam::default();
    println!(
        "| workload | optimizer | tch (C++, per parameter) ms | SDK tch ms | SDK foreach ms | SDK fused ms | default's speed-up | torch foreach ms | torch fused ms | state bytes |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for workload in args.workload.split(',') {
        let n: i64 = shapes(workload)
            .iter()
            .map(|s| s.iter().product::<i64>())
            .sum();
        for (name, config, lr, py_kw) in [
            (
                "SGD",
                &sgd as &dyn Both,
                0.01,
                serde_json::json!({"lr": 0.01, "momentum": 0.9}),
            ),
            (
                "Adam",
                &adam as &dyn Both,
                1e-3,
                serde_json::json!({"lr": 1e-3}),
            ),
        ] {
            let tch_ms = {
                let vs = store(workload, device);
                let mut opt = config.build_tch(&vs, lr);
                time(device, args.warmup, args.steps, || opt.step())
            };
            let mut ours = Vec::new();
            let mut state_bytes = 0;
            for implementation in [
                Implementation::Tch,
                Implementation::Foreach,
                Implementation::Fused,
            ] {
                let vs = store(workload, device);
                let mut opt =
                    Optimizer::new(&config.kind(), &vs, lr)?.with_implementation(implementation)?;
                ours.push(time(device, args.warmup, args.steps, || {
                    opt.step().unwrap();
                }));
                state_bytes = opt.state_bytes();
            }
            // The default: fused for SGD and Adam.
            let default = match config.kind().preferred_implementation() {
                Implementation::Tch => ours[0],
                Implementation::Foreach => ours[1],
                Implementation::Fused => ours[2],
            };
            let torch = |extra: &str| -> Option<f64> {
                let python = args.python.as_ref()?;
                let mut kw = py_kw.clone();
                kw[extra] = serde_json::json!(true);
                let spec = serde_json::json!([
                    shapes(workload),
                    args.device_name(),
                    args.warmup,
                    args.steps,
                    name,
                    kw
                ]);
                let out = Command::new(python)
                    .arg("-c")
                    .arg(PYTHON)
                    .arg(spec.to_string())
                    .output()
                    .ok()?;
                String::from_utf8(out.stdout).ok()?.trim().parse().ok()
            };
            let (tf, tfu) = (torch("foreach"), torch("fused"));
            let show = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.3}"));
            println!(
                "| {workload} ({:.2} M) | {name} | {tch_ms:.3} | {:.3} | {:.3} | {:.3} | {:.2}× | {} | {} | {state_bytes} |",
                n as f64 / 1e6,
                ours[0],
                ours[1],
                ours[2],
                tch_ms / default,
                show(tf),
                show(tfu),
            );
            println!(
                "BENCH {}",
                serde_json::json!({
                    "workload": workload, "optimizer": name, "device": args.device_name(),
                    "tch_ms": tch_ms, "sdk_tch_ms": ours[0], "sdk_foreach_ms": ours[1],
                    "sdk_fused_ms": ours[2], "torch_foreach_ms": tf, "torch_fused_ms": tfu,
                    "parameters": n, "state_bytes": state_bytes,
                })
            );
        }
    }
    Ok(())
}

impl Args {
    fn device_name(&self) -> &str {
        if self.device == "cuda" {
            "cuda:0"
        } else {
            "cpu"
        }
    }
}

/// A tch configuration, built both ways.
trait Both {
    fn build_tch(&self, vs: &nn::VarStore, lr: f64) -> nn::Optimizer;
    fn kind(&self) -> tch_distributed::Algorithm;
}

impl<C: OptimizerConfig + OptimizerKind + Copy> Both for C {
    fn build_tch(&self, vs: &nn::VarStore, lr: f64) -> nn::Optimizer {
        (*self).build(vs, lr).unwrap()
    }
    fn kind(&self) -> tch_distributed::Algorithm {
        self.algorithm()
    }
}
