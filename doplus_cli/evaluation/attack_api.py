"""What a white-box attack receives and gives back (`doplus evaluate --attacks`).

Two kinds: an *edit* attack returns a changed copy of the model (the forget suites then run on it as on a
quantized copy); a *reading* attack scores forget rows itself (through intermediate layers, a probe, or a soft
prompt) and returns its values beside the unattacked model's on the same rows, so that the two are comparable.
Both may need the starting model (the model the unlearning began from): `AttackInput.base`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from doplus_cli.data.formatting import PromptFormatter


@dataclass
class AttackInput:
    """The evaluated model and what an attack may read: its tokenizer and prompt format, the forget and retain
    rows of the suite under attack (`QASample`s: question, answer, perturbed answers), the starting model (None
    when neither the run's record nor `--base-model` names one), and the seed every random choice takes."""

    model: Any
    tokenizer: Any
    formatter: PromptFormatter
    forget: list  # QASample
    retain: list  # QASample
    base: Any = None
    seed: int = 0
    batch_size: int = 16
    options: dict[str, Any] = field(default_factory=dict)  # the attack's own settings (e.g. prune's fraction)
    progress: Any = None  # the evaluation's progress display (doplus_cli.progress), for attacks that take long


@dataclass
class Reading:
    """A reading attack's result: its metrics on `rows` and the unattacked model's on the same rows, by metric
    name; `directions` says which way each metric moves when the forget set is known (+1: higher); `details`
    holds what the report lists beside them (per-layer values, the same attack on the starting model, cost)."""

    rows: str  # which rows, in words ("tofu forget rows 4 to 7")
    unattacked: dict[str, float]
    attacked: dict[str, float]
    directions: dict[str, int]
    details: dict[str, Any] = field(default_factory=dict)
