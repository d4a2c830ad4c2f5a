"""PyTorch side of the all-reduce sweep: the same sizes, repetitions and timing (the
slowest rank's median all-reduce) as bench/allreduce.rs, over torch.distributed.all_reduce (gloo, float32, sum).

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \
        bench/python/allreduce_bench.py
"""

import argparse
import json
import resource
import time

import torch
import torch.distributed as dist


def iterations(nbytes, volume):
    """Repetitions for a size: volume / bytes, clamped to 10..2000 (as the Rust side)."""
    return min(max(volume // nbytes, 10), 2000)


def cpu_seconds():
    """User and system CPU seconds of this process so far (all its threads)."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--min-bytes", type=int, default=1 << 10)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--volume", type=int, default=512 << 20)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    nbytes = args.min_bytes
    while nbytes <= args.max_bytes:
        t = torch.zeros(nbytes // 4, dtype=torch.float32)
        for _ in range(args.warmup):
            dist.all_reduce(t)
        n = iterations(nbytes, args.volume)
        dist.barrier()
        times = []
        cpu_start = cpu_seconds()
        for _ in range(n):
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        cpu = (cpu_seconds() - cpu_start) / n
        mine = torch.tensor([sorted(times)[n // 2], cpu], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        secs = max(e[0].item() for e in every)
        cpu = sum(e[1].item() for e in every) / world
        if rank == 0:
            algbw = nbytes / secs
            print("BENCH " + json.dumps({
                "side": "pytorch",
                "world": world,
                "bytes": nbytes,
                "iterations": n,
                "seconds": secs,
                "cpu_seconds": cpu,
                "algbw": algbw,
                "busbw": algbw * 2 * (world - 1) / world,
            }), flush=True)
        nbytes *= 4
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
