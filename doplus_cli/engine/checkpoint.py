"""Checkpoints of an unlearning run, and exact resume.

`checkpoints/step-N/` holds everything the loop needs to continue as if it had never stopped: the trainable
weights (safetensors), the optimizer state (all of DualOptim+'s states, 8-bit codes included), the LR
scheduler, the data position of each set, the RNG states, the resolved configuration and the metrics so far.
It is written under a temporary name and renamed, so a folder named `step-N` is always complete. Everything
loads through weights-only paths: safetensors, JSON and `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from doplus_cli.errors import UserError

# Options that may change between a run and its resumption: they do not change what is computed.
RESUMABLE_CHANGES = {"resume", "overwrite", "save_every", "keep_last", "show_samples", "description", "out"}
_STEP_DIR = re.compile(r"^step-(\d+)$")


def config_for_comparison(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in RESUMABLE_CHANGES}


def differing_keys(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    saved, current = config_for_comparison(saved), config_for_comparison(current)
    return sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _python_state_to_json(state) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _numpy_state_to_json(state) -> list:
    name, keys, pos, has_gauss, cached = state
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights a run changes (all of them, or the adapters under LoRA), contiguous for safetensors."""
    names = {name for name, p in model.named_parameters() if p.requires_grad}
    return {name: t.detach().contiguous().clone() for name, t in model.state_dict().items() if name in names}


def save_checkpoint(
    folder: Path, step: int, model: torch.nn.Module, optimizer, scheduler, streams: dict[str, Any],
    config: dict[str, Any], records: list[dict[str, Any]], extra: dict[str, Any], keep_last: int,
) -> Path:
    """Write `folder/step-{step}` atomically; prune to the newest `keep_last` (0 keeps all)."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step-{step}"
    tmp = folder / f".step-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(trainable_state(model), str(tmp / "model.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    rng = rng_state()
    torch.save({"torch": rng["torch"], **({"cuda": rng["cuda"]} if "cuda" in rng else {})}, tmp / "rng.pt")
    state = {
        "step": step,
        "streams": {name: stream.state_dict() for name, stream in streams.items()},
        "python_rng": _python_state_to_json(rng["python"]),
        "numpy_rng": _numpy_state_to_json(rng["numpy"]),
        "config": config,
        "extra": extra,
    }
    (tmp / "state.json").write_text(json.dumps(state, indent=1, default=str))
    with open(tmp / "metrics.jsonl", "w") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in records)
    for path in tmp.iterdir():  # the data reach the disk before the rename makes the checkpoint visible
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep_last > 0:
        for old in list_checkpoints(folder)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints (`step-N`, never the temporary folders), oldest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def find_checkpoint(resume: str, out: Path) -> Path:
    """`latest` -> the newest checkpoint under OUT/checkpoints; otherwise the given folder."""
    if resume == "latest":
        found = list_checkpoints(out / "checkpoints")
        if not found:
            raise UserError(f"{out}: no checkpoint to resume from (checkpoints/step-N/ is written by --save-every)")
        return found[-1]
    path = Path(resume)
    if not (path / "state.json").is_file():
        raise UserError(f"{resume}: not a doplus checkpoint folder (no state.json)")
    return path


def read_state(path: Path) -> dict[str, Any]:
    return json.loads((path / "state.json").read_text())


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer, scheduler, streams: dict[str, Any]) -> dict:
    """Restore weights, optimizer, scheduler, data positions and RNG states; return the saved state."""
    state = read_state(path)
    weights = load_file(str(path / "model.safetensors"), device=str(next(model.parameters()).device))
    missing = [name for name in trainable_state(model) if name not in weights]
    if missing:
        raise UserError(f"{path}: checkpoint lacks weights for {len(missing)} parameters (e.g. {missing[0]})")
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, tensor in weights.items():
            params[name].copy_(tensor)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    for name, stream in streams.items():
        stream.load_state_dict(state["streams"][name])
    rng = torch.load(path / "rng.pt", weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    version, internal, gauss = state["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy_rng"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    return state


def saved_records(path: Path) -> list[dict[str, Any]]:
    with open(path / "metrics.jsonl") as handle:
        return [json.loads(line) for line in handle if line.strip()]
