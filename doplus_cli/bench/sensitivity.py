"""How sensitive each scheme is to a swept setting (`bench schemes --sweep lr=...`), by the rule docs/benchmarks.md
writes down, applied here:

- a scheme's best value is the sweep value with the best mean of the metric over its (task, seed) pairs (highest
  where higher is better), fixed per scheme from those means, never chosen per pair;
- its loss away from the best, per (task, seed) pair: the metric at the best value minus the mean of the metric at
  the other values (signed so that a positive loss is worse), over the pairs the scheme ran at every value;
- the loss one step either side of the best, on the sweep's sorted values (the larger of the two, the one side at
  an end of the grid), per scheme on the means;
- the seed spread at each value: the sample standard deviation over the seeds within a forget task, averaged over
  the tasks (a task with one seed adds nothing);
- for each pair of schemes, the paired differences of their losses (A − B over the shared pairs) with the 95% t
  interval of `bench/paired.py`: A is called less sensitive than B only when the interval lies below 0, more
  sensitive only when it lies above; otherwise no difference is detected, with the smallest the grid detects;
- and their seed spreads value by value: A is called less (more) seed-sensitive only when its spread is below
  (above) B's at every value but at most one, over three values or more.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from doplus_cli.bench.paired import interval_words, paired

Pair = tuple[Any, int]  # (task, seed)


def _key(value: Any) -> Any:
    """Sweep values in order: numbers by size, anything else as written."""
    return (0, float(value), "") if isinstance(value, (int, float)) and not isinstance(value, bool) else (1, 0.0,
                                                                                                           str(value))


def per_value(rows: list[dict[str, Any]], runs: dict[str, dict[str, Any]], scheme: str, metric: str
              ) -> dict[Any, dict[Pair, float]]:
    """{sweep value: {(task, seed): the run's metric}} of one scheme (SCHEMES.json's rows and runs)."""
    found: dict[Any, dict[Pair, float]] = {}
    for row in rows:
        if row["scheme"] != scheme:
            continue
        values = found.setdefault(row["sweep_value"], {})
        for name in row["runs"]:
            run = runs[name]
            value = run["values"].get(metric)
            if value is not None:
                values[(run.get("task_id"), run["seed"])] = float(value)
    return found


def seed_spread(values: dict[Pair, float]) -> float | None:
    """The sample std over the seeds within each task, averaged over the tasks with two seeds or more."""
    by_task: dict[Any, list[float]] = {}
    for (task, _), value in values.items():
        by_task.setdefault(task, []).append(value)
    spreads = [statistics.stdev(v) for v in by_task.values() if len(v) > 1]
    return statistics.mean(spreads) if spreads else None


def scheme_sensitivity(by_value: dict[Any, dict[Pair, float]], higher_is_better: bool) -> dict[str, Any] | None:
    """One scheme's best value, its losses away from it per pair, the loss one step either side and the seed
    spread at each value; None with fewer than two sweep values."""
    order = sorted(by_value, key=_key)
    if len(order) < 2:
        return None
    sign = 1.0 if higher_is_better else -1.0
    means = {v: statistics.mean(by_value[v].values()) if by_value[v] else None for v in order}
    scored = [v for v in order if means[v] is not None]
    if len(scored) < 2:
        return None
    best = max(scored, key=lambda v: sign * means[v])
    others = [v for v in order if v != best]
    pairs = sorted(set.intersection(*(set(by_value[v]) for v in order)),
                   key=lambda p: (-1 if p[0] is None else p[0], p[1]))
    losses = {p: sign * (by_value[best][p] - statistics.mean(by_value[v][p] for v in others)) for p in pairs}
    at = order.index(best)
    neighbours = [order[i] for i in (at - 1, at + 1) if 0 <= i < len(order) and means[order[i]] is not None]
    step_loss = max(sign * (means[best] - means[v]) for v in neighbours) if neighbours else None
    return {"values": order, "means": [means[v] for v in order], "best": best, "best_mean": means[best],
            "pairs": [{"task": t, "seed": s} for t, s in pairs], "losses": [losses[p] for p in pairs],
            "loss_mean": statistics.mean(losses.values()) if losses else None, "step_loss": step_loss,
            "seed_spread": [seed_spread(by_value[v]) for v in order]}


def reading(first: str, second: str, metric: str, result: Any) -> str:
    """The comparison of two schemes' losses in words, by the module's rule."""
    if result.n < 2 or result.low is None:
        return f"{first} − {second}: {result.n} pair{'s' if result.n != 1 else ''}, too few for an interval"
    interval = interval_words(result, "loss difference")
    if result.high < 0:
        return f"{first} is less sensitive than {second} on {metric} ({interval})"
    if result.low > 0:
        return f"{first} is more sensitive than {second} on {metric} ({interval})"
    return (f"no difference in sensitivity detected between {first} and {second} on {metric} ({interval}); the "
            f"grid detects a difference of about {result.detectable:.3g} or more")


def seed_reading(first: str, second: str, a: dict[str, Any], b: dict[str, Any]) -> str:
    """The two schemes' seed spreads value by value: A is called less (more) seed-sensitive only when its spread is
    below (above) B's at all the values both have a spread at but at most one, and at three values or more."""
    spreads = [(x, y) for value, x in zip(a["values"], a["seed_spread"]) if value in b["values"]
               for y in [b["seed_spread"][b["values"].index(value)]] if x is not None and y is not None]
    below = sum(1 for x, y in spreads if x < y)
    above = sum(1 for x, y in spreads if x > y)
    count = f"{first}'s seed spread is below {second}'s at {below} of {len(spreads)} values, above at {above}"
    if len(spreads) >= 3 and below >= len(spreads) - 1:
        return f"{first} is less seed-sensitive than {second} ({count})"
    if len(spreads) >= 3 and above >= len(spreads) - 1:
        return f"{first} is more seed-sensitive than {second} ({count})"
    return f"no difference in seed spread called between {first} and {second} ({count})"


def sensitivity(rows: list[dict[str, Any]], runs: dict[str, dict[str, Any]],
                metrics: Sequence[tuple[str, str, bool | None]], labels: dict[str, str]) -> list[dict[str, Any]]:
    """For each metric with a direction (key, label, higher is better): every scheme's sensitivity and every pair
    of schemes' paired loss difference. `labels`: scheme -> its label."""
    found = []
    schemes = list(dict.fromkeys(row["scheme"] for row in rows))
    for key, label, higher in metrics:
        if higher is None:
            continue
        per_scheme = {s: scheme_sensitivity(per_value(rows, runs, s, key), higher) for s in schemes}
        per_scheme = {s: v for s, v in per_scheme.items() if v is not None}
        if not per_scheme:
            continue
        comparisons = []
        names = list(per_scheme)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                la = dict(zip(map(_pair, per_scheme[a]["pairs"]), per_scheme[a]["losses"]))
                lb = dict(zip(map(_pair, per_scheme[b]["pairs"]), per_scheme[b]["losses"]))
                shared = [p for p in la if p in lb]
                result = paired([la[p] for p in shared], [lb[p] for p in shared])
                comparisons.append({"a": labels.get(a, a), "b": labels.get(b, b), **result.to_dict(),
                                    "reading": reading(labels.get(a, a), labels.get(b, b), label, result),
                                    "seed_spread": seed_reading(labels.get(a, a), labels.get(b, b),
                                                                per_scheme[a], per_scheme[b])})
        found.append({"metric": key, "label": label, "higher_is_better": higher,
                      "schemes": {labels.get(s, s): v for s, v in per_scheme.items()}, "comparisons": comparisons})
    return found


def _pair(entry: dict[str, Any]) -> Pair:
    return entry["task"], entry["seed"]


def render(found: list[dict[str, Any]], sweep_key: str) -> list[str]:
    """SCHEMES.md's section: per metric, a table of each scheme's best value, its mean there, its mean loss away
    from it and one step either side, and its seed spread at each value; then the comparisons in words."""
    lines: list[str] = []
    for entry in found:
        values = next(iter(entry["schemes"].values()))["values"]
        lines += ["", f"**Sensitivity to {sweep_key}, by {entry['label']}** (loss: the metric at the scheme's best "
                      f"{sweep_key} minus its mean at the others, per forget task and seed; docs/benchmarks.md):", "",
                  "| Method | best " + sweep_key + " | at the best | mean loss | loss one step away | "
                  + " | ".join(f"seed spread at {v}" for v in values) + " |",
                  "| --- |" + " ---: |" * (4 + len(values))]
        for label, s in entry["schemes"].items():
            cells = [label, str(s["best"]), _fmt(s["best_mean"]), _fmt(s["loss_mean"]), _fmt(s["step_loss"]),
                     *(_fmt(x) for x in s["seed_spread"])]
            lines.append("| " + " | ".join(cells) + " |")
        lines += [""] + [f"- {c['reading']}; {c['seed_spread']}." for c in entry["comparisons"]]
    return lines


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"
