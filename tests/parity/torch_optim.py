"""PyTorch's side of tests/tests/optimizer_parity.rs: torch.optim, one process.

    python torch_optim.py DIR < cases.json

Reads DIR/init.safetensors (l1.weight, l1.bias, l2.weight, l2.bias) and
DIR/data.safetensors (x: 64 x 8, y: 64 x 4). For each case of the JSON list on stdin,
{"name", "class" (SGD, Adam, AdamW, RMSprop), "kwargs" (its options, with foreach= or
fused=), "lrs" (group 0: l1, group 1: l2)}, trains l1: Linear(8, 32) -> tanh ->
l2: Linear(32, 4) on the whole batch with mse_loss for 100 steps and writes the
parameters after steps 1, 10 and 100 to DIR/torch-{name}-{step}.safetensors.

Then it resumes the Rust run: the parameters DIR/rust-{name}-50.safetensors and the
optimizer state DIR/rust-{name}-state-50.safetensors (written by the SDK's
Optimizer::state, in torch.optim's state_dict layout, with the param_groups as JSON in
its metadata) go into a fresh model and optimizer of the case's class through
load_state_dict; 50 more steps; DIR/torch-{name}-resumed-100.safetensors.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

from torch_ddp import Mlp, save_file

STEPS = 100
SAVED_STEPS = (1, 10, 100)


def optimizer(case, model, names=None):
    """The case's optimizer over l1 (group 0) and l2 (group 1); `names`, the groups'
    parameter names, orders each group's parameters as a saved state numbers them."""
    if names is None:
        names = [[n for n, _ in layer.named_parameters(prefix=prefix)]
                 for prefix, layer in (("l1", model.l1), ("l2", model.l2))]
    params = dict(model.named_parameters())
    groups = [{"params": [params[n] for n in group], "lr": lr}
              for group, lr in zip(names, case["lrs"])]
    return getattr(torch.optim, case["class"])(groups, **case["kwargs"])


def train(model, opt, data, first, last, save):
    for step in range(first, last + 1):
        opt.zero_grad()
        F.mse_loss(model(data["x"]), data["y"]).backward()
        opt.step()
        if save is not None and step in SAVED_STEPS:
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
            save_file(params, save(step))


# ANCHOR: state_dict
def state_dict(paths):
    """The SDK's state file (or, under ZeRO, the ranks' files) as torch.optim's
    state_dict: {"state": {j: {name: tensor}}, "param_groups": [...]}, from
    `state.{j}.{name}` and the metadata. Under ZeRO each rank's file holds its rows
    (dim 0) of every state tensor and names its rank in `dim0_shard`: the rows are put
    together in rank order."""
    parts = {}
    for path in [paths] if isinstance(paths, str) else paths:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata()
            groups = json.loads(metadata["param_groups"])
            rank = json.loads(metadata.get("dim0_shard", '{"rank": 0}'))["rank"]
            for key in f.keys():
                _, j, name = key.split(".", 2)
                parts.setdefault((int(j), name), []).append((rank, f.get_tensor(key)))
    state = {}
    for (j, name), chunks in parts.items():
        chunks = [t for _, t in sorted(chunks, key=lambda c: c[0])]
        # Every rank keeps the step count; the rest are rows.
        whole = chunks[0] if name == "step" or len(chunks) == 1 else torch.cat(chunks)
        state.setdefault(j, {})[name] = whole
    return {"state": state, "param_groups": groups}
# ANCHOR_END: state_dict


def main(out):
    torch.set_num_threads(1)
    cases = json.load(sys.stdin)
    data = load_file(os.path.join(out, "data.safetensors"))
    init = load_file(os.path.join(out, "init.safetensors"))
    for case in cases:
        name = case["name"]
        model = Mlp()
        model.load_state_dict(init)
        opt = optimizer(case, model)
        train(model, opt, data, 1, STEPS,
              lambda step: os.path.join(out, f"torch-{name}-{step}.safetensors"))

        model = Mlp()
        model.load_state_dict(load_file(os.path.join(out, f"rust-{name}-50.safetensors")))
        # ANCHOR: load
        saved = state_dict(os.path.join(out, f"rust-{name}-state-50.safetensors"))
        # The state numbers the parameters in the VarStore's order (bias before weight
        # in tch's Linear): each group's `param_names` say which is which.
        opt = optimizer(case, model, [g["param_names"] for g in saved["param_groups"]])
        opt.load_state_dict(saved)
        # ANCHOR_END: load
        train(model, opt, data, 51, STEPS, None)
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        save_file(params, os.path.join(out, f"torch-{name}-resumed-100.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1])
