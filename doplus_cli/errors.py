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
