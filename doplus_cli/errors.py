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


# Set by `doplus unlearn --num-processes N` for its workers: where each worker leaves the exit code of a run
# that ended on a user error or a signal (FILE.rank{R}); the workers then exit 0, so torchrun ends without
# its own traceback, and the launching process exits with that code.
EXIT_FILE_VARIABLE = "DOPLUS_EXIT_FILE"


def worker_exit_code(code: int) -> int:
    """The exit code for a run that ends with `code`: `code`, or 0 after leaving it for the launching process."""
    import os

    exit_file = os.environ.get(EXIT_FILE_VARIABLE)
    if not exit_file:
        return code
    with open(f"{exit_file}.rank{os.environ.get('RANK', '0')}", "w") as handle:
        handle.write(str(code))
    return 0


def quiet_worker() -> bool:
    """A worker other than the first under `--num-processes`: the first one prints the error line."""
    import os

    return bool(os.environ.get(EXIT_FILE_VARIABLE)) and os.environ.get("RANK", "0") != "0"
