//! The benchmark suite: every DDP workload on 1 and 2 ranks, Rust (`ddp`, under
//! `tchrun`) against PyTorch (`bench/python/ddp_bench.py`, under
//! `python -m torch.distributed.run`), then the raw all-reduce sweep on 2 ranks; prints
//! the comparison as Markdown tables.
//!
//! ```text
//! scripts/bench.sh                       # builds everything, then runs this
//! target/release/suite --only mlp,allreduce --rounds 2
//! ```
//!
//! Each (workload, ranks) pair runs Rust then PyTorch, `--rounds` times (the order
//! alternates between rounds), and the sweep `--sweep-rounds` times; the tables keep
//! each side's fastest run, the least disturbed by other load on the machine. Progress goes to stderr, the tables
//! to stdout, every run's raw figures to `--json`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use clap::Parser;
use serde_json::Value;

#[derive(Parser)]
#[command(about = "Runs every benchmark, Rust against PyTorch DDP, and prints the tables")]
struct Args {
    /// Comma-separated subset of mlp, cnn, transformer, linear200, allreduce.
    #[arg(long, default_value = "mlp,cnn,transformer,linear200,allreduce")]
    only: String,
    /// Rank counts of the DDP workloads.
    #[arg(long, default_value = "1,2")]
    ranks: String,
    /// Runs of each configuration and side (alternating which side goes first); each
    /// side's fastest is kept.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Runs of the all-reduce sweep per side; each size keeps each side's fastest.
    #[arg(long, default_value_t = 2)]
    sweep_rounds: usize,
    /// Multiplies every workload's timed step counts (0.2 for a quick look).
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// The Python with torch 2.11.0 (default: `$BENCH_PYTHON`, else the repository's
    /// `.venv/bin/python`).
    #[arg(long)]
    python: Option<PathBuf>,
    /// tinyshakespeare, for the transformer.
    #[arg(long, default_value = "data/tinyshakespeare.txt")]
    data: PathBuf,
    /// Where every run's raw figures are written (JSON).
    #[arg(long)]
    json: Option<PathBuf>,
}

/// A DDP workload and its step counts (per rank: batch, warm-up pairs, timed pairs of a
/// synchronized step and a no_sync step).
struct Workload {
    name: &'static str,
    what: &'static str,
    batch: usize,
    warmup: usize,
    steps: usize,
}

const WORKLOADS: &[Workload] = &[
    Workload {
        name: "mlp",
        what: "MLP 784-1024-1024-10, batch 64",
        batch: 64,
        warmup: 10,
        steps: 100,
    },
    Workload {
        name: "cnn",
        what: "MNIST CNN (2 conv + 2 fc), batch 64",
        batch: 64,
        warmup: 3,
        steps: 20,
    },
    Workload {
        name: "transformer",
        what: "char transformer 3.2 M params, 16 × 64 tokens",
        batch: 16,
        warmup: 2,
        steps: 6,
    },
    Workload {
        name: "linear200",
        what: "200 × Linear(64, 64), batch 64",
        batch: 64,
        warmup: 10,
        steps: 100,
    },
];

const SIDES: [&str; 2] = ["rust", "pytorch"];

struct Tools {
    root: PathBuf,
    bin: PathBuf,
    python: PathBuf,
}

impl Tools {
    /// The command of one side's run on `ranks` ranks of `program` (a binary next to
    /// this one, or a script under bench/python).
    fn command(&self, side: &str, ranks: usize, program: &str, args: &[String]) -> Command {
        // PyTorch's launcher; torch warns at import that numpy is missing, and the
        // benchmarks need none.
        let torchrun = || {
            let mut c = Command::new(&self.python);
            c.args([
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
            ])
            .arg(ranks.to_string())
            .env("PYTHONWARNINGS", "ignore::UserWarning");
            c
        };
        let mut cmd = match side {
            // The Rust binary under PyTorch's launcher, to tell the launcher's share.
            "rust-torchrun" => {
                let mut c = torchrun();
                c.arg("--no-python").arg(self.bin.join(program));
                c
            }
            "rust" => {
                let mut c = Command::new(self.bin.join("tchrun"));
                c.arg("--nproc-per-node")
                    .arg(ranks.to_string())
                    .arg(self.bin.join(program));
                c
            }
            _ => {
                let mut c = torchrun();
                c.arg(
                    self.root
                        .join("bench/python")
                        .join(format!("{program}_bench.py")),
                );
                c
            }
        };
        cmd.args(args)
            .current_dir(&self.root)
            .env("OMP_NUM_THREADS", "1")
            .env("MKL_NUM_THREADS", "1")
            .env("TCH_DISTRIBUTED_BACKEND", "gloo");
        cmd
    }

    /// Runs the command and returns its `BENCH {json}` lines.
    fn run(&self, mut cmd: Command) -> Result<Vec<Value>> {
        let shown = format!("{cmd:?}");
        let out = cmd
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .with_context(|| format!("starting {shown}"))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            bail!("{shown} failed ({}):\n{stdout}", out.status);
        }
        stdout
            .lines()
            .filter_map(|l| l.strip_prefix("BENCH "))
            .map(|j| serde_json::from_str(j).with_context(|| format!("parsing {j}")))
            .collect()
    }
}

fn f(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or(f64::NAN)
}

/// 12,345 with thousands separators.
fn thousands(x: f64) -> String {
    let s = format!("{:.0}", x);
    let (sign, digits) = s.strip_prefix('-').map_or(("", s.as_str()), |d| ("-", d));
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    format!("{sign}{out}")
}

fn size(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b => format!("{} KiB", b >> 10),
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let bin = std::env::current_exe()?
        .parent()
        .context("this program's directory")?
        .to_path_buf();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("the repository")?
        .to_path_buf();
    let python = args
        .python
        .clone()
        .or_else(|| std::env::var_os("BENCH_PYTHON").map(PathBuf::from))
        .unwrap_or_else(|| root.join(".venv/bin/python"));
    let tools = Tools { root, bin, python };
    for needed in ["tchrun", "ddp", "allreduce"] {
        if !tools.bin.join(needed).exists() {
            bail!(
                "{} is missing: build with scripts/bench.sh (cargo build --release -p tch-distributed --bin tchrun; cargo build --release -p tch-distributed-bench)",
                tools.bin.join(needed).display()
            );
        }
    }
    let only: Vec<&str> = args.only.split(',').map(str::trim).collect();
    let ranks: Vec<usize> = args
        .ranks
        .split(',')
        .map(|r| r.trim().parse().context("--ranks: a list of numbers"))
        .collect::<Result<_>>()?;
    let data = std::path::absolute(&args.data)?;
    let started = Instant::now();

    // (workload, ranks, side) → the fastest run.
    let mut best: BTreeMap<(String, usize, String), Value> = BTreeMap::new();
    let mut raw = Vec::new();
    for w in WORKLOADS.iter().filter(|w| only.contains(&w.name)) {
        let scaled = |n: usize| ((n as f64 * args.scale).round() as usize).max(2);
        let flags: Vec<String> = [
            ("--workload", w.name.to_string()),
            ("--batch", w.batch.to_string()),
            ("--warmup", w.warmup.to_string()),
            ("--steps", scaled(w.steps).to_string()),
            ("--lr", "0.01".to_string()),
            ("--data", data.display().to_string()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_string(), v])
        .collect();
        for &n in &ranks {
            for round in 0..args.rounds {
                let order = if round % 2 == 0 {
                    SIDES
                } else {
                    [SIDES[1], SIDES[0]]
                };
                for side in order {
                    let t = Instant::now();
                    let run = tools
                        .run(tools.command(side, n, "ddp", &flags))?
                        .pop()
                        .with_context(|| format!("{side} {} printed no result", w.name))?;
                    eprintln!(
                        "[{:5.0} s] {:11} {n} rank{} {:7}: {:>9} samples/s | step {:.2} ms = forward {:.2} + backward {:.2} (no_sync {:.2}) + optimizer {:.2} | CPU {:.2} ms/step ({:.2} no_sync) | page faults {:.0}/step ({:.0} no_sync) | RSS {:.0} MiB | {:.0} s",
                        started.elapsed().as_secs_f64(),
                        w.name,
                        if n == 1 { " " } else { "s" },
                        side,
                        thousands(f(&run, "samples_per_s")),
                        f(&run, "step_ms"),
                        f(&run, "forward_ms"),
                        f(&run, "backward_ms"),
                        f(&run, "backward_nosync_ms"),
                        f(&run, "optimizer_ms"),
                        f(&run, "cpu_ms_per_step"),
                        f(&run, "cpu_ms_per_nosync_step"),
                        f(&run, "minor_faults_per_step"),
                        f(&run, "minor_faults_per_nosync_step"),
                        run["rss_mb"].as_array().map_or(f64::NAN, |r| r[0].as_f64().unwrap_or(f64::NAN)),
                        t.elapsed().as_secs_f64(),
                    );
                    let key = (w.name.to_string(), n, side.to_string());
                    let faster = |b: &Value| f(&run, "samples_per_s") > f(b, "samples_per_s");
                    if best.get(&key).map(faster) != Some(false) {
                        best.insert(key, run.clone());
                    }
                    raw.push(run);
                }
            }
        }
    }

    // All-reduce sweep on 2 ranks: each side's best time per size.
    let mut sweep: BTreeMap<(u64, String), Value> = BTreeMap::new();
    if only.contains(&"allreduce") {
        for round in 0..args.sweep_rounds {
            let order = if round % 2 == 0 {
                ["rust", "pytorch", "rust-torchrun"]
            } else {
                ["pytorch", "rust", "rust-torchrun"]
            };
            for side in order {
                let t = Instant::now();
                let lines = tools.run(tools.command(side, 2, "allreduce", &[]))?;
                eprintln!(
                    "[{:5.0} s] all-reduce sweep, 2 ranks, {side}: {} sizes ({:.0} s)",
                    started.elapsed().as_secs_f64(),
                    lines.len(),
                    t.elapsed().as_secs_f64()
                );
                for l in lines {
                    let key = (l["bytes"].as_u64().unwrap_or(0), side.to_string());
                    let faster = |b: &Value| f(&l, "seconds") < f(b, "seconds");
                    if sweep.get(&key).map(faster) != Some(false) {
                        sweep.insert(key, l.clone());
                    }
                    raw.push(l);
                }
            }
        }
    }

    print_tables(&best, &sweep, &ranks);
    eprintln!("suite finished in {:.0} s", started.elapsed().as_secs_f64());
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&raw)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn print_tables(
    best: &BTreeMap<(String, usize, String), Value>,
    sweep: &BTreeMap<(u64, String), Value>,
    ranks: &[usize],
) {
    let get = |w: &str, n: usize, side: &str| best.get(&(w.to_string(), n, side.to_string()));
    let workloads: Vec<&Workload> = WORKLOADS
        .iter()
        .filter(|w| ranks.iter().any(|&n| get(w.name, n, "rust").is_some()))
        .collect();
    if !workloads.is_empty() {
        println!("\n### Throughput (samples/s of all ranks: world size × batch / median step)\n");
        println!("| workload | ranks | Rust | PyTorch | Rust / PyTorch |");
        println!("|---|---|---|---|---|");
        for w in &workloads {
            for &n in ranks {
                if let (Some(r), Some(p)) = (get(w.name, n, "rust"), get(w.name, n, "pytorch")) {
                    let (r, p) = (f(r, "samples_per_s"), f(p, "samples_per_s"));
                    println!(
                        "| {} | {n} | {} | {} | {:.2}× |",
                        w.what,
                        thousands(r),
                        thousands(p),
                        r / p
                    );
                }
            }
        }
    }
    if !workloads.is_empty() {
        println!("\n### Median step (ms) = forward + backward + optimizer; CPU time per step (ms, all threads)\n");
        println!("| workload | ranks | Rust step | PyTorch step | Rust fwd / bwd / opt | PyTorch fwd / bwd / opt | Rust CPU | PyTorch CPU | page faults per step Rust / PyTorch |");
        println!("|---|---|---|---|---|---|---|---|---|");
        for w in &workloads {
            for &n in ranks {
                if let (Some(r), Some(p)) = (get(w.name, n, "rust"), get(w.name, n, "pytorch")) {
                    let phases = |v: &Value| {
                        format!(
                            "{:.2} / {:.2} / {:.2}",
                            f(v, "forward_ms"),
                            f(v, "backward_ms"),
                            f(v, "optimizer_ms")
                        )
                    };
                    println!(
                        "| {} | {n} | {:.2} | {:.2} | {} | {} | {:.2} | {:.2} | {:.0} / {:.0} |",
                        w.name,
                        f(r, "step_ms"),
                        f(p, "step_ms"),
                        phases(r),
                        phases(p),
                        f(r, "cpu_ms_per_step"),
                        f(p, "cpu_ms_per_step"),
                        f(r, "minor_faults_per_step"),
                        f(p, "minor_faults_per_step"),
                    );
                }
            }
        }
    }
    let two = |w: &Workload| (get(w.name, 2, "rust"), get(w.name, 2, "pytorch"));
    if workloads
        .iter()
        .any(|w| matches!(two(w), (Some(_), Some(_))))
    {
        println!("\n### 2 ranks: scaling, exposed all-reduce, memory\n");
        println!(
            "| workload | scaling Rust | scaling PyTorch | backward Rust (ms) | backward PyTorch (ms) | exposed all-reduce Rust (ms) | exposed all-reduce PyTorch (ms) | peak RSS per rank Rust (MiB) | PyTorch (MiB) |"
        );
        println!("|---|---|---|---|---|---|---|---|---|");
        for w in &workloads {
            let (Some(r2), Some(p2)) = two(w) else {
                continue;
            };
            let scaling = |side: &str, two: &Value| {
                get(w.name, 1, side).map_or("–".to_string(), |one| {
                    format!(
                        "{:.0}%",
                        100.0 * f(two, "samples_per_s") / (2.0 * f(one, "samples_per_s"))
                    )
                })
            };
            let rss = |v: &Value| {
                v["rss_mb"].as_array().map_or("–".into(), |a| {
                    a.iter()
                        .map(|x| format!("{:.0}", x.as_f64().unwrap_or(f64::NAN)))
                        .collect::<Vec<_>>()
                        .join(" / ")
                })
            };
            println!(
                "| {} | {} | {} | {:.2} ({:.2} no_sync) | {:.2} ({:.2} no_sync) | {:.2} | {:.2} | {} | {} |",
                w.name,
                scaling("rust", r2),
                scaling("pytorch", p2),
                f(r2, "backward_ms"),
                f(r2, "backward_nosync_ms"),
                f(p2, "backward_ms"),
                f(p2, "backward_nosync_ms"),
                f(r2, "exposed_allreduce_ms"),
                f(p2, "exposed_allreduce_ms"),
                rss(r2),
                rss(p2),
            );
        }
    }
    if !sweep.is_empty() {
        println!("\n### All-reduce, 2 ranks, gloo, float32 sum (GB/s = 10^9 bytes/s)\n");
        println!("| size | Rust algbw | PyTorch algbw | Rust busbw | PyTorch busbw | Rust / PyTorch | Rust under torchrun algbw | Rust µs / PyTorch µs per all-reduce |");
        println!("|---|---|---|---|---|---|---|---|");
        let sizes: std::collections::BTreeSet<u64> = sweep.keys().map(|k| k.0).collect();
        for b in sizes {
            let (Some(r), Some(p)) = (
                sweep.get(&(b, "rust".to_string())),
                sweep.get(&(b, "pytorch".to_string())),
            ) else {
                continue;
            };
            let under_torchrun = sweep
                .get(&(b, "rust-torchrun".to_string()))
                .map_or("–".to_string(), |t| format!("{:.3}", f(t, "algbw") / 1e9));
            println!(
                "| {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.2}× | {} | {:.0} / {:.0} |",
                size(b),
                f(r, "algbw") / 1e9,
                f(p, "algbw") / 1e9,
                f(r, "busbw") / 1e9,
                f(p, "busbw") / 1e9,
                f(r, "algbw") / f(p, "algbw"),
                under_torchrun,
                1e6 * f(r, "seconds"),
                1e6 * f(p, "seconds"),
            );
        }
    }
}
