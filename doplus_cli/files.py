"""Writing a file so that a failed write never leaves a partial one, and hashing a file: used by the engine, the
evaluation and the benchmarks alike, so it sits below all of them."""

from __future__ import annotations

import hashlib
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


HASH_CHUNK = 16 << 20  # bytes read at a time: a checkpoint or model file is hashed without holding it in memory


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in chunks (hashlib releases the GIL on each)."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
