"""Checkpoints of an unlearning run, and exact resume.

`checkpoints/step-N/` holds everything the loop needs to continue as if it had never stopped: the trainable
weights (safetensors), the optimizer state (all of DualOptim+'s states, 8-bit codes included), the LR
scheduler, the data position of each set, the RNG states, the resolved configuration and the metrics so far.
It is written under a temporary name and renamed, so a folder named `step-N` is always complete. Everything
loads through weights-only paths: safetensors, JSON and `torch.load(weights_only=True)`.

On several processes each one writes its own RNG states (`rng.rank{R}.pt`). Under FSDP each one also writes
its shard of the weights and of the optimizer states (`model.rank{R}.safetensors`, `optimizer.rank{R}.pt`),
nothing is gathered, and a resumption needs the same number of processes; the folder must be on a file
system every process sees (as a cluster's shared storage is).
"""

from __future__ import annotations

import dataclasses
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

from doplus_cli.errors import UserError, write_failure
from doplus_cli.losses import LossParams
from doplus_cli.optim.distributed import local_shard

# Options that may change between a run and its resumption: they do not change what is computed.
RESUMABLE_CHANGES = {"resume", "overwrite", "save_every", "keep_last", "show_samples", "description", "out",
                     "log_update_similarity", "save_dtype", "report_to", "tracker_project", "tracker_run_name",
                     "tracker_group", "tracker_dir"}
_STEP_DIR = re.compile(r"^step-(\d+)$")


# A saved configuration that lacks one of these keys was written by a doplus without that option, and its run
# behaved as this value: DualOptim+ with the paper's rule, and training in the load dtype (a CUDA run in
# uncompensated bf16, which no precision reproduces, is refused on resume)
IMPLIED_BEFORE_ADDED = {"doplus_rule": "paper", "precision": "fp32"}
# nor did such a run use the newer losses' hyper-parameters (LossParams): their defaults stand in
IMPLIED_BEFORE_ADDED.update({f.name: f.default for f in dataclasses.fields(LossParams) if f.name != "seed"})


def config_for_comparison(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in {**IMPLIED_BEFORE_ADDED, **config}.items() if k not in RESUMABLE_CHANGES}


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
    """The weights a run changes (all of them, or the adapters under LoRA), contiguous for safetensors; under
    FSDP this process's shard of each."""
    return {name: local_shard(p.detach()).contiguous().clone()
            for name, p in model.named_parameters() if p.requires_grad}


class Processes:
    """Who writes what: this process's index, how many there are, a barrier, and whether weights and
    optimizer states are sharded (FSDP)."""

    def __init__(self, accelerator=None, sharded: bool = False) -> None:
        self.rank = accelerator.process_index if accelerator else 0
        self.world = accelerator.num_processes if accelerator else 1
        self.sharded = sharded
        self._accelerator = accelerator

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            self._accelerator.wait_for_everyone()

    def name(self, stem: str, suffix: str) -> str:
        """A file of this process's own: one per process when there are several."""
        return f"{stem}{suffix}" if self.world == 1 else f"{stem}.rank{self.rank}{suffix}"

    def weights_name(self, stem: str, suffix: str) -> str:
        """The file of the weights or optimizer states: one per process under FSDP, else one for all."""
        return self.name(stem, suffix) if self.sharded else f"{stem}{suffix}"


def _fsync(paths) -> None:
    for path in paths:  # the data reach the disk before the rename makes the checkpoint visible
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())


def save_checkpoint(
    folder: Path, step: int, model: torch.nn.Module, optimizer, scheduler, streams: dict[str, Any],
    config: dict[str, Any], records: list[dict[str, Any]], extra: dict[str, Any], keep_last: int,
    processes: Processes | None = None,
) -> Path:
    """Write `folder/step-{step}` atomically; prune to the newest `keep_last` (0 keeps all). Every process
    calls it; each writes its own part."""
    processes = processes or Processes()
    final = folder / f"step-{step}"
    tmp = folder / f".step-{step}.tmp"
    if processes.main:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    processes.barrier()
    written = []
    if processes.sharded or processes.main:
        model_file = tmp / processes.weights_name("model", ".safetensors")
        optimizer_file = tmp / processes.weights_name("optimizer", ".pt")
        save_file(trainable_state(model), str(model_file))
        torch.save(optimizer.state_dict(), optimizer_file)
        written += [model_file, optimizer_file]
    rng = rng_state()
    rng["python"], rng["numpy"] = _python_state_to_json(rng["python"]), _numpy_state_to_json(rng["numpy"])
    rng_file = tmp / processes.name("rng", ".pt")
    torch.save(rng, rng_file)
    written.append(rng_file)
    _fsync(written)
    processes.barrier()
    if processes.main:
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        state = {
            "step": step,
            "world_size": processes.world,
            "sharded": processes.sharded,
            "streams": {name: stream.state_dict() for name, stream in streams.items()},
            "config": config,
            "extra": extra,
        }
        (tmp / "state.json").write_text(json.dumps(state, indent=1, default=str))
        with open(tmp / "metrics.jsonl", "w") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in records)
        _fsync([tmp / "scheduler.pt", tmp / "state.json", tmp / "metrics.jsonl"])
        if final.exists():  # the same step saved again (SIGTERM right after a periodic save)
            _set_aside(final)
        # Pruning renames a checkpoint out of sight (atomic) before deleting it, so a kill never leaves a
        # half-deleted step-N that looks complete. With K >= 2 the excess goes before the new one appears:
        # at no moment are more than K complete checkpoints on disk, and never fewer than K-1 >= 1. With
        # K = 1 the new one appears first, so a kill in between leaves 2 rather than none.
        kept = list_checkpoints(folder)
        excess = kept[: max(0, len(kept) + 1 - keep_last)] if keep_last >= 2 else []
        for old in excess:
            _set_aside(old)
        os.replace(tmp, final)
        for old in list_checkpoints(folder)[:-keep_last] if keep_last == 1 else []:
            _set_aside(old)
        for old in sorted(folder.glob(".step-*.deleting")) + sorted(folder.glob(".step-*.tmp")):
            shutil.rmtree(old, ignore_errors=True)  # this save's, and whatever a kill left behind
    processes.barrier()
    return final


class CheckpointWriter:
    """A run's checkpoints under OUT/checkpoints: built once from what every checkpoint holds (the trained model,
    the optimizer, the LR scheduler, each objective's data stream, the resolved configuration); `save` adds the
    step's records and the command's own state."""

    def __init__(self, out: Path, model: torch.nn.Module, optimizer, scheduler, streams: dict[str, Any],
                 config: dict[str, Any], keep_last: int, processes: Processes) -> None:
        self.folder = out / "checkpoints"
        self.model, self.optimizer, self.scheduler, self.streams = model, optimizer, scheduler, streams
        self.config, self.keep_last, self.processes = config, keep_last, processes

    def save(self, step: int, records: list[dict[str, Any]], extra: dict[str, Any]) -> Path:
        """Write `step-{step}` (every process takes part). A failed write (disk full, no permission) is one line
        saying how to go on, and the half-written step is removed."""
        try:
            return save_checkpoint(self.folder, step, self.model, self.optimizer, self.scheduler, self.streams,
                                   self.config, records, extra, self.keep_last, self.processes)
        except Exception as error:
            failure = write_failure(self.folder / f"step-{step}", error, _how_to_go_on(self.folder))
            if failure is None:
                raise
            for partial in self.folder.glob(f".step-{step}.tmp"):
                shutil.rmtree(partial, ignore_errors=True)
            raise failure from error


def _how_to_go_on(folder: Path) -> str:
    """What a run whose checkpoint write failed says next: how to go on, from which checkpoint."""
    found = list_checkpoints(folder)
    if not found:
        return "; the run stopped before its first checkpoint: free space (or fix the permission) and start it again"
    return (f"; the run stopped, its newest complete checkpoint is {found[-1]}: free space (or fix the permission), "
            "then run the same command with --resume")


def _set_aside(checkpoint: Path) -> Path:
    aside = checkpoint.with_name(f".{checkpoint.name}.deleting")
    os.replace(checkpoint, aside)
    return aside


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


def open_resume(resume: str, out: Path, config: dict[str, Any], processes: Processes) -> tuple[Path, dict[str, Any]]:
    """(the checkpoint `--resume` names, its saved state), refused when it was written by another process layout
    or with a configuration that changes what is computed (`config`: this run's, resolved)."""
    path = find_checkpoint(resume, out)
    saved = read_state(path)
    check_processes(path, saved, processes)
    keys = differing_keys(saved["config"], config)
    if keys:
        changes = ", ".join(f"{k} ({saved['config'].get(k)!r} -> {config.get(k)!r})" for k in keys)
        raise UserError(f"{path}: cannot resume with a different configuration: {changes}")
    return path, saved


def check_processes(path: Path, state: dict[str, Any], processes: Processes) -> None:
    """A checkpoint continues only on the process layout that wrote it: the number of processes sets each
    one's rows of every batch, and FSDP shards are cut for that number."""
    world, sharded = state.get("world_size", 1), state.get("sharded", False)
    if world != processes.world:
        raise UserError(f"{path}: written by {world} process(es), this run has {processes.world}; resume with "
                        f"--num-processes {world} (each process's rows of every batch depend on it)")
    if sharded != processes.sharded:
        written, now = ("with" if sharded else "without"), ("with" if processes.sharded else "without")
        raise UserError(f"{path}: written {written} FSDP, this run is {now}; resume it {written} --fsdp")


def load_checkpoint(
    path: Path, model: torch.nn.Module, optimizer, scheduler, streams: dict[str, Any],
    processes: Processes | None = None,
) -> dict:
    """Restore weights, optimizer, scheduler, data positions and RNG states; return the saved state."""
    processes = processes or Processes()
    state = read_state(path)
    check_processes(path, state, processes)
    model_file = path / processes.weights_name("model", ".safetensors")
    optimizer_file = path / processes.weights_name("optimizer", ".pt")
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    weights = load_file(str(model_file), device=str(local_shard(next(iter(params.values()))).device))
    missing = [name for name in params if name not in weights]
    if missing:
        raise UserError(f"{path}: checkpoint lacks weights for {len(missing)} parameters (e.g. {missing[0]})")
    with torch.no_grad():
        for name, tensor in weights.items():
            local_shard(params[name]).copy_(tensor)
    optimizer.load_state_dict(torch.load(optimizer_file, weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    for name, stream in streams.items():
        stream.load_state_dict(state["streams"][name])
    rng = torch.load(path / processes.name("rng", ".pt"), weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    return state


def saved_records(path: Path) -> list[dict[str, Any]]:
    with open(path / "metrics.jsonl") as handle:
        return [json.loads(line) for line in handle if line.strip()]
