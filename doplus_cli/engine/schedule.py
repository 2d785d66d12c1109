"""Which objective each optimizer step takes: objectives in order, F_i consecutive steps each, or joint steps.

`unlearn`'s forget-first F_f:F_r cycle is the two-objective case [("forget", F_f), ("retain", F_r)].
"""

from __future__ import annotations

from collections.abc import Sequence

JOINT = "joint"  # the name of a joint step: every objective's weighted loss in one step


def objective_at(step: int, scheme: str, frequencies: Sequence[tuple[str, int]]) -> str:
    """The objective of 0-based optimizer step `step`.

    joint: every step is "joint". Otherwise steps cycle through the objectives in order, `F_i` consecutive
    steps each (an objective with frequency 0 never takes a step of its own).
    """
    if scheme == JOINT:
        return JOINT
    position = step % sum(frequency for _, frequency in frequencies)
    for name, frequency in frequencies:
        if position < frequency:
            return name
        position -= frequency
    raise AssertionError("unreachable: position < the cycle's length")


def steps_per_objective(steps: int, scheme: str, frequencies: Sequence[tuple[str, int]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for step in range(steps):
        name = objective_at(step, scheme, frequencies)
        counts[name] = counts.get(name, 0) + 1
    return counts
