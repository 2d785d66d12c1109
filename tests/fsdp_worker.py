"""Run under `torch.distributed.run --nproc_per_node 2` on a tiny Llama sharded as `doplus unlearn --fsdp`
shards it. The first process prints one JSON line per process and case.

    fsdp_worker.py MODEL CASE [CASE ...]
      shards:BITS    after a DualOptim+ step, how many state elements this process keeps
      step:INNER     DualOptim+ (adamw or muon) steps on the shards, with given gradients, against the same steps
                     on an unsharded copy in this process
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from doplus_cli.engine.sharding import shard_model
from doplus_cli.optim import DualOptimPlus, muon_param_groups


def count_shards(model, state_bits: int) -> dict:
    optimizer = DualOptimPlus(model.parameters(), lr=1e-3, state_bits=state_bits)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step(objective="forget")
    full, local, codes = 0, 0, 0
    for param in model.parameters():
        state = optimizer.state[param]
        for container in (state, state["delta"]["forget"]):
            for name in ("exp_avg", "exp_avg_sq"):
                full += param.numel()  # the whole parameter's elements
                local += container[name].numel()  # the elements this process keeps a state for
                codes += container[name].dtype == torch.uint8
    return {"full": full, "local": local, "codes": codes}


def compare_steps(model, plain, inner: str) -> dict:
    """Three steps (forget, retain, forget) with the same full gradients on both models; the largest
    difference between each shard and the same rows of the unsharded weights."""
    from torch.distributed.tensor import distribute_tensor

    def optimizer(m):
        groups = muon_param_groups(m) if inner == "muon" else m.parameters()
        return DualOptimPlus(groups, lr=1e-2, inner=inner, objectives=("forget", "retain"))

    sharded_opt, plain_opt = optimizer(model), optimizer(plain)
    generator = torch.Generator().manual_seed(1)  # the same gradients on every process
    for objective in ("forget", "retain", "forget"):
        for p, q in zip(model.parameters(), plain.parameters()):
            grad = torch.randn(q.shape, generator=generator).abs() + 0.5  # away from 0: no float32 cancellation
            q.grad = grad.clone()
            p.grad = distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None)
        sharded_opt.step(objective=objective)
        plain_opt.step(objective=objective)
    worst, moved = 0.0, 0.0
    with torch.no_grad():
        for p, q, start in zip(model.parameters(), plain.parameters(), START):
            rows = distribute_tensor(q.detach(), p.device_mesh, p.placements, src_data_rank=None).to_local()
            worst = max(worst, (p.to_local() - rows).abs().max().item() if rows.numel() else 0.0)
            moved = max(moved, (q - start).abs().max().item())
    return {"max_difference": worst, "moved": moved}


START: list[torch.Tensor] = []


def run_case(accelerator, model_dir: str, mode: str, option: str) -> dict:
    """One case on a freshly loaded and sharded model: `shards BITS` or `step INNER`."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    plain = copy.deepcopy(model)
    START[:] = [p.detach().clone() for p in plain.parameters()]
    model = shard_model(accelerator, model)
    return count_shards(model, int(option)) if mode == "shards" else compare_steps(model, plain, option)


def main(model_dir: str, *cases: str) -> None:
    """Each case ("shards:32", "step:muon", ...) in turn in the same two processes: a launch costs more than the
    cases it runs."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    for case in cases:
        row = run_case(accelerator, model_dir, *case.split(":"))
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, {"case": case, "rank": dist.get_rank(), **row})
        if dist.get_rank() == 0:  # one writer: two processes printing to one pipe can interleave their lines
            for one in rows:
                print(json.dumps(one), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    # Leave without interpreter finalization: a rank aborted there once in a CI run ("terminate called without an
    # active exception"; 16 repeats here passed), the shutdown race of gloo's worker threads described in
    # pytorch/pytorch#179291. The results are printed and the group is destroyed by now.
    sys.stdout.flush()
    os._exit(0)
