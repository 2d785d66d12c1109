"""Optimizer states saved by doplus 0.1.0, for `tests/test_optim_api.py::test_a_state_saved_by_release_0_1_0_loads`.

Made from commit d1bcf3d (version 0.1.0) checked out beside the repository and put first on the path:

    git worktree add /tmp/doplus-0.1.0 d1bcf3d
    PYTHONPATH=/tmp/doplus-0.1.0 python tests/data/release-0.1.0/make_states.py
    git worktree remove /tmp/doplus-0.1.0

For each optimizer (DualOptimPlus, DualOptim, doplus's AdamW) on a small fixed problem (three tensors in two
param groups, one of them bfloat16 where the optimizer keeps a compensation buffer for it; fixed seed; a few
steps) it writes `<name>.pt` holding the constructor's arguments, the optimizer's state_dict, the weights, the
gradient of one more step, the objective of that step and the weights after the 0.1.0 code took it. The test
loads the state into the current optimizer, takes that step and compares the weights.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import torch

import doplus_cli
from doplus_cli.optim import AdamW, DualOptim, DualOptimPlus

HERE = Path(__file__).resolve().parent
SHAPES = [(4, 3), (7,), (2, 3, 2)]
SCHEDULE = ["forget", "retain", "retain", "forget", "retain"]  # then one more step: "forget"


def problem(low_precision: bool):
    """The weights (the last one bf16 when `low_precision`) and a gradient per step, seed 0."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=generator) for shape in SHAPES]
    if low_precision:
        weights[-1] = weights[-1].to(torch.bfloat16)
    grads = [[torch.randn(shape, generator=generator).to(w.dtype) for shape, w in zip(SHAPES, weights)]
             for _ in range(len(SCHEDULE) + 1)]
    return weights, grads


CASES = {
    "dualoptim_plus": dict(
        cls=DualOptimPlus, low_precision=True,
        groups=[{}, {"lr": 5e-3, "betas": (0.8, 0.9), "weight_decay": 0.0}],
        kwargs=dict(lr=1e-2, betas=(0.9, 0.95), base_betas=(0.85, 0.99), eps=1e-8, weight_decay=0.1,
                    objectives=("forget", "retain"), compensated=True, fused=False),
    ),
    "dualoptim": dict(
        cls=DualOptim, low_precision=False,
        groups=[{}, {"lr": 5e-3, "betas": (0.8, 0.9), "weight_decay": 0.0}],
        kwargs=dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, objectives=("forget", "retain")),
    ),
    "adamw": dict(
        cls=AdamW, low_precision=True,
        groups=[{}, {"lr": 5e-3, "betas": (0.8, 0.9), "weight_decay": 0.0}],
        kwargs=dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, compensated=True, fused=False),
    ),
}


def step(opt, objective: str) -> None:
    if isinstance(opt, AdamW):
        opt.step()
    else:
        opt.step(objective=objective)


def make(name: str, case: dict) -> dict:
    weights, grads = problem(case["low_precision"])
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    groups = [{"params": params[:2], **case["groups"][0]}, {"params": params[2:], **case["groups"][1]}]
    opt = case["cls"](groups, **case["kwargs"])
    for objective, grad in zip(SCHEDULE, grads):
        for p, g in zip(params, grad):
            p.grad = g.clone()
        step(opt, objective)
    saved = {
        "state_dict": copy.deepcopy(opt.state_dict()),  # the next step updates the state tensors in place
        "weights": [p.detach().clone() for p in params],
        "next_grads": [g.clone() for g in grads[-1]],
        "next_objective": "forget",
    }
    for p, g in zip(params, grads[-1]):
        p.grad = g.clone()
    step(opt, "forget")
    saved["weights_after"] = [p.detach().clone() for p in params]
    saved["groups"] = case["groups"]
    saved["kwargs"] = case["kwargs"]
    return saved


def main() -> None:
    source = Path(doplus_cli.__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=60,
                            check=True).stdout.strip()
    if not commit.startswith("d1bcf3d"):
        sys.exit(f"doplus_cli comes from {source} at {commit}, not release 0.1.0 (d1bcf3d): set PYTHONPATH")
    torch.manual_seed(0)
    for name, case in CASES.items():
        saved = make(name, case)
        saved["made_by"] = {"commit": commit, "torch": str(torch.__version__)}
        torch.save(saved, HERE / f"{name}.pt")
        print(f"{name}.pt from {source} at {commit}")


if __name__ == "__main__":
    main()
