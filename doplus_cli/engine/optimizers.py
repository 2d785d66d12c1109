"""The optimizer of each update scheme, behind one call: `optimizer.step(objective=...)`.

- joint, alternate: one shared AdamW state (torch AdamW, or bitsandbytes AdamW8bit for 8-bit states);
- dualoptim: one AdamW state per objective (`DualOptim`);
- doplus: a shared base state plus one delta state per objective (`DualOptimPlus`), AdamW or Muon;
- scaffold, fedcm, local-adam: the paper's federated-learning baselines (`optim.fl_schemes`), whose base update
  or merge runs once per period of the objectives' cycle (`frequencies`).

Biases and norm weights (every parameter with fewer than 2 dimensions) get no weight decay, as in the
Hugging Face Trainer the paper's code ran on.

Under `--precision bf16` every optimizer updates the bf16 weights with compensated summation (a bf16
compensation buffer per weight, read and written inside the update kernel): DualOptim+ and DualOptim with
`compensated=True`, and joint and alternate with doplus's `optim.adamw.AdamW` in place of torch's, which has
none. Under fp32 and bf16-mixed the weights are float32 and these are torch's and bitsandbytes' optimizers.

Under FSDP every optimizer keeps states for this process's shard only, as plain tensors: DualOptim+ steps
the shards of its DTensor parameters itself; torch's and bitsandbytes' optimizers are given each shard as a
parameter of its own (`OnLocalShards`), which also lets bitsandbytes' 8-bit states work there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.optim import Optimizer

from doplus_cli.config import FL_SCHEMES, TrainConfig
from doplus_cli.optim import DualOptim, DualOptimPlus, FedCM, LocalAdam, Scaffold, muon_param_groups, quant
from doplus_cli.optim.adamw import AdamW
from doplus_cli.optim.diagnostics import adamw_step_stats, reduce_step_stats
from doplus_cli.optim.distributed import local_shard
from doplus_cli.optim.multi_tensor import MultiTensorKernel
from doplus_cli.registry import Registry


class SharedState:
    """joint / alternate: every objective steps the same optimizer state.

    `lr_multipliers` scales the learning rate of one objective's steps (`--forget-lr` with the alternate
    scheme, a task's `lr_multiplier`); the LR scheduler drives `inner`.
    """

    def __init__(self, inner: Optimizer, lr_multipliers: dict[str, float] | None = None) -> None:
        self.inner = inner
        self.lr_multipliers = dict(lr_multipliers or {})
        # the step diagnostics' multi-tensor launches: after a failed one, this optimizer's go per tensor
        self.multi_tensor_kernel = MultiTensorKernel()

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @torch.no_grad()
    def step(self, *, objective: str) -> None:
        multiplier = self._last_multiplier = self.lr_multipliers.get(objective, 1.0)
        if multiplier == 1.0:
            self.inner.step()
            return
        saved = [group["lr"] for group in self.inner.param_groups]
        for group in self.inner.param_groups:
            group["lr"] = group["lr"] * multiplier
        try:
            self.inner.step()
        finally:
            for group, lr in zip(self.inner.param_groups, saved):
                group["lr"] = lr

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step_diagnostics(self) -> dict[str, float]:
        if hasattr(self.inner, "step_diagnostics"):  # doplus's AdamW measures the step inside its kernel
            return self.inner.step_diagnostics()
        return reduce_step_stats(adamw_step_stats(self.inner, getattr(self, "_last_multiplier", 1.0),
                                                  kernel=self.multi_tensor_kernel))

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


@dataclass(frozen=True)
class OptimizerSettings:
    """What a run's optimizer is built from: `--scheme`, `--optimizer`, `--lr`, `--betas`, `--weight-decay`,
    `--state-bits`, `--doplus-rule`, `--v-floor`, `--base-update`, `--base-source`, and whether it keeps bf16
    compensation buffers."""

    scheme: str  # joint, alternate, dualoptim, doplus, scaffold, fedcm or local-adam
    optimizer: str  # DualOptim+'s inner rule: adamw or muon
    lr: float
    betas: tuple[float, float]
    weight_decay: float
    state_bits: int  # 32, or 8: 8-bit states
    rule: str  # DualOptim+'s AdamW rule: safeguarded or paper
    compensated: bool  # a bf16 compensation buffer per weight (--precision bf16)
    base_update: str = "after-param"  # DualOptim+'s ablations (paper, Tables 10, 11)
    base_source: str = "grad"
    v_floor: float = TrainConfig.v_floor  # the safeguarded rule's floor ρ on its denominator


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two param groups: matrices with weight decay, vectors (biases, norms) without."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.ndim >= 2]
    no_decay = [p for p in trainable if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


class OnLocalShards:
    """An optimizer over views of this process's shards of sharded (FSDP) parameters.

    Each view is a parameter sharing storage with its shard, so stepping it updates the model. Before each
    step it is pointed at the shard again (FSDP may move a shard to new storage, e.g. when it first pads it)
    and handed the local shard of its parameter's gradient.
    """

    def __init__(self, optimizer, pairs: list[tuple[torch.Tensor, torch.nn.Parameter]]) -> None:
        self.optimizer, self.pairs = optimizer, pairs
        self.lr_multipliers = getattr(optimizer, "lr_multipliers", {})

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def step(self, *, objective: str) -> None:
        for param, view in self.pairs:
            view.data = local_shard(param.detach())
            view.grad = None if param.grad is None else local_shard(param.grad)
        self.optimizer.step(objective=objective)

    def step_diagnostics(self) -> dict[str, float]:
        return self.optimizer.step_diagnostics()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param, view in self.pairs:
            param.grad, view.grad = None, None

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


def local_views(groups: list[dict]) -> tuple[list[dict], list[tuple[torch.Tensor, torch.nn.Parameter]]]:
    """The same param groups over parameters that view each parameter's local shard."""
    pairs, view_groups = [], []
    for group in groups:
        views = []
        for param in group["params"]:
            view = torch.nn.Parameter(local_shard(param).detach(), requires_grad=param.requires_grad)
            pairs.append((param, view))
            views.append(view)
        view_groups.append({**group, "params": views})
    return view_groups, pairs


def build_optimizer(
    model: torch.nn.Module, objectives: tuple[str, ...], multipliers: dict[str, float], settings: OptimizerSettings,
    sharded: bool = False, frequencies: Sequence[tuple[str, int]] | None = None,
) -> tuple[object, Optimizer]:
    """(the optimizer the loop steps with an objective, the torch Optimizer the LR scheduler drives).

    `objectives`: the objective names (dualoptim, doplus and the federated-learning schemes keep a state for
    each); `multipliers`: the per-objective learning-rate factors; `sharded`: the model's parameters are FSDP
    shards (DTensors); `frequencies`: the cycle [(objective, F_i), ...] the loop steps, which the
    federated-learning schemes' periods follow (None: one step each)."""
    tables = {id(weight) for weight in quant.embedding_weights(model)}
    if sharded and settings.scheme != "doplus":
        groups, pairs = local_views(decay_groups(model, settings.weight_decay))
        kept = [view for param, view in pairs if id(param) in tables]
        stepped, scheduled = _build_unsharded(settings, groups, objectives, multipliers, kept, frequencies)
        return OnLocalShards(stepped, pairs), scheduled
    if settings.scheme != "doplus":
        groups = decay_groups(model, settings.weight_decay)
        kept = [p for group in groups for p in group["params"] if id(p) in tables]
        return _build_unsharded(settings, groups, objectives, multipliers, kept, frequencies)
    if settings.optimizer == "muon":
        groups = muon_param_groups(model)
    else:
        groups = decay_groups(model, settings.weight_decay)
    optimizer = DualOptimPlus(
        groups, objectives=objectives, inner=settings.optimizer, state_bits=settings.state_bits, rule=settings.rule,
        lr_multipliers=multipliers, lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay,
        compensated=settings.compensated, base_update=settings.base_update, base_source=settings.base_source,
        v_floor=settings.v_floor,
    )
    return optimizer, optimizer


# The federated-learning baselines' optimizers, over config.FL_SCHEMES (the names config checks state_bits for).
FL_OPTIMIZERS: Registry[type] = Registry("federated-learning optimizer", type,
                                         {"scaffold": Scaffold, "fedcm": FedCM, "local-adam": LocalAdam},
                                         names=FL_SCHEMES)
FL_OPTIMIZERS.check_complete()


def _build_unsharded(
    settings: OptimizerSettings, groups: list[dict], objectives: tuple[str, ...], multipliers: dict[str, float],
    tables: list[torch.Tensor], frequencies: Sequence[tuple[str, int]] | None = None,
) -> tuple[object, Optimizer]:
    """joint / alternate (one shared state), dualoptim (one state per objective) and the federated-learning
    schemes over `groups`; with 8-bit states, `tables` (the embedding tables' parameters) keep 32-bit ones
    (`quant.adamw8bit`)."""
    common = dict(lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay)
    if settings.scheme in FL_OPTIMIZERS:  # config.py keeps them at 32-bit states
        cycle = dict(frequencies) if frequencies is not None else None
        optimizer = FL_OPTIMIZERS[settings.scheme](groups, objectives=objectives, frequencies=cycle,
                                                   lr_multipliers=multipliers, compensated=settings.compensated,
                                                   **common)
        return optimizer, optimizer
    if settings.scheme in ("joint", "alternate"):
        if settings.compensated:  # config.py refuses bf16 with these schemes' 8-bit states
            inner = AdamW(groups, compensated=True, **common)
        elif settings.state_bits == 8:
            inner = quant.adamw8bit(groups, tables, **common)
        else:
            params = [p for group in groups for p in group["params"]]
            fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params) or None
            inner = torch.optim.AdamW(groups, fused=fused, **common)
        shared = SharedState(inner, multipliers)
        return shared, inner
    optimizer = DualOptim(groups, objectives=objectives, state_bits=settings.state_bits, lr_multipliers=multipliers,
                          compensated=settings.compensated, full_precision=tables, **common)
    return optimizer, optimizer


def safeguard_fractions(counts: tuple[int, int, int] | None, device: torch.device) -> dict[str, float]:
    """DualOptim+'s floor and clamp fractions over every process's shards (a collective: every process calls
    it); {} when some process could not count (`DualOptimPlus.safeguard_counts` gave None)."""
    import torch.distributed as dist

    floored, clamped, elements = counts if counts is not None else (0, 0, 0)
    totals = torch.tensor([floored, clamped, elements, int(counts is None)], dtype=torch.int64, device=device)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    floored, clamped, elements, missing = totals.tolist()
    if missing or not elements:
        return {}
    return {"floor_fraction": floored / elements, "clamp_fraction": clamped / elements}
