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
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from doplus_cli.optim import multi_tensor, quant
from doplus_cli.optim.adamw import clone_state, new_compensation
from doplus_cli.optim.checks import (
    check_common,
    check_lr_multipliers,
    check_objectives,
    check_param_groups,
    step_arguments,
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
)
from doplus_cli.optim.multi_tensor import triton_installed

INNER_OPTIMIZERS = ("adamw", "muon")
RULES = ("safeguarded", "paper")
QUANTIZE_CHOICES = ("all", "base", "delta")
BASE_UPDATES = ("after-param", "before-delta", "after-delta")  # the paper's Table 10; the first is the rule
BASE_SOURCES = ("grad", "grad-minus-delta")  # the paper's Table 11; the first is the rule
FUSED_8BIT_CHUNK_ROWS = 512  # 128k elements per call of the 8-bit kernel

_ADAMW_STATES = ("exp_avg", "exp_avg_sq")
_MUON_STATES = ("momentum_buffer",)


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
            ``fused=False``.
        ns_coefficients, ns_steps, ns_eps, adjust_lr_fn: Muon's Newton–Schulz settings, as `torch.optim.Muon`.
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
        check_common(lr, betas, eps, weight_decay, state_bits)
        if base_betas is not None and (len(base_betas) != 2 or not all(0.0 <= b < 1.0 for b in base_betas)):
            raise ValueError(f"base_betas must be two numbers in [0, 1) or None, got {base_betas!r}")
        if inner not in INNER_OPTIMIZERS:
            raise ValueError(f"unknown inner optimizer {inner!r}: choose one of {list(INNER_OPTIMIZERS)}")
        if quantize not in QUANTIZE_CHOICES:
            raise ValueError(f"quantize must be one of {list(QUANTIZE_CHOICES)}, got {quantize!r}")
        if rule not in RULES:
            raise ValueError(f"unknown rule {rule!r}: choose one of {list(RULES)}")
        if base_update not in BASE_UPDATES:
            raise ValueError(f"unknown base_update {base_update!r}: choose one of {list(BASE_UPDATES)}")
        if base_source not in BASE_SOURCES:
            raise ValueError(f"unknown base_source {base_source!r}: choose one of {list(BASE_SOURCES)}")
        self.ablation = (base_update, base_source) != (BASE_UPDATES[0], BASE_SOURCES[0])
        if self.ablation and (fused is True or multi_tensor is True or inner == "muon"):
            raise ValueError(f"base_update={base_update!r}, base_source={base_source!r} run on the AdamW rule's "
                             "eager reference path only: use fused=None or False, multi_tensor=None or False, "
                             "inner='adamw'")
        self.base_update, self.base_source = base_update, base_source
        if not 0.0 <= v_floor < 1.0:
            raise ValueError(f"v_floor must be in [0, 1), got {v_floor}")
        if not max_update > 0.0:
            raise ValueError(f"max_update must be > 0, got {max_update}")
        self.objectives = check_objectives(objectives)
        self.lr_multipliers = check_lr_multipliers(lr_multipliers, self.objectives)
        self.inner = inner
        self.state_bits = state_bits
        self.quantize = quantize
        self.rule = rule
        self.v_floor, self.max_update = (v_floor, max_update) if rule == "safeguarded" else (0.0, math.inf)
        if multi_tensor is True and not triton_installed():
            raise ValueError("multi_tensor=True needs Triton (pip install triton)")
        self.fused = fused
        self.multi_tensor = multi_tensor
        self.compensated = compensated
        # per tensor: (largest |Δθ|/η, count above 10η[, count floored, count clamped]) of the last step
        self._step_stats: list[tuple[Tensor, ...]] = []
        self._rule_elements = 0  # elements the AdamW rule updated in the last step
        self._safeguard_counted = True  # False when some went through the multi-tensor kernel, which has no counts
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            base_betas=None if base_betas is None else tuple(base_betas),
            eps=eps,
            weight_decay=weight_decay,
            use_muon=None,
            ns_coefficients=tuple(ns_coefficients),
            ns_steps=ns_steps,
            ns_eps=ns_eps,
            adjust_lr_fn=adjust_lr_fn,
        )
        super().__init__(params, defaults)
        check_param_groups(self.param_groups, ("betas", "base_betas"))
        if self.ablation and any(group.get("use_muon") for group in self.param_groups):
            raise ValueError("base_update and base_source are options of the AdamW rule: a param group with "
                             "use_muon=True cannot take them")

    # -- which rule, which storage -------------------------------------------------------------------

    def _uses_muon(self, param: Tensor, group: dict) -> bool:
        if group.get("use_muon") is not None:
            return bool(group["use_muon"]) and param.ndim == 2
        return self.inner == "muon" and param.ndim == 2

    def _is_8bit(self, param: Tensor, is_base: bool) -> bool:
        # the whole parameter's size decides, so a sharded run quantises the same tensors as a single process
        if self.state_bits != 8 or param.numel() < quant.MIN_8BIT_SIZE:
            return False
        return self.quantize == "all" or (self.quantize == "base") == is_base

    def _use_fused(self, param: Tensor, grad: Tensor) -> bool:
        if self.fused is False or self.ablation or not (param.is_contiguous() and grad.is_contiguous()):
            return False
        return self.fused is True or param.numel() >= FUSED_MIN_NUMEL

    def _new_states(self, param: Tensor, local: Tensor, names: Sequence[str], is_base: bool) -> dict:
        """Zero-initialised states the size of `local` (the parameter, or this process's shard of it):
        float32 (float64 for float64 parameters), or uint8 codes + block absmax."""
        states: dict[str, Tensor] = {"step": torch.tensor(0.0, dtype=torch.float32)}
        state_dtype = torch.promote_types(local.dtype, torch.float32)
        for name in names:
            if self._is_8bit(param, is_base):
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
            state.update(self._new_states(param, local, names, is_base=True))
            state["delta"] = {}
            compensation = new_compensation(local) if self.compensated else None
            if compensation is not None:
                state["compensation"] = compensation
        if objective not in state["delta"]:
            state["delta"][objective] = self._new_states(param, local, names, is_base=False)
        return state, state["delta"][objective]

    # -- the step ------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, objective: str | None = None) -> Any:
        """Update every parameter that has a gradient with the gradient of `objective` (required: the objective
        whose gradient is in `.grad`). `closure`, as in torch's optimizers, recomputes the loss (with its
        backward) under `torch.enable_grad()` before the update; its loss is returned."""
        closure, objective = step_arguments(self, closure, objective)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        lr_scale = self.lr_multipliers.get(objective, 1.0)
        self._step_stats = []
        self._rule_elements, self._safeguard_counted = 0, True
        pending: list[tuple] = []  # (local, grad, group, state, delta, compensation) for the multi-tensor kernel
        pending_numel = 0
        for group in self.param_groups:
            hp_cache: dict[tuple, Tensor] = {}
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise ValueError("DualOptimPlus does not support sparse gradients")
                local, grad = local_shard(param), local_shard(param.grad)
                state, delta = self._state_for(param, local, group, objective)
                compensation = state.get("compensation")
                uses_muon = self._uses_muon(param, group)
                if not uses_muon:
                    self._rule_elements += local.numel()
                if not uses_muon and local.numel() and self._batchable(local, grad, state, delta, compensation):
                    pending.append((local, grad, group, state, delta, compensation))  # counted in _step_batched
                    pending_numel += local.numel()
                    if pending_numel >= multi_tensor.FLUSH_NUMEL:  # the device starts while the host goes on
                        self._step_stats.extend(self._step_batched(pending, lr_scale))
                        pending, pending_numel = [], 0
                    continue
                state["step"] += 1
                delta["step"] += 1
                if uses_muon:
                    self._step_stats.append(
                        self._muon_update(param, local, grad, group, state, delta, lr_scale, compensation))
                elif local.numel():  # a shard can be empty when a small tensor has fewer rows than processes
                    self._step_stats.append(
                        self._adamw_update(local, grad, group, state, delta, lr_scale, hp_cache, compensation))
        if pending:
            self._step_stats.extend(self._step_batched(pending, lr_scale))
        return loss

    def _step_batched(self, pending: list[tuple], lr_scale: float) -> list[tuple[Tensor, ...]]:
        """The AdamW rule for the tensors the multi-tensor kernel takes: their step counters in one call, then
        one launch per weight and gradient dtype, each tensor reading its row of scalars (param group's learning
        rate and weight decay, its t_B and t_k). Host work per
        tensor is a few dictionary lookups and its addresses; nothing waits for the device."""
        counters = [entry[3]["step"] for entry in pending] + [entry[4]["step"] for entry in pending]
        torch._foreach_add_(counters, 1.0)
        counts = step_counts(counters)
        n = len(pending)
        rows: dict[tuple, int] = {}  # (group, t_B, t_k) → row of the scalars matrix
        scalars: list[AdamWPlusScalars] = []
        batches: dict[tuple, tuple[list, list]] = {}  # (device, weight dtype, grad dtype, compensated) → entries, rows
        for i, entry in enumerate(pending):
            local, grad, group, state, delta, compensation = entry
            steps = (int(counts[i]), int(counts[n + i]))
            row = rows.get((id(group), steps))
            if row is None:
                row = rows[(id(group), steps)] = len(scalars)
                scalars.append(self._adamw_scalars(group, state, delta, lr_scale, steps))
            entries, entry_rows = batches.setdefault(
                (local.device, local.dtype, grad.dtype, compensation is not None), ([], []))
            entries.append(entry)
            entry_rows.append(row)
        packed = torch.cat([s.packed(torch.device("cpu"), torch.float32) for s in scalars])
        hp: dict[torch.device, Tensor] = {}  # the scalars on each device, copied once
        stats = []
        for (device, _, _, compensated), (entries, entry_rows) in batches.items():
            if device not in hp:
                hp[device] = packed.to(device, non_blocking=True)
            stats.extend(self._launch_multi_tensor(hp[device], compensated, entries, entry_rows, lr_scale))
        return stats

    def _batchable(self, local: Tensor, grad: Tensor, state: dict, delta: dict, compensation: Tensor | None) -> bool:
        if self.fused is False or self.multi_tensor is False or self.ablation:
            return False
        if self.multi_tensor is None and not multi_tensor.available(local.device):
            return False
        states = (state["exp_avg"], state["exp_avg_sq"], delta["exp_avg"], delta["exp_avg_sq"])
        return multi_tensor.eligible(local, grad, states, compensation)

    def _launch_multi_tensor(
        self, hp: Tensor, compensated: bool, entries: list, rows: list[int], lr_scale: float
    ) -> list[tuple[Tensor, ...]]:
        """One launch of the multi-tensor kernel over `entries` (entry i with row `rows[i]` of the scalars `hp`,
        on the entries' device); if it cannot compile, the per-tensor path (`multi_tensor.disable` logs why, or
        raises under $DOPLUS_REQUIRE_COMPILED=1)."""
        tensors = [(local, grad, state["exp_avg"], state["exp_avg_sq"], delta["exp_avg"], delta["exp_avg_sq"],
                    compensation) for local, grad, _, state, delta, compensation in entries]
        try:
            stats = [multi_tensor.launch(tensors, rows, hp, compensated)]
            self._safeguard_counted = False
            return stats
        except Exception as error:  # noqa: BLE001 - a compiler or driver error: stay correct, say so once
            multi_tensor.disable(error)
        hp_cache: dict[tuple, Tensor] = {}
        return [self._adamw_update(local, grad, group, state, delta, lr_scale, hp_cache, compensation)
                for local, grad, group, state, delta, compensation in entries]

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
        """(elements floored, elements clamped, elements of the AdamW rule) of the last step, over this process's
        elements; None under the paper's rule, when no element took the AdamW rule, or when the multi-tensor
        kernel (which does not count them) updated some."""
        if self.rule != "safeguarded" or not self._rule_elements or not self._safeguard_counted:
            return None
        counted = [stats for stats in self._step_stats if len(stats) == 4]
        if not counted:
            return 0, 0, self._rule_elements
        device = counted[0][2].device
        totals = torch.stack([torch.stack([stats[2], stats[3]]).to(device, torch.int64) for stats in counted])
        floored, clamped = totals.sum(0).tolist()
        return int(floored), int(clamped), self._rule_elements

    def _adamw_scalars(
        self, group: dict, state: dict, delta: dict, lr_scale: float, steps: tuple[int, int] | None = None
    ) -> AdamWPlusScalars:
        """The scalars of one update; `steps` = (t_B, t_k) when the caller has read them already."""
        if steps is None:
            steps = (int(state["step"].item()), int(delta["step"].item()))
        beta1, beta2 = group["betas"]
        base_beta1, base_beta2 = group["base_betas"] or group["betas"]
        return AdamWPlusScalars(
            lr=float(group["lr"]) * lr_scale,
            weight_decay=group["weight_decay"],
            beta1=beta1,
            beta2=beta2,
            base_beta1=base_beta1,
            base_beta2=base_beta2,
            eps=group["eps"],
            base_step=steps[0],
            delta_step=steps[1],
            v_floor=self.v_floor,
            max_update=self.max_update,
            base_update=self.base_update,
            base_source=self.base_source,
        )

    def _adamw_update(
        self, param: Tensor, grad: Tensor, group: dict, state: dict, delta: dict, lr_scale: float, hp_cache: dict,
        compensation: Tensor | None = None,
    ) -> tuple[Tensor, ...]:
        if not param.is_contiguous():
            # a transposed or strided weight: the rule runs on a copy in logical element order, the order of the
            # states and of the compensation buffer (both allocated contiguous), and the result goes back in place
            work = param.contiguous()
            stats = self._adamw_update(work, grad.contiguous(), group, state, delta, lr_scale, hp_cache,
                                       compensation)
            param.copy_(work)
            return stats
        s = self._adamw_scalars(group, state, delta, lr_scale)
        # (container, name, signed map): the delta second moment can be negative, so it is signed too
        slots = [
            (state, "exp_avg", True),
            (state, "exp_avg_sq", False),
            (delta, "exp_avg", True),
            (delta, "exp_avg_sq", True),
        ]
        if not self._use_fused(param, grad):
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
        states of low-precision parameters), so that a reloaded optimizer continues bit-identically."""
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, saved in state_dict["state"].items():
            param = params[index]
            self.state[param] = clone_state(saved, param.device)


def _sharded_orthogonalize(param: Tensor, s: MuonPlusScalars):
    """NewtonSchulz5 of the whole matrix, of which each process holds some rows: gather the rows, run the
    iteration on the whole matrix (every process the same), keep this process's rows."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.optim._muon import _zeropower_via_newtonschulz

    def orthogonalize(rows: Tensor) -> Tensor:
        whole = DTensor.from_local(
            rows, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        ).full_tensor()
        update = _zeropower_via_newtonschulz(whole, s.ns_coefficients, s.ns_steps, s.ns_eps)
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
