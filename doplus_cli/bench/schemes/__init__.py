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
    OUT/runs/NAME.failed.json     why its last attempt failed, until it starts again
    OUT/runs/NAME/eval/           `doplus evaluate` of final/ (unlearn, unless the run evaluated at its last step;
                                  align with eval_suite, written by the run itself)
    OUT/SCHEMES.json, SCHEMES.md  per scheme (and sweep value): mean and sample standard deviation over seeds
    OUT/tradeoff.png, curves.png, update_similarity.png

NAME is SCHEME-sSEED, or SCHEME-KEY=VALUE-sSEED with --sweep. The same command run again continues: a run
that finished and was evaluated is skipped, one with a checkpoint resumes, anything else starts afresh. The grid can
also be run as a job array, one run per process (`--run-index K`, grid.py).

The package follows the command: planning.py (the runs and OUT), running.py (the subprocesses), grid.py (each
run's state, --list-runs and the job array), summary.py (the
statistics, SCHEMES.json/md, the console table), plots.py (the figures); what differs between unlearn, multitask and
align recipes is their command's bench adapter (doplus_cli/bench/adapters/).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from doplus_cli.bench.schemes.grid import (
    RunState,
    array_syntax,
    check_run_index,
    counts_line,
    grid_states,
    listing,
    parse_states,
    print_listing,
)
from doplus_cli.bench.schemes.planning import (
    DEFAULT_SCHEMES,
    DEFAULT_SEEDS,
    TUNE_FOLDER,
    Bench,
    Run,
    check_out,
    plain,
    plan_bench,
    record_runs,
)
from doplus_cli.bench.schemes.plots import (
    plot_attacks,
    plot_curves,
    plot_tradeoff,
    plot_tradeoff_curves,
    plot_update_similarity,
)
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
from doplus_cli.errors import UserError
from doplus_cli.files import atomic_write_text
from doplus_cli.lifecycle import hold, run_guard, shared_turn

__all__ = ["DEFAULT_SCHEMES", "DEFAULT_SEEDS", "SCHEMES", "Result", "RunState", "array_syntax", "list_grid", "listing",
           "mean_std", "parse_states", "plan", "plan_bench", "plot_update_similarity", "print_listing",
           "print_summary", "render_markdown", "run_schemes_bench", "second_half_mean", "summarise", "write_outputs"]


def write_outputs(bench: Bench, index: dict[str, Any]) -> dict[str, Any]:
    """SCHEMES.json, SCHEMES.md and the figures, from every finished and evaluated run in OUT."""
    results, unfinished = collect(bench, index)
    summary = summarise(bench, results, unfinished)
    figures = [f for f in (plot_tradeoff(summary, bench.out), plot_tradeoff_curves(summary, bench.out),
                           plot_curves(summary, results, bench.adapter.curve_names(bench.runs[0].config), bench.out),
                           plot_update_similarity(summary, results, bench.out), plot_attacks(summary, bench.out)) if f]
    summary["figures"] = figures
    if bench.tuning:
        summary["tuned"] = {"how": bench.tuning, "values": plain(bench.tuned)}
    atomic_write_text(bench.out / "SCHEMES.json", json.dumps(summary, indent=2) + "\n")
    atomic_write_text(bench.out / "SCHEMES.md", render_markdown(summary, figures))
    return summary


def run_schemes_bench(recipe: str, schemes: str, seeds: str, out: str | None, set_options: list[str],
                      sweep: str | None, log_update_similarity: bool, num_processes: int | None, fsdp: bool,
                      say: Callable[[str], None], task_ids: str | None = None,
                      keep_checkpoints: bool = False, summarize_from: str = "final", run_index: int | None = None,
                      summarize: bool = False, tuned: tuple[dict[str, dict[str, Any]], str] | None = None,
                      parallel: int = 1, remove_final: bool = False) -> dict[str, Any] | None:
    """Plan and check everything, run what is missing (every run, `parallel` at a time, or run `run_index` alone),
    then write the tables and figures when every run is done (or `summarize`: from those that are); return
    SCHEMES.json, or None when the tables wait for runs still to be done."""
    bench = plan(recipe, schemes, seeds, out, set_options, sweep, log_update_similarity, task_ids, summarize_from,
                 tuned)
    if run_index is not None:
        check_run_index(bench, run_index)
    runner = Runner(bench, say, num_processes, fsdp, keep_checkpoints, remove_final)
    with run_guard():  # a signal from the start stops it (bench/schemes/running.py)
        if run_index is None and not summarize:  # one sequential bench per folder; workers hold only their runs
            hold(bench.out, "doplus bench schemes")
        if summarize:
            return _summarize_done(bench, runner, say)
        with shared_turn(bench.out):
            index = check_out(bench)
            record_runs(bench, index)
        if run_index is not None:
            runner.run_index(run_index)
        else:
            if parallel > 1:
                _, workers = planned_disk(bench, grid_states(bench), *starting_architecture(bench), keep_checkpoints,
                                          remove_final)
                if warning := parallel_words(parallel, workers):
                    say(f"warning: {warning}")
            tasks = f" x {len(bench.task_ids)} forget tasks" if task_ids is not None else ""
            say(f"{len(bench.runs)} runs ({len(bench.schemes)} schemes{tasks} x {len(bench.seeds)} seeds"
                + (f" x {len(bench.sweep_values)} values of {bench.sweep_key}" if bench.sweep_key else "")
                + f") of doplus {bench.adapter.command} into {bench.out}"
                + (f", {parallel} at a time" if parallel > 1 else ""))
            runner.run_all(parallel)
        left = [s for s in grid_states(bench) if s.state != "done"]
        if left:
            say(f"the tables wait for {len(left)} run{'s' if len(left) > 1 else ''} not done ("
                + ", ".join(f"{s.index} {s.run.name}: {s.state}" for s in left[:6]) + (", ..." if len(left) > 6
                                                                                      else "")
                + "); the process that ends the last writes them, or --summarize writes them from the runs done")
            return None
        return _summarize(bench, runner, index, say)


def plan(recipe: str, schemes: str, seeds: str, out: str | None, set_options: list[str], sweep: str | None,
         log_update_similarity: bool, task_ids: str | None = None, summarize_from: str = "final",
         tuned: tuple[dict[str, dict[str, Any]], str] | None = None) -> Bench:
    """The bench a command asks for, checked, before anything is written. `tuned`: each scheme's values found by
    `--tune` and how they were found, in words."""
    out = out or default_out(recipe)
    bench = plan_bench(recipe, schemes, seeds, out, set_options, sweep, log_update_similarity, task_ids,
                       tuned[0] if tuned else None)
    bench.tuning = tuned[1] if tuned else None
    bench.summarize_from = check_summarize_from(bench, summarize_from)
    return bench


def default_out(recipe: str) -> str:
    return os.path.join("bench", Path(recipe).stem)


def tune_folder(out: str | None, recipe: str, scheme: str) -> Path:
    """Where `--tune` keeps the study of `scheme`: OUT/tune/SCHEME/."""
    return Path(out or default_out(recipe)).expanduser().resolve() / TUNE_FOLDER / scheme


def scheme_label(bench: Bench, run: Run) -> str:
    """The scheme a run stands for in the dry run's lines: its scheme, with its sweep value under --sweep."""
    return run.scheme if run.sweep_value is None else f"{run.scheme} at {bench.sweep_key}={run.sweep_value}"


def planned_steps_words(bench: Bench, task: int | None) -> str:
    """The steps each run of forget task `task` will take, as the adapter tells them before the runs (align's
    --epochs count the steps from the data, and Joint steps on both sets at once): one number when they agree."""
    steps: dict[str, int] = {}
    for run in bench.runs:
        label = scheme_label(bench, run)
        if run.task_id == task and label not in steps:  # once a scheme (align opens the data to count them)
            steps[label] = bench.adapter.planned_steps(run.config)
    if len(set(steps.values())) == 1:
        return f"{next(iter(steps.values()))} steps a run"
    return "steps a run: " + ", ".join(f"{label} {count}" for label, count in steps.items())


def schemes_dry_run(bench: Bench, num_processes: int | None, fsdp: bool, keep_checkpoints: bool = False,
                    parallel: int = 1, remove_final: bool = False) -> str:
    """`bench schemes --dry-run`: the bench's own checks (made by `plan`), its folder's, and what its runs would
    check before their model loads, once per forget task (the data, the fields the loss and the evaluation need)
    and once for the model; then the grid, as text. Nothing run or written."""
    from doplus_cli.commands import command_named
    from doplus_cli.engine.teach import teaching_plan
    from doplus_cli.models import check_model

    states = list_grid(bench)
    if fsdp and (num_processes or 1) == 1:
        raise UserError("--fsdp shards each run across processes: add --num-processes N (N >= 2), or leave it out")
    command = command_named(bench.adapter.command)
    first = {}
    for run in bench.runs:
        first.setdefault(run.task_id, run)
    config = bench.runs[0].config
    lines = ["doplus bench schemes --dry-run: every check made before a run starts passed; nothing was run or "
             "written", f"grid: {counts_line(states)} ({len(bench.schemes)} schemes x {len(first)} forget task"
             f"{'s' if len(first) > 1 else ''} x {len(bench.seeds)} seeds"
             + (f" x {len(bench.sweep_values)} values of {bench.sweep_key}" if bench.sweep_key else "")
             + f") of doplus {bench.adapter.command} into {bench.out}"]
    model = config.model
    if config.teach:
        teaching, model = teaching_plan(config, lambda teach: command_named("multitask").bound(teach).open())
        lines.append(f"teaching stage: {teaching}")
    model_line, readable = check_model(model)
    lines.append(f"model: {model_line}")
    for task, run in first.items():
        plan = command.bound(run.config)
        plan.open()
        label = "data" if task is None else f"data of forget task {task}"
        lines.append(f"{label}: checked ({planned_steps_words(bench, task)})")
    words, workers = planned_disk(bench, states, model, readable, keep_checkpoints, remove_final)
    lines += [words] + [line for line in [parallel_words(parallel, workers)] if line]
    return "\n".join(lines)


def disk_words(bench: Bench, states: list[RunState], model: str | None, keep_checkpoints: bool,
               remove_final: bool = False) -> tuple[str, int | None]:
    """The grid's disk plan, in words, and how many runs at once the free space where OUT is takes (None: any
    number): what one run of each scheme holds at most while it trains (its checkpoints, which it removes when it
    ends unless --keep-checkpoints), beside the final models of the runs not done yet (none with --remove-final:
    each run removes its own once it is evaluated)."""
    from doplus_cli.commands import command_named
    from doplus_cli.engine.memory_plan import build_plan, bytes_text, disk_plan, free_bytes, model_plan, visible_gpu_gib

    cuda = visible_gpu_gib() is not None
    disks, label_of = {}, {}
    for run in bench.runs:
        label = label_of[run.name] = scheme_label(bench, run)
        if label not in disks:
            config = run.config if model == run.config.model else run.config.replace(model=model)
            plan = command_named(bench.adapter.command).bound(config)
            disks[label] = disk_plan(config, build_plan(config, model_plan(config, plan), plan, cuda),
                                     bench.adapter.planned_steps(run.config))
    left = [s for s in states if s.state != "done"]
    finals = 0 if remove_final else sum(disks[label_of[s.run.name]].final for s in left)
    training = max(d.held * d.checkpoint for d in disks.values())
    if keep_checkpoints:  # each run leaves its newest --keep-last checkpoints (every one without it)
        finals += sum(disks[label_of[s.run.name]].checkpoint * disks[label_of[s.run.name]].kept for s in left)
    free = free_bytes(bench.out)

    scheme_of = {label_of[run.name]: run.scheme for run in bench.runs}
    sizes: dict[str, dict[str, int]] = {}  # each scheme's, one entry for its sweep values where they agree
    for label, d in disks.items():
        sizes.setdefault(scheme_of[label], {})[label] = d.held * d.checkpoint
    holds = ", ".join(f"{scheme} {bytes_text(next(iter(by.values())))}" if len(set(by.values())) == 1 else
                      ", ".join(f"{label} {bytes_text(size)}" for label, size in by.items())
                      for scheme, by in sizes.items())
    final = "removes its final/ once it is evaluated (--remove-final)" if remove_final else "keeps its final/"
    kept = f"{final} and keeps its checkpoints (--keep-checkpoints)" if keep_checkpoints else \
        f"{final} and removes its checkpoints when it ends"
    runs_left = f"{len(left)} run not done keeps" if len(left) == 1 else f"{len(left)} runs not done keep"
    if training == 0:
        at_once = f"{'fits' if finals <= free else 'does not fit'}, with any number of runs at once"
        workers = None if finals <= free else 0
    else:
        workers = int((free - finals) // training) if free > finals else 0
        at_once = (f"{workers} runs at once fit (--parallel, --run-index workers)" if workers > 1 else
                   "1 run at a time fits" if workers == 1 else "not even one run at a time fits")
        if workers == 0 and not remove_final and free >= training:
            at_once += (f" while every final/ is kept; with --remove-final (each run's final/ goes once it is "
                        f"evaluated) {int(free // training)} at once")
    return (f"disk plan (an estimate): a run {kept}; while it trains its checkpoints take at most: {holds}; "
            f"the {runs_left} {'no model once evaluated' if remove_final and not finals else bytes_text(finals)}; "
            f"{bytes_text(free)} free where {bench.out} "
            f"is: {at_once}"), workers


def parallel_words(parallel: int, workers: int | None) -> str | None:
    """What the disk plan says of --parallel N, when it takes fewer runs at once (None when N fits)."""
    if parallel <= 1 or workers is None or workers >= parallel:
        return None
    return (f"--parallel {parallel} asks for more runs at once than the disk plan takes ({workers}): a run that "
            "finds the disk full stops, is listed as failed, and the same command continues it; --set save_every=0 "
            "or fewer at once leaves room")


def starting_architecture(bench: Bench) -> tuple[str | None, bool]:
    """(the model whose architecture the runs train: a teaching stage's base model, None for the embedded one;
    whether its config.json is at hand, which a hub id offline is not)."""
    from doplus_cli.engine.teach import teaching_plan
    from doplus_cli.models import check_model

    config = bench.runs[0].config
    model = teaching_plan(config, lambda teach: None)[1] if config.teach else config.model
    return model, check_model(model)[1]


def planned_disk(bench: Bench, states: list[RunState], model: str | None, readable: bool, keep_checkpoints: bool,
                 remove_final: bool = False) -> tuple[str, int | None]:
    """`disk_words` for `model` (`starting_architecture`), or a line saying it cannot be worked out."""
    if not readable:
        return "disk plan: not worked out (it needs the model's config.json, which is not here)", None
    return disk_words(bench, states, model, keep_checkpoints, remove_final)


def list_grid(bench: Bench) -> list[RunState]:
    """`--list-runs`: each run's state, read from OUT (nothing is written; OUT must hold this bench or nothing)."""
    if bench.out.is_dir():
        check_out(bench)
    return grid_states(bench)


def _summarize_done(bench: Bench, runner: Runner, say: Callable[[str], None]) -> dict[str, Any]:
    """`--summarize`: the tables from the runs that are done, the others named."""
    if not (bench.out / "bench.json").is_file():
        raise UserError(f"{bench.out}: no run of this bench has started here (no bench.json); run the grid first")
    index = check_out(bench)
    states = grid_states(bench)
    if not any(s.state == "done" for s in states):
        raise UserError(f"{bench.out}: no run is done yet ({counts_line(states)}); --list-runs shows the grid")
    left = [s for s in states if s.state != "done"]
    if left:
        say(f"the tables leave out {len(left)} run{'s' if len(left) > 1 else ''} not done: "
            + ", ".join(f"{s.index} {s.run.name} ({s.state})" for s in left))
    return _summarize(bench, runner, index, say)


def _summarize(bench: Bench, runner: Runner, index: dict[str, Any], say: Callable[[str], None]) -> dict[str, Any]:
    """The starting models' evaluations and the tables, in this process's turn: two workers that end the grid
    together write them one after the other, the second the same bytes again."""
    with shared_turn(bench.out):
        runner.starting_models()
        summary = write_outputs(bench, index)
    say(f"tables: {bench.out / 'SCHEMES.md'}, {bench.out / 'SCHEMES.json'}; figures: "
        + ", ".join(str(bench.out / f) for f in summary["figures"]))
    return summary
