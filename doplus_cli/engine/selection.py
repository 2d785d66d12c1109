"""`--select-by METRIC`: the evaluated step that is best by one metric, kept as OUT/best/ beside final/; and
`--stop-when METRIC<=VALUE`, the evaluated step that ends the run.

Each evaluation during training (`--eval-every`) offers its value; a value strictly better than the best so far
(by the metric's direction) makes its step the best, and the model as it is after that step is written to
OUT/best/ (written to best.tmp and renamed, in --save-dtype; the LoRA adapter alone with LoRA). Ties keep the
earlier step.

`--stop-when`: the first evaluation during training whose metric meets the bound ends the run after that step;
final/ is the model then, report.json's `steps` the steps trained and its `stopped` entry the rule, the step and
the value (step null: no evaluation met it, and the run trained every step). The learning-rate schedule is the
one of --steps throughout, so the model at that step is the one a run without the rule has at the same step.

Resume: the best so far is not stored apart, it is read again from the evaluations the checkpoint recorded. The
folder best/ on disk is left as it is: it holds either that step, or a later one written after the checkpoint,
which the resumed run reaches again with the same weights (resume continues bit-identically) and writes again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from doplus_cli.config import StopRule, TrainConfig, parse_select_by, parse_stop_when

BEST = "best"


@dataclass
class Selection:
    """The metric, its direction and the best evaluated step so far."""

    metric: str
    higher_is_better: bool
    step: int | None = None
    value: float | None = None

    def better(self, value: float) -> bool:
        if self.value is None:
            return True
        return value > self.value if self.higher_is_better else value < self.value

    def offer(self, row: dict[str, Any]) -> bool:
        """Take one evaluation's row ({"step": N, METRIC: value, ...}); True when its step is the new best."""
        value = row.get(self.metric)
        if value is None or value != value or not self.better(value):  # None and NaN never win
            return False
        self.step, self.value = int(row["step"]), float(value)
        return True

    def report(self, out: Path) -> dict[str, Any]:
        """The report's `best` entry."""
        return {"metric": self.metric, "direction": "max" if self.higher_is_better else "min", "step": self.step,
                "value": self.value, "folder": str(out / BEST) if self.step is not None else None}


def selection_for(config: TrainConfig, evals: list[dict[str, Any]]) -> Selection | None:
    """The run's selection with the best of the evaluations so far (a resumed run's, from its checkpoint); None
    without --select-by."""
    if not config.select_by:
        return None
    metric, higher = parse_select_by(config.select_by, config.selectable_metrics())
    selection = Selection(metric, higher)
    for row in evals:
        selection.offer(row)
    return selection


def stop_rule_for(config: TrainConfig) -> StopRule | None:
    """The run's --stop-when rule; None without it."""
    return parse_stop_when(config.stop_when, config.stoppable_metrics()) if config.stop_when else None


def stop_lines(report: dict[str, Any]) -> list[str]:
    """report.md's and the model card's line on --stop-when."""
    stopped = report.get("stopped")
    if not stopped:
        return []
    if stopped["step"] is None:
        return ["", f"Stop rule {stopped['rule']}: no evaluation met it; the run trained all "
                f"{stopped['planned_steps']} steps."]
    return ["", f"Stop rule {stopped['rule']}: met at step {stopped['step']} of {stopped['planned_steps']} "
            f"({stopped['metric']} {stopped['value']:.4g}); final/ is the model after that step."]


def best_lines(report: dict[str, Any]) -> list[str]:
    """report.md's and the model card's line on the kept step."""
    best = report.get("best")
    if not best:
        return []
    if best["step"] is None:
        return ["", f"Best step by {best['metric']} ({best['direction']}): none (no evaluation reported it); no "
                "best/ folder."]
    return ["", f"Best step by {best['metric']} ({best['direction']}): step {best['step']} ({best['value']:.4g}), "
            f"kept as {BEST}/ beside final/."]
