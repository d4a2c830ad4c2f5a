"""The GPU benchmark table: every workload on one CUDA device, fp32 and bf16, three sides.

    python3 bench/python/gpu_suite.py --bin target/release --data data/tinyshakespeare.txt
    ./run.sh [--only linear4096,linear200] [--scale 0.5]   # in a `scripts/bench_gpu.sh --package` DIR

Sides, for each workload (bench/ddp.rs and bench/python/ddp_bench.py; same models,
data, initialisation, SGD, buckets):
- `rust`: the `ddp` binary, plain tch code under `#[distributed]` (`mixed_precision =
  "bf16"` for bf16), under `tchrun`;
- `pytorch`: PyTorch's `DistributedDataParallel` under `python -m torch.distributed.run`
  (torch.autocast for bf16);
- `plain`: PyTorch without DDP and without a process group, one process: what a
  one-GPU user runs.
On 1 rank the Rust side and DDP use NCCL; on 2 ranks, which share the GPU (NCCL refuses
two ranks on one device), both use Gloo on the CUDA tensors. Every step ends with a
device synchronisation before the clock is read; figures are medians over the timed
steps. Each process runs fp32 then bf16, each from an emptied caching allocator with its
peak statistics reset.

Progress goes to stderr, the Markdown tables to stdout (and `table.md` in `--out`),
every run's raw figures to `results.json` there, each run's output to a log there.
Without a CUDA device it exits with status 2 (`--allow-cpu` runs the same pipeline on
the CPU with Gloo: a smoke test, not a benchmark). Uses nothing outside the standard
library; the benchmarked processes import torch.
"""

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import threading
import time

# name, description, batch, warm-up pairs and timed pairs (a pair is one synchronized
# step and one under no_sync) on 1 rank and on 2 ranks (Gloo through host memory).
WORKLOADS = [
    ("mlp", "MLP 784-1024-1024-10, batch 64", 64, 20, 400, 200),
    ("cnn", "MNIST CNN (2 conv + 2 fc), batch 64", 64, 20, 300, 150),
    ("transformer", "char transformer 3.2 M params, 16 × 64 tokens", 16, 10, 150, 100),
    ("linear200", "200 × Linear(64, 64), batch 64", 64, 10, 100, 60),
    ("linear4096", "4 × Linear(4096, 4096), batch 512", 512, 5, 60, 20),
]
NAMES = [w[0] for w in WORKLOADS]
# The workloads that the targets name run first, in case the time budget ends
# the run early.
RUN_ORDER = ["linear4096", "linear200", "mlp", "cnn", "transformer"]
SIDES = {"rust": "Rust", "pytorch": "DDP", "plain": "plain"}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", required=True, help="directory holding ddp and tchrun")
    p.add_argument("--scripts", default=os.path.dirname(os.path.abspath(__file__)),
                   help="directory holding ddp_bench.py (default: this script's)")
    p.add_argument("--data", default="data/tinyshakespeare.txt",
                   help="tinyshakespeare, for the transformer")
    p.add_argument("--only", default=",".join(NAMES),
                   help=f"comma-separated subset of {','.join(NAMES)}")
    p.add_argument("--ranks", default="1,2", help="rank counts: 1 (NCCL), 2 (Gloo)")
    p.add_argument("--precision", default="fp32,bf16")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiplies the timed steps, and below 1 the warm-up steps "
                        "(0.2 for a quick look)")
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of each configuration and side; the fastest is kept")
    p.add_argument("--budget-s", type=float, default=510,
                   help="no run starts after this many seconds (default 8.5 minutes)")
    p.add_argument("--deadline-s", type=float, default=575,
                   help="a run still going at this many seconds is stopped")
    p.add_argument("--run-timeout-s", type=float, default=240,
                   help="a single run (one side, one workload, every precision) still going "
                        "after this many seconds is stopped")
    p.add_argument("--out", default="gpu-bench-out",
                   help="directory for logs, results.json and table.md")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--sync-phases", action="store_true",
                   help="also synchronize between forward, backward and optimizer step, and "
                        "print their medians (a diagnosis: steps get slower)")
    p.add_argument("--no-smi", action="store_true",
                   help="do not sample nvidia-smi for per-process GPU memory")
    p.add_argument("--allow-cpu", action="store_true",
                   help="without a GPU, run the pipeline on the CPU (a smoke test)")
    p.add_argument("--version-file", help="a file naming the build (printed in the table)")
    args = p.parse_args()
    started = time.monotonic()

    only = [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = [w for w in only if w not in NAMES]
    if unknown:
        sys.exit(f"--only: unknown workload(s) {unknown}; choose from {NAMES}")
    ranks = [int(r) for r in args.ranks.split(",")]
    precisions = [x.strip() for x in args.precision.split(",")]

    info = device_info(args.python)
    if not info.get("cuda"):
        why = info.get("error") or "torch.cuda.is_available() is False"
        if not args.allow_cpu:
            print(f"bench_gpu: needs a GPU: no CUDA device is visible to {args.python} ({why}). "
                  "Run this on a machine with an NVIDIA GPU, torch 2.11 with CUDA, and "
                  "LD_LIBRARY_PATH naming torch's lib directory (run.sh sets it).",
                  file=sys.stderr)
            sys.exit(2)
        print("bench_gpu: no GPU: --allow-cpu runs the pipeline on the CPU with Gloo "
              "(a smoke test; the figures are not GPU figures)", file=sys.stderr)
    device = "cuda" if info.get("cuda") else "cpu"

    bin_dir = os.path.abspath(args.bin)
    ddp, tchrun = os.path.join(bin_dir, "ddp"), os.path.join(bin_dir, "tchrun")
    for f in (ddp, tchrun):
        if not os.access(f, os.X_OK):
            sys.exit(f"{f} is missing (build with scripts/bench_gpu.sh)")
    check = preflight(ddp, device)
    if device == "cuda" and not check.get("nccl"):
        print("warning: the ddp binary was built without NCCL: its 1-rank runs will fail "
              "(build against a libtorch with CUDA and the CUDA headers: scripts/env.sh)",
              file=sys.stderr)
    data = os.path.abspath(args.data)
    if "transformer" in only and not os.path.exists(data):
        print(f"warning: {data} is missing: the transformer is left out", file=sys.stderr)
        only.remove("transformer")

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    version = ""
    if args.version_file and os.path.exists(args.version_file):
        with open(args.version_file) as f:
            version = f.read().strip()
    print(f"bench_gpu: {info.get('name', 'CPU')}; logs in {out}", file=sys.stderr)

    runner = Runner(args, started, out, device, ddp, tchrun, data)
    results = {}  # (workload, ranks, side, precision) -> fastest report
    notes = []
    raw = []
    by_name = {w[0]: w for w in WORKLOADS}
    for index, name in enumerate(n for n in RUN_ORDER if n in only):
        _, _, batch, warmup, steps1, steps2 = by_name[name]
        for n in ranks:
            sides = ["rust", "pytorch", "plain"] if n == 1 else ["rust", "pytorch"]
            for rnd in range(args.rounds):
                order = sides if (index + rnd) % 2 == 0 else sides[::-1]
                for side in order:
                    steps = max(2, round((steps1 if n == 1 else steps2) * args.scale))
                    warm = max(2, round(warmup * min(1.0, args.scale)))
                    flags = ["--workload", name, "--device", device, "--batch", str(batch),
                             "--warmup", str(warm), "--steps", str(steps), "--lr", "0.01",
                             "--data", data] + (["--sync-phases"] if args.sync_phases else [])
                    # A Rust process runs one job with one set of settings (the first
                    # #[distributed] function's): a process per precision. PyTorch's
                    # sides run every precision in one process.
                    runs = ([[p] for p in precisions] if side == "rust" else [precisions])
                    reports = []
                    for these in runs:
                        tag = f"{name}-{n}-{side}-{rnd}" + (f"-{these[0]}" if side == "rust" else "")
                        got, note = runner.run(side, n, flags + ["--precision", ",".join(these)], tag)
                        if note:
                            notes.append(f"{name}, {n} rank{'s' * (n > 1)}, {SIDES[side]}: {note}")
                        for r in got:
                            r["smi_peak_mb"] = runner.last_smi_peak
                        reports += got
                    for r in reports:
                        raw.append(r)
                        key = (name, n, side, r.get("precision"))
                        if key not in results or r["step_ms"] < results[key]["step_ms"]:
                            results[key] = r
                    with open(os.path.join(out, "results.json"), "w") as f:
                        json.dump(raw, f, indent=1)

    table = tables(info, version, device, results, only, ranks, precisions, notes,
                   time.monotonic() - started, args.sync_phases)
    print(table)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table + "\n")
    print(f"bench_gpu: finished in {time.monotonic() - started:.0f} s", file=sys.stderr)


def device_info(python):
    """The GPU, torch, CUDA, NCCL and driver versions, asked of a separate Python (so
    this process holds no CUDA context)."""
    code = ("import json, torch\n"
            "d = {'torch': torch.__version__, 'cuda_version': torch.version.cuda,"
            " 'cuda': torch.cuda.is_available()}\n"
            "if d['cuda']:\n"
            "    d['name'] = torch.cuda.get_device_name(0)\n"
            "    d['count'] = torch.cuda.device_count()\n"
            "    d['capability'] = '.'.join(map(str, torch.cuda.get_device_capability(0)))\n"
            "    try:\n"
            "        d['nccl'] = '.'.join(map(str, torch.cuda.nccl.version()))\n"
            "    except Exception:\n"
            "        pass\n"
            "print(json.dumps(d))\n")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONWARNINGS": "ignore"})
        info = json.loads(out.stdout.strip().splitlines()[-1])
    except Exception as e:  # no torch, a broken driver, …
        return {"cuda": False, "error": f"{type(e).__name__}: {e}"}
    if shutil.which("nvidia-smi"):
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
            first = smi.stdout.strip().splitlines()[0].split(", ")
            info["smi_name"], info["driver"], info["memory"] = first[0], first[1], first[2]
        except Exception:
            pass
    return info


def preflight(ddp, device):
    """`ddp --check`: it starts (libtorch found), sees the GPU, has NCCL."""
    try:
        out = subprocess.run([ddp, "--check", "--device", device], capture_output=True,
                             text=True, timeout=120)
    except Exception as e:
        sys.exit(f"{ddp} did not start: {e}")
    line = [l for l in out.stdout.splitlines() if l.startswith("CHECK ")]
    if out.returncode != 0 or not line:
        sys.exit(f"{ddp} --check failed (exit {out.returncode}):\n{out.stderr.strip()}\n"
                 "Is LD_LIBRARY_PATH naming torch's lib directory "
                 "(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib?")
    check = json.loads(line[0][len("CHECK "):])
    if device == "cuda" and check.get("cuda_devices", 0) < 1:
        sys.exit(f"{ddp} sees no CUDA device although torch does: is it linked against a "
                 "libtorch with CUDA (libtorch_cuda.so)? " + json.dumps(check))
    return check


class Runner:
    """Starts one side's process(es), with a time limit, and collects its BENCH lines."""

    def __init__(self, args, started, out, device, ddp, tchrun, data):
        self.args, self.started, self.out, self.device = args, started, out, device
        self.ddp, self.tchrun, self.data = ddp, tchrun, data
        self.last_smi_peak = None

    def elapsed(self):
        return time.monotonic() - self.started

    def command(self, side, n, flags):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "PYTHONWARNINGS": "ignore::UserWarning"}
        # Each precision is the attribute's own (bench/ddp.rs): no launcher setting may
        # override it, nor accumulate gradients; tchrun reads an empty run configuration
        # instead of any `tchrun config` file on this machine.
        for var in ("TCH_DISTRIBUTED_MIXED_PRECISION", "TCH_DISTRIBUTED_GRAD_ACCUM",
                    "TCH_DISTRIBUTED_GPUS", "TCH_DISTRIBUTED_NPROC"):
            env.pop(var, None)
        empty = os.path.join(self.out, "empty-config.toml")
        if not os.path.exists(empty):
            open(empty, "w").close()
        env["TCH_DISTRIBUTED_CONFIG"] = empty
        # NCCL on one rank with its own GPU; Gloo (through host memory) for ranks that
        # share the GPU, and on the CPU.
        backend = "nccl" if self.device == "cuda" and n == 1 else "gloo"
        torchrun = [self.args.python, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", str(n)]
        script = os.path.join(self.args.scripts, "ddp_bench.py")
        if side == "rust":
            env["TCH_DISTRIBUTED_BACKEND"] = backend
            return [self.tchrun, "--nproc-per-node", str(n), self.ddp, *flags], env
        if side == "pytorch":
            return [*torchrun, script, *flags, "--backend", backend], env
        return [self.args.python, script, "--mode", "plain", *flags], env

    def run(self, side, n, flags, tag):
        """(reports, note): the run's BENCH reports, and why there are none or some are
        missing."""
        self.last_smi_peak = None
        if self.elapsed() > self.args.budget_s:
            return [], "not run: time budget spent"
        cmd, env = self.command(side, n, flags)
        log_path = os.path.join(self.out, f"{tag}.log")
        timeout = max(5.0, min(self.args.run_timeout_s, self.args.deadline_s - self.elapsed()))
        sampler = SmiSampler(enabled=self.device == "cuda" and not self.args.no_smi)
        t = time.monotonic()
        note = None
        with open(log_path, "w") as log:
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log,
                                    stdin=subprocess.DEVNULL, text=True,
                                    start_new_session=True)
            sampler.start()
            try:
                stdout, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                stdout, _ = proc.communicate()
                note = f"stopped after {timeout:.0f} s (--run-timeout-s or --deadline-s)"
            finally:
                sampler.stop()
        with open(log_path) as f:
            logged = [l.strip() for l in f.read().splitlines()[1:] if l.strip()]
        # The cause, rather than the launcher's traceback that follows it.
        errors = [l for l in logged if "Error" in l or "error:" in l or "terminate" in l]
        stderr_tail = errors[:2] if errors else logged[-3:]
        with open(log_path, "a") as log:
            log.write("--- stdout\n" + stdout)
        self.last_smi_peak = sampler.peak()
        reports = []
        for line in stdout.splitlines():
            if line.startswith("BENCH "):
                reports.append(json.loads(line[len("BENCH "):]))
        for r in reports:
            r["side_key"] = side
            r["seconds"] = time.monotonic() - t
        expected = len(flags[flags.index("--precision") + 1].split(","))
        if proc.returncode != 0 and note is None:
            if len(reports) == expected:
                # Seen once with PyTorch on the CPU: std::terminate while the process
                # group was being destroyed, every figure already printed.
                note = (f"exited with status {proc.returncode} after printing all its "
                        f"results (see {log_path}); the results are kept")
            else:
                note = (f"failed (exit {proc.returncode}; {log_path}): "
                        + " | ".join(stderr_tail)[-300:])
        status = "ok" if note is None else note
        print(f"[{self.elapsed():5.0f} s] {tag:28} {time.monotonic() - t:5.1f} s  "
              + "  ".join(f"{r.get('precision')}: {r['step_ms']:.3f} ms"
                          + (f", {r['peak_allocated_mb']:.0f} MiB"
                             if r.get("peak_allocated_mb") is not None else "")
                          for r in reports)
              + ("" if note is None else f"  [{status}]"), file=sys.stderr)
        return reports, note


class SmiSampler:
    """The largest GPU memory that `nvidia-smi` shows for any one compute process
    while a run lasts (MiB; CUDA context, NCCL and library workspaces included)."""

    def __init__(self, enabled):
        self.enabled = enabled and shutil.which("nvidia-smi") is not None
        self.max = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def start(self):
        if self.enabled:
            self.thread.start()

    def stop(self):
        self.done.set()
        if self.enabled:
            self.thread.join(timeout=10)

    def peak(self):
        return self.max

    def loop(self):
        while not self.done.wait(0.5):
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-compute-apps=pid,used_memory",
                     "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, timeout=10).stdout
            except Exception:
                continue
            for line in out.splitlines():
                parts = [x.strip() for x in line.split(",")]
                if len(parts) == 2 and parts[1].isdigit():
                    self.max = max(self.max or 0, int(parts[1]))


def fmt(x, digits=2):
    return "–" if x is None else f"{x:,.{digits}f}"


def tables(info, version, device, results, only, ranks, precisions, notes, seconds,
           phases=False):
    get = lambda w, n, s, p: results.get((w, n, s, p))  # noqa: E731
    val = lambda r, k: None if r is None else r.get(k)  # noqa: E731
    name = info.get("smi_name") or info.get("name") or "CPU (smoke test, not GPU figures)"
    lines = [f"### GPU: {name}", ""]
    facts = [f"torch {info.get('torch', '?')}"]
    if info.get("cuda_version"):
        facts.append(f"CUDA {info['cuda_version']}")
    if info.get("nccl"):
        facts.append(f"NCCL {info['nccl']}")
    if info.get("driver"):
        facts.append(f"driver {info['driver']}")
    if info.get("memory"):
        facts.append(info["memory"])
    if version:
        facts.append(f"build {version}")
    facts.append(datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    facts.append(f"{seconds:.0f} s")
    lines += ["; ".join(facts) + ".", ""]
    lines += [
        "Median step (ms, device-synchronized) and samples/s of all ranks; Rust = "
        "`#[distributed]`, DDP = PyTorch `DistributedDataParallel`, plain = PyTorch "
        "without DDP (1 process). 1 rank: NCCL; 2 ranks share the GPU over Gloo. "
        "Step ratios below 1.00 mean Rust is faster; the target is Rust ÷ plain ≤ 1.00 "
        "on 1 rank, Rust ÷ DDP ≤ 1.00 on 2 ranks.",
        "",
        "| workload | ranks | precision | step ms: Rust / DDP / plain | samples/s: Rust / DDP / plain "
        "| Rust ÷ plain | Rust ÷ DDP | peak allocated MiB: Rust / DDP / plain | target |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    what = {w[0]: w[1] for w in WORKLOADS}
    for w in NAMES:
        if w not in only:
            continue
        for n in ranks:
            for prec in precisions:
                r, d, pl = (get(w, n, s, prec) for s in ("rust", "pytorch", "plain"))
                if r is None and d is None and pl is None:
                    continue
                step = [val(x, "step_ms") for x in (r, d, pl)]
                sps = [val(x, "samples_per_s") for x in (r, d, pl)]
                mem = [val(x, "peak_allocated_mb") for x in (r, d, pl)]
                ratio = lambda a, b: None if a is None or b is None else a / b  # noqa: E731
                vs_plain, vs_ddp = ratio(step[0], step[2]), ratio(step[0], step[1])
                goal = vs_plain if n == 1 else vs_ddp
                target = "–" if goal is None else ("✓" if round(goal, 2) <= 1.0 else "✗")
                backend = "NCCL" if device == "cuda" and n == 1 else "Gloo"
                lines.append(
                    f"| {what[w]} | {n} ({backend}) | {prec} "
                    f"| {' / '.join(fmt(x, 3) for x in step[: 3 if n == 1 else 2])} "
                    f"| {' / '.join(fmt(x, 0) for x in sps[: 3 if n == 1 else 2])} "
                    f"| {fmt(vs_plain)}{'×' if vs_plain is not None else ''} "
                    f"| {fmt(vs_ddp)}{'×' if vs_ddp is not None else ''} "
                    f"| {' / '.join(fmt(x, 0) for x in mem[: 3 if n == 1 else 2])} | {target} |")
    if 2 in ranks:
        lines += ["", "2 ranks on one GPU over Gloo: all-reduce time left exposed (median "
                  "synchronized step − median step under no_sync, ms) and scaling (samples/s "
                  "on 2 ranks ÷ twice 1 rank's).", "",
                  "| workload | precision | exposed all-reduce Rust / DDP | scaling Rust / DDP |",
                  "|---|---|---|---|"]
        for w in NAMES:
            for prec in precisions:
                r2, d2 = get(w, 2, "rust", prec), get(w, 2, "pytorch", prec)
                if r2 is None and d2 is None:
                    continue
                exposed = [None if x is None or x.get("step_nosync_ms") is None
                           else x["step_ms"] - x["step_nosync_ms"] for x in (r2, d2)]
                scaling = []
                for side, x in (("rust", r2), ("pytorch", d2)):
                    one = get(w, 1, side, prec)
                    scaling.append(None if x is None or one is None else
                                   100 * x["samples_per_s"] / (2 * one["samples_per_s"]))
                lines.append(f"| {what[w]} | {prec} | {' / '.join(fmt(x) for x in exposed)} "
                             f"| {' / '.join(fmt(x, 0) + ('%' if x is not None else '') for x in scaling)} |")
    if phases:
        lines += ["", "Phases (median ms, synchronized between phases: --sync-phases): "
                  "zero_grad + forward + loss / backward / optimizer step.", "",
                  "| workload | ranks | precision | Rust | DDP | plain |", "|---|---|---|---|---|---|"]
        for w in NAMES:
            for n in ranks:
                for prec in precisions:
                    row = [get(w, n, s, prec) for s in ("rust", "pytorch", "plain")]
                    if all(x is None for x in row):
                        continue
                    cells = ["–" if x is None else " / ".join(
                        fmt(x.get(k), 3) for k in ("forward_ms", "backward_ms", "optimizer_ms"))
                        for x in row]
                    lines.append(f"| {what[w]} | {n} | {prec} | " + " | ".join(cells) + " |")
    smi = {}
    for (w, n, side, _), r in results.items():
        if r.get("smi_peak_mb") is not None:
            smi[(w, n, side)] = r["smi_peak_mb"]
    if smi:
        lines += ["", "GPU memory of the largest process over its run (fp32 and bf16; "
                  "nvidia-smi, MiB: CUDA context, NCCL and cuBLAS workspaces included).", "",
                  "| workload | ranks | Rust | DDP | plain |", "|---|---|---|---|---|"]
        for w in NAMES:
            for n in ranks:
                row = [smi.get((w, n, s)) for s in ("rust", "pytorch", "plain")]
                if any(x is not None for x in row):
                    lines.append(f"| {what[w]} | {n} | "
                                 + " | ".join(fmt(x, 0) for x in row) + " |")
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
