"""`doplus bench schemes` on `doplus multitask` recipes (commands/multitask.py).

The bench compares its runs by each task's held-out score after training (report.json, like the paper's Table 4).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from doplus_cli.bench.adapters.base import BenchAdapter, Metric
from doplus_cli.commands.multitask import MULTITASK, MultitaskConfig
from doplus_cli.config import AVERAGE
from doplus_cli.errors import UserError


class MultitaskAdapter(BenchAdapter):
    training = MULTITASK
    tradeoff_bars = True

    def check_evaluation(self, given: set[str], config: MultitaskConfig, recipe: Path) -> None:
        if config.eval_rows == 0 and not any(task["eval"] for task in config.tasks):
            raise UserError(f"{recipe}: no evaluation suite: eval_rows is 0 and no task has an eval file, so no "
                            "task is scored; set eval_rows > 0 or give the tasks eval files")

    def metric_list(self, config: MultitaskConfig) -> tuple[Metric, ...]:
        return (*(Metric(task["name"], task["name"], True) for task in config.tasks), Metric(AVERAGE, AVERAGE, True))

    def describe(self, config: MultitaskConfig, swept: str | None) -> str:
        return "tasks " + ", ".join(f"{t['name']} ({t['metric']})" for t in config.tasks)

    def score_definitions(self, config: MultitaskConfig, facts: list[dict[str, Any]]) -> list[str]:
        lines = ["Task scores: % on each task's held-out rows after training (its metric); average: their mean."]
        befores = [fact["before"] for fact in facts if fact.get("before")]
        if befores and all(before == befores[0] for before in befores):
            scores = ", ".join(f"{name} {value:.2f}" for name, value in befores[0].items() if value is not None)
            lines.append(f"Before training (the same rows and model for every run): {scores}.")
        return lines

    keeps_best = True

    def at_best(self, folder: Path, report: dict[str, Any]) -> tuple[dict[str, Any], Path] | None:
        """The report with the scores of the best step's evaluation during training in place of the final ones."""
        step = (report.get("best") or {}).get("step")
        row = next((e for e in report.get("evals") or [] if e.get("step") == step), None)
        if step is None or row is None:
            return None
        after = {name: row.get(name) for name in report["scores"]["after"]}
        return {**report, "scores": {**report["scores"], "after": after}}, folder

    def scores(self, report: dict[str, Any], evaluation: Path) -> tuple[dict[str, Any], dict[str, str]]:
        """The held-out scores after training (report.json, like the paper's Table 4)."""
        return dict(report["scores"]["after"]), {}

    def scores_before(self, report: dict[str, Any]) -> dict[str, Any] | None:
        """The same held-out rows scored before training (the same for every run of the same model and data)."""
        return dict(report["scores"]["before"])


MULTITASK_ADAPTER = MultitaskAdapter()
