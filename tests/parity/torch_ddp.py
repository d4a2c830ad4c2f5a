"""PyTorch's side of tests/tests/parity.rs: the training of tests/src/bin/parity_worker.rs
with torch.nn.parallel.DistributedDataParallel on 2 ranks over gloo.

    python torch_ddp.py DIR

Reads DIR/init.safetensors (the weights, under the VarStore's names) and
DIR/data.safetensors (x: 64 x 8, y: 64 x 4); trains l1: Linear(8, 32) -> tanh ->
l2: Linear(32, 4) once with each of torch.optim.SGD(lr=0.05, momentum=0.9),
torch.optim.Adam(lr=0.01), torch.optim.AdamW(lr=0.01) and torch.optim.RMSprop(lr=0.01)
(fused=True for the first three and foreach=True for RMSprop, as the SDK's defaults),
100 steps each: 25 epochs of the 8 batches of 8 rows in
order, rank r taking batches r, r + 2, r + 4, r + 6 of each epoch (what #[distributed]
gives each rank of tch's Iter2). After steps 1, 10 and 100 rank 0 writes the
parameters to DIR/torch-{sgd,adam,adamw,rmsprop}-{step}.safetensors.

With a second argument `zero`, each optimizer is wrapped in
torch.distributed.optim.ZeroRedundancyOptimizer (ZeRO stage 1) and the files are
DIR/torch-zero-{kind}-{step}.safetensors. With `fp16` or `bf16`, DDP compresses the
gradients with PyTorch's fp16_compress_hook or bf16_compress_hook
(torch.distributed.algorithms.ddp_comm_hooks.default_hooks) and the files are
DIR/torch-{fp16,bf16}-{kind}-{step}.safetensors.

The two ranks are forked from this process (one import of torch) and meet through a
FileStore in DIR (no port to pick).
"""

import ctypes
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import safetensors
from safetensors.torch import load_file
from torch.nn.parallel import DistributedDataParallel

WORLD_SIZE = 2
BATCH = 8
EPOCHS = 25
SAVED_STEPS = (1, 10, 100)


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 32)
        self.l2 = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


def save_file(tensors, path):
    """safetensors.torch.save_file without numpy, which the venv does not have:
    the float32 tensors' bytes go to safetensors' own writer."""
    def entry(t):
        assert t.dtype == torch.float32 and t.is_contiguous()
        data = ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())
        return {"dtype": "float32", "shape": list(t.shape), "data": data}

    safetensors.serialize_file({n: entry(t) for n, t in tensors.items()}, path)


def optimizer(kind, params, zero):
    """The SDK's default implementations: fused where torch.optim has it, else
    foreach; with `zero`, inside a ZeroRedundancyOptimizer."""
    cls, kwargs = {
        "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, fused=True)),
        "adam": (torch.optim.Adam, dict(lr=0.01, fused=True)),
        "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.01, fused=True)),
        "rmsprop": (torch.optim.RMSprop, dict(lr=0.01, foreach=True)),
    }[kind]
    if zero:
        # Imported here, in the forked rank, never in the parent before the fork
        # (torch.distributed.optim pulls in more of torch, and threads it starts do not
        # survive a fork).
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)
    return cls(params, **kwargs)


def run(rank, out, mode):
    torch.set_num_threads(1)
    zero = mode == "zero"
    store = dist.FileStore(os.path.join(out, f"torch-store-{mode or 'ddp'}"), WORLD_SIZE)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE)
    data = load_file(os.path.join(out, "data.safetensors"))
    xs, ys = data["x"], data["y"]
    batches = xs.shape[0] // BATCH
    for kind in ("sgd", "adam", "adamw", "rmsprop"):
        model = Mlp()
        model.load_state_dict(load_file(os.path.join(out, "init.safetensors")))
        ddp = DistributedDataParallel(model)
        if mode in ("fp16", "bf16"):
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
            ddp.register_comm_hook(None, hook[mode])
        opt = optimizer(kind, ddp.parameters(), zero)
        step = 0
        for _epoch in range(EPOCHS):
            for b in range(rank, batches, WORLD_SIZE):
                x, y = xs[b * BATCH : (b + 1) * BATCH], ys[b * BATCH : (b + 1) * BATCH]
                opt.zero_grad()
                F.mse_loss(ddp(x), y).backward()
                opt.step()
                step += 1
                if step in SAVED_STEPS and rank == 0:
                    params = {n: p.detach().clone() for n, p in model.named_parameters()}
                    prefix = f"torch-{mode}" if mode else "torch"
                    save_file(params, os.path.join(out, f"{prefix}-{kind}-{step}.safetensors"))
        assert step == 100, step
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mode = sys.argv[2] if len(sys.argv) > 2 else ""
    assert mode in ("", "zero", "fp16", "bf16"), mode
    mp.start_processes(run, args=(sys.argv[1], mode), nprocs=WORLD_SIZE, start_method="fork")
