"""Running the runs: each an ordinary `doplus COMMAND` subprocess, its output appended to its log, one at a time
or `--parallel N` at once, its folder held meanwhile (a run another process holds is left to it); then the
starting model's evaluation; SIGTERM and Ctrl-C checkpoint the current runs and stop the bench."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from doplus_cli.bench.schemes.grid import failure_record, record_failure
from doplus_cli.bench.schemes.planning import Bench, Run, completed_report, start_folder
from doplus_cli.engine.checkpoint import list_checkpoints
from doplus_cli.errors import RunError, UserError, writing
from doplus_cli.lifecycle import FolderInUse, holding, in_use
from doplus_cli.lifecycle import environment as lifecycle_environment
from doplus_cli.ownership import RECORD_NAME
from doplus_cli.ownership import read as read_record


class Stopped(UserError):
    """SIGTERM or Ctrl-C: the current run checkpointed and stopped; the same command continues."""

    def __init__(self, number: int, what: str | None) -> None:
        during = f" during {what}" if what else ""
        super().__init__(f"stopped by {signal.Signals(number).name}{during}; run the same command again to continue "
                         "(finished runs and checkpoints are kept)")
        self.exit_code = 128 + number


class Signals:
    """While the bench runs, SIGTERM and SIGINT go to the current runs (each finishes its step, writes a
    checkpoint and exits); the bench then stops instead of starting the next run."""

    def __init__(self) -> None:
        self.processes: set[subprocess.Popen] = set()
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Signals:
        if threading.current_thread() is threading.main_thread():
            for number in (signal.SIGTERM, signal.SIGINT):
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def _handle(self, number: int, frame) -> None:
        self.received = number
        for process in list(self.processes):
            if process.poll() is None:
                process.send_signal(number)


def remove_output(run_folder: Path, name: str) -> int | None:
    """Remove a finished run's `checkpoints/` or `final/`, only where the run's record lists it (the run wrote it);
    the bytes it held, or None when there is none to remove. The folder is renamed out of sight first: a kill
    mid-removal leaves nothing under its name that looks whole."""
    folder = run_folder / name
    record = read_record(run_folder)
    if not folder.is_dir() or record is None or name not in record["entries"]:
        return None
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    aside = run_folder / f".{name}.removing"
    shutil.rmtree(aside, ignore_errors=True)
    with writing(folder):
        os.replace(folder, aside)
        shutil.rmtree(aside)
    return size


class Runner:
    """Runs each command as a subprocess with its output appended to the run's log, one at a time."""

    def __init__(self, bench: Bench, say: Callable[[str], None], num_processes: int | None, fsdp: bool,
                 keep_checkpoints: bool = False, remove_final: bool = False) -> None:
        self.bench, self._print, self.num_processes, self.fsdp = bench, say, num_processes, fsdp
        self.keep_checkpoints, self.remove_final = keep_checkpoints, remove_final
        self.signals = Signals()
        self._worker = threading.local()  # a --parallel worker's additions to its runs' environment
        self._lock = threading.Lock()

    def say(self, line: str) -> None:
        with self._lock:  # one line at a time from the --parallel workers
            self._print(line)

    def run_all(self, parallel: int = 1) -> list[str]:
        """Every run in order, `parallel` at a time; the names of those left to another process that holds them
        (a job array's worker)."""
        if parallel > 1:
            return self._run_parallel(parallel)
        elsewhere = []
        with self.signals:
            total = len(self.bench.runs)
            for number, run in enumerate(self.bench.runs, start=1):
                if not self.run_held(run, f"[{number}/{total}] {run.name}"):
                    elsewhere.append(run.name)
        return elsewhere

    def _run_parallel(self, parallel: int) -> list[str]:
        """`run_all` with `parallel` workers (threads), each running one run at a time, in the grid's order, with
        its share of the machine (`worker_environments`). A run that fails or a signal stops the start of new runs;
        the runs under way finish (or, on a signal, checkpoint), then the first failure is raised."""
        total = len(self.bench.runs)
        queue = list(enumerate(self.bench.runs, start=1))
        elsewhere: list[str] = []
        failures: list[BaseException] = []

        def work(environment: dict[str, str]) -> None:
            self._worker.environment = environment
            while True:
                with self._lock:
                    if not queue or failures or self.signals.received:
                        return
                    number, run = queue.pop(0)
                try:
                    if not self.run_held(run, f"[{number}/{total}] {run.name}"):
                        with self._lock:
                            elsewhere.append(run.name)
                except BaseException as error:  # noqa: BLE001 -- raised again by the main thread below
                    with self._lock:
                        failures.append(error)
                    return

        with self.signals:
            workers = [threading.Thread(target=work, args=(environment,), daemon=True)
                       for environment in worker_environments(parallel)]
            for worker in workers:
                worker.start()
            while any(worker.is_alive() for worker in workers):  # a timed join: signals reach the main thread
                for worker in workers:
                    worker.join(timeout=0.2)
        if self.signals.received:
            raise Stopped(self.signals.received, None)
        if failures:
            raise failures[0]
        return elsewhere

    def run_index(self, index: int) -> None:
        """Run `index` of the grid alone (`--run-index`)."""
        run = self.bench.runs[index]
        with self.signals:
            if not self.run_held(run, f"run {index} ({run.name})"):
                raise FolderInUse(f"{run.folder}: run {index} ({run.name}) is running in another process "
                                  f"({in_use(run.folder) or 'it has just ended'}); --list-runs shows the grid")

    def run_held(self, run: Run, label: str) -> bool:
        """`run_one` holding the run's folder all along (its training and its evaluation); False, said in one line,
        when another process holds it."""
        if self.signals.received:
            raise Stopped(self.signals.received, None)
        stack = ExitStack()
        try:
            stack.enter_context(holding(run.folder, f"doplus bench schemes, run {run.name}"))
        except FolderInUse:
            self._say(label, f"left to the process that holds it ({in_use(run.folder) or 'it has just ended'})")
            return False
        with stack:
            self.run_one(run, label)
        return True

    def starting_models(self) -> None:
        """`evaluate_starts` with the bench's signal handling."""
        with self.signals:
            self.evaluate_starts()

    def evaluate_starts(self) -> None:
        """The model every run of a forget task starts from (the taught model), evaluated once per task into
        OUT/start/task-T/ (OUT/start/all/ without --task-ids) with the runs' evaluation settings: the first point of
        their curves. Its path is the one the task's first finished run reports."""
        if not self.bench.adapter.has_start(self.bench.runs[0].config):
            return
        for task in self.bench.task_ids:
            folder = start_folder(self.bench, task)
            if (folder / "eval.json").is_file():
                continue
            first = next(((r, report) for r in self.bench.runs if r.task_id == task
                          and (report := completed_report(r.folder)) is not None), None)
            if first is None:
                continue
            if self.signals.received:
                raise Stopped(self.signals.received, None)
            run, model = first[0], first[1]["model"]
            what = "the starting model" + ("" if task is None else f" of task {task}")
            self._say("start", f"evaluating {what}: {model}")
            log = folder.with_name(folder.name + ".log")
            command = self.bench.adapter.evaluate_command(run.config, run.folder, model, folder)
            seconds = self._call(command, log, f"the evaluation of {what}")
            if not (folder / "eval.json").is_file():
                raise RunError(f"the evaluation of {what} wrote no eval.json; see its log {log}")
            self._say("start", f"evaluated {what} in {duration(seconds)}")

    def run_one(self, run: Run, label: str) -> None:
        """Skip, train (afresh, resumed or restarted) and/or evaluate one run, saying which in one line each."""
        kind = self.bench.adapter
        report = completed_report(run.folder)
        if report is not None and kind.evaluation(run.folder, report) is not None:
            self._say(label, "skipped: finished and evaluated")
            self._tidy(run, label)
            return
        failure_record(run).unlink(missing_ok=True)  # a new attempt: the last one's failure is history
        try:
            if report is None:
                report = self._train(run, label)
            if kind.evaluation(run.folder, report) is None:
                self._say(label, "evaluating")
                command = kind.evaluate_command(run.config, run.folder)
                seconds = self._call(command, run.log, f"the evaluation of {run.name}")
                if kind.evaluation(run.folder, report) is None:
                    raise RunError(f"the evaluation of {run.name} wrote no eval.json; see its log {run.log}")
                self._say(label, f"evaluated in {duration(seconds)}")
        except RunError as error:  # listed as failed (--list-runs) until an attempt starts again
            record_failure(run, str(error))
            raise
        self._tidy(run, label)

    def _tidy(self, run: Run, label: str) -> None:
        """A finished and evaluated run's checkpoints go (only an unfinished run resumes from one), so the disk a
        bench needs stays about one run's checkpoints; `--keep-checkpoints` keeps them. With `--remove-final` its
        final/ goes too (the tables read the run's evaluation, not its model), for sweeps whose models would not
        fit on the disk together."""
        if not self.keep_checkpoints:
            size = remove_output(run.folder, "checkpoints")
            if size is not None:
                self._say(label, f"removed its checkpoints ({size / 1e9:.2f} GB; --keep-checkpoints keeps them)")
        if self.remove_final:
            size = remove_output(run.folder, "final")
            if size is not None:
                self._say(label, f"removed its final model ({size / 1e9:.2f} GB; --remove-final)")

    def _train(self, run: Run, label: str) -> dict[str, Any]:
        command = [sys.executable, "-m", "doplus_cli", self.bench.adapter.command, "--recipe", str(run.recipe_path),
                   "--out", str(run.folder)]
        checkpoints = list_checkpoints(run.folder / "checkpoints")
        if checkpoints:
            command.append("--resume")
            self._say(label, f"resumed from {checkpoints[-1].name} (log: {run.log})")
        elif (run.folder / RECORD_NAME).is_file():  # stopped before its first checkpoint: --resume starts it again
            command.append("--resume")
            self._say(label, f"started again: it stopped before its first checkpoint (log: {run.log})")
        else:
            self._say(label, f"started (log: {run.log})")
        if self.num_processes and self.num_processes > 1:
            command += ["--num-processes", str(self.num_processes)]
        if self.fsdp:
            command.append("--fsdp")
        seconds = self._call(command, run.log, f"run {run.name}")
        report = completed_report(run.folder)
        if report is None:
            raise RunError(f"run {run.name} ended without a completed report.json; see its log {run.log}")
        self._say(label, f"finished in {duration(seconds)}")
        return report

    def _say(self, label: str, text: str) -> None:
        self.say(f"{time.strftime('%H:%M:%S')} {label}: {text}")

    def _call(self, command: list[str], log_path: Path, what: str) -> float:
        """Run `command` (`what`, in words), its output appended to the log; the seconds it took. A failure stops
        the bench."""
        started = time.perf_counter()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a") as log:
            offset = log.tell()  # where this attempt's output starts
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {what}: {shlex.join(command)}\n")
            log.flush()
            environment = getattr(self._worker, "environment", {})
            with self._lock:
                process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           env={**lifecycle_environment(), **environment, "PYTHONUNBUFFERED": "1"})
                self.signals.processes.add(process)
            try:
                code = process.wait()
            finally:
                with self._lock:
                    self.signals.processes.discard(process)
        if self.signals.received:
            raise Stopped(self.signals.received, what)
        if code != 0:
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            last = last_error(log_path, offset)
            raise RunError(f"{what} failed ({how}){': ' + last if last else ''}; see its log {log_path} (finished "
                           "runs are kept: the same command goes on from here)")
        return time.perf_counter() - started


def cpu_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def visible_gpus() -> list[str]:
    """The GPUs a run would see, as CUDA_VISIBLE_DEVICES names them (its own list where it is set)."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [name.strip() for name in given.split(",") if name.strip()]
    import torch

    return [str(k) for k in range(torch.cuda.device_count())]


def worker_environments(parallel: int) -> list[dict[str, str]]:
    """What each of `parallel` workers adds to its runs' environment: its share of the CPU cores as torch's
    threads (OMP_NUM_THREADS and MKL_NUM_THREADS, unless the user set them), and where several GPUs are visible
    one of them in turn (CUDA_VISIBLE_DEVICES); with one GPU every run shares it."""
    threads = str(max(1, cpu_cores() // parallel))
    gpus = visible_gpus()
    environments = []
    for k in range(parallel):
        environment = {name: threads for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if name not in os.environ}
        if len(gpus) > 1:
            environment["CUDA_VISIBLE_DEVICES"] = gpus[k % len(gpus)]
        environments.append(environment)
    return environments


def last_error(log: Path, offset: int) -> str:
    """The last `error: ...` line (the CLI's one-line errors) the log got from `offset` on, else its last line."""
    with open(log, "rb") as handle:
        handle.seek(offset)
        text = handle.read().decode(errors="replace")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    line = errors[-1] if errors else (lines[-1] if lines else "")
    return line[:300]


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{int(seconds // 60)} min {seconds % 60:02.0f} s"
