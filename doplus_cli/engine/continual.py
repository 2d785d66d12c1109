"""Continual unlearning (`doplus unlearn --task-ids 1,2,3 --continual`): forget tasks one after another.

Each task is an ordinary `doplus unlearn` run in OUT/task-T/, started from the previous task's final model; its
retain set drops every task unlearned so far (the DualOptim+ authors' `forget.py` with TASK_LIST, whose
`get_task_data` keeps the forget file's rows of the tasks not unlearned yet). Each task is evaluated at its last
step on its own forget rows, as the authors evaluate each task of a sequence. The same command run again with
`--resume latest` skips the finished tasks and resumes the unfinished one from its newest checkpoint.

    OUT/config.yaml                the continual run's options
    OUT/task-T/                    task T's run (config.yaml, metrics.jsonl, report.*, final/, evals/)
    OUT/continual.json, report.md  one evaluation row per task and the running mean over the tasks so far
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from doplus_cli import ownership
from doplus_cli.config import UnlearnConfig, parse_report_to, parse_task_ids
from doplus_cli.engine import outputs
from doplus_cli.engine.checkpoint import list_checkpoints
from doplus_cli.engine.loop import default_out_dir
from doplus_cli.errors import UserError
from doplus_cli.files import atomic_write_text

AGGREGATES = ("MU", "UFE", "TFE", "OVR")


def task_folder(out: Path, task: int) -> Path:
    return out / f"task-{task}"


def _completed(folder: Path) -> dict[str, Any] | None:
    path = folder / "report.json"
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    return report if report.get("status") == "completed" else None


CONTINUAL = "doplus unlearn --continual"  # the command the folder's record names (ownership.py)


def continual_outputs(config: UnlearnConfig, order: list[int]) -> tuple[str, ...]:
    """The entries a continual run writes in OUT: recorded before it writes any of them."""
    names = ["config.yaml", "continual.json", "report.md", *(task_folder(Path(), task).name for task in order)]
    if parse_report_to(config.report_to) and config.tracker_dir is None:
        names.append("trackers")  # the tasks' tracker runs, side by side
    return tuple(names)


def prepare(config: UnlearnConfig, out: Path, order: list[int], write: bool = True) -> None:
    """A fresh OUT, or one this command may continue (--resume) or replace (--overwrite: what its record lists);
    `write` False checks the same without recording or removing anything (`--dry-run`)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: --out exists and is a file, not a folder")
    names = continual_outputs(config, order)
    if config.resume is None:
        then = ", or --resume latest to continue its tasks"
        if write:
            ownership.begin(out, CONTINUAL, names, config.overwrite, then=then)
        else:
            ownership.check_start(out, CONTINUAL, names, config.overwrite, then=then)
        return
    if not ownership.is_started(out, CONTINUAL):
        if not ((out / "config.yaml").is_file() and any(task_folder(out, task).is_dir() for task in order)):
            raise UserError(f"{out}: no `{CONTINUAL}` was started here (no {ownership.RECORD_NAME}), so there is "
                            "nothing to resume; start it without --resume")
        if write:
            ownership.adopt(out, CONTINUAL, names)  # a continual run of a doplus that kept no record
    saved = out / "config.yaml"
    if saved.is_file():
        import yaml

        before = yaml.safe_load(saved.read_text()) or {}
        now = {**config.to_dict(), "out": str(out), "resume": before.get("resume")}
        changed = sorted(k for k in now if k not in ("resume", "overwrite", "accept_changed", "accept_unverified")
                         and before.get(k) != now[k])
        if changed:
            raise UserError(f"{out}: the continual run there was started with other options ({', '.join(changed)})"
                            "; resume with the same ones, or start a new --out")
    if write:
        ownership.claim(out, CONTINUAL, names)


def run_continual(config: UnlearnConfig, console: Console | None,
                  run_unlearn: Callable[[UnlearnConfig, Console | None], dict[str, Any]]) -> dict[str, Any]:
    """Unlearn `config.task_ids` in order, each task one run of `run_unlearn` (`doplus unlearn`'s single run,
    handed over by its command); return the continual report (also written to OUT)."""
    console = console or Console(stderr=True)
    order = parse_task_ids(config.task_ids)
    if config.task_id is not None:
        raise UserError("--task-id and --continual: the tasks come from --task-ids (give --task-ids only)")
    out = Path(config.out or default_out_dir("unlearn"))
    config = config.replace(out=str(out))
    out.mkdir(parents=True, exist_ok=True)
    prepare(config, out, order)
    outputs.write_config(out, {**config.to_dict(), "out": str(out)})
    model, rows = config.model, []
    for index, task in enumerate(order):
        folder = task_folder(out, task)
        report = _completed(folder)
        if report is None:
            changes: dict[str, Any] = {"task_id": task, "model": model, "out": str(folder)}
            if config.tracker_dir is None:  # --report-to: the tasks' tracker runs side by side, in OUT/trackers/
                changes.update(tracker_dir=str(out / "trackers"), tracker_run_name=f"{out.name}-task-{task}",
                               tracker_group=config.tracker_group or out.name)
            if index > 0:
                changes["taught"] = None  # the starting model is the previous task's, not the taught one
            changes["eval_every"] = config.eval_every or config.steps  # each task evaluated at its last step at least
            resume = "latest" if config.resume is not None and list_checkpoints(folder / "checkpoints") else None
            # a task folder without a checkpoint starts afresh
            part = copy.deepcopy(config).replace(**changes, resume=resume, overwrite=resume is None)
            console.print(f"continual: task {task} ({index + 1} of {len(order)}), starting from "
                          f"{model or 'the embedded model'}" + (" (resuming)" if part.resume else ""), highlight=False)
            report = run_unlearn(part, console)
        else:
            console.print(f"continual: task {task} finished before, skipped", highlight=False)
        model = str(folder / "final")  # the same path on every process
        if report:
            rows.append(_row(task, report))
    if not rows:  # not the main process
        return {}
    summary = {"status": "completed", "out": str(out), "task_ids": order, "rows": rows,
               "running_mean": _running_mean(rows), "final": str(task_folder(out, order[-1]) / "final"),
               "config": config.to_dict()}
    atomic_write_text(out / "report.md", render_markdown(summary))
    atomic_write_text(out / "continual.json", json.dumps(summary, indent=2) + "\n")
    return summary


def _row(task: int, report: dict[str, Any]) -> dict[str, Any]:
    last = (report.get("evals") or [{}])[-1]
    data = report.get("data", {})
    return {"task_id": task, "forget_rows": data.get("forget_rows"), "retain_rows": data.get("retain_rows"),
            "steps": report.get("steps"), "wall_time_s": report.get("wall_time_s"), "folder": str(
                Path(report["final"]).parent), **{name: last.get(name) for name in AGGREGATES}}


def _running_mean(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """After each task: the mean of each aggregate over the tasks unlearned so far (each on its own forget rows)."""
    result = []
    for count in range(1, len(rows) + 1):
        entry: dict[str, Any] = {"after_task": rows[count - 1]["task_id"], "tasks": count}
        for name in AGGREGATES:
            values = [row[name] for row in rows[:count] if row.get(name) is not None]
            entry[name] = sum(values) / len(values) if len(values) == count else None
        result.append(entry)
    return result


def _cell(value: Any) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def render_markdown(summary: dict[str, Any]) -> str:
    cfg = summary["config"]
    lines = [f"# doplus unlearn --continual: {cfg['loss']} with {cfg['scheme']}", "",
             f"- forget: {cfg['forget']}, tasks {', '.join(map(str, summary['task_ids']))} in this order, each from "
             "the previous task's final model; retain: " + str(cfg["retain"]) + " without the tasks unlearned so far",
             f"- each task: {cfg['steps']} steps, evaluated at its last step on its own forget rows (TOFU suite, %)",
             "", "## Each task after it was unlearned", "",
             "| task | forget rows | retain rows | steps | wall time (s) | " + " | ".join(AGGREGATES) + " |",
             "| ---: | ---: | ---: | ---: | ---: |" + " ---: |" * len(AGGREGATES)]
    for row in summary["rows"]:
        lines.append(f"| {row['task_id']} | {row['forget_rows']} | {row['retain_rows']} | {row['steps']} | "
                     f"{row['wall_time_s']:.1f} | " + " | ".join(_cell(row[n]) for n in AGGREGATES) + " |")
    lines += ["", "## Running mean over the tasks unlearned so far", "",
              "| after task | tasks | " + " | ".join(AGGREGATES) + " |",
              "| ---: | ---: |" + " ---: |" * len(AGGREGATES)]
    for entry in summary["running_mean"]:
        lines.append(f"| {entry['after_task']} | {entry['tasks']} | "
                     + " | ".join(_cell(entry[n]) for n in AGGREGATES) + " |")
    lines += ["", f"Final model: {summary['final']}"]
    return "\n".join(lines) + "\n"


def print_continual(summary: dict[str, Any], console: Console) -> None:
    table = Table(title="Continual unlearning: each task after it was unlearned (TOFU suite, %)")
    for column in ("task", "forget rows", "retain rows", *AGGREGATES):
        table.add_column(column, justify="right")
    for row in summary["rows"]:
        table.add_row(str(row["task_id"]), str(row["forget_rows"]), str(row["retain_rows"]),
                      *(_cell(row[n]) for n in AGGREGATES))
    console.print(table)
    console.print(f"model: {summary['final']}   report: {Path(summary['out']) / 'report.md'}")
