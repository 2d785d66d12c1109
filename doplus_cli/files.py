"""Writing a file so that a failed write never leaves a partial one: used by the engine, the evaluation and the
benchmarks alike, so it sits below all of them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from doplus_cli.errors import writing


def atomic_write_text(path: Path, text: str) -> None:
    """Write `path` aside and rename it into place: a failed write (one line, `errors.WriteError`) leaves the
    previous file, or none, never a partial one."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with writing(path):
            tmp.write_text(text)
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: Path, data: Any) -> None:
    """`data` as indented JSON, written atomically."""
    atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")
