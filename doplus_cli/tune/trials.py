"""One trial of `doplus tune`: an ordinary `doplus COMMAND` run in DIR/trials/NNNN from DIR/recipes/NNNN.yaml, its
evaluations during training reported to Optuna as they appear (the pruner may stop it), then its evaluation and its
scores, read as `bench schemes` reads a run's (the recipe's command's bench adapter)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from doplus_cli.bench.schemes.planning import completed_report
from doplus_cli.bench.schemes.running import Signals, last_error
from doplus_cli.config import recorded
from doplus_cli.errors import RunError

if TYPE_CHECKING:
    from doplus_cli.tune import Tune

POLL_SECONDS = 1.0  # how often a running trial's folder is looked at for a new evaluation


class Pruned(Exception):
    """The pruner stopped the trial at `step`."""

    def __init__(self, step: int) -> None:
        super().__init__(f"pruned at step {step}")
        self.step = step


class TrialStopped(Exception):
    """SIGTERM or Ctrl-C reached the worker: the trial's run checkpointed and stopped."""

    def __init__(self, number: int) -> None:
        super().__init__(signal.Signals(number).name)
        self.number = number


@dataclass
class Outcome:
    scores: dict[str, Any]
    seconds: float
    steps: int
    intermediate: dict[int, float] = field(default_factory=dict)


def trial_name(number: int) -> str:
    return f"{number:04d}"


def recipe_path(tune: Tune, number: int) -> Path:
    return tune.out / "recipes" / f"{trial_name(number)}.yaml"


def write_recipe(tune: Tune, number: int, values: dict[str, Any]) -> None:
    """DIR/recipes/NNNN.yaml: the recipe the trial runs (best.yaml is the best trial's)."""
    from doplus_cli.files import atomic_write_text

    path = recipe_path(tune, number)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, yaml.safe_dump(values, sort_keys=False))


def run_trial(tune: Tune, trial: Any, values: dict[str, Any], signals: Signals, log: Path) -> Outcome:
    """Run the trial's recipe (written by `write_recipe`), reporting each evaluation during training to `trial`;
    evaluate the run and return its scores. Raises Pruned, TrialStopped or RunError."""
    name = trial_name(trial.number)
    folder, recipe = tune.out / "trials" / name, recipe_path(tune, trial.number)
    command = [sys.executable, "-m", "doplus_cli", tune.adapter.command, "--recipe", str(recipe), "--out", str(folder)]
    started = time.perf_counter()
    intermediate: dict[int, float] = {}
    seen: set[str] = set()

    def look() -> int | None:
        """Report the evaluations written since the last look; the step at which to prune, or None."""
        evals = folder / "evals"
        if not evals.is_dir():
            return None
        steps = sorted(int(p.name.removeprefix("step-")) for p in evals.glob("step-*")
                       if p.name.removeprefix("step-").isdigit() and p.name not in seen
                       and (p / "eval.json").is_file() and (p / "SUMMARY.json").is_file())
        for step in steps:
            seen.add(f"step-{step}")
            value = _read_metric(evals / f"step-{step}" / "SUMMARY.json", tune.objective.metric)
            if value is None:
                continue
            intermediate[step] = value
            trial.report(value, step)
            if step < tune.steps and trial.should_prune():
                return step
        return None

    code, pruned_at = watch(command, log, f"trial {name}", signals, look)
    if signals.received:
        raise TrialStopped(signals.received)
    if pruned_at is not None:
        raise Pruned(pruned_at)
    if code != 0:
        raise RunError(_failed(f"trial {name}", code, log))
    report = completed_report(folder)
    if report is None:
        raise RunError(f"trial {name} ended without a completed report.json; see its log {log}")
    evaluation = tune.adapter.evaluation(folder, report)
    if evaluation is None:
        evaluate = tune.adapter.evaluate_command(tune.trial_config(values), folder)
        code, _ = watch(evaluate, log, f"the evaluation of trial {name}", signals, None)
        if signals.received:
            raise TrialStopped(signals.received)
        evaluation = tune.adapter.evaluation(folder, report)
        if code != 0 or evaluation is None:
            raise RunError(_failed(f"the evaluation of trial {name}", code, log))
    scores, _ = tune.adapter.scores(report, evaluation)
    return Outcome(scores, time.perf_counter() - started, int(report.get("steps", 0)), intermediate)


def evaluate_start(tune: Tune, values: dict[str, Any], model: str, signals: Signals) -> dict[str, Any]:
    """The starting model's scores (DIR/start/, evaluated once, with the trials' evaluation settings)."""
    out = tune.out / "start"
    config = tune.trial_config(values)
    if not (out / "eval.json").is_file():
        command = tune.adapter.evaluate_command(config, tune.out / "start-run", model, out)
        log = tune.out / "start.log"
        code, _ = watch(command, log, "the evaluation of the starting model", signals, None)
        if signals.received:
            raise TrialStopped(signals.received)
        if code != 0 or not (out / "eval.json").is_file():
            raise RunError(_failed("the evaluation of the starting model", code, log))
    return tune.adapter.scores({"config": {"eval_suite": recorded(getattr(config, "eval_suite", None))}}, out)[0]


def _read_metric(path: Path, metric: str) -> float | None:
    try:
        value = json.loads(path.read_text()).get(metric)
    except (OSError, ValueError):
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _failed(what: str, code: int, log: Path) -> str:
    """The failure in one line, with the last error line of the log's last attempt."""
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    line = last_error(log, max(0, log.read_bytes().rfind(b"\n=== ")))  # from the start of the last attempt
    return f"{what} failed ({how}){': ' + line if line else ''}; see its log {log}"


def watch(command: list[str], log_path: Path, what: str, signals: Signals, look: Any) -> tuple[int, int | None]:
    """Run `command` with its output appended to the log, calling `look` every POLL_SECONDS while it runs; when
    `look` returns a step, the run is stopped (SIGTERM: it checkpoints and exits). (exit code, that step)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {what}: {shlex.join(command)}\n")
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
        signals.process = process
        stop_at = None
        try:
            while True:
                try:
                    code = process.wait(timeout=POLL_SECONDS)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if look is not None and stop_at is None and not signals.received:
                    stop_at = look()
                    if stop_at is not None:
                        process.send_signal(signal.SIGTERM)
            if look is not None and stop_at is None and code == 0:
                look()  # the evaluations written in the last moments
        finally:
            signals.process = None
    return code, stop_at
