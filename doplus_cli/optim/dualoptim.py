"""DualOptim (Zhong et al., 2025): fully decoupled states, one complete AdamW per objective.

Each objective owns a real `torch.optim.AdamW` (32-bit) or `bitsandbytes.optim.AdamW8bit` (8-bit) over the
same parameters, so its step is exactly that optimizer's step with that objective's state. This class keeps
the public param groups (for LR schedulers and per-group options) and copies their hyper-parameters into
the inner optimizer of the objective being stepped.

With `compensated=True` (bf16 weights, `--precision bf16`) each objective's optimizer is doplus's
`optim.adamw.AdamW` instead, and all of them read and write one compensation buffer per weight (a weight
has one rounding residual, whichever objective moved it last); it is saved once, in this state_dict.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from doplus_cli.optim import quant
from doplus_cli.optim.adamw import AdamW
from doplus_cli.optim.checks import (
    check_common,
    check_lr_multipliers,
    check_objectives,
    check_param_groups,
    step_arguments,
)
from doplus_cli.optim.diagnostics import adamw_step_stats, reduce_step_stats
from doplus_cli.optim.multi_tensor import MultiTensorKernel

_SYNCED_KEYS = ("lr", "betas", "eps", "weight_decay")


class DualOptim(Optimizer):
    """One AdamW state and step counter per objective; `step(objective=k)` is AdamW with state k.

    Args:
        fused: passed to `torch.optim.AdamW` (32-bit states). None uses torch's fused kernel where torch
            supports it (CPU and CUDA floating-point parameters), which is also what makes DualOptim as
            fast as a single AdamW; False gives torch's default (single-tensor/foreach) arithmetic.
        compensated: compensated summation for bf16 weights (32-bit states only; see the module).
        full_precision: with 8-bit states, tensors whose states stay 32-bit (the embedding tables:
            `quant.adamw8bit`).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float = 1e-5,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        objectives: Sequence[str] = ("forget", "retain"),
        state_bits: int = 32,
        *,
        lr_multipliers: Mapping[str, float] | None = None,
        fused: bool | None = None,
        compensated: bool = False,
        full_precision: Iterable[Tensor] = (),
    ) -> None:
        check_common(lr, betas, eps, weight_decay, state_bits)
        if compensated and state_bits != 32:
            raise ValueError("DualOptim's compensated summation needs 32-bit states (bitsandbytes' 8-bit AdamW "
                             "has none)")
        self.compensated = compensated
        self.full_precision = list(full_precision)
        self.compensation: dict[Tensor, Tensor] = {}  # one buffer per weight, shared by the objectives
        self.objectives = check_objectives(objectives)
        self.lr_multipliers = check_lr_multipliers(lr_multipliers, self.objectives)
        self.state_bits = state_bits
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        check_param_groups(self.param_groups)
        for group in self.param_groups:
            for param in group["params"]:
                if param.is_sparse:
                    raise ValueError("DualOptim does not support sparse parameters")
        if fused is None and state_bits == 32:
            fused = all(
                p.is_floating_point() and p.device.type in ("cpu", "cuda")
                for group in self.param_groups
                for p in group["params"]
            )
        self.fused = fused
        self.inner: dict[str, Optimizer] = {name: self._make_inner() for name in self.objectives}
        # the step diagnostics' multi-tensor launches: after a failed one, this optimizer's go per tensor
        self.multi_tensor_kernel = MultiTensorKernel()

    def _make_inner(self) -> Optimizer:
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": group["params"]}
                  for group in self.param_groups]
        if self.compensated:
            return AdamW(groups, compensation=self.compensation)
        if self.state_bits == 8:
            return quant.adamw8bit(groups, self.full_precision)
        return torch.optim.AdamW(groups, fused=self.fused or None)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, objective: str | None = None) -> Any:
        """AdamW step of `objective`'s own optimizer (required: the objective whose gradient is in `.grad`), with
        the current param-group hyper-parameters. `closure` as in torch's optimizers: called under
        `torch.enable_grad()` before the update, its loss returned."""
        closure, objective = step_arguments(self, closure, objective)
        loss = None
        if closure is not None:  # before the gradients' checks below, which must see the closure's gradients
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None and param.grad.is_sparse:
                    raise ValueError("DualOptim does not support sparse gradients")
                if param.grad is not None and param.grad.stride() != param.stride():
                    # torch's fused AdamW reads the gradient in the weight's memory order; autograd's gradients
                    # share the weight's layout, a gradient assigned by hand need not
                    param.grad = torch.empty_like(param).copy_(param.grad)
        inner = self.inner[objective]
        self._last_objective = objective
        scale = self.lr_multipliers.get(objective, 1.0)
        for outer, group in zip(self.param_groups, inner.param_groups):
            for key in _SYNCED_KEYS:
                group[key] = outer[key]
            group["lr"] = outer["lr"] * scale
        inner.step()
        return loss

    def __getstate__(self) -> dict:
        # torch's Optimizer keeps only defaults, state and param_groups; a copy needs the per-objective optimizers
        return self.__dict__.copy()

    def step_diagnostics(self) -> dict[str, float]:
        """Largest |Δθ|/η and the number of elements above 10η of the last step (`diagnostics.py`)."""
        last = getattr(self, "_last_objective", None)
        if last and hasattr(self.inner[last], "step_diagnostics"):  # doplus's AdamW measures it in its kernel
            return self.inner[last].step_diagnostics()
        return reduce_step_stats(adamw_step_stats(self.inner[last], kernel=self.multi_tensor_kernel) if last else [])

    @property
    def state(self) -> defaultdict:
        """The states of every objective, per parameter: ``state[p][objective]`` is that objective's AdamW state
        (the objective's optimizer's own dict, so a tensor changed in it is changed in the optimizer) and
        ``state[p]["compensation"]`` the weight's compensation buffer. One mapping keyed by parameter, as
        `torch.optim.Optimizer.state`, with one level more because each objective has a whole AdamW state; it is
        assembled at each read, so add to it by assigning (below), not by inserting into a read copy."""
        merged: defaultdict = defaultdict(dict)
        for name, inner in self.__dict__.get("inner", {}).items():
            for param, value in inner.state.items():
                if value:
                    merged[param][name] = value
        for param, buffer in self.__dict__.get("compensation", {}).items():
            merged[param]["compensation"] = buffer
        return merged

    @state.setter
    def state(self, value: Mapping[Tensor, Mapping[str, Any]]) -> None:
        """Replace every objective's state (and the compensation buffers) with those of `value`, a mapping of
        the form `state` reads; ``opt.state = opt.state`` changes nothing."""
        if "inner" not in self.__dict__:  # Optimizer.__init__ assigns its empty state before the objectives exist
            if value:
                raise ValueError("DualOptim's state can be assigned once its objectives' optimizers exist")
            return
        per_objective: dict[str, defaultdict] = {name: defaultdict(dict) for name in self.objectives}
        compensation: dict[Tensor, Tensor] = {}
        for param, entry in value.items():
            unknown = set(entry) - set(self.objectives) - {"compensation"}
            if unknown:
                raise ValueError(f"DualOptim's state of a parameter holds {sorted(unknown)}: its keys are the "
                                 f"objectives {list(self.objectives)} and 'compensation'")
            for name in self.objectives:
                if name in entry:
                    per_objective[name][param] = entry[name]
            if "compensation" in entry:
                compensation[param] = entry["compensation"]
        for name, inner in self.inner.items():
            inner.state = per_objective[name]
        self.compensation.clear()  # the objectives' optimizers hold this same dict
        self.compensation.update(compensation)

    def __setstate__(self, state: dict) -> None:
        # torch's load_state_dict hands its state on through here; DualOptim's lives in the objectives' optimizers
        state = dict(state)
        value = state.pop("state", None)
        super().__setstate__(state)
        if value:
            self.state = value

    def _params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        state = {
            "param_groups": super().state_dict()["param_groups"],
            "state": {},
            "objectives": {name: inner.state_dict() for name, inner in self.inner.items()},
        }
        if self.compensation:
            state["compensation"] = {i: self.compensation[p] for i, p in enumerate(self._params())
                                     if p in self.compensation}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = set(self.objectives) - set(state_dict.get("objectives", {}))
        if missing:
            raise ValueError(f"state_dict has no state for objectives {sorted(missing)}")
        super().load_state_dict({"param_groups": state_dict["param_groups"], "state": {}})
        for name, inner in self.inner.items():
            inner.load_state_dict(state_dict["objectives"][name])
        params = self._params()
        self.compensation.clear()  # the inner optimizers hold this same dict
        for index, buffer in state_dict.get("compensation", {}).items():
            self.compensation[params[index]] = buffer.detach().to(params[index].device, copy=True)
