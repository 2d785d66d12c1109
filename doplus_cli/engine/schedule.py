"""Which objective each optimizer step takes: the forget-first F_f:F_r cycle, or joint steps."""

from __future__ import annotations


def objective_at(step: int, scheme: str, forget_freq: int, retain_freq: int) -> str:
    """The objective of 0-based optimizer step `step`.

    joint: every step is "joint" (forget and retain losses summed). Otherwise steps cycle through
    `forget_freq` forget steps, then `retain_freq` retain steps, starting with forget (retain_freq 0:
    forget steps only).
    """
    if scheme == "joint":
        return "joint"
    return "forget" if step % (forget_freq + retain_freq) < forget_freq else "retain"


def steps_per_objective(steps: int, scheme: str, forget_freq: int, retain_freq: int) -> dict[str, int]:
    counts: dict[str, int] = {}
    for step in range(steps):
        name = objective_at(step, scheme, forget_freq, retain_freq)
        counts[name] = counts.get(name, 0) + 1
    return counts
