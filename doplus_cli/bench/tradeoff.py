"""The forget/retain trade-off measured directly, from each unlearning run's evaluation curve.

OVR folds forget efficacy and utility into one number at the run's last step, so a scheme that forgets more
slowly and one that keeps more utility can tie or swap places. Here the two are compared at matched levels
instead, along each run's curve: the taught (starting) model, then every evaluation during training, in step
order, each a point (UFE, MU).

- **MU at matched UFE**: for a UFE level, the MU where the run's UFE first reaches the level, interpolated
  linearly between the two evaluations on either side of the crossing.
- **UFE at matched MU**: for an MU level below the start, the UFE where the run's MU first falls to the level.

A run whose curve never reaches a level has no value there: it is counted as not reached, never extrapolated.
A run whose curve already starts past the level (its taught model is past it) is counted apart, as past at the
start. Levels come from the runs themselves by a fixed rule (`levels`), so no one picks them after seeing the
schemes' numbers.

Matched levels read a curve at a few places; the whole curve is read by its Pareto envelope, the evaluations no
other evaluation of the run beats on both UFE and MU (`envelope`):

- **The area it dominates** (`dominated_area`): the area of the (UFE, MU) region that some envelope point is at
  least as good as on both, above the reference point (the runs' mean starting UFE, MU 0): more forgetting at
  the same utility, or more utility at the same forgetting, anywhere along the run, enlarges it.
- **Dominance** (`dominance`): one run's envelope dominates another's when every point of the other is matched
  or beaten on both by one of its points, and not the reverse; otherwise the two envelopes cross (or coincide).
  Two schemes' runs on the same forget task and seed are compared pair by pair (`dominance_counts`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

FRACTIONS = (0.25, 0.5, 0.75)  # where the levels sit between the start and the runs' typical end


@dataclass(frozen=True)
class Crossing:
    """The value of y where x first reaches a level; `status` is "reached", "not reached" or "past at the start"."""

    value: float | None
    status: str


def at_level(curve: Sequence[tuple[float, float]], level: float, falling: bool) -> Crossing:
    """y where x first reaches `level` along `curve` ((x, y) points in step order): x rising to >= level, or
    with `falling` x falling to <= level. Linear interpolation between the two points around the first
    crossing; a point exactly at the level gives its own y."""
    if not curve:
        return Crossing(None, "not reached")

    def past(x: float) -> bool:
        return x <= level if falling else x >= level

    x0, y0 = curve[0]
    if past(x0):
        return Crossing(y0, "reached") if x0 == level else Crossing(None, "past at the start")
    for (xa, ya), (xb, yb) in zip(curve, curve[1:]):
        if past(xb):
            t = (level - xa) / (xb - xa)  # xb != xa: xa is not past the level and xb is
            return Crossing(ya + t * (yb - ya), "reached")
    return Crossing(None, "not reached")


def levels(starts: Sequence[float], ends: Sequence[float]) -> list[float]:
    """The rule for the common levels: 1/4, 1/2 and 3/4 of the way from the mean of the runs' starting values to
    the median of their end values (final UFE; lowest MU on the curve), rounded to 0.1. None when the runs, at
    the median, did not move away from the start."""
    if not starts or not ends:
        return []
    start, end = statistics.mean(starts), statistics.median(ends)
    if abs(end - start) < 0.1:
        return []
    return [round(start + f * (end - start), 1) for f in FRACTIONS]


def ordered(start: dict[str, Any] | None, evals: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A run's evaluations in step order, the starting model's first when it was evaluated."""
    return ([start] if start else []) + sorted(evals, key=lambda e: e["step"])


def curve_of(start: dict[str, Any] | None, evals: Sequence[dict[str, Any]]) -> list[tuple[float, float]]:
    """(UFE, MU) points in step order: the starting model (when evaluated), then each evaluation that has both."""
    return [(p["UFE"], p["MU"]) for p in ordered(start, evals) if p.get("UFE") is not None and p.get("MU") is not None]


def envelope(curve: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points of `curve` ((UFE, MU), both higher is better) that no other point matches or beats on both with
    one of them strictly better, once each, in rising UFE (so falling MU)."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(set(curve), key=lambda p: (-p[0], -p[1])):  # highest UFE first, then highest MU
        if not front or y > front[-1][1]:
            front.append((x, y))
    return front[::-1]


def dominated_area(curve: Sequence[tuple[float, float]], x_ref: float, y_ref: float = 0.0) -> float:
    """The area of the region {(x, y): x_ref <= x <= X and y_ref <= y <= Y for some envelope point (X, Y)}: with
    the envelope in rising x (falling y) and x_0 = x_ref, the sum over its points beyond the reference of
    (x_i - max(x_{i-1}, x_ref)) * (y_i - y_ref)."""
    area, left = 0.0, x_ref
    for x, y in envelope(curve):
        if x <= left or y <= y_ref:
            continue
        area += (x - left) * (y - y_ref)
        left = x
    return area


def dominance(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> str:
    """"a" when a's envelope dominates b's (every point of b's matched or beaten on both by a point of a's, not the
    reverse), "b" the other way, "equal" when each covers the other, "cross" when neither does."""
    def covers(first, second):
        return all(any(x >= u and y >= v for x, y in envelope(first)) for u, v in envelope(second))

    a_covers, b_covers = covers(a, b), covers(b, a)
    if a_covers and b_covers:
        return "equal"
    return "a" if a_covers else "b" if b_covers else "cross"


def dominance_counts(first: dict[Any, Sequence[tuple[float, float]]],
                     second: dict[Any, Sequence[tuple[float, float]]]) -> dict[str, Any]:
    """`dominance` over the pairs both hold (key: forget task and seed): how many times the first's envelope
    dominates, the second's does, they are equal, they cross; and the pairs, in key order."""
    shared = sorted(set(first) & set(second), key=repr)
    results = [dominance(first[key], second[key]) for key in shared]
    return {"pairs": len(shared), "first": results.count("a"), "second": results.count("b"),
            "equal": results.count("equal"), "cross": results.count("cross"),
            "by_pair": [[list(key) if isinstance(key, tuple) else key, r] for key, r in zip(shared, results)]}


def dominance_between(rows: list[dict[str, Any]], runs: dict[str, dict[str, Any]],
                      curves: dict[str, Sequence[Sequence[float]]]) -> list[dict[str, Any]]:
    """For each pair of SCHEMES.json rows at the same sweep value, `dominance_counts` of their runs' curves paired
    by (forget task, seed)."""
    def by_pair(row: dict[str, Any]) -> dict[Any, list[tuple[float, float]]]:
        return {(runs[n].get("task_id"), runs[n]["seed"]): [tuple(p) for p in curves[n]]
                for n in row["runs"] if n in curves}

    found = []
    for i, first in enumerate(rows):
        for second in rows[i + 1:]:
            if first["sweep_value"] == second["sweep_value"]:
                found.append({"a": first["label"], "b": second["label"], "sweep_value": first["sweep_value"],
                              **dominance_counts(by_pair(first), by_pair(second))})
    return found


def summarise_tradeoff(runs: dict[str, dict[str, Any]], groups: list[tuple[str, list[str]]]) -> dict[str, Any] | None:
    """`runs`: name -> {"start": point or None, "evals": [points]}; `groups`: (row label, run names).
    Levels by `levels`, then per row and level the mean and sample std of the runs that reached it, and how many
    did not (or started past it). None when no run has a curve of two points."""
    curves = {name: curve_of(r.get("start"), r.get("evals", [])) for name, r in runs.items()}
    curves = {name: c for name, c in curves.items() if len(c) > 1}
    if not curves:
        return None
    ufe_levels = levels([c[0][0] for c in curves.values()], [c[-1][0] for c in curves.values()])
    mu_levels = levels([c[0][1] for c in curves.values()], [min(mu for _, mu in c) for c in curves.values()])
    rows = []
    for label, names in groups:
        members = [n for n in names if n in curves]
        row: dict[str, Any] = {"label": label, "runs": members, "mu_at_ufe": [], "ufe_at_mu": []}
        for key, grid, falling in (("mu_at_ufe", ufe_levels, False), ("ufe_at_mu", mu_levels, True)):
            # MU at UFE: x = UFE rising, y = MU; UFE at MU: x = MU falling, y = UFE
            for level in grid:
                crossings = [at_level(curves[n] if not falling else [(mu, ufe) for ufe, mu in curves[n]],
                                      level, falling) for n in members]
                values = [c.value for c in crossings if c.status == "reached"]
                row[key].append({
                    "level": level, "values": [c.value for c in crossings], "status": [c.status for c in crossings],
                    "mean": statistics.mean(values) if values else None,
                    "std": statistics.stdev(values) if len(values) > 1 else None,
                    "reached": len(values), "runs": len(members),
                    "past_at_start": sum(c.status == "past at the start" for c in crossings),
                })
        rows.append(row)
    x_ref = statistics.mean(c[0][0] for c in curves.values())
    areas = {name: dominated_area(c, x_ref) for name, c in curves.items()}
    for row in rows:
        values = [areas[n] for n in row["runs"]]
        row["area"] = {"values": values, "mean": statistics.mean(values) if values else None,
                       "std": statistics.stdev(values) if len(values) > 1 else None, "runs": len(values)}
    return {"ufe_levels": ufe_levels, "mu_levels": mu_levels, "rows": rows, "areas": areas,
            "area_reference": [x_ref, 0.0],
            "curves": {name: [list(p) for p in c] for name, c in curves.items()},
            "rule": "levels at 1/4, 1/2 and 3/4 of the way from the runs' mean starting value (the taught model) to "
                    "the median over runs of the final UFE / the lowest MU on the curve; a run's value at a level is "
                    "interpolated linearly between the evaluations around its first crossing, never extrapolated"}


def cell(entry: dict[str, Any]) -> str:
    """`mean ± std (reached/runs)`, or `not reached (0/runs)`; runs past the level at the start are named."""
    count = f"{entry['reached']}/{entry['runs']}"
    past = f", {entry['past_at_start']} past at the start" if entry["past_at_start"] else ""
    if entry["mean"] is None:
        return f"not reached ({count}{past})"
    std = f" ± {entry['std']:.2f}" if entry["std"] is not None else ""
    return f"{entry['mean']:.2f}{std} ({count}{past})"


def render(tradeoff: dict[str, Any], over: str) -> list[str]:
    """The trade-off tables, in Markdown lines."""
    lines = [f"### Trade-off at matched levels (mean ± std over {over}; in brackets: runs that reach the level)",
             "", f"Rule: {tradeoff['rule']}.", ""]
    for key, grid, title, name in (("mu_at_ufe", tradeoff["ufe_levels"], "MU (%) at matched UFE", "UFE"),
                                   ("ufe_at_mu", tradeoff["mu_levels"], "UFE (%) at matched MU", "MU")):
        if not grid:
            lines += [f"{title}: no levels (the runs did not move away from the starting model)", ""]
            continue
        lines += [f"{title} (higher is better)", "",
                  "| scheme | " + " | ".join(f"{name} = {level:.1f}" for level in grid) + " |",
                  "| --- |" + " ---: |" * len(grid)]
        for row in tradeoff["rows"]:
            lines.append(f"| {row['label']} | " + " | ".join(cell(e) for e in row[key]) + " |")
        lines.append("")
    x_ref = tradeoff["area_reference"][0]
    lines += [f"Whole curves: the area of the (UFE, MU) region each run's Pareto envelope dominates above UFE = "
              f"{x_ref:.1f} (the runs' mean start) and MU = 0, in UFE·MU points (higher is better)", "",
              "| scheme | area |", "| --- | ---: |"]
    for row in tradeoff["rows"]:
        area = row["area"]
        value = "n/a" if area["mean"] is None else f"{area['mean']:.1f}" + (
            f" ± {area['std']:.1f}" if area["std"] is not None else "")
        lines.append(f"| {row['label']} | {value} ({area['runs']} run{'s' if area['runs'] != 1 else ''}) |")
    lines.append("")
    for entry in tradeoff.get("dominance", []):
        lines.append(f"- {entry['a']} against {entry['b']}, over {entry['pairs']} runs of the same forget task and "
                     f"seed: {entry['a']}'s envelope dominates in {entry['first']}, {entry['b']}'s in "
                     f"{entry['second']}, they coincide in {entry['equal']} and cross in {entry['cross']}.")
    return lines
