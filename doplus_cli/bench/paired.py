"""Paired evidence between the schemes of one `bench schemes` grid.

Two schemes' runs on the same forget task with the same seed share their data order, their starting model and
their evaluation sets: the difference of a metric between the two runs of such a pair removes what the pair has in
common, and the spread left is the schemes' own. For each pair of schemes (at one sweep value) and each score
metric, over the (task, seed) pairs both ran:

- the differences A − B, one per pair, kept in SCHEMES.json;
- their mean and its 95% confidence interval from Student's t with n − 1 degrees of freedom;
- how many pairs agree in sign with the mean;
- the smallest mean difference the grid detects at its observed spread: (t(0.975) + t(0.80)) · sd / √n, the
  difference a two-sided 5% test finds with 80% power.

The reading, applied by `reading` and written in docs/benchmarks.md: a scheme is called better on a metric only
when the interval excludes 0 (the direction by the metric's better side); otherwise the grid detects no
difference, and the reading says the smallest it could have detected. Fewer than 2 pairs give no interval and no
reading but the count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

CONFIDENCE = 0.95
POWER = 0.80


@dataclass(frozen=True)
class Paired:
    """The paired differences A − B of one metric and what they show."""

    n: int
    differences: tuple[float, ...]
    mean: float | None
    low: float | None  # the 95% interval of the mean difference (None below 2 pairs)
    high: float | None
    agree: int  # pairs whose difference has the mean's sign
    detectable: float | None  # the smallest mean difference detected with 80% power at this spread

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "differences": list(self.differences)}


def t_quantile(probability: float, degrees: int) -> float:
    from scipy import stats

    return float(stats.t.ppf(probability, degrees))


def paired(a: Sequence[float], b: Sequence[float]) -> Paired:
    """The differences a[i] − b[i] (the two runs of pair i) and their mean, interval, sign agreement and the
    smallest detectable difference."""
    if len(a) != len(b):
        raise ValueError(f"paired values need one of each per pair: {len(a)} against {len(b)}")
    differences = tuple(float(x) - float(y) for x, y in zip(a, b))
    n = len(differences)
    if n == 0:
        return Paired(0, (), None, None, None, 0, None)
    mean = sum(differences) / n
    agree = sum(1 for d in differences if d * mean > 0)
    if n < 2:
        return Paired(n, differences, mean, None, None, agree, None)
    sd = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1))
    error = sd / math.sqrt(n)
    t = t_quantile(1 - (1 - CONFIDENCE) / 2, n - 1)
    return Paired(n, differences, mean, mean - t * error, mean + t * error, agree,
                  (t + t_quantile(POWER, n - 1)) * error)


def interval_words(result: Paired, what: str = "mean") -> str:
    """`mean +1.2, 95% CI [+0.3, +2.1], 5 of 6 pairs agree` (`what` names the mean)."""
    return (f"{what} {result.mean:+.3g}, 95% CI [{result.low:+.3g}, {result.high:+.3g}], {result.agree} of "
            f"{result.n} pairs agree")


def reading(first: str, second: str, metric: str, higher_is_better: bool | None, result: Paired) -> str:
    """The comparison in words, by the rule of the module's docstring."""
    if result.n < 2 or result.low is None or result.high is None or result.mean is None:
        return f"{first} − {second} on {metric}: {result.n} pair{'s' if result.n != 1 else ''}, too few for an interval"
    interval = interval_words(result)
    if result.low > 0 or result.high < 0:
        if higher_is_better is None:
            side = "higher" if result.mean > 0 else "lower"
            return f"{first} is {side} than {second} on {metric} ({interval})"
        better = first if (result.mean > 0) == higher_is_better else second
        worse = second if better == first else first
        return f"{better} is better than {worse} on {metric} ({interval})"
    return (f"no difference detected between {first} and {second} on {metric} ({interval}); the grid detects a "
            f"mean difference of about {result.detectable:.3g} or more")


def comparisons(rows: list[dict[str, Any]], runs: dict[str, dict[str, Any]],
                metrics: Sequence[tuple[str, str, bool | None]]) -> list[dict[str, Any]]:
    """Every pair of rows at the same sweep value, for each score metric (key, label, higher is better): the
    paired differences over the (task, seed) pairs both rows ran and evaluated. `rows` and `runs` are
    SCHEMES.json's."""
    found = []
    for i, first in enumerate(rows):
        for second in rows[i + 1:]:
            if first["sweep_value"] != second["sweep_value"]:
                continue
            for key, label, higher in metrics:
                a, b = _by_pair(first, runs, key), _by_pair(second, runs, key)
                shared = sorted(set(a) & set(b), key=lambda pair: (-1 if pair[0] is None else pair[0], pair[1]))
                result = paired([a[pair] for pair in shared], [b[pair] for pair in shared])
                found.append({"metric": key, "a": first["label"], "b": second["label"],
                              "sweep_value": first["sweep_value"],
                              "pairs": [{"task": task, "seed": seed} for task, seed in shared], **result.to_dict(),
                              "reading": reading(first["label"], second["label"], label, higher, result)})
    return found


def _by_pair(row: dict[str, Any], runs: dict[str, dict[str, Any]], key: str) -> dict[tuple[int | None, int], float]:
    values = {}
    for name in row["runs"]:
        run = runs[name]
        value = run["values"].get(key)
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            values[(run.get("task_id"), run["seed"])] = float(value)
    return values


def render(found: list[dict[str, Any]], labels: dict[str, str], sweep_key: str | None) -> list[str]:
    """SCHEMES.md's section: one line a comparison, grouped by metric."""
    if not found:
        return []
    lines = ["**Paired differences** (A − B over the runs of the same forget task and seed; 95% t interval; a "
             "scheme is called better only when the interval excludes 0, docs/benchmarks.md):", ""]
    for entry in found:
        where = f" ({sweep_key} = {entry['sweep_value']})" if sweep_key else ""
        lines.append(f"- {labels.get(entry['metric'], entry['metric'])}{where}: {entry['reading']}.")
    return lines
