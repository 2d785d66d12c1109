"""What `doplus bench schemes` asks of a training command, and the registry it looks the adapters up in.

A bench adapter stands beside one command (commands/): the command's name, config class and marker are its own; the
adapter adds what only the bench needs to compare runs of it (its metrics, how a run is evaluated and scored, its
caption and column definitions, its trade-off plot). A command the bench compares is one adapter module here and one
`register` line in bench/adapters/__init__.py.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from doplus_cli.commands import COMMANDS, Command, command_marked
from doplus_cli.config import TrainConfig
from doplus_cli.errors import UserError
from doplus_cli.registry import Registry


@dataclass(frozen=True)
class Metric:
    """A column of the bench's tables: the key of its value, its label, which way is better, its format."""

    key: str
    label: str
    higher_is_better: bool | None  # None: no best is marked (a description, not a goal)
    spec: str = ".2f"  # format of the mean and the standard deviation

    @property
    def header(self) -> str:
        arrow = {True: " ↑", False: " ↓", None: ""}[self.higher_is_better]
        return self.label + arrow


@dataclass(frozen=True)
class TradeoffAxes:
    """The bench's trade-off scatter (tradeoff.png): one metric per axis, a point per scheme."""

    x: str  # metric key on the x axis
    y: str  # metric key on the y axis
    x_label: str
    y_label: str
    y_complement: bool = False  # plot 1 - y: a fraction where lower is better, shown so that up is better


class BenchAdapter:
    """What the bench needs to know about the recipes and runs of one command (`training`)."""

    training: Command
    metrics: tuple[Metric, ...] = ()
    takes_task_ids = False  # `bench schemes --task-ids`: its recipes have forget tasks to pick
    matched_tradeoff = False  # its runs' (MU, UFE) curves give the trade-off at matched levels (bench/tradeoff.py)
    tradeoff_bars = False  # tradeoff.png: each task's score as grouped bars instead of a scatter on two axes
    keeps_best = False  # its runs evaluate during training and keep the best step (--select-by): --summarize-from

    @property
    def command(self) -> str:
        return self.training.command

    @property
    def config_class(self) -> type[TrainConfig]:
        return self.training.config_class

    @property
    def marker(self) -> str:
        return self.training.marker

    def check_evaluation(self, given: set[str], config: TrainConfig, recipe: Path) -> None:
        raise NotImplementedError

    def metric_list(self, config: TrainConfig) -> tuple[Metric, ...]:
        return self.metrics

    def describe(self, config: TrainConfig, swept: str | None) -> str:
        """What the recipe trains, in a few words for the caption (leaving out what `swept` changes)."""
        return ""

    def score_definitions(self, config: TrainConfig, facts: list[dict[str, Any]]) -> list[str]:
        """What the score columns are, for the lines under the table; `facts` are the runs' (`evaluated_during_
        training`, ...)."""
        return []

    def tradeoff_axes(self, keys: set[str]) -> TradeoffAxes | None:
        """The axes of tradeoff.png given the metric keys the table has; None: no trade-off figure."""
        return None

    def evaluation(self, folder: Path, report: dict[str, Any]) -> Path | None:
        """The folder of the evaluation of the finished run in `folder`, or None when it has none yet."""
        return folder

    def evaluate_command(self, config: TrainConfig, folder: Path, model: str | None = None,
                         out: Path | None = None) -> list[str]:
        """The command that evaluates the run in `folder` (or `model` into `out`: the starting model)."""
        raise NotImplementedError

    def at_best(self, folder: Path, report: dict[str, Any]) -> tuple[dict[str, Any], Path] | None:
        """(the report as the bench reads it at the run's best step, that step's evaluation); None when the run
        kept no best step."""
        return None

    def has_start(self, config: TrainConfig) -> bool:
        """Whether the bench evaluates the starting model too (the first point of every run's curve)."""
        return False

    def scores(self, report: dict[str, Any], evaluation: Path) -> tuple[dict[str, Any], dict[str, str]]:
        """({metric key: value}, {metric key: what it covers, when partial}) of a run and its evaluation."""
        raise NotImplementedError

    def scores_before(self, report: dict[str, Any]) -> dict[str, Any] | None:
        """The score columns' values before training, where the run measures them itself (SCHEMES.json's
        `before`); None where it does not."""
        return None

    def curve_names(self, config: TrainConfig) -> tuple[str, ...]:
        """The values each run's curve plots: those its own evaluations during training plot (the command's)."""
        return self.training.curve_names(config)

    def planned_steps(self, config: TrainConfig) -> int:
        """The run's optimizer steps, as far as the bench can tell before it runs (for `save_every`)."""
        return config.steps


def doplus_evaluate(folder: Path, options: list[tuple[str, Any]], trust_remote_code: bool, model: str | None = None,
                    out: Path | None = None) -> list[str]:
    """`doplus evaluate` of the run's final/ (or `model`) into its eval/ folder (or `out`), with the options whose
    value is not None."""
    command = [sys.executable, "-m", "doplus_cli", "evaluate", "--model", model or str(folder / "final")]
    for option, value in options:
        if value is not None:
            command += [option, str(value)]
    if trust_remote_code:
        command.append("--trust-remote-code")
    return command + ["--out", str(out or folder / "eval"), "--overwrite"]


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


# ---- the registry -------------------------------------------------------------------------------------------

ADAPTERS: Registry[BenchAdapter] = Registry("bench adapter", BenchAdapter, names=COMMANDS)  # by command


def register(adapter: BenchAdapter) -> BenchAdapter:
    return ADAPTERS.register(adapter.command, adapter)


def adapter_named(command: str) -> BenchAdapter:
    return ADAPTERS[command]


def adapter_of(recipe: Path, keys: set[str]) -> BenchAdapter:
    """The adapter of a recipe's command (or of --set/--sweep's keys), or one line saying the bench runs none."""
    command = command_marked(keys)
    if command is not None and command.command in ADAPTERS:
        return ADAPTERS[command.command]
    markers = ", ".join(f"{adapter.marker} ({name})" for name, adapter in ADAPTERS.items())
    raise UserError(f"{recipe}: not a recipe bench schemes can run: it sets none of {markers}")
