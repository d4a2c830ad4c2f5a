"""PyTorch side of the DDP benchmarks: the same models, data and step as bench/ddp.rs.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \
        bench/python/ddp_bench.py --workload mlp
    python -m torch.distributed.run --standalone --nproc-per-node 1 bench/python/ddp_bench.py \
        --device cuda --backend nccl --precision fp32,bf16 --workload linear4096 --batch 512
    python bench/python/ddp_bench.py --mode plain --device cuda --workload mlp

One intra-op thread per rank, DistributedDataParallel with its default buckets (25 MiB,
the first 1 MiB, as the SDK's defaults) and SGD; the same phases, runs and medians as
bench/ddp.rs. `--backend` is gloo by default (CPU tensors, or CUDA tensors staged
through the host so that ranks can share a GPU); nccl needs a GPU per rank.
`--mode plain` is what a one-GPU user runs: the model itself, no process group, no DDP
(one process, without the launcher); its "no_sync" steps are ordinary steps.
`--precision bf16` runs the forward pass and the loss under
`torch.autocast(device_type, torch.bfloat16)`. `--workload` and `--precision` take
comma-separated lists, run in turn in this process. On CUDA the clock is read after
`torch.cuda.synchronize()`, and each combination starts from an emptied caching
allocator with its peak statistics reset (see bench/ddp.rs). Rank 0 prints one line
`BENCH {json}` per combination, with the same fields as the Rust side.
"""

import argparse
import contextlib
import gc
import json
import math
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Mlp(nn.Module):
    """784-1024-1024-10 with ReLU."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 1024)
        self.fc2 = nn.Linear(1024, 1024)
        self.fc3 = nn.Linear(1024, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class Cnn(nn.Module):
    """tch-rs's MNIST conv net (without dropout)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 5)
        self.conv2 = nn.Conv2d(32, 64, 5)
        self.fc1 = nn.Linear(1024, 1024)
        self.fc2 = nn.Linear(1024, 10)

    def forward(self, x):
        x = F.max_pool2d(self.conv1(x), 2)
        x = F.max_pool2d(self.conv2(x), 2)
        x = F.relu(self.fc1(x.view(-1, 1024)))
        return self.fc2(x)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4d GELU MLP."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharTransformer(nn.Module):
    """Token and position embeddings, `layers` blocks, final layer norm, linear head."""

    def __init__(self, vocab, d=256, layers=4, heads=4, context=64):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        t = x.shape[1]
        x = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class Deep(nn.Module):
    """`layers` Linear(width, width) in sequence with ReLU between."""

    def __init__(self, layers=200, width=64):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = F.relu(x)
        return x


def tch_init(model):
    """tch's default initialisation (nn::linear, nn::conv2d), so that both sides train
    the same model: Kaiming-uniform weights with the ReLU gain (bound sqrt(6 / fan_in)),
    linear biases uniform in ±1/sqrt(fan_in), convolution biases zero. Embeddings
    (normal) and layer norms (ones, zeros) are initialised alike by both libraries."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                nn.init.kaiming_uniform_(m.weight, nonlinearity="relu")
                if isinstance(m, nn.Linear):
                    bound = 1 / math.sqrt(m.in_features)
                    nn.init.uniform_(m.bias, -bound, bound)
                else:
                    nn.init.zeros_(m.bias)
    return model


def read_text(path):
    with open(path, "rb") as f:
        data = f.read()
    index = {}  # labels in order of first appearance, as tch's TextData
    labels = [index.setdefault(c, len(index)) for c in data]
    return torch.tensor(labels, dtype=torch.int64), len(index)


WORKLOADS = ["mlp", "cnn", "transformer", "linear200", "linear4096"]


def workload(args, name):
    """(model, list of (input, target) batches, loss function), on the CPU."""
    g = torch.Generator().manual_seed(1000 + args.rank)
    pool = range(args.pool)
    if name == "mlp":
        model = Mlp()
        batches = [(torch.randn(args.batch, 784, generator=g),
                    torch.randint(0, 10, (args.batch,), generator=g)) for _ in pool]
        loss = F.cross_entropy
    elif name == "cnn":
        model = Cnn()
        batches = [(torch.randn(args.batch, 1, 28, 28, generator=g),
                    torch.randint(0, 10, (args.batch,), generator=g)) for _ in pool]
        loss = F.cross_entropy
    elif name == "transformer":
        tokens, vocab = read_text(args.data)
        model = CharTransformer(vocab, context=args.context)
        batches = []
        for _ in pool:
            start = torch.randint(0, tokens.numel() - args.context - 1, (args.batch, 1), generator=g)
            window = tokens[start + torch.arange(args.context + 1)]
            batches.append((window[:, :-1], window[:, 1:]))

        def loss(logits, y):
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    elif name in ("linear200", "linear4096"):
        depth, width = (200, 64) if name == "linear200" else (4, 4096)
        model = Deep(depth, width)
        batches = [(torch.randn(args.batch, width, generator=g),
                    torch.randn(args.batch, width, generator=g)) for _ in pool]
        loss = F.mse_loss
    else:
        raise SystemExit(f"unknown workload {name}")
    return model, batches, loss


def comma_list(choices):
    def parse(value):
        items = [v.strip() for v in value.split(",") if v.strip()]
        bad = [v for v in items if v not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{value!r}: use a comma-separated list of {choices}")
        return items
    return parse


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workload", required=True, type=comma_list(WORKLOADS))
    p.add_argument("--mode", choices=["ddp", "plain"], default="ddp")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--precision", type=comma_list(["fp32", "bf16"]), default=["fp32"])
    p.add_argument("--sync-phases", action="store_true",
                   help="on CUDA, also synchronize between the phases of a step")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--pool", type=int, default=8)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--data", default="data/tinyshakespeare.txt")
    args = p.parse_args()

    torch.set_num_threads(1)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    if args.device == "cuda":
        # As the SDK: the rank's GPU is its local rank's, or the only one it sees (ranks
        # then share it).
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", 0 if torch.cuda.device_count() == 1 else local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if args.mode == "plain":
        args.rank, world = 0, 1
    else:
        if args.backend == "nccl":
            if device.type != "cuda":
                raise SystemExit("--backend nccl needs --device cuda")
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
        args.rank, world = dist.get_rank(), dist.get_world_size()
    for name in args.workload:
        for precision in args.precision:
            report_line = run(args, name, precision, device, world)
            if report_line is not None:
                print("BENCH " + json.dumps(report_line), flush=True)
            gc.collect()
    if args.mode == "ddp":
        dist.destroy_process_group()


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args, name, precision, device, world):
    """One workload at one precision; rank 0 returns the report, the others None."""
    cuda = device.type == "cuda"
    plain = args.mode == "plain"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device) if cuda else math.nan
    torch.manual_seed(42)
    model, batches, loss_fn = workload(args, name)
    tch_init(model)
    model.to(device)
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    params = sum(p.numel() for p in model.parameters())
    if plain:
        ddp = model
        no_sync = contextlib.nullcontext
    else:
        # PyTorch's DDP keeps its 1 MiB first bucket only when bucket_cap_mb is left
        # out; given explicitly (even as 25), the first bucket is bucket_cap_mb too, and
        # the SDK's attribute does the same. bench/ddp.rs leaves it out, so 25 is left
        # out here.
        cap = None if args.bucket_cap_mb == 25 else args.bucket_cap_mb
        ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if cuda else None, bucket_cap_mb=cap)
        no_sync = ddp.no_sync
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    if precision == "bf16":
        autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731
    else:
        autocast = contextlib.nullcontext
    barrier = (lambda: None) if plain else dist.barrier
    sync_phases = cuda and args.sync_phases

    def phases():
        return {"forward": [], "backward": [], "step": [], "total": [], "cpu": 0.0, "faults": 0.0}

    def phase_clock():
        if sync_phases:
            synchronize(device)
        return time.perf_counter()

    # Warm-up, then the timed steps; both alternate a synchronized step with one
    # under no_sync, so that the two kinds see the same load on a shared machine.
    timed = [phases(), phases()]  # [synchronized, no_sync]
    final_loss = math.nan
    for run_index, steps in enumerate([args.warmup, args.steps]):
        barrier()
        synchronize(device)
        for i in range(2 * steps):
            local = i % 2 == 1
            x, y = batches[(i // 2) % len(batches)]
            cpu0, faults0 = cpu_seconds(), minor_faults()
            t0 = time.perf_counter()
            opt.zero_grad()
            if local:
                with no_sync():
                    with autocast():
                        loss = loss_fn(ddp(x), y)
                    t1 = phase_clock()
                    loss.backward()
            else:
                with autocast():
                    loss = loss_fn(ddp(x), y)
                t1 = phase_clock()
                loss.backward()
            t2 = phase_clock()
            opt.step()
            synchronize(device)
            t3 = time.perf_counter()
            if run_index == 1:
                p = timed[local]
                for k, t in zip(("forward", "backward", "step", "total"),
                                (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                    p[k].append(t)
                p["cpu"] += cpu_seconds() - cpu0
                p["faults"] += minor_faults() - faults0
                if not local:
                    final_loss = loss.item()
    barrier()
    sync, local = timed
    n = max(args.steps, 1)
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if cuda:
        memory = [float(torch.cuda.max_memory_allocated(device)),
                  float(torch.cuda.max_memory_reserved(device))]
    else:
        memory = [math.nan, math.nan]
    mine = torch.tensor([sum(sync["total"]), median(sync["total"]), median(sync["forward"]),
                         median(sync["backward"]), median(sync["step"]),
                         median(local["backward"]), float(rss_kb), sync["cpu"] / n, final_loss,
                         local["cpu"] / n, sync["faults"] / n, local["faults"] / n,
                         median(local["total"]), *memory, float(baseline)],
                        dtype=torch.float64)
    if plain:
        rows = [mine.tolist()]
    else:
        # NCCL gathers CUDA tensors only.
        where = device if args.backend == "nccl" else torch.device("cpu")
        every = [torch.zeros_like(mine, device=where) for _ in range(world)]
        dist.all_gather(every, mine.to(where))
        rows = torch.stack(every).cpu().tolist()
    if args.rank != 0:
        return None
    backend = "none" if plain else dist.get_backend()
    side = "pytorch-plain" if plain else "pytorch"
    run = {"workload": name, "precision": precision, "device": device.type,
           "backend": backend, "mode": args.mode, "sync_phases": sync_phases,
           "device_name": torch.cuda.get_device_name(device) if cuda else None}
    return report(side, args, run, world, params, rows, [] if plain else buckets(ddp))


def median(xs):
    return statistics.median(xs) if xs else math.nan


def cpu_seconds():
    """User and system CPU seconds of this process so far (all its threads)."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def minor_faults():
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def buckets(ddp):
    """Parameters per gradient bucket after the rebuild, as the Rust side reports them
    (empty with a world of one process, where the Rust side has no Reducer)."""
    if dist.get_world_size() == 1:
        return []
    try:
        return [len(b.parameters()) for b in ddp.reducer._get_zeros_like_grad_buckets()]
    except Exception:  # a private API: absent in some versions
        return None


def report(side, args, run, world, params, rows, buckets):
    """The fields both sides print (see bench/ddp.rs); `rows` is every rank's figures."""
    mx = lambda k: max(r[k] for r in rows)  # noqa: E731
    mean = lambda k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    mib = lambda k: mx(k) / 2**20 if math.isfinite(mx(k)) else None  # noqa: E731
    samples = world * args.batch
    return {
        "side": side,
        "mode": run["mode"],
        "workload": run["workload"],
        "device": run["device"],
        "device_name": run["device_name"],
        "precision": run["precision"],
        "backend": run["backend"],
        "world": world,
        "batch": args.batch,
        "warmup": args.warmup,
        "steps": args.steps,
        "params": params,
        "phases_synchronized": run["device"] == "cpu" or run["sync_phases"],
        "sync_steps_s": mx(0),
        "samples_per_s": samples / mx(1),
        "samples_per_s_mean": samples * args.steps / mx(0),
        "step_ms": 1e3 * mx(1),
        "step_nosync_ms": 1e3 * mx(12),
        "forward_ms": 1e3 * mean(2),
        "backward_ms": 1e3 * mean(3),
        "optimizer_ms": 1e3 * mean(4),
        "backward_nosync_ms": 1e3 * mean(5),
        "exposed_allreduce_ms": 1e3 * (mean(3) - mean(5)),
        "rss_mb": [r[6] / 1024 for r in rows],
        "peak_allocated_mb": mib(13),
        "peak_reserved_mb": mib(14),
        "baseline_allocated_mb": mib(15),
        "cpu_ms_per_step": 1e3 * mean(7),
        "cpu_ms_per_nosync_step": 1e3 * mean(9),
        "minor_faults_per_step": mean(10),
        "minor_faults_per_nosync_step": mean(11),
        "loss": rows[0][8],
        "finite": all(math.isfinite(r[8]) for r in rows),
        "buckets": buckets,
    }


if __name__ == "__main__":
    main()
