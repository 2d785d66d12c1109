"""The one user-error type: the CLI prints it as a single line and exits with code 2."""

from __future__ import annotations

import errno
import re
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


# What makes a write fail that is the place's doing, not doplus's: a full disk or quota, a read-only file system, no
# permission, a missing folder, a file too large for the file system, a failing device.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT,
                          errno.ENOTDIR, errno.EISDIR, errno.EFBIG, errno.EIO})
# torch.save to a path and some writers report the failure as text alone: words that still say it was the write
_WRITE_WORDS = ("write", "ioerror", "storagefull", "no space", "os error", "permission denied", "read-only")
# how the Rust io::Error of safetensors and tokenizers prints its errno: "(os error 28)", "Os { code: 28, ..."
_RUST_ERRNO = re.compile(r"\bos error (\d+)|\bOs \{ code: (\d+)")


def errno_of(error: BaseException) -> int | None:
    """The errno behind a failed write, along the error's chain (`__cause__`, `__context__`): an OSError's own, or
    the one a library's message carries (torch.save into a Python file raises a RuntimeError whose context is the
    file's OSError; safetensors prints Rust's "os error N")."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno:
            return current.errno
        match = _RUST_ERRNO.search(str(current)[:2000])
        if match:
            return int(match.group(1) or match.group(2))
        current = current.__cause__ or current.__context__
    return None


def _probe_errno(path: object) -> int | None:
    """The errno a small write beside `path` fails with now (None: it succeeds): what a writer that kept only text
    of its failure (torch.save to a path: "unexpected pos") met. The probe's file is this call's own and removed."""
    import os
    import tempfile
    from pathlib import Path

    folder = Path(str(path))
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    try:
        handle, name = tempfile.mkstemp(prefix=".doplus-write-probe-", dir=folder)
    except OSError as error:
        return error.errno
    try:
        os.write(handle, bytes(1 << 16))
        os.fsync(handle)
    except OSError as error:
        return error.errno
    finally:
        os.close(handle)
        os.unlink(name)
    return None


def write_failure(path: object, error: BaseException, then: str = "") -> WriteError | None:
    """The one-line WriteError for `error` raised while writing `path` (None: not a failed write). The failure is
    recognised by its errno wherever the chain of errors holds one (a full disk or quota, a read-only or
    unwritable place; `WRITE_ERRNOS`), by the words of a writer that reports only text, or, for such a writer's
    bare message, by the errno a small write beside `path` meets now. An OSError may name the file that failed,
    which is then named instead of `path`."""
    number = errno_of(error)
    if isinstance(error, OSError):
        where, reason = error.filename or path, error.strerror or str(error)
        return WriteError(f"{where}: cannot write ({reason}){then}")
    if number is None and not isinstance(error, RuntimeError) and type(error).__name__ != "SafetensorError":
        return None
    if number is None:
        text = " ".join(str(error).split())
        if any(word in text.lower() for word in _WRITE_WORDS):
            return WriteError(f"{path}: cannot write ({text[:200]}){then}")
        number = _probe_errno(path)
    if number is None or number not in WRITE_ERRNOS:
        return None
    import os

    return WriteError(f"{path}: cannot write ({os.strerror(number)}){then}")


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
