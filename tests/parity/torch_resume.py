"""PyTorch's side of tests/tests/zero.rs: resumes a ZeRO checkpoint in torch.optim.

    python torch_resume.py DIR CKPT STEPS OUT

Reads the model of checkpoint CKPT (model.safetensors) and its optimizer state, one
shard per rank (optimizer-rank-R.safetensors, each with the parameters that rank
owned): together they are the whole state_dict of torch.optim.Adam. Loads both into
l1: Linear(8, 32) -> tanh -> l2: Linear(32, 4) and Adam, trains on the whole batch of
DIR/data.safetensors for STEPS more steps, and writes the parameters to DIR/OUT.
"""

import glob
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(__file__))
from torch_ddp import Mlp, save_file  # noqa: E402
from torch_optim import state_dict  # noqa: E402


def main(out, ckpt, steps, name):
    torch.set_num_threads(1)
    data = load_file(os.path.join(out, "data.safetensors"))
    model = Mlp()
    model.load_state_dict(load_file(os.path.join(ckpt, "model.safetensors")))
    saved = state_dict(sorted(glob.glob(os.path.join(ckpt, "optimizer-rank-*.safetensors"))))
    params = dict(model.named_parameters())
    groups = [{"params": [params[n] for n in g["param_names"]]} for g in saved["param_groups"]]
    opt = torch.optim.Adam(groups)
    opt.load_state_dict(saved)
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(data["x"]), data["y"]).backward()
        opt.step()
    save_file({n: p.detach().clone() for n, p in model.named_parameters()}, os.path.join(out, name))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
