"""AdamW with compensated summation for bfloat16 weights (`--precision bf16`).

`torch.optim.AdamW` writes its update straight into the weight: with bf16 weights an update below bf16's
spacing (1.2e-4 next to a weight of 0.02; an AdamW step is about lr = 1e-5) rounds back to the same value
and is lost. This AdamW keeps float32 moments and, for each bf16 parameter, a bf16 compensation buffer that
its one-pass kernel reads and writes with the weight (`kernels.adamw_fused`; the rule and the compensated
write are documented in `kernels.py`). joint and alternate step with it, and DualOptim builds one per
objective over a compensation buffer they share, under `--precision bf16`; with float32 weights or
`compensated=False` it is the plain AdamW rule (the engine keeps torch's fused AdamW there).

State of one parameter: step (float32 scalar), exp_avg, exp_avg_sq (float32), compensation (bf16;
only for bf16 weights, and only when this optimizer owns the buffers).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from doplus_cli.optim.checks import check_common, check_param_groups, with_built_settings
from doplus_cli.optim.diagnostics import reduce_step_stats
from doplus_cli.optim.kernels import FUSED_MIN_NUMEL, AdamWScalars, adamw_fused, adamw_reference

LOW_PRECISION = (torch.bfloat16,)  # weights whose updates get a compensation buffer


def new_compensation(local: Tensor) -> Tensor | None:
    """A zero compensation buffer for a low-precision weight (or its local shard); None for float32."""
    if local.dtype not in LOW_PRECISION:
        return None
    return torch.zeros_like(local, memory_format=torch.contiguous_format)


class AdamW(Optimizer):
    """AdamW (decoupled weight decay) with float32 states and compensated bf16 weights.

    Args:
        compensated: keep a compensation buffer for every bf16 parameter (False: updates round into
            the weight as torch's AdamW does).
        compensation: a dict {parameter: buffer} shared with other optimizers over the same weights (one
            buffer per weight, whichever state steps it); None: the buffers live in this optimizer's state.
        fused: the compiled one-pass kernel (True), the eager reference (False), or by size (None).

    ``compensated`` and ``fused`` are defaults of the param groups, as ``lr`` is: a group may set its own, and
    `state_dict` carries them.
    """

    def __init__(
        self, params: Iterable[Tensor] | Iterable[dict], lr: float = 1e-5, betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8, weight_decay: float = 0.0, *, compensated: bool = True,
        compensation: dict[Tensor, Tensor] | None = None, fused: bool | None = None,
    ) -> None:
        check_common(lr, betas, eps, weight_decay, 32)
        self.shared_compensation = compensation
        self._step_stats: list[tuple[Tensor, Tensor]] = []
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, compensated=compensated,
                        fused=fused)
        super().__init__(params, defaults)
        check_param_groups(self.param_groups)

    def _compensation(self, param: Tensor, state: dict, group: dict) -> Tensor | None:
        if not group["compensated"] or param.dtype not in LOW_PRECISION:
            return None
        store = state if self.shared_compensation is None else self.shared_compensation
        key = "compensation" if self.shared_compensation is None else param
        if key not in store:
            store[key] = new_compensation(param)
        return store[key]

    @staticmethod
    def _use_fused(param: Tensor, grad: Tensor, fused: bool | None) -> bool:
        if fused is False or not (param.is_contiguous() and grad.is_contiguous()):
            return False
        return fused is True or param.numel() >= FUSED_MIN_NUMEL

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step_stats = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "step" not in state:
                    state_dtype = torch.promote_types(param.dtype, torch.float32)
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, dtype=state_dtype, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
                state["step"] += 1
                s = AdamWScalars(lr=float(group["lr"]), weight_decay=group["weight_decay"], beta1=beta1, beta2=beta2,
                                 eps=group["eps"], step=int(state["step"].item()))
                compensation = self._compensation(param, state, group)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if self._use_fused(param, param.grad, group["fused"]):
                    stats = adamw_fused(param, param.grad, m, v, s.packed(param.device, m.dtype), compensation)
                else:
                    stats = adamw_reference(param, param.grad, m, v, s, compensation)
                self._step_stats.append(stats)
        return loss

    def __getstate__(self) -> dict:
        # torch's Optimizer keeps only defaults, state and param_groups; a copy needs the shared compensation
        return self.__dict__.copy()

    def step_diagnostics(self) -> dict[str, float]:
        """Of the last step: the largest |Δθ|/η and the number of elements above 10η, read from the master
        weight (θ_bf16 + c) inside the update kernel."""
        return reduce_step_stats(self._step_stats)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As `torch.optim.Optimizer`, but every state tensor keeps its saved dtype (torch casts states to the
        parameter's dtype: float32 moments of a bf16 weight would become bf16). The state dicts of doplus 0.1.0
        and 0.2.0 kept ``compensated`` and ``fused`` on the optimizer: each group takes them from the group as this
        optimizer was built (its own value, else the constructor's)."""
        super().load_state_dict(with_built_settings(state_dict, self.param_groups))
        params = [p for group in self.param_groups for p in group["params"]]
        for index, saved in state_dict["state"].items():
            self.state[params[index]] = clone_state(saved, params[index].device)


def clone_state(value: Any, device: torch.device) -> Any:
    """A saved optimizer state (tensors, nested dicts) copied onto `device`, every tensor in its saved dtype."""
    if isinstance(value, Tensor):
        if value.ndim == 0 and value.dtype == torch.float32:  # step counters stay on the host, as in torch
            return value.detach().clone()
        return value.detach().to(device=device, copy=True)
    if isinstance(value, dict):
        return {k: clone_state(v, device) for k, v in value.items()}
    return value


def compensation_buffers(optimizer) -> dict[Tensor, Tensor]:
    """{parameter: compensation buffer} of a doplus optimizer (DualOptimPlus, DualOptim, AdamW, or the engine's
    wrapper of one); empty where there are none."""
    shared = getattr(optimizer, "compensation", None)  # DualOptim: one dict shared by its objectives
    if isinstance(shared, dict):
        return dict(shared)
    if getattr(optimizer, "shared_compensation", None) is not None:
        return dict(optimizer.shared_compensation)
    inner = getattr(optimizer, "inner", None)  # the engine's SharedState around one AdamW
    if isinstance(inner, Optimizer):
        return compensation_buffers(inner)
    return {param: state["compensation"] for param, state in getattr(optimizer, "state", {}).items()
            if isinstance(state, dict) and "compensation" in state}
