"""`doplus bench optimizer --stability`: does an update rule blow up where v̂_B + v̂_k passes through zero?

A synthetic two-objective problem, fixed so anyone can rerun it:

* three tensors of 100,000, 60,000 and 40,000 elements (200k in all), starting at θ₀ = 0.02·N(0, 1);
* each objective has a fixed direction per element, d_f ~ N(0, 1) and d_r ~ N(0, 1); a forget step's gradient
  is d_f + 0.3·ξ, a retain step's is s·(0.5·d_r + 0.3·ξ), with fresh noise ξ ~ N(0, 1) every step and s the
  retain scale (1, or 0.01 for the harder variant where the retain gradients are 100x smaller);
* the forget-first 1:5 cycle, 120 steps, lr 1e-3, betas (0.9, 0.95), no weight decay.

The safeguarded rule runs at each floor ρ asked for (`--v-floor 0,0.01,0.02,0.05`; the default floor alone
without it); ρ = 0 is the clamp alone. For each rule it reports, from the optimizer's own step diagnostics:

* ``max_update``: the largest single-element step over the run, in learning rates (AdamW's is about 1);
* ``big_updates``: the number of element-steps larger than 10 learning rates;
* ``float32_vs_float64``: ‖θ_fp32 − θ_fp64‖ / ‖θ_fp64 − θ₀‖, the run in float32 against the same run in
  float64, as a fraction of the distance the weights moved (the displacement);
* ``8bit_<mode>_vs_32bit``: the same distance for 8-bit states (all, base or delta quantised) against 32-bit.

Reference rows run bitsandbytes' AdamW8bit against torch AdamW and 8-bit DualOptim against 32-bit DualOptim
on the same gradients, to show what quantisation alone costs a rule without the singularity.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from doplus_cli.config import TrainConfig
from doplus_cli.errors import UserError
from doplus_cli.optim import DualOptim, DualOptimPlus, quant

SHAPES = ((400, 250), (300, 200), (40_000,))
STEPS = 120
LR = 1e-3
BETAS = (0.9, 0.95)
CYCLE = ("forget",) + ("retain",) * 5
RETAIN_SCALES = (1.0, 0.01)


def gradient_stream(seed: int, retain_scale: float, shapes: Sequence[tuple[int, ...]] = SHAPES
                    ) -> Callable[[int], tuple[str, list[Tensor]]]:
    """step -> (objective, float64 gradients); the same sequence for every optimizer given the same seed."""
    generator = torch.Generator().manual_seed(seed)
    forget = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]
    retain = [0.5 * torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]
    noises = torch.Generator().manual_seed(seed + 1)

    def at(step: int) -> tuple[str, list[Tensor]]:
        objective = CYCLE[step % len(CYCLE)]
        noise = [0.3 * torch.randn(shape, generator=noises, dtype=torch.float64) for shape in shapes]
        if objective == "forget":
            return objective, [d + n for d, n in zip(forget, noise)]
        return objective, [retain_scale * (d + n) for d, n in zip(retain, noise)]

    return at


def start_weights(seed: int, shapes: Sequence[tuple[int, ...]] = SHAPES) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed + 2)
    return [0.02 * torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]


def run(
    build: Callable[[list[torch.nn.Parameter]], Any], dtype: torch.dtype, seed: int = 0, retain_scale: float = 1.0,
    steps: int = STEPS, shapes: Sequence[tuple[int, ...]] = SHAPES,
) -> dict[str, Any]:
    """Train the synthetic problem with one optimizer; the final weights (float64) and its step diagnostics."""
    params = [torch.nn.Parameter(w.to(dtype)) for w in start_weights(seed, shapes)]
    optimizer = build(params)
    gradients = gradient_stream(seed, retain_scale, shapes)
    largest, big = 0.0, 0
    for step in range(steps):
        objective, grads = gradients(step)
        for p, g in zip(params, grads):
            p.grad = g.to(dtype)
        optimizer.step(objective=objective)
        diagnostics = getattr(optimizer, "step_diagnostics", None)
        if callable(diagnostics):
            stats = diagnostics()
            largest, big = max(largest, stats["max_update"]), big + stats["big_updates"]
    return {"weights": torch.cat([p.detach().double().view(-1) for p in params]), "max_update": largest,
            "big_updates": big}


def relative_distance(a: Tensor, b: Tensor, start: Tensor) -> float:
    """‖a − b‖ / ‖b − θ₀‖: how far apart two runs end, in units of the distance b moved."""
    return float((a - b).norm() / (b - start).norm())


class _Shared:
    """A single-state optimizer (torch AdamW, bitsandbytes AdamW8bit) stepped with an objective name."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner

    def step(self, *, objective: str) -> None:
        self.inner.step()


def doplus_builder(rule: str, state_bits: int = 32, quantize: str = "all", v_floor: float = TrainConfig.v_floor):
    return lambda params: DualOptimPlus(params, lr=LR, betas=BETAS, rule=rule, state_bits=state_bits,
                                        quantize=quantize, v_floor=v_floor)


def _dualoptim(state_bits: int):
    return lambda params: DualOptim(params, lr=LR, betas=BETAS, state_bits=state_bits)


def _adamw(state_bits: int):
    def build(params):
        if state_bits == 8:
            import bitsandbytes as bnb

            return _Shared(bnb.optim.AdamW8bit(params, lr=LR, betas=BETAS, weight_decay=0.0,
                                               min_8bit_size=quant.MIN_8BIT_SIZE))
        return _Shared(torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=0.0))

    return build


def parse_floors(text: str | None) -> tuple[float, ...]:
    """`--v-floor 0,0.01,0.05`: the safeguarded rule's floors to run, each in [0, 1); None: the default floor."""
    if text is None:
        return (TrainConfig.v_floor,)
    floors = []
    for item in str(text).split(","):
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not 0.0 <= value < 1.0:
            raise UserError(f"--v-floor {text}: '{item.strip()}' is not a number in [0, 1) (comma-separated floors, "
                            "e.g. 0,0.01,0.05)")
        floors.append(value)
    return tuple(dict.fromkeys(floors))


def stability_rows(seed: int = 0, progress: Callable[[str], None] | None = None,
                   floors: Sequence[float] = (TrainConfig.v_floor,)) -> list[dict[str, Any]]:
    """One row per (rule, retain scale), the safeguarded rule once per floor in `floors`: step extremes and the
    float32/float64 and 8-bit/32-bit distances."""
    rows = []
    start = torch.cat([w.view(-1) for w in start_weights(seed)])
    for retain_scale in RETAIN_SCALES:
        candidates = [("doplus paper", "paper", 0.0)] + [("doplus safeguarded", "safeguarded", v) for v in floors]
        for name, rule, v_floor in candidates:
            began = time.perf_counter()
            if progress:
                progress(f"{name}{f' v_floor {v_floor:g}' if rule == 'safeguarded' else ''}, "
                         f"retain scale {retain_scale:g}")
            exact = run(doplus_builder(rule, v_floor=v_floor), torch.float64, seed, retain_scale)
            single = run(doplus_builder(rule, v_floor=v_floor), torch.float32, seed, retain_scale)
            row = {
                "rule": name,
                "v_floor": v_floor if rule == "safeguarded" else None,
                "retain_scale": retain_scale,
                "max_update_float64": exact["max_update"],
                "max_update_float32": single["max_update"],
                "big_updates_float32": single["big_updates"],
                "float32_vs_float64": relative_distance(single["weights"], exact["weights"], start),
            }
            for mode in ("all", "base", "delta"):
                eight = run(doplus_builder(rule, 8, mode, v_floor), torch.float32, seed, retain_scale)
                row[f"8bit_{mode}_vs_32bit"] = relative_distance(eight["weights"], single["weights"], start)
                row[f"max_update_8bit_{mode}"] = eight["max_update"]
            row["seconds"] = time.perf_counter() - began
            rows.append(row)
        for name, make in (("adamw (shared state)", _adamw), ("dualoptim", _dualoptim)):
            if progress:
                progress(f"{name}, retain scale {retain_scale:g}")
            exact = run(make(32), torch.float64, seed, retain_scale)
            single = run(make(32), torch.float32, seed, retain_scale)
            eight = run(make(8), torch.float32, seed, retain_scale)
            rows.append({
                "rule": name,
                "retain_scale": retain_scale,
                "float32_vs_float64": relative_distance(single["weights"], exact["weights"], start),
                "8bit_all_vs_32bit": relative_distance(eight["weights"], single["weights"], start),
            })
    return rows


STABILITY_COLUMNS = (
    ("rule", "rule"),
    ("v_floor", "ρ"),
    ("retain_scale", "retain ×"),
    ("max_update_float64", "max step/lr fp64"),
    ("max_update_float32", "max step/lr fp32"),
    ("big_updates_float32", ">10 lr (fp32)"),
    ("float32_vs_float64", "fp32 vs fp64"),
    ("8bit_all_vs_32bit", "8-bit all"),
    ("8bit_base_vs_32bit", "8-bit base"),
    ("8bit_delta_vs_32bit", "8-bit delta"),
)


def format_value(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return f"{value:,}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def print_stability(rows: list[dict[str, Any]], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title="DualOptim+ stability on the synthetic two-objective problem (distances in displacements)")
    for _, title in STABILITY_COLUMNS:
        table.add_column(title, justify="left" if title == "rule" else "right")
    for row in rows:
        table.add_row(*(format_value(row.get(key)) for key, _ in STABILITY_COLUMNS))
    console.print(table)
