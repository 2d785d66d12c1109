"""Progress that a batch job's log shows too, and the count of tokens an evaluation pushes through the model.

rich's live bar draws nothing without a terminal (a cluster job's output sent to a file), so `LoggedProgress`
prints a plain line when a task starts, every `every` percent of it and when it ends: the task, done/total, the
rate and the time left. On a terminal it is rich's bar, unchanged.

`count_tokens` adds to the counter of the innermost `counting_tokens()` block (none: nothing is counted), so the
generation and scoring code say what they ran without a counter passed through every call.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn


class LoggedProgress(Progress):
    """rich's Progress; without a terminal, plain lines every `every` percent (and at start and end)."""

    def __init__(self, *columns, console: Console, every: float = 5.0, **kwargs) -> None:
        super().__init__(*columns, console=console, **kwargs)
        self.log_lines = not console.is_terminal and not kwargs.get("disable", False)
        self.every = every
        self._logged: dict[TaskID, tuple[float, float]] = {}  # task -> (started, last percent printed)

    def add_task(self, description: str, *args, log: bool = True, **kwargs) -> TaskID:
        """rich's add_task; `log=False`: no lines for this task (the training loop prints its own)."""
        task = super().add_task(description, *args, **kwargs)
        if log and self.log_lines and kwargs.get("total") is not None and kwargs.get("visible", True):
            self._logged[task] = (time.perf_counter(), 0.0)
            total = kwargs["total"]
            self.console.print(f"{description}: 0/{total:g}", highlight=False, markup=False)
        return task

    def update(self, task_id: TaskID, *args, **kwargs) -> None:
        super().update(task_id, *args, **kwargs)
        self._log(task_id)

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._log(task_id)

    def _log(self, task_id: TaskID) -> None:
        if task_id not in self._logged:
            return
        started, last = self._logged[task_id]
        task = self._tasks[task_id]
        if not task.total:
            return
        percent = 100.0 * task.completed / task.total
        finished = task.completed >= task.total
        if not finished and percent < last + self.every:
            return
        elapsed = time.perf_counter() - started
        rate = task.completed / elapsed if elapsed > 0 else 0.0
        left = (task.total - task.completed) / rate if rate > 0 else float("nan")
        tail = f"done in {elapsed:.0f} s" if finished else f"{left:.0f} s left"
        self.console.print(f"{task.description}: {task.completed:g}/{task.total:g} ({percent:.0f}%), "
                           f"{rate:.2f}/s, {tail}", highlight=False, markup=False)
        if finished:
            del self._logged[task_id]
        else:
            self._logged[task_id] = (started, percent - percent % self.every)


def progress_bar(console: Console, *, disable: bool = False) -> LoggedProgress:
    """The progress display of evaluations and training: a bar on a terminal, plain lines in a log."""
    return LoggedProgress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TextColumn("{task.fields[status]}"), TimeElapsedColumn(), console=console, disable=disable)


@dataclass
class TokenCount:
    """Tokens an evaluation pushed through the model, padding left out: prompts of greedy generation, the tokens
    it generated (up to and including the stop token, within each row's budget), and teacher-forced tokens
    (the NLL scoring passes: prompts and answers)."""

    prompt: int = 0
    generated: int = 0
    teacher_forced: int = 0

    @property
    def total(self) -> int:
        return self.prompt + self.generated + self.teacher_forced


_COUNTER: ContextVar[TokenCount | None] = ContextVar("doplus_token_count", default=None)


@contextlib.contextmanager
def counting_tokens() -> Iterator[TokenCount]:
    count = TokenCount()
    token = _COUNTER.set(count)
    try:
        yield count
    finally:
        _COUNTER.reset(token)


def count_tokens(kind: str, n: int) -> None:
    """Add `n` tokens of `kind` (prompt, generated, teacher_forced) to the current count, if one is running."""
    count = _COUNTER.get()
    if count is not None:
        setattr(count, kind, getattr(count, kind) + int(n))
