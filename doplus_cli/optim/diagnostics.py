"""Step diagnostics for every scheme: the largest |Δθ|/η of an optimizer step and how many elements moved
more than 10η.

DualOptim+ computes them inside its update kernels (`DualOptimPlus.step_diagnostics`). The AdamW-based
schemes (joint and alternate through torch's AdamW or bitsandbytes' AdamW8bit, and DualOptim's per-objective
AdamW) step inside those libraries, so their step is recovered from the optimizer state just written: AdamW's
update direction uses the moments *after* the step, so for each element

    u = m̂ / (sqrt(v̂) + ε),   m̂ = m / (1 − β1^t),  v̂ = v / (1 − β2^t)
    θ_old = (θ + η·u) / (1 − η·λ),   |Δθ|/η = |u + λ·θ_old|

which is the step exactly (up to rounding), without a copy of the weights. bitsandbytes' AdamW8bit steps
with float moments and then re-quantises them, so the step recovered from its stored 8-bit codes carries their
quantisation error (a few percent, up to 7% measured): enough to tell a 10-lr step from a 1-lr one. The pass
over m, v and θ is one compiled reduction per tensor (`adam_update_stats`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from doplus_cli.optim import multi_tensor as mt
from doplus_cli.optim.kernels import BIG_UPDATE, CompiledKernel


def _adam_ratio_stats(theta: Tensor, m: Tensor, v: Tensor, hp: Tensor) -> tuple[Tensor, Tensor]:
    """(max |Δθ|/η, #elements above BIG_UPDATE) of an AdamW step; hp = [1/bc1, 1/bc2, ε, η, λ, 1/(1 − ηλ)]."""
    inv_bc1, inv_bc2, eps, lr, wd, inv_decay = (hp[i] for i in range(6))
    u = (m * inv_bc1) / ((v * inv_bc2).sqrt() + eps)
    theta_old = (theta + lr * u) * inv_decay
    ratio = (u + wd * theta_old).abs()
    return ratio.amax(), (ratio > BIG_UPDATE).sum()


_adam_ratio_compiled = CompiledKernel(_adam_ratio_stats, "AdamW step diagnostics")


def adam_update_stats(theta: Tensor, m: Tensor, v: Tensor, step: float, group: dict, lr: float
                      ) -> tuple[Tensor, Tensor]:
    """The diagnostics of one tensor's AdamW step from its post-step state (float32 or float64 math)."""
    beta1, beta2 = group["betas"]
    wd = float(group.get("weight_decay", 0.0))
    dtype = torch.promote_types(m.dtype, torch.float32)
    hp = torch.tensor(
        [1.0 / (1.0 - beta1**step), 1.0 / (1.0 - beta2**step), group["eps"], lr, wd, 1.0 / (1.0 - lr * wd)],
        dtype=dtype, device=m.device,
    )
    args = (theta.detach().reshape(-1).to(dtype), m.reshape(-1).to(dtype), v.reshape(-1).to(dtype), hp)
    if theta.numel() < (1 << 16):  # the compiled call's overhead outweighs a small tensor's pass
        return _adam_ratio_stats(*args)
    return _adam_ratio_compiled(*args)


def _bnb_moment(state: dict, index: int) -> Tensor:
    """bitsandbytes' first (1) or second (2) moment as float32, dequantised when stored in 8 bits."""
    stored = state[f"state{index}"]
    if stored.dtype != torch.uint8:
        return stored
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_blockwise(
        stored, absmax=state[f"absmax{index}"], code=state[f"qmap{index}"], blocksize=256
    )


def adamw_step_stats(optimizer: torch.optim.Optimizer, lr_scale: float = 1.0, multi_tensor: bool | None = None,
                     kernel: mt.MultiTensorKernel | None = None) -> list[tuple[Tensor, Tensor]]:
    """Per-tensor diagnostics of the step `optimizer` (torch AdamW or bitsandbytes AdamW8bit) just took.

    `multi_tensor`: float32 moments go through one Triton launch per device and weight dtype
    (`multi_tensor.adam_stats`) instead of one compiled call per tensor: None on CUDA with Triton, True also on
    CPU tensors (Triton's interpreter, for tests), False never. On an H200 a compiled call costs ~0.2 ms of host
    time (measured for the DualOptim+ update kernel), an estimated 50 ms of the 133 ms Alternate step of a 135M
    model's 272 tensors.

    `kernel`: the caller's record of a failed launch, kept across its steps (after one, ``multi_tensor=None``
    takes the per-tensor path); None: a record for this call alone."""
    kernel = kernel or mt.MultiTensorKernel()
    stats = []
    batches: dict[tuple, tuple[list, list]] = {}  # (device, weight dtype) → (θ, m, v) entries, their rows
    rows: dict[tuple, int] = {}
    scalars: list[list[float]] = []
    stepped = [(group, param, optimizer.state[param]) for group in optimizer.param_groups for param in group["params"]
               if param.grad is not None and optimizer.state.get(param)]
    steps = step_counts([state["step"] for _, _, state in stepped])
    for (group, param, state), step in zip(stepped, steps):
        lr = float(group["lr"]) * lr_scale
        if "exp_avg" in state:
            m, v = state["exp_avg"], state["exp_avg_sq"]
        else:
            m, v = _bnb_moment(state, 1), _bnb_moment(state, 2)
        theta = param.detach()
        use = multi_tensor is not False and (multi_tensor is True or kernel.available(theta.device))
        if use and mt.stats_eligible(theta, m, v):
            row = _scalar_row(rows, scalars, group, step, lr)
            entries, entry_rows = batches.setdefault((theta.device, theta.dtype), ([], []))
            entries.append((theta, m, v))
            entry_rows.append(row)
            continue
        stats.append(adam_update_stats(param, m, v, step, group, lr))
    for (device, _), (entries, entry_rows) in batches.items():
        hp = torch.tensor(scalars, dtype=torch.float32).to(device, non_blocking=True)
        try:
            stats.append(mt.adam_stats(entries, entry_rows, hp))
        except Exception as error:  # noqa: BLE001 - a compiler or driver error: stay correct, say so once
            kernel.failed(error)
            stats.extend(_adam_ratio_stats(t.reshape(-1).float(), m.reshape(-1), v.reshape(-1), hp[row])
                         for (t, m, v), row in zip(entries, entry_rows))
    return stats


def step_counts(counters: list) -> list[float]:
    """The values of optimizers' step counters, read with one transfer per device: torch's fused AdamW keeps
    them on the GPU, where reading each with `float()` waits for the device once per tensor (272 waits per step
    of a 135M model)."""
    values = [0.0] * len(counters)
    by_device: dict[torch.device, list[int]] = {}
    for i, counter in enumerate(counters):
        if isinstance(counter, Tensor):
            by_device.setdefault(counter.device, []).append(i)
        else:  # bitsandbytes counts in a Python int
            values[i] = float(counter)
    for indices in by_device.values():
        read = torch.stack([counters[i].reshape(()).double() for i in indices]).tolist()
        for i, value in zip(indices, read):
            values[i] = value
    return values


def _scalar_row(rows: dict, scalars: list, group: dict, step: float, lr: float) -> int:
    """The row of [1/bc1, 1/bc2, ε, η, λ, 1/(1 − ηλ)] for this group, step and lr (added when new)."""
    key = (id(group), step, lr)
    if key not in rows:
        beta1, beta2 = group["betas"]
        wd = float(group.get("weight_decay", 0.0))
        rows[key] = len(scalars)
        scalars.append([1.0 / (1.0 - beta1**step), 1.0 / (1.0 - beta2**step), group["eps"], lr, wd,
                        1.0 / (1.0 - lr * wd)])
    return rows[key]


def reduce_step_stats(stats: list[tuple[Tensor, Tensor]]) -> dict[str, float]:
    """Per-tensor (max |Δθ|/η, count above 10η) pairs → one step's diagnostics (one host sync)."""
    if not stats:
        return {"max_update": 0.0, "big_updates": 0}
    device = stats[0][0].device
    largest = torch.stack([m.to(device, torch.float64) for m, _ in stats]).amax()
    count = torch.stack([c.to(device, torch.int64) for _, c in stats]).sum()
    return {"max_update": float(largest), "big_updates": int(count)}
