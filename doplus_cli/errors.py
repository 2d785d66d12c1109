"""The one user-error type: the CLI prints it as a single line and exits with code 2."""

from __future__ import annotations


class UserError(Exception):
    """A problem with what the user asked for (a path, an option, a data row), not a bug in doplus.

    The message must say what is wrong and where (file, line, field) in one line.
    """

    exit_code = 2


class RunError(UserError):
    """A run that cannot go on (a non-finite loss, say): one line, exit code 1."""

    exit_code = 1


class Interrupted(UserError):
    """SIGTERM or Ctrl-C ended a run after a checkpoint: one line saying how to resume, exit 128 + signal."""


# Set by `doplus unlearn --num-processes N` for its workers: a file where the main worker leaves the exit code
# of a stopped run, so that the workers themselves can exit 0 and torchrun ends without a traceback.
STOP_FILE_VARIABLE = "DOPLUS_STOP_FILE"


def exit_code_after_stop(code: int, main_process: bool) -> int:
    """The exit code of a worker whose run was stopped by a signal (see STOP_FILE_VARIABLE)."""
    import os

    stop_file = os.environ.get(STOP_FILE_VARIABLE)
    if not stop_file:
        return code
    if main_process:
        with open(stop_file, "w") as handle:
            handle.write(str(code))
    return 0
