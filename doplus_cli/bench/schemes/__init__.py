"""`doplus bench schemes`: the update schemes on one recipe over seeds, as paper-ready tables and figures.

    doplus bench schemes --recipe R.yaml --schemes joint,alternate,dualoptim,doplus --seeds 0,1,2 --out OUT

Every scheme x seed (x sweep value) is an ordinary run of the CLI, `doplus unlearn`, `doplus multitask` or
`doplus align` by the recipe's kind, started as a subprocess from a recipe of its own and evaluated with the
recipe's suite:

    OUT/bench.json                the experiment (kind, recipe values, --set, --sweep key) and the runs it holds
    OUT/recipes/NAME.yaml         the run's recipe: the given one (paths absolute), scheme, seed, --set, sweep
    OUT/runs/NAME/                the run itself (config.yaml, metrics.jsonl, report.json, final/, and its
                                  checkpoints/ until it is evaluated; --keep-checkpoints keeps them)
    OUT/runs/NAME.log             its output (and its evaluation's), appended at every start
    OUT/runs/NAME/eval/           `doplus evaluate` of final/ (unlearn, unless the run evaluated at its last step;
                                  align with eval_suite, written by the run itself)
    OUT/SCHEMES.json, SCHEMES.md  per scheme (and sweep value): mean and sample standard deviation over seeds
    OUT/tradeoff.png, curves.png, update_similarity.png

NAME is SCHEME-sSEED, or SCHEME-KEY=VALUE-sSEED with --sweep. The same command run again continues: a run
that finished and was evaluated is skipped, one with a checkpoint resumes, anything else starts afresh.

The package follows the command: planning.py (the runs and OUT), running.py (the subprocesses), summary.py (the
statistics, SCHEMES.json/md, the console table), plots.py (the figures); what differs between unlearn, multitask and
align recipes is their kind's (doplus_cli/kinds/).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from doplus_cli.bench.schemes.planning import (
    DEFAULT_SCHEMES,
    DEFAULT_SEEDS,
    Bench,
    check_out,
    plan_bench,
    record_runs,
)
from doplus_cli.bench.schemes.plots import plot_curves, plot_tradeoff, plot_tradeoff_curves, plot_update_similarity
from doplus_cli.bench.schemes.running import Runner
from doplus_cli.bench.schemes.summary import (
    Result,
    check_summarize_from,
    collect,
    mean_std,
    print_summary,
    render_markdown,
    second_half_mean,
    summarise,
)
from doplus_cli.config import SCHEMES
from doplus_cli.files import atomic_write_text
from doplus_cli.lifecycle import hold, run_guard

__all__ = ["DEFAULT_SCHEMES", "DEFAULT_SEEDS", "SCHEMES", "Result", "mean_std", "plan_bench", "plot_update_similarity",
           "print_summary", "render_markdown", "run_schemes_bench", "second_half_mean", "summarise", "write_outputs"]


def write_outputs(bench: Bench, index: dict[str, Any]) -> dict[str, Any]:
    """SCHEMES.json, SCHEMES.md and the figures, from every finished and evaluated run in OUT."""
    results, unfinished = collect(bench, index)
    summary = summarise(bench, results, unfinished)
    figures = [f for f in (plot_tradeoff(summary, bench.out), plot_tradeoff_curves(summary, bench.out),
                           plot_curves(summary, results, bench.kind.curve_names(bench.runs[0].config), bench.out),
                           plot_update_similarity(summary, results, bench.out)) if f]
    summary["figures"] = figures
    atomic_write_text(bench.out / "SCHEMES.json", json.dumps(summary, indent=2) + "\n")
    atomic_write_text(bench.out / "SCHEMES.md", render_markdown(summary, figures))
    return summary


def run_schemes_bench(recipe: str, schemes: str, seeds: str, out: str | None, set_options: list[str],
                      sweep: str | None, log_update_similarity: bool, num_processes: int | None, fsdp: bool,
                      say: Callable[[str], None], task_ids: str | None = None,
                      keep_checkpoints: bool = False, summarize_from: str = "final") -> dict[str, Any]:
    """Plan and check everything, run what is missing, then write the tables and figures; return SCHEMES.json."""
    out = out or os.path.join("bench", Path(recipe).stem)
    bench = plan_bench(recipe, schemes, seeds, out, set_options, sweep, log_update_similarity, task_ids)
    bench.summarize_from = check_summarize_from(bench, summarize_from)
    with run_guard():  # one bench per folder, and a signal from the start stops it (bench/schemes/running.py)
        hold(bench.out, "doplus bench schemes")
        return _run_bench(bench, task_ids, num_processes, fsdp, say, keep_checkpoints)


def _run_bench(bench: Bench, task_ids: str | None, num_processes: int | None, fsdp: bool,
               say: Callable[[str], None], keep_checkpoints: bool) -> dict[str, Any]:
    index = check_out(bench)
    record_runs(bench, index)
    tasks = f" x {len(bench.task_ids)} forget tasks" if task_ids is not None else ""
    say(f"{len(bench.runs)} runs ({len(bench.schemes)} schemes{tasks} x {len(bench.seeds)} seeds"
        + (f" x {len(bench.sweep_values)} values of {bench.sweep_key}" if bench.sweep_key else "")
        + f") of doplus {bench.kind.command} into {bench.out}")
    Runner(bench, say, num_processes, fsdp, keep_checkpoints).run_all()
    summary = write_outputs(bench, index)
    say(f"tables: {bench.out / 'SCHEMES.md'}, {bench.out / 'SCHEMES.json'}; figures: "
        + ", ".join(str(bench.out / f) for f in summary["figures"]))
    return summary
