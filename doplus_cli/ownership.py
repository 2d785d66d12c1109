"""What doplus wrote in an output folder, recorded before it writes it: the only paths it ever deletes there.

A command that writes into `--out` (a training run, an evaluation, a continual run) first writes the folder's
record, `OUT/.doplus-run.json`: the command and the names of the entries it is going to write directly in OUT
(`config.yaml`, `final`, `checkpoints`, ...; each with the `NAME.tmp` twin its atomic writer uses). Only then does
it write them. Everything else in OUT belongs to the user and is never touched:

- a fresh start refuses an entry it must write that exists without being recorded (one line naming it), so a
  user's `data/` or `report.md` is neither overwritten nor deleted;
- `--overwrite` removes exactly the recorded entries of the earlier run of the same command, and nothing else;
- `--resume` needs a record: a folder where no run of the command was started holds nothing to resume.

The record names entries of OUT only, never a path outside it, and a record that is damaged or names something
else (`..`, a path with a separator) is one line, never a deletion.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from doplus_cli.errors import UserError, writing
from doplus_cli.files import atomic_write_text

RECORD_NAME = ".doplus-run.json"
RECORD_FORMAT = 1
TMP = ".tmp"  # the suffix of the name an atomic writer writes aside (files.atomic_write_text, outputs.save_final)


def _twins(names: Iterable[str]) -> list[str]:
    """Each name and the name its atomic writer writes aside, in order, once each."""
    return list(dict.fromkeys(n for name in names for n in (name, name + TMP)))


def _valid_name(name: object) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name and name != RECORD_NAME)


def read(folder: Path) -> dict[str, Any] | None:
    """The folder's record ({"command", "entries", ...}), or None where no doplus command recorded anything. A
    record that cannot be read is one line: nothing is deleted on a guess."""
    path = Path(folder) / RECORD_NAME
    if not path.is_file():
        return None
    try:
        if path.stat().st_size > 1 << 20:
            raise ValueError("larger than 1 MiB")
        record = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(record, dict) or not isinstance(record.get("command"), str):
            raise ValueError("no command")
        entries = record.get("entries")
        if not isinstance(entries, list) or not all(_valid_name(name) for name in entries):
            raise ValueError("its entries are not names of the folder's own entries")
    except (OSError, ValueError, RecursionError) as error:
        reason = " ".join(str(error).split())[:100] or type(error).__name__
        raise UserError(f"{path}: unreadable record of what doplus wrote in this folder ({reason}); move the "
                        "folder's files you want to keep and remove the folder, or choose another --out") from None
    return record


def _write(folder: Path, command: str, entries: list[str], started: str | None = None) -> None:
    record = {"format": RECORD_FORMAT, "command": command,
              "started": started or time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime()),
              "entries": entries}
    atomic_write_text(folder / RECORD_NAME, json.dumps(record, indent=1) + "\n")


def _same_command(folder: Path, record: dict[str, Any], command: str) -> None:
    if record["command"] != command:
        raise UserError(f"{folder}: holds the files of a `{record['command']}` ({folder / RECORD_NAME}), not of a "
                        f"`{command}`; choose another --out")


def present(folder: Path, record: dict[str, Any] | None) -> list[str]:
    """The recorded entries that exist."""
    if record is None:
        return []
    return [name for name in record["entries"] if os.path.lexists(folder / name)]


def _refuse_collisions(folder: Path, names: Iterable[str], recorded: Iterable[str]) -> None:
    """One line for the first entry `names` holds that exists in the folder without being recorded."""
    mine = set(recorded)
    for name in _twins(names):
        if name not in mine and os.path.lexists(folder / name):
            raise UserError(f"{folder / name}: exists and doplus did not write it (it is not in {folder / RECORD_NAME})"
                            f"; this run writes there: move it, or choose another --out")


def check_start(folder: Path, command: str, names: Iterable[str], overwrite: bool, then: str = "") -> list[str]:
    """What a fresh start of `command` in `folder` would find, without changing anything: the refusals `begin`
    makes (one line each), else the recorded entries `overwrite` would remove (`--dry-run` says which)."""
    folder = Path(folder)
    record = read(folder)
    removed: list[str] = []
    if record is not None:
        _same_command(folder, record, command)
        if not overwrite:
            raise UserError(f"{folder}: holds a `{command}` started {record.get('started', 'earlier')} (pass "
                            f"--overwrite to replace what it wrote{then})")
        removed = present(folder, record)
    _refuse_collisions(folder, names, removed)
    return removed


def begin(folder: Path, command: str, names: Iterable[str], overwrite: bool, then: str = "") -> None:
    """A fresh start of `command` in `folder`, which will write the entries `names`. A folder holding an earlier
    start of the command is refused unless `overwrite`, which removes exactly what that start recorded (`then`: how
    the refusal goes on, e.g. the --resume hint); a folder of another command's is refused; an entry in `names` that
    exists unrecorded is refused. Then the record, before anything of the run is written."""
    folder = Path(folder)
    names = list(names)
    if check_start(folder, command, names, overwrite, then):
        remove_recorded(folder)
    with writing(folder):
        _write(folder, command, _twins(names))


def claim(folder: Path, command: str, names: Iterable[str]) -> None:
    """Add entries to the record of a started run (a resumed run that now writes something more: trackers asked for
    on resume), refusing one that exists unrecorded."""
    folder = Path(folder)
    record = read(folder)
    if record is None:
        raise UserError(f"{folder}: no record of a `{command}` (no {RECORD_NAME}); start it without --resume")
    _same_command(folder, record, command)
    new = [name for name in _twins(names) if name not in record["entries"]]
    if not new:
        return
    _refuse_collisions(folder, new, record["entries"])
    with writing(folder):
        _write(folder, command, record["entries"] + new, record.get("started"))


def remove_recorded(folder: Path, record: dict[str, Any] | None = None) -> list[str]:
    """Remove the entries the folder's record lists (a folder is renamed out of sight before it is deleted, so a
    kill midway never leaves a half-deleted folder under its name); the record stays. Returns what was removed."""
    folder = Path(folder)
    record = record if record is not None else read(folder)
    removed = []
    for name in present(folder, record):
        target = folder / name
        with writing(target):
            if target.is_dir() and not target.is_symlink():
                aside = Path(tempfile.mkdtemp(prefix=f".{name}.removing-", dir=folder))  # a new name, nobody's
                os.replace(target, aside / name)
                shutil.rmtree(aside)
            else:
                target.unlink()
        removed.append(name)
    return removed


def is_started(folder: Path, command: str) -> bool:
    """Whether `command` was started in `folder` (its record is there)."""
    record = read(Path(folder))
    if record is None:
        return False
    _same_command(Path(folder), record, command)
    return True


def adopt(folder: Path, command: str, names: Iterable[str]) -> list[str]:
    """Record `names` as the run's entries, for a run written by a doplus that kept no record: the caller has checked
    that the folder holds that run (its checkpoints and config.yaml). Returns those among them that exist."""
    folder = Path(folder)
    found = [name for name in _twins(names) if os.path.lexists(folder / name)]
    with writing(folder):
        _write(folder, command, _twins(names))
    return found
