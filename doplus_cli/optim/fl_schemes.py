"""The federated-learning baselines the paper compares DualOptim+ with (its appendix "Comparison with Federated
Learning Methods", Table `tab:fl`), adapted as the paper adapts them to the forget/retain cycle:

* `Scaffold` (SCAFFOLD and MIME share this adaptation): a base state B and one delta state per objective,
  the delta a residual against the base, Δ_k ← β·Δ_k + (1 − β)·(g − B), as in DualOptim+; the base changes
  only once per period, B ← B + mean_k Δ̂_k.
* `FedCM`: the delta follows the gradient itself, Δ_k ← β·Δ_k + (1 − β)·g; the base changes once per period
  as in `Scaffold`.
* `LocalAdam`: one complete AdamW state per objective (as DualOptim), all merged into their mean,
  S_k ← mean_j S_j, once per period.

    opt = Scaffold(model.parameters(), lr=1e-5, frequencies={"forget": 1, "retain": 5})
    loss_forget.backward(); opt.step(objective="forget"); opt.zero_grad()
    for _ in range(5): loss_retain.backward(); opt.step(objective="retain"); opt.zero_grad()   # period ends here

**The period.** A period is one pass of the cycle: every objective k takes its F_k steps (`frequencies`). The
optimizer counts each objective's steps since the last period ended; the step that completes the last count
ends the period, and the base update (or the merge) runs right after that step's parameter update. An
objective that steps more often than F_k in one period is refused (`ValueError`): the caller's cycle and the
optimizer's would disagree. The counts are part of `state_dict()`, so a checkpoint taken inside a period
resumes it. Objectives with F_k = 0 take no steps and are not part of a period.

**What the paper leaves open, and what doplus does** (the same choices in the three classes):

* *Bias correction at the period boundary.* The base update and the merge use the bias-corrected states,
  Δ̂_k = Δ_k / (1 − β^t_k) and Ŝ_k (Adam's m̂, v̂), each with its objective's own step count t_k: the
  objectives take different numbers of steps (F_f ≠ F_r), so their raw averages carry different biases.
  The base itself is not an average started from zero (it is a sum of bias-corrected terms), so it is used
  as it is: B, never B̂.
* *The update.* As DualOptim+ forms it (Algorithm 1, line 16), base plus bias-corrected delta, for the first
  moment and the second alike: θ ← θ·(1 − ηλ) − η·(B_m + m̂_k) / (sqrt(|B_v + v̂_k|) + ε). For FedCM, whose
  delta already follows the whole gradient, this counts the base on top of it, and the base sums the
  objectives' mean momenta of every period so far: its steps grow with the number of periods (a constant
  gradient moves it sqrt(n + 1) learning rates after n periods). That is the rule as the paper writes it;
  doplus does not change it.
* *Adam's second moment.* Treated exactly as the first: its own base and deltas (Scaffold, FedCM; the delta's
  input is g² − B_v or g²), merged like the first moment (LocalAdam: v_k ← mean_j v̂_j, re-biased below).
* *Step counters after a boundary.* Kept: t_k counts objective k's steps over the whole run. After the merge,
  LocalAdam stores each objective's merged state re-biased for its own count, S_k = Ŝ·(1 − β^t_k), so that its
  next bias correction reads back exactly the merged mean. The deltas of Scaffold and FedCM are left as they
  are by the base update.
* *Which objectives are averaged.* The objectives of the period (F_k > 0) that have stepped this parameter
  (a parameter without a gradient in an objective's steps has no state for it).

States are float32 (float64 for float64 parameters); with `compensated=True` bf16 weights keep a compensation
buffer, as DualOptim+'s (`kernels.py`). The arithmetic is eager PyTorch, one line per line of the rule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from doplus_cli.optim.adamw import clone_state, new_compensation
from doplus_cli.optim.checks import (
    check_common,
    check_lr_multipliers,
    check_objectives,
    check_param_groups,
    step_arguments,
)
from doplus_cli.optim.diagnostics import reduce_step_stats
from doplus_cli.optim.kernels import BIG_UPDATE, read_master, write_master

PERIOD_KEY = "period"  # state_dict key: each objective's steps in the current period


def check_frequencies(frequencies: Mapping[str, int] | Sequence[tuple[str, int]] | None,
                      objectives: tuple[str, ...]) -> dict[str, int]:
    """{objective: F_k} for every objective (None: one step each); F_k whole numbers >= 0, at least one > 0."""
    if frequencies is None:
        return {name: 1 for name in objectives}
    items = dict(frequencies.items() if isinstance(frequencies, Mapping) else frequencies)
    if set(items) != set(objectives):
        raise ValueError(f"frequencies must give F_k for exactly the objectives {list(objectives)}, got {items}")
    for name, value in items.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"frequency of {name!r} must be a whole number >= 0, got {value!r}")
    if not any(items.values()):
        raise ValueError("at least one objective needs a frequency > 0")
    return {name: items[name] for name in objectives}


class PeriodicOptimizer(Optimizer):
    """What the three schemes share: objectives and their frequencies, the period's step counts, learning-rate
    multipliers, compensation buffers, diagnostics and checkpoints. Subclasses implement `_update` (one
    parameter's step) and `_end_period` (the base update or the merge)."""

    def __init__(
        self, params: Iterable[Tensor] | Iterable[dict], lr: float, betas: tuple[float, float], eps: float,
        weight_decay: float, objectives: Sequence[str], frequencies: Mapping[str, int] | None,
        lr_multipliers: Mapping[str, float] | None, compensated: bool,
    ) -> None:
        check_common(lr, betas, eps, weight_decay, 32)
        self.objectives = check_objectives(objectives)
        self.frequencies = check_frequencies(frequencies, self.objectives)
        self.lr_multipliers = check_lr_multipliers(lr_multipliers, self.objectives)
        self.compensated = compensated
        self.period_steps = {name: 0 for name in self.objectives}
        self.periods_ended = 0  # in this process, since construction or the last load_state_dict (tests read it)
        self._step_stats: list[tuple[Tensor, Tensor]] = []
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        check_param_groups(self.param_groups)

    # -- the period --------------------------------------------------------------------------------------

    def _count_step(self, objective: str) -> bool:
        """Count a step of `objective` in the current period; True when it completes the period."""
        if self.period_steps[objective] >= self.frequencies[objective]:
            raise ValueError(
                f"objective {objective!r} stepped more than its frequency {self.frequencies[objective]} in one "
                f"period (steps so far: {self.period_steps}); step the objectives in the cycle given as "
                f"frequencies={self.frequencies}")
        self.period_steps[objective] += 1
        return all(self.period_steps[k] == f for k, f in self.frequencies.items())

    # -- the step ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, objective: str | None = None) -> Any:
        """Update every parameter that has a gradient with the gradient of `objective` (required); after the step
        that completes the period, the base update (or the merge). `closure` as in torch's optimizers: called
        under `torch.enable_grad()` before the update, its loss returned."""
        closure, objective = step_arguments(self, closure, objective)
        ends_period = self._count_step(objective)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        lr_scale = self.lr_multipliers.get(objective, 1.0)
        self._step_stats = []
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise ValueError(f"{type(self).__name__} does not support sparse gradients")
                state = self.state[param]
                if not state:
                    self._init_state(param, state)
                if objective not in state["delta"]:
                    state["delta"][objective] = _zero_moments(param)
                delta = state["delta"][objective]
                delta["step"] += 1
                self._step_stats.append(self._update(param, param.grad, group, state, delta, lr_scale))
        if ends_period:
            self._end_period()
            self.period_steps = {name: 0 for name in self.objectives}
            self.periods_ended += 1
        return loss

    def _init_state(self, param: Tensor, state: dict) -> None:
        state["delta"] = {}
        if self.compensated:
            compensation = new_compensation(param)
            if compensation is not None:
                state["compensation"] = compensation

    def _objective_states(self, state: dict) -> list[dict]:
        """The states of the period's objectives that have stepped this parameter."""
        return [state["delta"][k] for k, f in self.frequencies.items()
                if f > 0 and k in state["delta"] and int(state["delta"][k]["step"]) > 0]

    def _update(self, param: Tensor, grad: Tensor, group: dict, state: dict, delta: dict, lr_scale: float
                ) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def _end_period(self) -> None:
        raise NotImplementedError

    # -- diagnostics and checkpoints ---------------------------------------------------------------------

    def step_diagnostics(self) -> dict[str, float]:
        """Of the last step: the largest |Δθ|/η and the number of elements above 10η."""
        return reduce_step_stats(self._step_stats)

    def __getstate__(self) -> dict:
        # torch's Optimizer keeps only defaults, state and param_groups; a copy needs the period too
        return self.__dict__.copy()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state[PERIOD_KEY] = dict(self.period_steps)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As `torch.optim.Optimizer`, every state tensor in its saved dtype, and the period's step counts."""
        state_dict = dict(state_dict)
        period = state_dict.pop(PERIOD_KEY, None)
        if period is None or set(period) != set(self.objectives):
            raise ValueError(f"state_dict has no period step counts for objectives {list(self.objectives)}")
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, saved in state_dict["state"].items():
            self.state[params[index]] = clone_state(saved, params[index].device)
        self.period_steps = {name: int(period[name]) for name in self.objectives}


def _zero_moments(param: Tensor) -> dict:
    dtype = torch.promote_types(param.dtype, torch.float32)
    return {"step": torch.tensor(0.0, dtype=torch.float32),
            "exp_avg": torch.zeros_like(param, dtype=dtype, memory_format=torch.contiguous_format),
            "exp_avg_sq": torch.zeros_like(param, dtype=dtype, memory_format=torch.contiguous_format)}


def _bias_corrected(moments: dict, betas: tuple[float, float]) -> tuple[Tensor, Tensor]:
    """(m / (1 − β1^t), v / (1 − β2^t)) of one objective's moments, t its step count."""
    t = int(moments["step"])
    return moments["exp_avg"] / (1.0 - betas[0] ** t), moments["exp_avg_sq"] / (1.0 - betas[1] ** t)


def _apply(param: Tensor, compensation: Tensor | None, theta_old: Tensor, m: Tensor, v_abs: Tensor, lr: float,
           eps: float, weight_decay: float) -> tuple[Tensor, Tensor]:
    """θ ← θ·(1 − ηλ) − η·m / (sqrt(v) + ε); returns the step diagnostics (largest |Δθ|/η, count above 10η)."""
    direction = m / (v_abs.sqrt() + eps)
    write_master(param, compensation, theta_old * (1.0 - lr * weight_decay) - lr * direction)
    ratio = (weight_decay * theta_old + direction).abs()
    if ratio.numel() == 0:
        return ratio.new_zeros(()), torch.zeros((), dtype=torch.int64)
    return ratio.amax(), (ratio > BIG_UPDATE).sum()


class PeriodicBase(PeriodicOptimizer):
    """Base + delta states with the base updated once per period (`Scaffold`, `FedCM`; the module says how).

    Args:
        delta_input: "residual" (the delta follows g − B: SCAFFOLD/MIME) or "gradient" (the delta follows g:
            FedCM).
        frequencies: {objective: F_k}, the cycle the caller steps (None: one step each, in any order).
        Others as `DualOptimPlus` (32-bit states only).

    State of one parameter: ``exp_avg``, ``exp_avg_sq`` the base B_m, B_v; ``delta[k]`` with ``step`` (t_k),
    ``exp_avg``, ``exp_avg_sq``; ``compensation`` for a bf16 weight with ``compensated=True``.
    """

    DELTA_INPUTS = ("residual", "gradient")

    def __init__(
        self, params: Iterable[Tensor] | Iterable[dict], lr: float = 1e-5, betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8, weight_decay: float = 0.0, objectives: Sequence[str] = ("forget", "retain"), *,
        delta_input: str = "residual", frequencies: Mapping[str, int] | None = None,
        lr_multipliers: Mapping[str, float] | None = None, compensated: bool = False,
    ) -> None:
        if delta_input not in self.DELTA_INPUTS:
            raise ValueError(f"delta_input must be one of {list(self.DELTA_INPUTS)}, got {delta_input!r}")
        self.delta_input = delta_input
        super().__init__(params, lr, betas, eps, weight_decay, objectives, frequencies, lr_multipliers, compensated)

    def _init_state(self, param: Tensor, state: dict) -> None:
        base = _zero_moments(param)
        state["exp_avg"], state["exp_avg_sq"] = base["exp_avg"], base["exp_avg_sq"]
        super()._init_state(param, state)

    def _update(self, param: Tensor, grad: Tensor, group: dict, state: dict, delta: dict, lr_scale: float
                ) -> tuple[Tensor, Tensor]:
        beta1, beta2 = group["betas"]
        base_m, base_v = state["exp_avg"], state["exp_avg_sq"]
        m, v = delta["exp_avg"], delta["exp_avg_sq"]
        compensation = state.get("compensation")
        g = grad.to(m.dtype)
        theta_old = read_master(param, compensation, m.dtype)
        if self.delta_input == "residual":  # Δ ← βΔ + (1 − β)(g − B)  (appendix, SCAFFOLD/MIME)
            m.copy_(beta1 * m + (1.0 - beta1) * (g - base_m))
            v.copy_(beta2 * v + (1.0 - beta2) * (g * g - base_v))
        else:  # Δ ← βΔ + (1 − β)g  (appendix, FedCM)
            m.copy_(beta1 * m + (1.0 - beta1) * g)
            v.copy_(beta2 * v + (1.0 - beta2) * (g * g))
        m_hat, v_hat = _bias_corrected(delta, (beta1, beta2))
        return _apply(param, compensation, theta_old, base_m + m_hat, (base_v + v_hat).abs(),
                      float(group["lr"]) * lr_scale, group["eps"], group["weight_decay"])

    def _end_period(self) -> None:
        """B ← B + mean_k Δ̂_k for both moments (appendix), each Δ̂_k with its objective's own step count."""
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state.get(param)
                if not state:
                    continue
                deltas = self._objective_states(state)
                if not deltas:
                    continue
                corrected = [_bias_corrected(delta, group["betas"]) for delta in deltas]
                state["exp_avg"].add_(torch.stack([m for m, _ in corrected]).mean(0))
                state["exp_avg_sq"].add_(torch.stack([v for _, v in corrected]).mean(0))


class Scaffold(PeriodicBase):
    """SCAFFOLD / MIME as the paper adapts them: the delta a residual against the base (as DualOptim+), the base
    updated once per period by B ← B + mean_k Δ̂_k. Arguments as `PeriodicBase`."""

    def __init__(self, params: Iterable[Tensor] | Iterable[dict], lr: float = 1e-5,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 objectives: Sequence[str] = ("forget", "retain"), **options: Any) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, objectives, delta_input="residual", **options)


class FedCM(PeriodicBase):
    """FedCM as the paper adapts it: the delta follows the gradient, Δ ← βΔ + (1 − β)g, the base updated once
    per period by B ← B + mean_k Δ̂_k. Arguments as `PeriodicBase`."""

    def __init__(self, params: Iterable[Tensor] | Iterable[dict], lr: float = 1e-5,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 objectives: Sequence[str] = ("forget", "retain"), **options: Any) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, objectives, delta_input="gradient", **options)


class LocalAdam(PeriodicOptimizer):
    """Local Adam as the paper adapts it: one AdamW state per objective (as DualOptim), merged after each period
    into the objectives' mean, S_k ← mean_j Ŝ_j re-biased for t_k (the module says why).

    Args:
        frequencies: {objective: F_k}, the cycle the caller steps (None: one step each, in any order).
        Others as `DualOptim` (32-bit states only).

    State of one parameter: ``delta[k]`` with ``step`` (t_k), ``exp_avg``, ``exp_avg_sq`` (objective k's AdamW
    moments; the key is shared with the base/delta schemes); ``compensation`` as `PeriodicBase`.
    """

    def __init__(
        self, params: Iterable[Tensor] | Iterable[dict], lr: float = 1e-5, betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8, weight_decay: float = 0.0, objectives: Sequence[str] = ("forget", "retain"), *,
        frequencies: Mapping[str, int] | None = None, lr_multipliers: Mapping[str, float] | None = None,
        compensated: bool = False,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, objectives, frequencies, lr_multipliers, compensated)

    def _update(self, param: Tensor, grad: Tensor, group: dict, state: dict, delta: dict, lr_scale: float
                ) -> tuple[Tensor, Tensor]:
        beta1, beta2 = group["betas"]
        m, v = delta["exp_avg"], delta["exp_avg_sq"]
        compensation = state.get("compensation")
        g = grad.to(m.dtype)
        theta_old = read_master(param, compensation, m.dtype)
        m.copy_(beta1 * m + (1.0 - beta1) * g)  # AdamW with objective k's state
        v.copy_(beta2 * v + (1.0 - beta2) * (g * g))
        m_hat, v_hat = _bias_corrected(delta, (beta1, beta2))
        return _apply(param, compensation, theta_old, m_hat, v_hat, float(group["lr"]) * lr_scale, group["eps"],
                      group["weight_decay"])

    def _end_period(self) -> None:
        """S = mean_k Ŝ_k (appendix: S = ½(S_f + S_r)) for both moments; each objective keeps S re-biased for its
        own step count, so its next bias correction reads S back."""
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                state = self.state.get(param)
                if not state:
                    continue
                moments = self._objective_states(state)
                if not moments:
                    continue
                corrected = [_bias_corrected(moment, (beta1, beta2)) for moment in moments]
                merged_m = torch.stack([m for m, _ in corrected]).mean(0)
                merged_v = torch.stack([v for _, v in corrected]).mean(0)
                for moment in moments:
                    t = int(moment["step"])
                    moment["exp_avg"].copy_(merged_m * (1.0 - beta1**t))
                    moment["exp_avg_sq"].copy_(merged_v * (1.0 - beta2**t))
