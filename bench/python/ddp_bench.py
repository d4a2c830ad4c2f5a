"""PyTorch side of the DDP benchmarks: the same models, data and step as bench/ddp.rs.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \
        bench/python/ddp_bench.py --workload mlp

One intra-op thread per rank, gloo, DistributedDataParallel with its default buckets
(25 MiB, the first 1 MiB, as the SDK's defaults) and SGD; the same phases, runs and medians as bench/ddp.rs. Rank 0 prints one line
`BENCH {json}` with the same fields as the Rust side.
"""

import argparse
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
        x = self.tok(x) + self.pos(torch.arange(t))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class Deep(nn.Module):
    """200 Linear(64, 64) in sequence with ReLU between."""

    def __init__(self, layers=200):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(layers))

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


def workload(args):
    """(model, list of (input, target) batches, loss function, samples per batch)."""
    g = torch.Generator().manual_seed(1000 + args.rank)
    pool = range(args.pool)
    if args.workload == "mlp":
        model = Mlp()
        batches = [(torch.randn(args.batch, 784, generator=g),
                    torch.randint(0, 10, (args.batch,), generator=g)) for _ in pool]
        loss = F.cross_entropy
    elif args.workload == "cnn":
        model = Cnn()
        batches = [(torch.randn(args.batch, 1, 28, 28, generator=g),
                    torch.randint(0, 10, (args.batch,), generator=g)) for _ in pool]
        loss = F.cross_entropy
    elif args.workload == "transformer":
        tokens, vocab = read_text(args.data)
        model = CharTransformer(vocab, context=args.context)
        batches = []
        for _ in pool:
            start = torch.randint(0, tokens.numel() - args.context - 1, (args.batch, 1), generator=g)
            window = tokens[start + torch.arange(args.context + 1)]
            batches.append((window[:, :-1], window[:, 1:]))

        def loss(logits, y):
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    elif args.workload == "linear200":
        model = Deep()
        batches = [(torch.randn(args.batch, 64, generator=g),
                    torch.randn(args.batch, 64, generator=g)) for _ in pool]
        loss = F.mse_loss
    else:
        raise SystemExit(f"unknown workload {args.workload}")
    return model, batches, loss


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workload", required=True, choices=["mlp", "cnn", "transformer", "linear200"])
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
    dist.init_process_group("gloo")
    args.rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(42)
    model, batches, loss_fn = workload(args)
    tch_init(model)
    params = sum(p.numel() for p in model.parameters())
    # PyTorch's DDP keeps its 1 MiB first bucket only when bucket_cap_mb is left out;
    # given explicitly (even as 25), the first bucket is bucket_cap_mb too, and the
    # SDK's attribute does the same. bench/ddp.rs leaves it out, so 25 is left out here.
    cap = None if args.bucket_cap_mb == 25 else args.bucket_cap_mb
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)

    def phases():
        return {"forward": [], "backward": [], "step": [], "total": [], "cpu": 0.0, "faults": 0.0}

    # Warm-up, then the timed steps; both alternate a synchronized step with one
    # under no_sync, so that the two kinds see the same load on a shared machine.
    timed = [phases(), phases()]  # [synchronized, no_sync]
    for run, steps in enumerate([args.warmup, args.steps]):
        dist.barrier()
        for i in range(2 * steps):
            local = i % 2 == 1
            x, y = batches[(i // 2) % len(batches)]
            cpu0, faults0 = cpu_seconds(), minor_faults()
            t0 = time.perf_counter()
            opt.zero_grad()
            if local:
                with ddp.no_sync():
                    loss = loss_fn(ddp(x), y)
                    t1 = time.perf_counter()
                    loss.backward()
            else:
                loss = loss_fn(ddp(x), y)
                t1 = time.perf_counter()
                loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            if run == 1:
                p = timed[local]
                for k, t in zip(("forward", "backward", "step", "total"),
                                (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                    p[k].append(t)
                p["cpu"] += cpu_seconds() - cpu0
                p["faults"] += minor_faults() - faults0
                if not local:
                    final_loss = loss.item()
    dist.barrier()
    sync, local = timed
    n = max(args.steps, 1)
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    mine = torch.tensor([sum(sync["total"]), median(sync["total"]), median(sync["forward"]),
                         median(sync["backward"]), median(sync["step"]),
                         median(local["backward"]), float(rss_kb), sync["cpu"] / n, final_loss,
                         local["cpu"] / n, sync["faults"] / n, local["faults"] / n],
                        dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    if args.rank == 0:
        rows = torch.stack(every).tolist()
        print("BENCH " + json.dumps(report("pytorch", args, world, params, rows, buckets(ddp))),
              flush=True)
    dist.destroy_process_group()


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


def report(side, args, world, params, rows, buckets):
    """The fields both sides print (see bench/ddp.rs); `rows` is every rank's figures."""
    mx = lambda k: max(r[k] for r in rows)  # noqa: E731
    mean = lambda k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    samples = world * args.batch
    return {
        "side": side,
        "workload": args.workload,
        "world": world,
        "batch": args.batch,
        "warmup": args.warmup,
        "steps": args.steps,
        "params": params,
        "sync_steps_s": mx(0),
        "samples_per_s": samples / mx(1),
        "samples_per_s_mean": samples * args.steps / mx(0),
        "step_ms": 1e3 * mx(1),
        "forward_ms": 1e3 * mean(2),
        "backward_ms": 1e3 * mean(3),
        "optimizer_ms": 1e3 * mean(4),
        "backward_nosync_ms": 1e3 * mean(5),
        "exposed_allreduce_ms": 1e3 * (mean(3) - mean(5)),
        "rss_mb": [r[6] / 1024 for r in rows],
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
