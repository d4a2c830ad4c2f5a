# PyTorch FSDP2's reference for tests/tests/sharding.rs: the sharding worker's model
# (l1: 6 -> 13, tanh, l2: 13 -> 7, tanh, l3: 7 -> 3), `fully_shard` on l2, l3 and the
# whole model, Adam (lr 0.01, weight decay 1e-2, torch.optim's default kernels) for 10
# steps, each of WORLD ranks (Gloo, on the CPU) on its share of the 24 samples.
#
# With a fourth argument `bf16` (`fp32`: none), every `fully_shard` gets
# MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32).
#
# Usage: python fsdp2_reference.py INIT OUT WORLD [fp32|bf16]
#   INIT: safetensors with x, y and the initial l1/l2/l3 weights and biases;
#   OUT: the final parameters (full tensors), written by rank 0.
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(6, 13)
        self.l2 = torch.nn.Linear(13, 7)
        self.l3 = torch.nn.Linear(7, 3)

    def forward(self, x):
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


def worker(rank, world, store, init, out, bf16):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    data = load_file(init)
    net = Net()
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(data[name])
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy()
    if bf16:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(net.l2, mesh=mesh, mp_policy=policy)
    fully_shard(net.l3, mesh=mesh, mp_policy=policy)
    fully_shard(net, mesh=mesh, mp_policy=policy)
    opt = torch.optim.Adam(net.parameters(), lr=0.01, weight_decay=1e-2)
    share = 24 // world
    x = data["x"][rank * share:(rank + 1) * share]
    y = data["y"][rank * share:(rank + 1) * share]
    for _ in range(10):
        opt.zero_grad()
        # Under bf16, the loss in fp32, as autocast runs mse_loss.
        torch.nn.functional.mse_loss(net(x).float(), y).backward()
        opt.step()
    full = {k: v.full_tensor().contiguous() for k, v in net.state_dict().items()}
    if rank == 0:
        save_file(full, out)
    dist.destroy_process_group()
    # The rank leaves without C++'s static destructors at the interpreter's exit: one of
    # them sometimes ends a rank with "terminate called without an active exception"
    # (SIGABRT) after all its work is done (about 1 run in 8 under bf16 with another
    # run beside it, PyTorch 2.11 on the CPU), and mp.spawn then fails the run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    init, out, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
    bf16 = sys.argv[4:] == ["bf16"]
    # The ranks meet in a file (c10d's FileStore) beside OUT, not on a TCP port that
    # another test could take between choosing it and binding it.
    store = os.path.abspath(out) + ".store"
    if os.path.exists(store):
        os.remove(store)
    mp.spawn(worker, args=(world, store, init, out, bf16), nprocs=world)
