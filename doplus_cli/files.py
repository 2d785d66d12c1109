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


def save_figure(figure: Any, path: Path, dpi: int = 120) -> None:
    """A matplotlib figure as PNG, written aside and renamed as `atomic_write_text` writes text."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with writing(path):
            figure.savefig(tmp, dpi=dpi, format="png")
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: Path, data: Any) -> None:
    """`data` as indented JSON, written atomically."""
    atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def process_umask() -> int:
    """The process's umask, read without changing it (Linux's /proc/self/status; elsewhere set and put back)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(folder_or_files: Path | list[Path]) -> None:
    """Give files the mode the process's umask gives a new file: safetensors writes its files 0600, which would keep
    a run's weights from the colleagues who read everything else it wrote on a shared file system."""
    paths = folder_or_files if isinstance(folder_or_files, list) else [
        p for p in Path(folder_or_files).rglob("*") if p.is_file()]
    mode = 0o666 & ~process_umask()
    for path in paths:
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


HASH_CHUNK = 16 << 20  # bytes read at a time: a checkpoint or model file is hashed without holding it in memory


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in chunks (hashlib releases the GIL on each)."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
