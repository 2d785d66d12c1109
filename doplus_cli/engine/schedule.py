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


def authors_epoch_steps(scheme: str, forget_rows: int, retain_rows: int, forget_freq: int, retain_freq: int,
                        effective_batch: int) -> int:
    """One "epoch" in optimizer steps, as the DualOptim+ authors count it (`forget.py`, `steps_per_epoch`); their
    warm-up is one such epoch, then linear decay.

    Alternating schemes (alternate, dualoptim, doplus) with B = batch x grad_accum x processes:
    (1 + F_r/F_f) * ceil(|D_f| / B) when ceil(|D_f| / F_f) <= ceil(|D_r| / F_r), else (1 + F_f/F_r) * ceil(|D_r| / B)
    (the retain side runs out first), truncated to a whole number. Joint (each example pairs a forget row with a
    retain row) and a forget set alone: ceil(|D_f| / B). The truncation is done in exact integers here, where the
    authors' `int()` of a float product could land one step lower when the product is whole but rounds below it.
    """
    forget_batches = -(-forget_rows // effective_batch)
    if scheme == "joint" or retain_rows == 0 or retain_freq == 0:
        return forget_batches
    if -(-forget_rows // forget_freq) <= -(-retain_rows // retain_freq):
        return (forget_freq + retain_freq) * forget_batches // forget_freq
    return (forget_freq + retain_freq) * -(-retain_rows // effective_batch) // retain_freq


def authors_warmup(epoch_steps: int) -> int:
    """The authors' warm-up: one epoch, none when an epoch is a single step."""
    return epoch_steps if epoch_steps > 1 else 0


def _linear_warmup_factor(step: int, *, warmup_steps: int, total_steps: int) -> float:
    if step < warmup_steps:
        return float(step) / float(max(1, warmup_steps))
    return max(0.0, float(total_steps - step) / float(max(1, total_steps - warmup_steps)))


def linear_warmup_schedule(optimizer, warmup_steps: int, total_steps: int):
    """The learning rate rises linearly from 0 over `warmup_steps`, then falls linearly to 0 at `total_steps`.

    The same factors, in the same float arithmetic, as transformers' `get_linear_schedule_with_warmup`
    (tests/test_unlearn_fingerprint.py trains against that function), on torch's `LambdaLR` with a partial of a
    module-level function, so a checkpoint's scheduler state is the same too. Importing that function pulls in
    transformers' Trainer utilities and with them peft and bitsandbytes, about a second of every run's start."""
    from functools import partial

    from torch.optim.lr_scheduler import LambdaLR

    return LambdaLR(optimizer, partial(_linear_warmup_factor, warmup_steps=warmup_steps, total_steps=total_steps))
