"""PyTorch's side of the BatchNorm case of tests/tests/parity.rs: the training of
tests/src/bin/parity_bn_worker.rs with
torch.nn.parallel.DistributedDataParallel(broadcast_buffers=True) on 2 ranks over gloo.

    python torch_ddp_bn.py DIR

Reads DIR/init.safetensors (the weights and running statistics, under the VarStore's
names) and DIR/data.safetensors (x: 80 x 1 x 8 x 8, y: 80 class indices); trains
c1: Conv2d(1, 4, 3) -> bn1: BatchNorm2d(4) -> relu -> c2: Conv2d(4, 8, 3) ->
bn2: BatchNorm2d(8) -> relu -> flatten -> l: Linear(128, 4) in train mode with
torch.optim.SGD(lr=0.05, momentum=0.9, fused=True, the SDK's default) on the cross-entropy loss, 10 steps: 2 epochs
of the 10 batches of 8 images in order, rank r taking batches r, r + 2, ..., r + 8 of
each epoch (what #[distributed] gives each rank of tch's Iter2). Then rank 0 writes
its parameters and running statistics to DIR/torch.safetensors, and each rank r runs
the model through DDP in evaluation mode on all 80 images and writes the logits to
DIR/torch-eval-rank{r}.safetensors.

The module's attribute names are the VarStore's path names, so the state dict's names
are tch's (c1.weight, bn1.running_mean, ...), except for BatchNorm's
num_batches_tracked, which tch's batch norm does not have: it starts at 0 here
(BatchNorm fills it in when the state dict lacks it) and is not written out. eps 1e-5
and momentum 0.1, BatchNorm2d's defaults, are also tch's BatchNormConfig defaults.

DDP broadcasts rank 0's buffers at the start of each forward pass that follows a
synchronized one (and at construction), so the running statistics that rank 0 ends
with are the same as the SDK's; rank 1's are its own update of rank 0's from the
step before, hence only rank 0 writes them. The evaluation's forward pass, the first
after the last synchronized one, broadcasts rank 0's again: there rank 1 normalizes
with the same statistics as the SDK's rank 1.

The two ranks are forked from this process (one import of torch) and meet through a
FileStore in DIR (no port to pick).
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.nn.parallel import DistributedDataParallel

from torch_ddp import save_file

WORLD_SIZE = 2
BATCH = 8
EPOCHS = 2
STEPS = 10


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(1, 4, 3)
        self.bn1 = torch.nn.BatchNorm2d(4, eps=1e-5, momentum=0.1)
        self.c2 = torch.nn.Conv2d(4, 8, 3)
        self.bn2 = torch.nn.BatchNorm2d(8, eps=1e-5, momentum=0.1)
        self.l = torch.nn.Linear(8 * 4 * 4, 4)

    def forward(self, x):
        x = F.relu(self.bn1(self.c1(x)))
        x = F.relu(self.bn2(self.c2(x)))
        return self.l(torch.flatten(x, 1))


def run(rank, out):
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(out, "torch-store"), WORLD_SIZE)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE)
    data = load_file(os.path.join(out, "data.safetensors"))
    xs, ys = data["x"], data["y"]
    batches = xs.shape[0] // BATCH
    model = ConvNet()
    # Strict: BatchNorm fills in a missing num_batches_tracked itself (with 0, as for
    # a state dict saved before it existed), every other name must match.
    model.load_state_dict(load_file(os.path.join(out, "init.safetensors")))
    model.train()
    ddp = DistributedDataParallel(model, broadcast_buffers=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, fused=True)
    step = 0
    for _epoch in range(EPOCHS):
        for b in range(rank, batches, WORLD_SIZE):
            x, y = xs[b * BATCH : (b + 1) * BATCH], ys[b * BATCH : (b + 1) * BATCH]
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
            step += 1
    assert step == STEPS, step
    if rank == 0:
        state = {
            n: t.detach().clone()
            for n, t in model.state_dict().items()
            if not n.endswith("num_batches_tracked")
        }
        save_file(state, os.path.join(out, "torch.safetensors"))
    # Evaluation through DDP: the forward pass after the last synchronized one first
    # broadcasts rank 0's buffers, so rank 1 too normalizes with rank 0's statistics.
    ddp.eval()
    with torch.no_grad():
        logits = ddp(xs)
    path = os.path.join(out, f"torch-eval-rank{rank}.safetensors")
    save_file({"logits": logits.contiguous()}, path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.start_processes(run, args=(sys.argv[1],), nprocs=WORLD_SIZE, start_method="fork")
