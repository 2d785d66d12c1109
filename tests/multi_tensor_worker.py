"""Run the multi-tensor DualOptim+ kernel (`doplus_cli/optim/multi_tensor.py`) on CPU tensors through Triton's
interpreter, which Triton turns on only when `TRITON_INTERPRET=1` is in the environment before it is imported:
so `tests/test_multi_tensor.py` starts this file in a process of its own and asserts on what it saves.

    multi_tensor_worker.py OUT     saves a dict of runs (tensors, diagnostics, launch counters) to OUT
"""

from __future__ import annotations

import math
import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from doplus_cli.optim import DualOptimPlus, dualoptim_plus, multi_tensor  # noqa: E402

# sizes: a whole tile and a partial one (5,330 = 4,096 + 1,234, itself a whole block and a partial one), one
# partial tile, a matrix, a 1-element tensor; five tiles in all, as the interpreter runs each tile in Python
SHAPES = [(5330,), (1000,), (24, 40), (1,)]
KWARGS = dict(lr=1e-2, betas=(0.9, 0.95), base_betas=(0.8, 0.99), eps=1e-8, weight_decay=0.1,
              lr_multipliers={"forget": 2.0})


def start(dtype):
    generator = torch.Generator().manual_seed(0)
    return [(0.05 * torch.randn(shape, generator=generator, dtype=torch.float64)).to(dtype) for shape in SHAPES]


def grads_for(step, dtype, nan_at=None):
    generator = torch.Generator().manual_seed(100 + step)
    out = []
    for shape in SHAPES:
        g = 0.1 * torch.randn(shape, generator=generator, dtype=torch.float64) + (0.05 if step % 3 == 0 else -0.03)
        out.append(g.to(dtype))
    if nan_at is not None and step == nan_at:
        out[1].view(-1)[7] = math.nan
    return out


def run(dtype, multi, rule="safeguarded", compensated=False, steps=6, nan_at=None, groups=False):
    """`groups`: two param groups (the second with its own lr factor and no weight decay), and the last tensor
    without a gradient on steps 2 and 5, so that tensors of one step have different scalars (lr, λ, t_B, t_k)."""
    params = [torch.nn.Parameter(t.clone()) for t in start(dtype)]
    spec = ([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0, "lr_factor": 0.5}] if groups
            else params)
    opt = DualOptimPlus(spec, rule=rule, compensated=compensated, fused=True, multi_tensor=multi, **KWARGS)
    before = (multi_tensor.COUNTERS.launches, multi_tensor.COUNTERS.tensors)
    diagnostics, used = [], []
    for step in range(steps):
        objective = "forget" if step % 3 == 0 else "retain"
        for group in opt.param_groups:
            group["lr"] = 1e-2 * (1.0 - step / 10) * group.get("lr_factor", 1.0)
        grads = grads_for(step, dtype, nan_at)
        if groups and step in (2, 5):
            grads[-1] = None
        used.append((objective, 1e-2 * (1.0 - step / 10), [None if g is None else g.clone() for g in grads]))
        for p, g in zip(params, grads):
            p.grad = g
        opt.step(objective=objective)
        diagnostics.append(opt.step_diagnostics())
    states = {}
    for i, p in enumerate(params):
        state = opt.state[p]
        states[i] = {name: state[name].clone() for name in ("exp_avg", "exp_avg_sq")}
        states[i]["step"] = float(state["step"])
        if "compensation" in state:
            states[i]["compensation"] = state["compensation"].clone()
        for objective, delta in state["delta"].items():
            states[i][objective] = {name: delta[name].clone() for name in ("exp_avg", "exp_avg_sq")}
            states[i][objective]["step"] = float(delta["step"])
    return {
        "start": start(dtype),
        "steps": used,  # (objective, lr, gradients) of every step, for the test's float64 loop
        "params": [p.detach().clone() for p in params],
        "states": states,
        "diagnostics": diagnostics,
        "launches": multi_tensor.COUNTERS.launches - before[0],
        "tensors": multi_tensor.COUNTERS.tensors - before[1],
    }


def misaligned_run():
    """One tensor whose storage starts 4 bytes into a buffer (not 16-byte aligned): it takes the per-tensor
    path, the others the multi-tensor kernel, and the result equals the per-tensor path on all of them."""
    results = {}
    for multi in (True, False):
        buffer = torch.zeros(1001)
        odd = torch.nn.Parameter(buffer[1:])  # noqa: F841 - a view: data_ptr % 16 == 4
        with torch.no_grad():
            odd.copy_(start(torch.float32)[1])
        aligned = torch.nn.Parameter(start(torch.float32)[0].clone())
        opt = DualOptimPlus([aligned, odd], fused=True, multi_tensor=multi, **KWARGS)
        before = multi_tensor.COUNTERS.tensors
        for step in range(3):
            g = grads_for(step, torch.float32)
            aligned.grad, odd.grad = g[0], g[1]
            opt.step(objective="forget")
        results[multi] = {"params": [aligned.detach().clone(), odd.detach().clone()],
                          "tensors": multi_tensor.COUNTERS.tensors - before, "odd_address": odd.data_ptr() % 16}
    return results


def adam_stats_run():
    """torch's AdamW over two param groups (float32 weights with weight decay; bf16 weights with another lr and
    none), three steps; then the step diagnostics through the multi-tensor kernel and per tensor, and the
    actual step |θ_after − θ_before| / lr per group, for the test's independent check."""
    from doplus_cli.optim.diagnostics import adamw_step_stats, reduce_step_stats

    params = [torch.nn.Parameter(t.clone()) for t in start(torch.float32)]
    params[2] = torch.nn.Parameter(params[2].detach().bfloat16())
    params[3] = torch.nn.Parameter(params[3].detach().bfloat16())
    groups = [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    result = {}
    for step in range(3):
        for p, g in zip(params, grads_for(step, torch.float32)):
            p.grad = g.to(p.dtype)
        before = [p.detach().double().clone() for p in params]
        opt.step()
        launches = multi_tensor.COUNTERS.by_kernel.get("adam_stats_multi_tensor_kernel", 0)
        multi = reduce_step_stats(adamw_step_stats(opt, multi_tensor=True))
        result.setdefault("launches", []).append(
            multi_tensor.COUNTERS.by_kernel.get("adam_stats_multi_tensor_kernel", 0) - launches)
        result.setdefault("multi", []).append(multi)
        result.setdefault("single", []).append(reduce_step_stats(adamw_step_stats(opt, multi_tensor=False)))
        result.setdefault("moved", []).append(
            [((p.detach().double() - b) / group["lr"]).abs().max().item()
             for group in opt.param_groups for p, b in zip(group["params"], before[:2] if group is opt.param_groups[0]
                                                          else before[2:])])
    return result


def functional_run(steps=6):
    """`dualoptim_plus` on `run`'s float32 problem (the forget multiplier folded into lr) over states made here,
    with the multi-tensor kernel (foreach=True) and without it: the implementation each call named, the launches."""
    results = {}
    for foreach in (True, False):
        params = start(torch.float32)

        def zeros(w):
            return {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(w), "exp_avg_sq": torch.zeros_like(w)}

        states = [zeros(w) for w in params]
        deltas = {name: [zeros(w) for w in params] for name in ("forget", "retain")}
        before = multi_tensor.COUNTERS.launches
        implementations = []
        for step in range(steps):
            objective = "forget" if step % 3 == 0 else "retain"
            lr = 1e-2 * (1.0 - step / 10) * KWARGS["lr_multipliers"].get(objective, 1.0)
            report = dualoptim_plus(params, grads_for(step, torch.float32), states, deltas[objective], lr=lr,
                                    betas=KWARGS["betas"], base_betas=KWARGS["base_betas"], eps=KWARGS["eps"],
                                    weight_decay=KWARGS["weight_decay"], foreach=foreach, fused=True)
            implementations.append(report.implementation)
        results[foreach] = {"params": params, "implementations": implementations,
                            "launches": multi_tensor.COUNTERS.launches - before}
    return results


def main(out: str) -> None:
    runs = {}
    for dtype, compensated in ((torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, False)):
        for rule in ("safeguarded", "paper"):
            name = f"{str(dtype).removeprefix('torch.')}-{'compensated' if compensated else 'plain'}-{rule}"
            runs[name] = {multi: run(dtype, multi, rule, compensated) for multi in (True, False)}
    runs["groups"] = {multi: run(torch.float32, multi, groups=True) for multi in (True, False)}
    multi_tensor.FLUSH_NUMEL = 6000  # 5,330 + 1,000 elements: the first two tensors, then the other two
    runs["flush"] = run(torch.float32, True)
    multi_tensor.FLUSH_NUMEL = 1 << 26
    runs["nan"] = {multi: run(torch.float32, multi, nan_at=5, steps=6) for multi in (True, False)}
    runs["misaligned"] = misaligned_run()
    runs["functional"] = functional_run()
    runs["adam_stats"] = adam_stats_run()
    runs["fallback_reason"] = multi_tensor.fallbacks().get(multi_tensor.NAME)
    torch.save(runs, out)


if __name__ == "__main__":
    main(sys.argv[1])
