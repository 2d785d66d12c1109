"""The bench's grid run by many processes at once (a cluster's job array): each run's state, `--list-runs`,
`--run-index K` and `--summarize`.

    doplus bench schemes ARGS --list-runs                 the grid: index, scheme, seed, task, sweep value, state
    doplus bench schemes ARGS --list-runs --indexes failed   the failed runs' indexes as SLURM's --array takes them
    doplus bench schemes ARGS --run-index K               run K only (trained and evaluated), into the same OUT
    doplus bench schemes ARGS --summarize                 the tables and figures from the runs that are done

Many `--run-index` processes share one OUT safely: each holds its run's folder (`OUT/runs/NAME/.doplus.lock`, the
run's own process inherits the hold) for as long as it trains and evaluates it, and the files they share (bench.json,
the run recipes, the tables, the starting model's evaluation) are written in turns (`lifecycle.shared_turn`). The
process that finds every run done writes the tables, with the very function a sequential bench writes them with, so
they are the same bytes whichever order the runs finished in.

A run's state, read from OUT alone (no record of its own that could go stale):
    done     its report says completed and its evaluation is there
    running  a process holds its folder
    failed   its last attempt failed: OUT/runs/NAME.failed.json says how (a signal is not a failure: that run is
             pending and resumes from its checkpoint)
    pending  anything else: not started, stopped with a checkpoint, or trained and not yet evaluated
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from doplus_cli.bench.adapters.base import read_json
from doplus_cli.bench.schemes.planning import Bench, Run, completed_report
from doplus_cli.config import list_value
from doplus_cli.engine.checkpoint import list_checkpoints
from doplus_cli.errors import UserError
from doplus_cli.files import atomic_write_text
from doplus_cli.lifecycle import in_use

STATES = ("pending", "running", "done", "failed")


@dataclass
class RunState:
    index: int
    run: Run
    state: str
    detail: str  # running: who holds it; failed: what failed; pending: where it would start


def failure_record(run: Run) -> Path:
    """OUT/runs/NAME.failed.json, beside the run's log: why its last attempt failed."""
    return run.folder.with_name(run.name + ".failed.json")


def record_failure(run: Run, reason: str) -> None:
    atomic_write_text(failure_record(run), json.dumps(
        {"run": run.name, "reason": reason, "log": str(run.log),
         "when": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime())}, indent=2) + "\n")


def is_done(bench: Bench, run: Run) -> bool:
    report = completed_report(run.folder)
    return report is not None and bench.adapter.evaluation(run.folder, report) is not None


def state_of(bench: Bench, index: int) -> RunState:
    run = bench.runs[index]
    if is_done(bench, run):
        return RunState(index, run, "done", "")
    holder = in_use(run.folder)
    if holder is not None:
        return RunState(index, run, "running", holder)
    record = failure_record(run)
    if record.is_file():
        try:
            reason = read_json(record).get("reason", "")
        except UserError:
            reason = f"see {record}"
        return RunState(index, run, "failed", reason)
    if completed_report(run.folder) is not None:
        return RunState(index, run, "pending", "trained; its evaluation is left")
    checkpoints = list_checkpoints(run.folder / "checkpoints")
    return RunState(index, run, "pending", f"resumes from {checkpoints[-1].name}" if checkpoints else "")


def grid_states(bench: Bench) -> list[RunState]:
    return [state_of(bench, index) for index in range(len(bench.runs))]


def check_run_index(bench: Bench, index: int) -> Run:
    count = len(bench.runs)
    if not 0 <= index < count:
        raise UserError(f"--run-index {index}: the grid has {count} run{'s' if count != 1 else ''}, indexes 0 to "
                        f"{count - 1} (--list-runs lists them)")
    return bench.runs[index]


def parse_states(text: str) -> list[str]:
    states = list_value(text, str, False, "--indexes")
    unknown = [s for s in states if s not in STATES]
    if unknown or not states:
        raise UserError(f"--indexes {text}: give states from {', '.join(STATES)} (comma-separated)")
    return states


def array_syntax(indexes: list[int]) -> str:
    """Indexes as SLURM's `--array` takes them: runs of consecutive numbers as ranges, "0-3,5,7-8"."""
    ranges: list[list[int]] = []
    for index in sorted(set(indexes)):
        if ranges and ranges[-1][1] == index - 1:
            ranges[-1][1] = index
        else:
            ranges.append([index, index])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def run_command(bench: Bench, run: Run) -> str:
    """The command of the run itself (what `--run-index` starts, before the run's evaluation)."""
    return shlex.join(["doplus", bench.adapter.command, "--recipe", str(run.recipe_path), "--out", str(run.folder)])


def listing(bench: Bench, states: list[RunState]) -> list[dict[str, Any]]:
    """--list-runs --json: one object per run."""
    return [{"index": s.index, "name": s.run.name, "scheme": s.run.scheme, "seed": s.run.seed,
             "task_id": s.run.task_id, "sweep_key": bench.sweep_key, "sweep_value": s.run.sweep_value,
             "state": s.state, "detail": s.detail, "folder": str(s.run.folder), "log": str(s.run.log),
             "command": run_command(bench, s.run)} for s in states]


def counts_line(states: list[RunState]) -> str:
    counts = {state: sum(s.state == state for s in states) for state in STATES}
    return f"{len(states)} runs: " + ", ".join(f"{counts[state]} {state}" for state in ("done", "running", "failed",
                                                                                          "pending"))


def print_listing(bench: Bench, states: list[RunState], bench_command: str, console: Console) -> None:
    """The grid as a table (folders and commands relative to OUT, in full under --json), its counts and what to run
    next."""
    table = Table(title=f"bench grid in {bench.out}", title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("run")
    table.add_column("scheme")
    table.add_column("seed", justify="right")
    if any(s.run.task_id is not None for s in states):
        table.add_column("task", justify="right")
    if bench.sweep_key:
        table.add_column(bench.sweep_key)
    table.add_column("state")
    table.add_column("detail")
    styles = {"done": "green", "running": "cyan", "failed": "red", "pending": ""}
    for s in states:
        cells = [str(s.index), s.run.name, s.run.scheme, str(s.run.seed)]
        if any(x.run.task_id is not None for x in states):
            cells.append("" if s.run.task_id is None else str(s.run.task_id))
        if bench.sweep_key:
            cells.append(json.dumps(s.run.sweep_value) if not isinstance(s.run.sweep_value, str)
                         else s.run.sweep_value)
        cells += [f"[{styles[s.state]}]{s.state}[/]" if styles[s.state] else s.state, s.detail]
        table.add_row(*cells)
    console.print(table)
    console.print(counts_line(states))
    console.print(f"run K: {bench.out}/runs/NAME/ from {bench.out}/recipes/NAME.yaml "
                  f"(doplus {bench.adapter.command} --recipe ... --out ..., then its evaluation), started by: "
                  f"{bench_command} --run-index K")
    failed = [s.index for s in states if s.state == "failed"]
    if failed:
        console.print(f"re-run the failed: sbatch --array={array_syntax(failed)} ... or {bench_command} "
                      f"--run-index K for each")
