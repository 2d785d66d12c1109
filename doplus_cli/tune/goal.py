"""What `doplus tune` optimises: one metric of the recipe's evaluation suite (`--objective`), subject to bounds on
others (`--constraint`).

    --objective OVR               a metric the bench's tables show for the suite, in its better direction
    --objective muse_privleak:min a direction given where the metric has none, or to go against it
    --constraint "MU>=20"         a bound on a metric of the same evaluation
    --constraint "model_utility>=0.9*start"   a bound relative to the starting model's value (evaluated once)

A trial is feasible when every constraint holds; the best trial is the best feasible one. Optuna's TPE sampler
takes the constraints as values that are <= 0 where they hold (`violation`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from doplus_cli.errors import UserError, shown

_CONSTRAINT = re.compile(r"^\s*([A-Za-z_][\w/.\-]*)\s*(>=|<=)\s*([-+0-9.eE]+)\s*(\*\s*start)?\s*$")


@dataclass(frozen=True)
class Objective:
    metric: str
    maximize: bool

    @property
    def direction(self) -> str:
        return "maximize" if self.maximize else "minimize"

    def describe(self) -> str:
        return f"{self.direction} {self.metric}"


@dataclass(frozen=True)
class Constraint:
    metric: str
    op: str  # >= or <=
    bound: float
    relative: bool  # the bound is a multiple of the starting model's value

    def text(self) -> str:
        return f"{self.metric}{self.op}{self.bound:g}" + ("*start" if self.relative else "")

    def limit(self, start: dict[str, Any] | None) -> float:
        """The bound as a number (a relative one needs the starting model's scores)."""
        if not self.relative:
            return self.bound
        value = (start or {}).get(self.metric)
        if value is None:
            raise UserError(f"--constraint {self.text()}: the starting model's evaluation has no {self.metric}")
        return self.bound * float(value)

    def violation(self, scores: dict[str, Any], start: dict[str, Any] | None) -> float:
        """How far the trial is from meeting the bound: <= 0 where it holds; a missing value does not hold."""
        value = scores.get(self.metric)
        if value is None or not math.isfinite(float(value)):
            return math.inf
        limit = self.limit(start)
        return limit - float(value) if self.op == ">=" else float(value) - limit


def parse_objective(text: str, metrics: dict[str, bool | None], suite: str) -> Objective:
    """`METRIC` or `METRIC:max|min`, METRIC among `metrics` ({key: higher is better, or None})."""
    name, _, how = text.strip().rpartition(":") if text.strip().endswith((":max", ":min")) else (text.strip(), "", "")
    _known(name, metrics, suite, "--objective")
    if how:
        return Objective(name, how == "max")
    better = metrics[name]
    if better is None:
        raise UserError(f"--objective {name}: the {suite} suite marks no better side of {name}; write {name}:max or "
                        f"{name}:min")
    return Objective(name, better)


def parse_constraints(items: list[str], metrics: dict[str, bool | None], suite: str) -> list[Constraint]:
    constraints = []
    for item in items:
        match = _CONSTRAINT.match(item)
        if not match:
            raise UserError(f"--constraint {shown(item)}: write METRIC>=VALUE, METRIC<=VALUE or METRIC>=F*start "
                            "(F times the starting model's value)")
        name, op, number, relative = match.groups()
        _known(name, metrics, suite, f"--constraint {item}")
        try:
            bound = float(number)
        except ValueError:
            raise UserError(f"--constraint {item}: '{number}' is not a number") from None
        if not math.isfinite(bound):
            raise UserError(f"--constraint {item}: the bound is a finite number")
        constraints.append(Constraint(name, op, bound, relative is not None))
    return constraints


def _known(name: str, metrics: dict[str, bool | None], suite: str, where: str) -> None:
    if name not in metrics:
        raise UserError(f"{where}: the {suite} evaluation gives no metric {shown(name)}; it gives "
                        f"{', '.join(metrics)}")
