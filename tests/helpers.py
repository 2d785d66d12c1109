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


def write_sets(tofu_dir, folder, forget_rows: int, retain_rows: int):
    """forget.jsonl and retain.jsonl in `folder`: the first rows of TOFU's forget01 and retain90 (read from
    ../shared, never copied into the project); returns the folder."""
    for role, name, n in (("forget", "forget01.json", forget_rows), ("retain", "retain90.json", retain_rows)):
        lines = [line for line in open(tofu_dir / name) if line.strip()][:n]
        (folder / f"{role}.jsonl").write_text("".join(lines))
    return folder
