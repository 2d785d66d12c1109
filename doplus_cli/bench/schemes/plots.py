"""The figures: tradeoff.png (the command's trade-off per scheme), tradeoff_curves.png (each run's path through
(MU, UFE)), curves.png (the evaluations during training), update_similarity.png (the paper's Figure 2a)."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from doplus_cli.bench.adapters import adapter_named
from doplus_cli.bench.schemes.summary import Result, row_label
from doplus_cli.files import save_figure


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> str:
    """Save as PNG under a temporary name, then rename (as `atomic_write_text` does for text)."""
    fig.tight_layout()
    try:
        save_figure(fig, path)
    finally:
        _pyplot().close(fig)
    return path.name


def plot_tradeoff(summary: dict[str, Any], out: Path) -> str | None:
    """The command's trade-off per scheme, error bars the std over seeds (unlearning: forget efficacy UFE against
    utility MU; alignment: the safety loss against the general loss), or each task's score per scheme as grouped
    bars (multitask)."""
    plt = _pyplot()
    rows, sweep = summary["rows"], summary["sweep"]
    kind = adapter_named(summary["kind"])
    if kind.tradeoff_bars:
        tasks = [c["key"] for c in summary["columns"] if c["role"] == "score"]
        fig, ax = plt.subplots(figsize=(max(6.0, 2 + 0.6 * len(tasks) * len(rows)), 4.5))
        width = 0.8 / max(1, len(rows))
        for i, row in enumerate(rows):
            means = [row["metrics"][t]["mean"] or 0.0 for t in tasks]
            errors = [row["metrics"][t]["std"] or 0.0 for t in tasks]
            ax.bar([x + (i - (len(rows) - 1) / 2) * width for x in range(len(tasks))], means, width, yerr=errors,
                   capsize=3, label=row_label(row, sweep))
        ax.set_xticks(range(len(tasks)), tasks)
        ax.set_ylabel("held-out score after training (%)")
    else:
        axes = kind.tradeoff_axes({c["key"] for c in summary["columns"]})
        if axes is None:
            return None
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for row in rows:
            x, y = row["metrics"][axes.x], row["metrics"][axes.y]
            if x["mean"] is None or y["mean"] is None:
                continue
            ax.errorbar(x["mean"], 1 - y["mean"] if axes.y_complement else y["mean"], xerr=x["std"], yerr=y["std"],
                        fmt="o", capsize=4, label=row_label(row, sweep))
        ax.set_xlabel(axes.x_label)
        ax.set_ylabel(axes.y_label)
    ax.set_title("mean over seeds; error bars: sample std (none with one seed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out / "tradeoff.png")


def plot_attacks(summary: dict[str, Any], out: Path) -> str | None:
    """attacks.png: the headline forget metric before and after each attack, one colour per scheme, error bars the
    std over seeds (and tasks); None when the runs ran no attacks."""
    attacked = [c for c in summary["columns"] if c["role"] == "attack"]
    if not attacked:
        return None
    metric = attacked[0]["key"].split(" ")[0]
    keys = [metric, *(c["key"] for c in attacked)]
    labels = ["unattacked", *(c["key"].split(" ", 1)[1].removeprefix("after ") for c in attacked)]
    plt = _pyplot()
    rows = summary["rows"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(keys)), 4.5))
    width = 0.8 / max(1, len(rows))
    for i, row in enumerate(rows):
        stats = [row["metrics"].get(k, {"mean": None, "std": None}) for k in keys]
        ax.bar([x + (i - (len(rows) - 1) / 2) * width for x in range(len(keys))],
               [s["mean"] if s["mean"] is not None else 0.0 for s in stats], width,
               yerr=[s["std"] or 0.0 for s in stats], capsize=3, label=row_label(row, summary["sweep"]))
    ax.set_xticks(range(len(keys)), labels, rotation=20)
    ax.set_ylabel(f"{metric} of the last evaluation")
    ax.set_title(f"{metric} before and after each attack; error bars: sample std over {summary.get('over', 'seeds')}")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return _save(fig, out / "attacks.png")


def plot_tradeoff_curves(summary: dict[str, Any], out: Path) -> str | None:
    """Each run's path through (MU, UFE), from the starting model through its evaluations, one colour per
    scheme; the dotted lines are the matched levels of the trade-off tables."""
    tradeoff = summary.get("tradeoff")
    if not tradeoff:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.8))
    for i, row in enumerate(tradeoff["rows"]):
        colour = f"C{i % 10}"
        for j, name in enumerate(row["runs"]):
            curve = tradeoff["curves"].get(name)
            if not curve:
                continue
            ufe, mu = zip(*curve)
            ax.plot(mu, ufe, color=colour, marker="o", markersize=3, alpha=0.8, label=row["label"] if j == 0 else None)
            ax.plot(mu[-1], ufe[-1], color=colour, marker="s", markersize=6)
    for level in tradeoff["ufe_levels"]:
        ax.axhline(level, color="grey", linestyle=":", linewidth=0.8)
    for level in tradeoff["mu_levels"]:
        ax.axvline(level, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("MU (%)  (utility, higher is better)")
    ax.set_ylabel("UFE (%)  (forget efficacy, higher is better)")
    ax.set_title("each run from its starting model (small dots) to its end (square)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out / "tradeoff_curves.png")


def _mean_curve(series: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    by_step: dict[int, list[float]] = {}
    for points in series:
        for step, value in points:
            by_step.setdefault(step, []).append(value)
    return [(step, statistics.mean(values)) for step, values in sorted(by_step.items())]


def _groups(summary: dict[str, Any], results: list[Result]) -> Iterator[tuple[str, list[Result]]]:
    by_name = {r.name: r for r in results}
    for row in summary["rows"]:
        yield row_label(row, summary["sweep"]), [by_name[name] for name in row["runs"]]


def plot_curves(summary: dict[str, Any], results: list[Result], names: tuple[str, ...], out: Path) -> str | None:
    """The evaluations during training: one panel per aggregate (or task), a line per scheme, mean over seeds."""
    names = tuple(n for n in names if any(e.get(n) is not None for r in results for e in r.curve))
    if not names or not any(len(r.curve) > 1 for r in results):
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        for label, members in _groups(summary, results):
            curve = _mean_curve([[(e["step"], e[name]) for e in r.curve if e.get(name) is not None] for r in members])
            if curve:
                ax.plot(*zip(*curve), marker="o", label=label)
        ax.set_title(f"{name} (%)")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    return _save(fig, out / "curves.png")


def plot_update_similarity(summary: dict[str, Any], results: list[Result], out: Path) -> str | None:
    """update_cosine against the step per scheme (mean over seeds): the paper's Figure 2a."""
    if not any(r.update_cosines for r in results):
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, members in _groups(summary, results):
        curve = _mean_curve([r.update_cosines for r in members])
        if curve:
            ax.plot(*zip(*curve), label=label)
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("update_cosine (latest updates of the objectives)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out / "update_similarity.png")
