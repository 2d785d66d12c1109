"""Small helpers shared by the end-to-end tests."""

from __future__ import annotations

from doplus_cli.cli import main


def run_cli(*args) -> int:
    """Run `doplus ARGS` in this process; return the exit code (0 on success)."""
    try:
        main([str(a) for a in args])
    except SystemExit as done:
        return done.code
    return 0
