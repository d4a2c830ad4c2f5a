# PyTorch's side of bench/sharding.rs: 16 x Linear(1024, 1024) with ReLU, Adam, on
# WORLD ranks over Gloo, as DDP or FSDP2 (`fully_shard` on every layer and on the
# model). Each rank prints `SHARDING {json}`: the memory when the model is about to be
# built (`baseline`) and its peak after the steps (`peak`), in bytes, and the mean step
# time (ms) of 5 steps after one warm-up step. On the CPU the memory is the resident
# set (VmRSS, VmHWM); on CUDA (the ranks share GPU 0) the caching allocator's
# allocated bytes (`memory_allocated`, `max_memory_allocated`).
#
# Usage: python fsdp_bench.py WORLD ddp|fsdp2 [cpu|cuda]
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAYERS, WIDTH, BATCH = 16, 1024, 8


def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def worker(rank, world, port, mode, device):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
        torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated() if cuda else status("VmRSS:")
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers).to(device)
    if mode == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(net)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device, (world,))
        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    x = torch.randn(BATCH, WIDTH, device=device)

    def step():
        opt.zero_grad(set_to_none=True)
        net(x).square().mean().backward()
        opt.step()

    step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(5):
        step()
    if cuda:
        torch.cuda.synchronize()
    step_ms = (time.perf_counter() - start) / 5 * 1e3
    peak = torch.cuda.max_memory_allocated() if cuda else status("VmHWM:")
    row = {"rank": rank, "world_size": world, "side": f"pytorch-{mode}", "device": device,
           "baseline": baseline, "peak": peak, "step_ms": step_ms}
    # One write, so that the ranks' lines do not interleave.
    sys.stderr.write("SHARDING " + json.dumps(row) + "\n")
    sys.stderr.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    world, mode = int(sys.argv[1]), sys.argv[2]
    device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(world, port, mode, device), nprocs=world)
