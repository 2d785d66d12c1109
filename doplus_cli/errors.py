"""The one user-error type: the CLI prints it as a single line and exits with code 2."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class UserError(Exception):
    """A problem with what the user asked for (a path, an option, a data row), not a bug in doplus.

    The message must say what is wrong and where (file, line, field) in one line.
    """

    exit_code = 2


def shown(value: object, limit: int = 60, quoted: bool = True) -> str:
    """`value` as an error message shows it: its repr (`quoted=False`: a string's text without quotes, as a flag's
    value is typed), at most `limit` characters (a longer one cut, ending in '...'), on one line, so that no message
    echoes a value of any size. reprlib makes the repr without walking the whole of a long or deeply nested value."""
    import reprlib

    if isinstance(value, str) and not quoted:
        text = repr(value[:limit + 1])[1:-1]  # line breaks and control characters escaped
    else:
        short = reprlib.Repr()
        short.maxstring = short.maxother = short.maxlong = limit
        short.maxlevel = 2
        try:
            text = short.repr(value)
        except Exception:  # an int past Python's digit limit, an object whose repr fails
            text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:max(limit - 3, 1)] + "..."


class RunError(UserError):
    """A run that cannot go on (a non-finite loss, say): one line, exit code 1."""

    exit_code = 1


class WriteError(UserError):
    """A file or folder doplus writes could not be written (disk full, no permission, a read-only or missing
    place): one line naming it, exit code 2. Every writer writes aside and renames, so what failed never looks
    finished, and the same command run again goes on from what was complete."""


_WRITE_WORDS = ("write", "ioerror", "storagefull", "no space", "os error", "permission denied", "read-only")


def write_failure(path: object, error: BaseException, then: str = "") -> WriteError | None:
    """The one-line WriteError for `error` raised while writing `path` (None: not a failed write). torch.save
    and safetensors report a full disk as RuntimeError / SafetensorError, with no path; an OSError may name
    the file that failed, which is then named instead of `path`."""
    if isinstance(error, OSError):
        where, reason = error.filename or path, error.strerror or str(error)
    elif isinstance(error, RuntimeError) or type(error).__name__ == "SafetensorError":
        text = " ".join(str(error).split())
        if not any(word in text.lower() for word in _WRITE_WORDS):
            return None
        where, reason = path, text[:200]
    else:
        return None
    return WriteError(f"{where}: cannot write ({reason}){then}")


@contextmanager
def writing(path: object, then: str = "") -> Iterator[None]:
    """Turn a failed write inside the block into `write_failure(path, ...)`; other errors pass unchanged."""
    try:
        yield
    except UserError:
        raise
    except Exception as error:
        failure = write_failure(path, error, then)
        if failure is None:
            raise
        raise failure from error


# Internal plumbing, not a user setting: set by `doplus unlearn --num-processes N` for its workers, where each
# worker leaves the exit code of a run that ended on a user error or a signal (FILE.rank{R}); the workers then
# exit 0, so torchrun ends without its own traceback, and the launching process exits with that code.
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
