"""DualOptim+: one shared base optimizer state plus one delta state per objective (paper, Section 3.2).

    opt = DualOptimPlus(model.parameters(), lr=1e-5, objectives=("forget", "retain"))
    loss_forget.backward(); opt.step(objective="forget"); opt.zero_grad()
    loss_retain.backward(); opt.step(objective="retain"); opt.zero_grad()

The caller always names the objective whose gradient is in `.grad`; nothing is inferred from a counter.
The update rules are in `kernels.py`; this class owns hyper-parameters, state layout and dispatch.

State of one parameter (plain tensors and dicts, so `torch.load(weights_only=True)` can read it):

    step                         t_B, float32 scalar tensor, counts every update of this parameter
    exp_avg, exp_avg_sq          m_B, v_B (AdamW rule)      | momentum_buffer  m_B (Muon rule)
    delta[k].step                t_k, counts updates by objective k
    delta[k].exp_avg, .exp_avg_sq   m_k, v_k                | delta[k].momentum_buffer
    <name>_absmax                with 8-bit states: <name> holds uint8 codes, this the fp32 block absmax
    compensation                 with bf16 weights and compensated=True: the weight's compensation buffer
                                 (bf16, the size of the weight; `kernels.py`), shared by every objective

A sharded parameter (a DTensor, as FSDP2 makes it) is updated through its local shard: every state above is
a plain tensor the size of this process's shard, so each process keeps states only for its own part, the
elementwise AdamW rule and its 8-bit codes run on the shard unchanged, and only Muon's orthogonalisation
gathers the whole matrix.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.optim import Optimizer

from doplus_cli.optim import multi_tensor, quant
from doplus_cli.optim.adamw import clone_state, new_compensation
from doplus_cli.optim.checks import (
    check_common,
    check_lr_multipliers,
    check_objectives,
    step_arguments,
    with_built_settings,
)
from doplus_cli.optim.diagnostics import reduce_step_stats, step_counts
from doplus_cli.optim.distributed import local_shard
from doplus_cli.optim.kernels import (
    FUSED_MIN_NUMEL,
    AdamWPlusScalars,
    MuonPlusScalars,
    adamw_plus_fused,
    adamw_plus_fused_8bit,
    adamw_plus_reference,
    muon_plus_reference,
    newton_schulz,
)
from doplus_cli.optim.multi_tensor import MultiTensorKernel, triton_installed

INNER_OPTIMIZERS = ("adamw", "muon")
RULES = ("safeguarded", "paper")
QUANTIZE_CHOICES = ("all", "base", "delta")
BASE_UPDATES = ("after-param", "before-delta", "after-delta")  # the paper's Table 10; the first is the rule
BASE_SOURCES = ("grad", "grad-minus-delta")  # the paper's Table 11; the first is the rule
FUSED_8BIT_CHUNK_ROWS = 512  # 128k elements per call of the 8-bit kernel

# a param group's settings that the AdamW rule's scalars take (`adamw_plus_scalars`), beside its learning rate
ADAMW_RULE_SETTINGS = ("betas", "base_betas", "eps", "weight_decay", "rule", "v_floor", "max_update", "base_update",
                       "base_source")

_ADAMW_STATES = ("exp_avg", "exp_avg_sq")
_MUON_STATES = ("momentum_buffer",)


def check_group(group: Mapping[str, Any]) -> None:
    """A param group's settings (or the constructor's, before any group takes them), as `DualOptimPlus` takes
    them; ValueError names the first that is not."""
    check_common(group["lr"], group["betas"], group["eps"], group["weight_decay"], group["state_bits"])
    base_betas = group["base_betas"]
    if base_betas is not None and (len(base_betas) != 2 or not all(0.0 <= b < 1.0 for b in base_betas)):
        raise ValueError(f"base_betas must be two numbers in [0, 1) or None, got {base_betas!r}")
    if group["inner"] not in INNER_OPTIMIZERS:
        raise ValueError(f"unknown inner optimizer {group['inner']!r}: choose one of {list(INNER_OPTIMIZERS)}")
    if group["quantize"] not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of {list(QUANTIZE_CHOICES)}, got {group['quantize']!r}")
    if group["rule"] not in RULES:
        raise ValueError(f"unknown rule {group['rule']!r}: choose one of {list(RULES)}")
    base_update, base_source = group["base_update"], group["base_source"]
    if base_update not in BASE_UPDATES:
        raise ValueError(f"unknown base_update {base_update!r}: choose one of {list(BASE_UPDATES)}")
    if base_source not in BASE_SOURCES:
        raise ValueError(f"unknown base_source {base_source!r}: choose one of {list(BASE_SOURCES)}")
    if not 0.0 <= group["v_floor"] < 1.0:
        raise ValueError(f"v_floor must be in [0, 1), got {group['v_floor']}")
    if not group["max_update"] > 0.0:
        raise ValueError(f"max_update must be > 0, got {group['max_update']}")
    if group["multi_tensor"] is True and not triton_installed():
        raise ValueError("multi_tensor=True needs Triton (pip install triton)")
    if (base_update, base_source) == (BASE_UPDATES[0], BASE_SOURCES[0]):
        return
    if group["fused"] is True or group["multi_tensor"] is True or group["inner"] == "muon":
        raise ValueError(f"base_update={base_update!r}, base_source={base_source!r} run on the AdamW rule's "
                         "eager reference path only: use fused=None or False, multi_tensor=None or False, "
                         "inner='adamw'")
    if group["use_muon"]:
        raise ValueError("base_update and base_source are options of the AdamW rule: a param group with "
                         "use_muon=True cannot take them")


class DualOptimPlus(Optimizer):
    """DualOptim+ with the AdamW rule (Algorithm 1) or, for 2-D weights, the Muon rule (Algorithm 2).

    Args:
        params: parameters or param groups. A group may set ``use_muon`` (True/False) to override the
            default choice of rule (with ``inner="muon"``: Muon for 2-D tensors, AdamW for the rest; use
            `muon_param_groups` to keep embeddings and the output head on AdamW).
        lr, betas, eps, weight_decay: as in `torch.optim.AdamW`; betas are the delta states' factors.
        base_betas: the base state's factors; None means the same as ``betas``.
        objectives: names of the objectives, any number >= 1 (one base state, one delta state each).
        inner: "adamw" or "muon".
        state_bits: 32 (float32 states) or 8 (blockwise 8-bit, bitsandbytes' dynamic maps).
        lr_multipliers: per-objective learning-rate factors, e.g. ``{"forget": 2.0}``.
        quantize: with 8-bit states, which states are 8-bit: "all", "base" or "delta" (paper, Table 9).
        rule: "safeguarded" (default) or "paper" (the paper's AdamW rule exactly). The safeguard floors the
            denominator at ``v_floor``·(v̂_B + |v̂_k|) and bounds each element's step at ``max_update``·lr
            (`kernels.py`); elsewhere the two rules are identical. The Muon rule has no such division and
            is the same under both.
        compensated: for bf16 weights, keep a compensation buffer per weight that every update kernel
            reads and writes with it, so that updates below the weights' spacing accumulate
            (`--precision bf16`); float32 weights have none and step exactly as without it.
        fused: use the compiled one-pass kernels (True), the eager reference (False), or decide per
            tensor by size (None).
        base_update: when the base state takes the gradient (paper, Table 10): "after-param" (the rule,
            Algorithm 1), "before-delta" or "after-delta" (`kernels.py` gives each rule).
        base_source: what the base state takes (paper, Table 11): "grad" (the rule) or "grad-minus-delta"
            (g − m̂_k, g² − v̂_k). Both ablations are AdamW-rule options that run on the eager reference
            path: with a value other than the rule's, ``fused=None`` uses it for every tensor, and
            ``fused=True``, ``multi_tensor=True`` or ``inner="muon"`` are refused.
        multi_tensor: update every eligible tensor of a step (float32 states, `multi_tensor.eligible`) in one
            Triton kernel launch (`multi_tensor.py`): None on CUDA when Triton is installed, True also on
            CPU tensors through Triton's interpreter (for tests; slow), False never. Ignored with
            ``fused=False``. After a failed launch this optimizer takes the per-tensor path (its
            ``multi_tensor_kernel`` says why); another optimizer tries the kernel again.
        ns_coefficients, ns_steps, ns_eps, adjust_lr_fn: Muon's Newton–Schulz settings, as `torch.optim.Muon`.

    Every argument but ``objectives`` and ``lr_multipliers`` (the state's layout and its per-objective factors)
    is a default of the param groups, as in torch's optimizers: a group may set its own (its rule, floor,
    bound, state bits, ...), each group is checked as the constructor's arguments are, and `state_dict`
    carries every group's values. One step hands every AdamW-rule tensor with the same ``multi_tensor`` and
    ``fused`` to one call of `dualoptim_plus_updates`, the functional form.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float = 1e-5,
        betas: tuple[float, float] = (0.9, 0.95),
        base_betas: tuple[float, float] | None = None,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        objectives: Sequence[str] = ("forget", "retain"),
        inner: str = "adamw",
        state_bits: int = 32,
        *,
        lr_multipliers: Mapping[str, float] | None = None,
        quantize: str = "all",
        rule: str = "safeguarded",
        base_update: str = "after-param",
        base_source: str = "grad",
        v_floor: float = 0.02,
        max_update: float = 10.0,
        fused: bool | None = None,
        multi_tensor: bool | None = None,
        compensated: bool = False,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
        ns_steps: int = 5,
        ns_eps: float = 1e-7,
        adjust_lr_fn: str | None = None,
    ) -> None:
        self.objectives = check_objectives(objectives)
        self.lr_multipliers = check_lr_multipliers(lr_multipliers, self.objectives)
        # this optimizer's record of a failed multi-tensor launch: after one it takes the per-tensor path
        self.multi_tensor_kernel = MultiTensorKernel()
        # per tensor: (largest |Δθ|/η, count above 10η[, count floored, count clamped]) of the last step
        self._step_stats: list[tuple[Tensor, ...]] = []
        self._rule_elements = 0  # elements the safeguarded AdamW rule updated in the last step
        self._safeguard_counted = True  # False when some went through the multi-tensor kernel, which has no counts
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            base_betas=None if base_betas is None else tuple(base_betas),
            eps=eps,
            weight_decay=weight_decay,
            inner=inner,
            use_muon=None,
            state_bits=state_bits,
            quantize=quantize,
            rule=rule,
            v_floor=v_floor,
            max_update=max_update,
            base_update=base_update,
            base_source=base_source,
            compensated=compensated,
            fused=fused,
            multi_tensor=multi_tensor,
            ns_coefficients=tuple(ns_coefficients),
            ns_steps=ns_steps,
            ns_eps=ns_eps,
            adjust_lr_fn=adjust_lr_fn,
        )
        check_group(defaults)  # the constructor's own values, named as such
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """As torch's, then the group's settings (its own and the defaults it takes) checked as the
        constructor's: torch checks only the defaults, so a group's bad value would otherwise step silently."""
        super().add_param_group(param_group)
        try:
            check_group(self.param_groups[-1])
        except ValueError as error:
            self.param_groups.pop()
            raise ValueError(f"param group {len(self.param_groups)}: {error}") from None

    # -- which rule, which storage -------------------------------------------------------------------

    @staticmethod
    def _uses_muon(param: Tensor, group: dict) -> bool:
        if group["use_muon"] is not None:
            return bool(group["use_muon"]) and param.ndim == 2
        return group["inner"] == "muon" and param.ndim == 2

    @staticmethod
    def _is_8bit(param: Tensor, group: dict, is_base: bool) -> bool:
        # the whole parameter's size decides, so a sharded run quantises the same tensors as a single process
        if group["state_bits"] != 8 or param.numel() < quant.MIN_8BIT_SIZE:
            return False
        return group["quantize"] == "all" or (group["quantize"] == "base") == is_base

    def _new_states(self, param: Tensor, local: Tensor, names: Sequence[str], group: dict, is_base: bool) -> dict:
        """Zero-initialised states the size of `local` (the parameter, or this process's shard of it):
        float32 (float64 for float64 parameters), or uint8 codes + block absmax."""
        states: dict[str, Tensor] = {"step": torch.tensor(0.0, dtype=torch.float32)}
        state_dtype = torch.promote_types(local.dtype, torch.float32)
        for name in names:
            if self._is_8bit(param, group, is_base):
                states[name] = torch.zeros(local.numel(), dtype=torch.uint8, device=local.device)
                states[name + "_absmax"] = torch.zeros(
                    quant.num_blocks(local.numel()), dtype=torch.float32, device=local.device
                )
            else:
                states[name] = torch.zeros_like(local, dtype=state_dtype, memory_format=torch.contiguous_format)
        return states

    def _state_for(self, param: Tensor, local: Tensor, group: dict, objective: str) -> tuple[dict, dict]:
        names = _MUON_STATES if self._uses_muon(param, group) else _ADAMW_STATES
        state = self.state[param]
        if not state:
            state.update(self._new_states(param, local, names, group, is_base=True))
            state["delta"] = {}
            compensation = new_compensation(local) if group["compensated"] else None
            if compensation is not None:
                state["compensation"] = compensation
        if objective not in state["delta"]:
            state["delta"][objective] = self._new_states(param, local, names, group, is_base=False)
        return state, state["delta"][objective]

    # -- the step ------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, objective: str | None = None) -> Any:
        """Update every parameter that has a gradient with the gradient of `objective` (required: the objective
        whose gradient is in `.grad`). `closure`, as in torch's optimizers, recomputes the loss (with its
        backward) under `torch.enable_grad()` before the update; its loss is returned.

        The AdamW rule's tensors of every param group go to the functional form, `dualoptim_plus_updates`, in one
        call per (``multi_tensor``, ``fused``) setting of the groups (one call when no group sets its own), which
        chooses the implementation for all of them (and so updates every such group in one launch of the
        multi-tensor kernel); the Muon rule's are updated one by one."""
        closure, objective = step_arguments(self, closure, objective)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        lr_scale = self.lr_multipliers.get(objective, 1.0)
        self._step_stats = []
        self._rule_elements, self._safeguard_counted = 0, True
        calls: dict[tuple[bool | None, bool | None], list[TensorUpdate]] = {}  # (foreach, fused) → the AdamW rule's
        for group in self.param_groups:
            template = self._adamw_scalars(group, lr_scale)
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise ValueError("DualOptimPlus does not support sparse gradients")
                local, grad = local_shard(param), local_shard(param.grad)
                state, delta = self._state_for(param, local, group, objective)
                compensation = state.get("compensation")
                if self._uses_muon(param, group):
                    state["step"] += 1
                    delta["step"] += 1
                    self._step_stats.append(
                        self._muon_update(param, local, grad, group, state, delta, lr_scale, compensation))
                    continue
                calls.setdefault((group["multi_tensor"], group["fused"]), []).append(
                    TensorUpdate(local, grad, state, delta, compensation, template))
                if group["rule"] == "safeguarded":
                    self._rule_elements += local.numel()
        for (foreach, fused), updates in calls.items():
            report = dualoptim_plus_updates(updates, foreach=foreach, fused=fused,
                                            multi_tensor_kernel=self.multi_tensor_kernel)
            self._step_stats.extend(report.stats)
            self._safeguard_counted = self._safeguard_counted and report.safeguard_counted
        return loss

    def __getstate__(self) -> dict:
        # torch's Optimizer keeps only defaults, state and param_groups; a copy needs the rule's settings too
        return self.__dict__.copy()

    def step_diagnostics(self) -> dict[str, float]:
        """Of the last step, over this process's elements: ``max_update`` the largest |Δθ|/η, and
        ``big_updates`` the number of elements whose step exceeded 10η (`kernels.BIG_UPDATE`); under the
        safeguarded rule also ``floor_fraction`` and ``clamp_fraction``, the fractions of the AdamW rule's
        elements where the floor and the clamp acted (`safeguard_counts`)."""
        diagnostics = reduce_step_stats([(stats[0], stats[1]) for stats in self._step_stats])
        counts = self.safeguard_counts()
        if counts is not None:
            floored, clamped, elements = counts
            diagnostics.update(floor_fraction=floored / elements, clamp_fraction=clamped / elements)
        return diagnostics

    def safeguard_counts(self) -> tuple[int, int, int] | None:
        """(elements floored, elements clamped, elements of the safeguarded AdamW rule) of the last step, over this
        process's elements; None when no element took the safeguarded rule (every group under the paper's, or
        none with the AdamW rule), or when the multi-tensor kernel (which does not count them) updated some."""
        if not self._rule_elements or not self._safeguard_counted:
            return None
        counted = [stats for stats in self._step_stats if len(stats) == 4]
        if not counted:
            return 0, 0, self._rule_elements
        device = counted[0][2].device
        totals = torch.stack([torch.stack([stats[2], stats[3]]).to(device, torch.int64) for stats in counted])
        floored, clamped = totals.sum(0).tolist()
        return int(floored), int(clamped), self._rule_elements

    def _adamw_scalars(self, group: dict, lr_scale: float) -> AdamWPlusScalars:
        """The scalars of `group`'s updates, without the step counts (the update fills them in): the group's
        settings as `dualoptim_plus` takes them, the learning rate times the objective's multiplier."""
        return adamw_plus_scalars(lr=float(group["lr"]) * lr_scale,
                                  **{key: group[key] for key in ADAMW_RULE_SETTINGS})

    def _muon_update(
        self, param: Tensor, local: Tensor, grad: Tensor, group: dict, state: dict, delta: dict, lr_scale: float,
        compensation: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        s = MuonPlusScalars(
            lr=float(group["lr"]) * lr_scale,
            weight_decay=group["weight_decay"],
            momentum=group["betas"][0],
            base_momentum=(group["base_betas"] or group["betas"])[0],
            ns_coefficients=group["ns_coefficients"],
            ns_steps=group["ns_steps"],
            ns_eps=group["ns_eps"],
            adjust_lr_fn=group["adjust_lr_fn"],
        )
        base = _read_slot(state, "momentum_buffer", True, 0, local.numel()).view(local.shape)
        mom = _read_slot(delta, "momentum_buffer", True, 0, local.numel()).view(local.shape)
        orthogonalize = _sharded_orthogonalize(param, s) if local is not param else None
        stats = muon_plus_reference(local, grad, base, mom, s, orthogonalize, param.shape, compensation)
        _write_slot(state, "momentum_buffer", True, base.view(-1), 0)
        _write_slot(delta, "momentum_buffer", True, mom.view(-1), 0)
        return stats

    # -- checkpoints ---------------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict) -> None:
        """Load as `torch.optim.Optimizer` does, but keep every state tensor's dtype (uint8 codes, float32
        states of low-precision parameters), so that a reloaded optimizer continues bit-identically.

        A saved group's settings replace the group's, as in torch. The state dicts of doplus 0.1.0 and 0.2.0 kept
        the rule's settings (``rule``, ``v_floor``, ``max_update``, ``state_bits``, ``quantize``, ``inner``,
        ``compensated``, ``fused``, ``multi_tensor``) on the optimizer, not in their groups: each group takes
        those it lacks from the group as this optimizer was built (its own value, else the constructor's). Every
        group is checked as the constructor's arguments are before anything is loaded."""
        state_dict = with_built_settings(state_dict, self.param_groups)
        if len(state_dict["param_groups"]) == len(self.param_groups):
            for index, group in enumerate(state_dict["param_groups"]):
                try:
                    check_group(group)
                except ValueError as error:
                    raise ValueError(f"state_dict param group {index}: {error}") from None
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, saved in state_dict["state"].items():
            param = params[index]
            self.state[param] = clone_state(saved, param.device)


# -- the functional form: the AdamW rule over the tensors of one param group -----------------------------

IMPLEMENTATIONS = ("reference", "compiled", "multi_tensor")


@dataclass
class UpdateReport:
    """What one call of `dualoptim_plus` did."""

    implementation: str  # the one it chose, of IMPLEMENTATIONS
    stats: list[tuple[Tensor, ...]]  # per tensor, or per launch of the multi-tensor kernel: `step_diagnostics`
    safeguard_counted: bool  # False when the multi-tensor kernel, which does not count floor and clamp, ran


@torch.no_grad()
def dualoptim_plus(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    states: Sequence[dict],
    deltas: Sequence[dict],
    compensations: Sequence[Tensor | None] | None = None,
    *,
    lr: float,
    betas: tuple[float, float],
    base_betas: tuple[float, float] | None = None,
    eps: float,
    weight_decay: float,
    rule: str = "safeguarded",
    v_floor: float = 0.02,
    max_update: float = 10.0,
    base_update: str = "after-param",
    base_source: str = "grad",
    foreach: bool | None = None,
    fused: bool | None = None,
    multi_tensor_kernel: MultiTensorKernel | None = None,
) -> UpdateReport:
    """One DualOptim+ AdamW step (Algorithm 1; the safeguard of `kernels.py`) of one param group's `params` with
    `grads`: the functional form of `DualOptimPlus`, as `torch.optim.adamw.adamw` is AdamW's. It is
    `dualoptim_plus_updates` with every tensor taking these scalars; `DualOptimPlus.step` calls that with the
    tensors of all its param groups at once (so the multi-tensor kernel takes every group in one launch); its
    ``fused`` and ``multi_tensor`` are ``fused`` and ``foreach`` here.

    `states[i]` is parameter i's base state and `deltas[i]` its delta state of the objective whose gradient is
    `grads[i]` (the layout `DualOptimPlus` documents: ``step``, ``exp_avg``, ``exp_avg_sq``, float32 or 8-bit
    codes with their ``_absmax``); both step counters are incremented here, then every state and the parameter
    are updated in place, without autograd. `compensations[i]` is a bf16 weight's compensation buffer or None.
    The settings are a param group's, as `DualOptimPlus` keeps them: ``rule="paper"`` is the safeguarded rule
    with no floor and no bound (``v_floor=0``, ``max_update=math.inf``), whatever `v_floor` and `max_update`
    say; `base_update`, `base_source` are its ablations (reference only).

    The implementation is chosen once for the call, as `adamw()` chooses among torch's single-tensor,
    multi-tensor and fused ones, and named in the report:

    * ``"reference"`` (``fused=False``, or an ablation): the eager rule (`kernels.adamw_plus_reference`) per tensor.
    * ``"multi_tensor"`` (``foreach=True``; None: on CUDA with Triton): one Triton launch over every tensor the
      kernel takes (`multi_tensor.eligible`: float32 states, aligned); the others take the compiled path.
    * ``"compiled"`` (otherwise): the compiled one-pass kernels per tensor, every contiguous tensor with
      ``fused=True``; with ``fused=None`` those of `FUSED_MIN_NUMEL` elements or more, and the reference below,
      where the kernel's fixed cost exceeds the work.

    ``multi_tensor_kernel`` keeps the record of a failed multi-tensor launch across calls (`DualOptimPlus` holds
    one for its life): after a failure those calls take the compiled path. None: a record for this call alone.
    """
    n = len(params)
    if not len(grads) == len(states) == len(deltas) == n or (compensations is not None and len(compensations) != n):
        raise ValueError("params, grads, states, deltas (and compensations) must have one entry per tensor")
    compensations = [None] * n if compensations is None else list(compensations)
    template = adamw_plus_scalars(lr=lr, betas=betas, base_betas=base_betas, eps=eps, weight_decay=weight_decay,
                                  rule=rule, v_floor=v_floor, max_update=max_update, base_update=base_update,
                                  base_source=base_source)
    updates = [TensorUpdate(*tensors, template) for tensors in zip(params, grads, states, deltas, compensations)]
    return dualoptim_plus_updates(updates, foreach=foreach, fused=fused, multi_tensor_kernel=multi_tensor_kernel)


def adamw_plus_scalars(
    *, lr: float, betas: tuple[float, float], base_betas: tuple[float, float] | None, eps: float,
    weight_decay: float, rule: str, v_floor: float, max_update: float, base_update: str, base_source: str,
) -> AdamWPlusScalars:
    """The scalars of the AdamW rule's updates under one param group's settings, without the step counts (each
    update reads them from its states). ``base_betas=None`` means ``betas``; the paper's rule is ρ = 0, c = ∞."""
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}: choose one of {list(RULES)}")
    beta1, beta2 = betas
    base_beta1, base_beta2 = base_betas or betas
    safeguarded = rule == "safeguarded"
    return AdamWPlusScalars(
        lr=float(lr), weight_decay=weight_decay, beta1=beta1, beta2=beta2, base_beta1=base_beta1,
        base_beta2=base_beta2, eps=eps, base_step=0, delta_step=0,
        v_floor=v_floor if safeguarded else 0.0, max_update=max_update if safeguarded else math.inf,
        base_update=base_update, base_source=base_source,
    )


class TensorUpdate(NamedTuple):
    """One tensor's part of a DualOptim+ AdamW step: what `dualoptim_plus` takes per tensor, with the scalars of
    its param group (the step counts are read from the states)."""

    param: Tensor
    grad: Tensor
    state: dict
    delta: dict
    compensation: Tensor | None
    scalars: AdamWPlusScalars


@torch.no_grad()
def dualoptim_plus_updates(updates: Sequence[TensorUpdate], *, foreach: bool | None = None,
                           fused: bool | None = None,
                           multi_tensor_kernel: MultiTensorKernel | None = None) -> UpdateReport:
    """`dualoptim_plus` over tensors whose scalars may differ (several param groups): the form
    `DualOptimPlus.step` calls with every tensor of its groups, so that one launch of the multi-tensor kernel
    updates all of them, each tensor reading its own row of scalars. The implementation is chosen once for the
    call, as `dualoptim_plus` documents."""
    updates = list(updates)
    kernel = multi_tensor_kernel or MultiTensorKernel()
    for scalars in {update.scalars for update in updates}:  # one per param group: no work per tensor
        if scalars.base_update not in BASE_UPDATES or scalars.base_source not in BASE_SOURCES:
            raise ValueError(f"base_update must be one of {list(BASE_UPDATES)} and base_source one of "
                             f"{list(BASE_SOURCES)}, got {scalars.base_update!r}, {scalars.base_source!r}")
    params = [update.param for update in updates]
    implementation = _choose_implementation(params, all(update.scalars.default_base for update in updates), foreach,
                                            fused, kernel)
    if implementation == "multi_tensor":
        stats, counted = _multi_tensor_dualoptim_plus(updates, fused, kernel)
        return UpdateReport(implementation, stats, counted)
    return UpdateReport(implementation, _single_tensor_dualoptim_plus(updates, fused), True)


def _choose_implementation(params: Sequence[Tensor], default_base: bool, foreach: bool | None,
                           fused: bool | None, kernel: MultiTensorKernel) -> str:
    if not default_base:  # the ablations have the eager rule only
        if fused is True or foreach is True:
            raise ValueError("base_update and base_source other than the rule's run on the AdamW rule's eager "
                             "reference path only: use fused=None or False, foreach=None or False")
        return "reference"
    if fused is False:
        return "reference"
    if foreach is True and not triton_installed():
        raise ValueError("foreach=True (the multi-tensor kernel) needs Triton (pip install triton)")
    if kernel.fallback_reason is not None:  # its launch failed before: the per-tensor kernels from then on
        return "compiled"
    if foreach is None:
        foreach = bool(params) and all(kernel.available(p.device) for p in params)
    return "multi_tensor" if foreach else "compiled"


def _single_tensor_dualoptim_plus(entries: list[tuple], fused: bool | None) -> list[tuple[Tensor, ...]]:
    """Each tensor by itself: the compiled kernel where `_use_compiled` says so, the eager reference otherwise
    (always with ``fused=False`` or an ablation)."""
    hp_cache: dict[tuple, Tensor] = {}
    stats = []
    for param, grad, state, delta, compensation, template in entries:
        state["step"] += 1
        delta["step"] += 1
        if param.numel():  # a shard can be empty when a small tensor has fewer rows than processes
            stats.append(_adamw_update(param, grad, state, delta, template, fused, hp_cache, compensation))
    return stats


def _use_compiled(param: Tensor, grad: Tensor, s: AdamWPlusScalars, fused: bool | None) -> bool:
    if fused is False or not s.default_base or not (param.is_contiguous() and grad.is_contiguous()):
        return False
    return fused is True or param.numel() >= FUSED_MIN_NUMEL


def _adamw_update(
    param: Tensor, grad: Tensor, state: dict, delta: dict, template: AdamWPlusScalars, fused: bool | None,
    hp_cache: dict, compensation: Tensor | None = None,
) -> tuple[Tensor, ...]:
    if not param.is_contiguous():
        # a transposed or strided weight: the rule runs on a copy in logical element order, the order of the
        # states and of the compensation buffer (both allocated contiguous), and the result goes back in place
        work = param.contiguous()
        stats = _adamw_update(work, grad.contiguous(), state, delta, template, fused, hp_cache, compensation)
        param.copy_(work)
        return stats
    s = replace(template, base_step=int(state["step"].item()), delta_step=int(delta["step"].item()))
    # (container, name, signed map): the delta second moment can be negative, so it is signed too
    slots = [
        (state, "exp_avg", True),
        (state, "exp_avg_sq", False),
        (delta, "exp_avg", True),
        (delta, "exp_avg_sq", True),
    ]
    if not _use_compiled(param, grad, s, fused):
        flat_compensation = None if compensation is None else compensation.view(-1)
        return _adamw_reference_slots(param.view(-1), grad.reshape(-1), slots, s, 0, param.numel(),
                                      flat_compensation)
    state_dtype = torch.promote_types(param.dtype, torch.float32)
    key = (s, str(param.device), state_dtype)
    if key not in hp_cache:
        hp_cache[key] = s.packed(param.device, state_dtype)
    hp = hp_cache[key]
    if not any(container[name].dtype == torch.uint8 for container, name, _ in slots):
        return adamw_plus_fused(
            param, grad, state["exp_avg"], state["exp_avg_sq"], delta["exp_avg"], delta["exp_avg_sq"], hp,
            compensation,
        )
    return _adamw_fused_8bit_slots(param, grad, slots, s, hp, compensation)


def _multi_tensor_dualoptim_plus(entries: list[tuple], fused: bool | None,
                                 kernel: MultiTensorKernel) -> tuple[list[tuple[Tensor, ...]], bool]:
    """The tensors the multi-tensor kernel takes, one launch per `multi_tensor.FLUSH_NUMEL` elements (the device
    starts while the host goes on); the others, and any whose launch cannot compile, by `_adamw_update`."""
    stats: list[tuple[Tensor, ...]] = []
    counted = True
    others: list[tuple] = []
    pending: list[tuple] = []
    pending_numel = 0
    for entry in entries:
        param, grad, state, delta, compensation, _ = entry
        states = (state["exp_avg"], state["exp_avg_sq"], delta["exp_avg"], delta["exp_avg_sq"])
        if not param.numel() or not multi_tensor.eligible(param, grad, states, compensation):
            others.append(entry)
            continue
        pending.append(entry)
        pending_numel += param.numel()
        if pending_numel >= multi_tensor.FLUSH_NUMEL:
            batch_stats, launched = _step_batched(pending, fused, kernel)
            stats.extend(batch_stats)
            counted = counted and not launched
            pending, pending_numel = [], 0
    if pending:
        batch_stats, launched = _step_batched(pending, fused, kernel)
        stats.extend(batch_stats)
        counted = counted and not launched
    stats.extend(_single_tensor_dualoptim_plus(others, fused))
    return stats, counted


def _step_batched(pending: list[tuple], fused: bool | None,
                  kernel: MultiTensorKernel) -> tuple[list[tuple[Tensor, ...]], bool]:
    """The step counters of `pending` in one call, then one launch per weight and gradient dtype, each tensor
    reading its row of scalars (its param group's learning rate and weight decay, its t_B and t_k). Host work
    per tensor is a few dictionary lookups and its addresses; nothing waits for the device. Returns the stats
    and whether any launch ran."""
    counters = [entry[2]["step"] for entry in pending] + [entry[3]["step"] for entry in pending]
    torch._foreach_add_(counters, 1.0)
    counts = step_counts(counters)
    n = len(pending)
    rows: dict[AdamWPlusScalars, int] = {}  # the scalars of one update (hyper-parameters, t_B, t_k) → their row
    batches: dict[tuple, tuple[list, list]] = {}  # (device, weight dtype, grad dtype, compensated) → entries, rows
    for i, entry in enumerate(pending):
        param, grad, _, _, compensation, template = entry
        scalars = replace(template, base_step=int(counts[i]), delta_step=int(counts[n + i]))
        row = rows.setdefault(scalars, len(rows))
        entries, entry_rows = batches.setdefault((param.device, param.dtype, grad.dtype, compensation is not None),
                                                 ([], []))
        entries.append(entry)
        entry_rows.append(row)
    packed = torch.cat([s.packed(torch.device("cpu"), torch.float32) for s in rows])  # in the rows' order
    hp: dict[torch.device, Tensor] = {}  # the scalars on each device, copied once
    stats: list[tuple[Tensor, ...]] = []
    launched = False
    for (device, _, _, compensated), (entries, entry_rows) in batches.items():
        if device not in hp:
            hp[device] = packed.to(device, non_blocking=True)
        tensors = [(param, grad, state["exp_avg"], state["exp_avg_sq"], delta["exp_avg"], delta["exp_avg_sq"],
                    compensation) for param, grad, state, delta, compensation, _ in entries]
        try:
            stats.append(multi_tensor.launch(tensors, entry_rows, hp[device], compensated))
            launched = True
            continue
        except Exception as error:  # noqa: BLE001 - a compiler or driver error: stay correct, say so once
            kernel.failed(error)
        hp_cache: dict[tuple, Tensor] = {}
        stats.extend(_adamw_update(param, grad, state, delta, template, fused, hp_cache, compensation)
                     for param, grad, state, delta, compensation, template in entries)
    return stats, launched


def _sharded_orthogonalize(param: Tensor, s: MuonPlusScalars):
    """NewtonSchulz5 of the whole matrix, of which each process holds some rows: gather the rows, run the
    iteration on the whole matrix (every process the same), keep this process's rows."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    def orthogonalize(rows: Tensor) -> Tensor:
        whole = DTensor.from_local(
            rows, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        ).full_tensor()
        update = newton_schulz(whole, s.ns_coefficients, s.ns_steps, s.ns_eps)
        return distribute_tensor(update, param.device_mesh, param.placements, src_data_rank=None).to_local()

    return orthogonalize


# -- state slots: a float32 tensor or 8-bit codes with their block absmax ------------------------------


def _read_slot(container: dict, name: str, signed: bool, start: int, stop: int) -> Tensor:
    """Float32 values of elements [start, stop) of a state (a view when it is float32). start % 256 == 0."""
    stored = container[name]
    if stored.dtype != torch.uint8:
        return stored.view(-1)[start:stop]
    blocks = slice(start // quant.BLOCKSIZE, quant.num_blocks(stop))
    return quant.dequantize(stored[start:stop], container[name + "_absmax"][blocks], signed)


def _write_slot(container: dict, name: str, signed: bool, values: Tensor, start: int) -> None:
    stored = container[name]
    if stored.dtype != torch.uint8:
        if values.data_ptr() != stored.view(-1)[start:].data_ptr():
            stored.view(-1)[start : start + values.numel()].copy_(values)
        return
    stop = start + values.numel()
    blocks = slice(start // quant.BLOCKSIZE, quant.num_blocks(stop))
    quant.quantize(values, signed, stored[start:stop], container[name + "_absmax"][blocks])


def _adamw_reference_slots(
    flat_param: Tensor, flat_grad: Tensor, slots: list, s: AdamWPlusScalars, start: int, stop: int,
    flat_compensation: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """Reference AdamW rule on elements [start, stop): dequantize (bitsandbytes), update, re-quantize."""
    values = [_read_slot(c, name, signed, start, stop) for c, name, signed in slots]
    param_part = flat_param[start:stop]
    compensation = None if flat_compensation is None else flat_compensation[start:stop]
    stats = adamw_plus_reference(param_part, flat_grad[start:stop], *values, s, compensation)
    for (container, name, signed), value in zip(slots, values):
        _write_slot(container, name, signed, value, start)
    return stats


def rows_per_8bit_call(device: torch.device, rows: int) -> int:
    """256-blocks per call of the compiled 8-bit kernel. On a CPU, chunks of FUSED_8BIT_CHUNK_ROWS keep the
    kernel's per-block temporaries in cache. On a GPU there is no such cache to fit and each call costs
    ~0.1 ms of host time (dynamo's guards, the launch): the whole tensor is one call. Chunked on an H200,
    a 1B-parameter step made ~7,600 calls and took 1.5 s against 37 ms for bitsandbytes' AdamW8bit."""
    return FUSED_8BIT_CHUNK_ROWS if device.type == "cpu" else max(rows, 1)


def _adamw_fused_8bit_slots(
    param: Tensor, grad: Tensor, slots: list, s: AdamWPlusScalars, hp: Tensor, compensation: Tensor | None = None
) -> tuple[Tensor, ...]:
    """Compiled 8-bit kernel on the whole 256-blocks; the short last block (if any) takes the reference."""
    numel = param.numel()
    whole = numel // quant.BLOCKSIZE * quant.BLOCKSIZE
    flat_param, flat_grad = param.view(-1), grad.view(-1)
    flat_compensation = None if compensation is None else compensation.view(-1)
    device = str(param.device)
    maps = (quant.code_map(True, device), quant.code_map(False, device))
    tables = tuple(
        (t.bucket_start, t.thresholds, t.skip, t.fixup_steps, t.bucket_threshold, t.bucket_codes)
        for t in (quant.search_tables(True, device), quant.search_tables(False, device))
    )
    rows = whole // quant.BLOCKSIZE
    stats = []
    chunk = rows_per_8bit_call(param.device, rows)
    for first in range(0, rows, chunk):
        last = min(rows, first + chunk)
        lo, hi = first * quant.BLOCKSIZE, last * quant.BLOCKSIZE
        states = []
        for container, name, _signed in slots:
            stored = container[name]
            if stored.dtype == torch.uint8:
                states.append((stored[lo:hi].view(-1, quant.BLOCKSIZE), container[name + "_absmax"][first:last]))
            else:
                states.append((stored.view(-1)[lo:hi].view(-1, quant.BLOCKSIZE),))
        stats.append(adamw_plus_fused_8bit(
            flat_param[lo:hi].view(-1, quant.BLOCKSIZE),
            flat_grad[lo:hi].view(-1, quant.BLOCKSIZE),
            tuple(states),
            maps,
            tables,
            hp,
            None if flat_compensation is None else flat_compensation[lo:hi].view(-1, quant.BLOCKSIZE),
        ))
    if whole < numel:
        stats.append(_adamw_reference_slots(flat_param, flat_grad, slots, s, whole, numel, flat_compensation))
    largest = torch.stack([part[0] for part in stats]).amax()
    return (largest, *(torch.stack([part[i] for part in stats]).sum() for i in (1, 2, 3)))


def muon_param_groups(model: torch.nn.Module, **group_options: Any) -> list[dict]:
    """Param groups for ``inner="muon"``: Muon for hidden 2-D weights, AdamW for embeddings, the output head,
    norms and biases (Muon practice). Frozen parameters are left out."""
    skip: set[int] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            skip.update(id(p) for p in module.parameters(recurse=False))
    get_out = getattr(model, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    if head is not None:
        skip.update(id(p) for p in head.parameters())
    muon, adamw = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (muon if param.ndim == 2 and id(param) not in skip else adamw).append(param)
    groups = []
    if muon:
        groups.append({"params": muon, "use_muon": True, **group_options})
    if adamw:
        groups.append({"params": adamw, "use_muon": False, **group_options})
    return groups
