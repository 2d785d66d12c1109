"""Checkpoints of an unlearning run, and exact resume.

`checkpoints/step-N/` holds everything the loop needs to continue as if it had never stopped: the trainable
weights (safetensors), the optimizer state (all of DualOptim+'s states, 8-bit codes included), the LR
scheduler, the data position of each set, the RNG states, the resolved configuration and the metrics so far.
It is written under a temporary name and renamed, so a folder named `step-N` is always complete. Everything
loads through weights-only paths: safetensors, JSON and `torch.load(weights_only=True)`.

Its `manifest.json`, written last, lists every file with its size and sha256, the format version, the doplus,
torch, transformers and accelerate versions, the number of processes, the precision and the run's inputs
(engine/inputs.py). A resumption checks every file against it first: a checkpoint damaged after it was written
(a copy cut short, a storage fault, a flipped bit) is named with the file and what is wrong, and `--resume
latest` passes over it to the newest intact one. A checkpoint without a manifest (doplus 0.1 and 0.2 wrote none)
is refused, since nothing says its files are whole, unless `--accept-unverified` takes it as it is.

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
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from doplus_cli.engine import inputs
from doplus_cli.errors import RunError, UserError, shown, write_failure
from doplus_cli.files import file_sha256, follow_umask
from doplus_cli.losses import LossParams
from doplus_cli.optim.distributed import local_shard

# Options that may change between a run and its resumption: they do not change what is computed.
RESUMABLE_CHANGES = {"resume", "overwrite", "save_every", "save_minutes", "keep_last", "show_samples", "description",
                     "out", "log_update_similarity", "save_dtype", "report_to", "tracker_project", "tracker_run_name",
                     "tracker_group", "tracker_dir", "accept_changed", "accept_unverified"}
_STEP_DIR = re.compile(r"^step-(\d+)$")
MANIFEST = "manifest.json"
# The manifest's format: a resumption reads formats up to this one and refuses a newer one.
MANIFEST_FORMAT = 1


# A saved configuration that lacks one of these keys was written by a doplus without that option, and its run
# behaved as this value: DualOptim+ with the paper's rule, and training in the load dtype (a CUDA run in
# uncompensated bf16, which no precision reproduces, is refused on resume), and the safeguard's floor at 0.05
IMPLIED_BEFORE_ADDED = {"doplus_rule": "paper", "precision": "fp32", "base_update": "after-param",
                        "base_source": "grad", "v_floor": 0.05}
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


def trainable_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) of every weight a run changes, in the model's order."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def finite_probe(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One float32 value that is finite when every element of `tensors` is: their sum (a NaN or an infinity
    propagates through it). A sum that overflows on finite elements reads as non-finite too, which
    `first_non_finite` then clears. The tensors may sit on several devices: an optimizer's state dict on a GPU
    holds CUDA moments beside the step counters torch's AdamW keeps on the CPU. Each device's tensors are reduced
    there, and the value lands on the first accelerator among them (the CPU where there is none), so a GPU run
    makes no host synchronisation here."""
    floating = [t for t in tensors if t.is_floating_point() and t.numel()]
    if not floating:
        return torch.zeros(())
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for t in floating:
        groups.setdefault(t.device, []).append(t)
    parts = []
    for device, group in groups.items():
        if device.type == "cpu":
            sums = [t.sum(dtype=torch.float32) for t in group]  # a read of memory, no squares, on the CPU
        else:
            sums = [n.float() for n in torch._foreach_norm(group)]  # one fused kernel over the device's tensors
        parts.append(torch.stack(sums).sum())
    target = next((device for device in groups if device.type != "cpu"), torch.device("cpu"))
    return torch.stack([part.to(target) for part in parts]).sum()


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of `tensors` is finite (`finite_probe`; one host synchronisation)."""
    return bool(torch.isfinite(finite_probe(tensors)).item())


def first_non_finite(named: list[tuple[str, torch.Tensor]]) -> tuple[str, str] | None:
    """(name, what) of the first tensor holding a NaN or an infinity, or None."""
    for name, tensor in named:
        if tensor.is_floating_point() and tensor.numel() and not bool(torch.isfinite(tensor).all()):
            nans = int(torch.isnan(tensor).sum())
            infs = int(torch.isinf(tensor).sum())
            return name, ", ".join(f"{n} {w}" for n, w in ((nans, "NaN"), (infs, "infinite")) if n)
    return None


def optimizer_tensors(optimizer, model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of the optimizer's state dict (what a checkpoint saves), named by its path
    with the parameter's name for a parameter's index."""
    scheduled = getattr(optimizer, "optimizer", optimizer)
    by_id = {id(p): name for name, p in model.named_parameters()}
    names = [by_id.get(id(p), str(i)) for i, p in
             enumerate(p for group in getattr(scheduled, "param_groups", []) for p in group["params"])]
    found: list[tuple[str, torch.Tensor]] = []

    def walk(value: Any, path: str, indexed: bool) -> None:
        if torch.is_tensor(value):
            found.append((path, local_shard(value)))
        elif isinstance(value, dict):
            for key, item in value.items():
                label = names[key] if indexed and isinstance(key, int) and 0 <= key < len(names) else str(key)
                walk(item, f"{path}.{label}" if path else label, key in ("state", "compensation"))
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(item, f"{path}.{index}", False)

    walk(optimizer.state_dict(), "", False)
    return found


def non_finite_in(model: torch.nn.Module, optimizer, states: bool = True) -> tuple[str, str] | None:
    """(where, what) of a NaN or infinity in the trainable weights (and the optimizer's states), or None: one
    reduction, and only when it finds something a search for the tensor. On this process's shards under FSDP."""
    weights = [(f"weight {name}", local_shard(p.detach())) for name, p in trainable_weights(model)]
    named = weights + ([(f"optimizer state {name}", t) for name, t in optimizer_tensors(optimizer, model)]
                       if states else [])
    if all_finite([t for _, t in named]):
        return None
    return first_non_finite(named)


class Processes:
    """Who writes what. This process's index, how many there are, which one is the main one and the barrier are
    accelerate's `PartialState`'s (read when asked); doplus adds the file names each process writes and whether
    weights and optimizer states are sharded (FSDP). `world`: the number of processes a dry run plans for without
    starting them, and starting no accelerate state (this process is then the main one and nothing waits)."""

    def __init__(self, sharded: bool = False, world: int | None = None) -> None:
        self.sharded = sharded
        self._planned = world

    @property
    def rank(self) -> int:
        return 0 if self._planned is not None else _state().process_index

    @property
    def world(self) -> int:
        return self._planned if self._planned is not None else _state().num_processes

    @property
    def main(self) -> bool:
        return self._planned is not None or _state().is_main_process

    def barrier(self) -> None:
        if self._planned is None:
            _state().wait_for_everyone()

    def gather(self, value: Any) -> list[Any]:
        """Every process's `value`, in process order, on every process."""
        if self.world == 1:
            return [value]
        from accelerate.utils import gather_object

        return gather_object([value])

    def broadcast(self, value: Any) -> Any:
        """The main process's `value`, on every process."""
        if self.world == 1:
            return value
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([value])[0]

    def name(self, stem: str, suffix: str) -> str:
        """A file of this process's own: one per process when there are several."""
        return f"{stem}{suffix}" if self.world == 1 else f"{stem}.rank{self.rank}{suffix}"

    def weights_name(self, stem: str, suffix: str) -> str:
        """The file of the weights or optimizer states: one per process under FSDP, else one for all."""
        return self.name(stem, suffix) if self.sharded else f"{stem}{suffix}"


def _state():
    """accelerate's process state (shared by every `Accelerator` of this process)."""
    from accelerate import PartialState

    return PartialState()


def _save_torch(obj: Any, path: Path) -> None:
    """torch.save into a file doplus opened: a failed write then carries the file's OSError (its errno: a full
    disk, a quota), where torch.save given a path reports only "unexpected pos"."""
    with open(path, "wb") as handle:
        torch.save(obj, handle)


def _fsync(paths) -> None:
    for path in paths:  # the data reach the disk before the rename makes the checkpoint visible
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())


def _described(paths) -> dict[str, dict[str, Any]]:
    """{file name: its size and sha256}, read back just after it was written (from the page cache)."""
    return {path.name: {"size": path.stat().st_size, "sha256": file_sha256(path)} for path in paths}


def _synced_and_described(paths: list[Path]) -> dict[str, dict[str, Any]]:
    """fsync `paths` and hash them at the same time: the hashing (CPU) runs while the disk takes the data."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:
        described = pool.submit(_described, paths)
        _fsync(paths)
        return described.result()


def _write_manifest(folder: Path, files: dict[str, dict[str, Any]], step: int, processes: Processes,
                    config: dict[str, Any], run_inputs: dict[str, Any] | None) -> None:
    """`folder/manifest.json`, the checkpoint's last file: written aside, synced, renamed."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "step": step,
        "software": inputs.software_versions(),
        "world_size": processes.world,
        "sharded": processes.sharded,
        "precision": config.get("precision"),
        "files": dict(sorted(files.items())),
        "inputs": run_inputs,
    }
    tmp = folder / (MANIFEST + ".tmp")
    with open(tmp, "w") as handle:
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, folder / MANIFEST)


def save_checkpoint(
    folder: Path, step: int, model: torch.nn.Module, optimizer, scheduler, streams: dict[str, Any],
    config: dict[str, Any], records: list[dict[str, Any]], extra: dict[str, Any], keep_last: int | None,
    processes: Processes | None = None,
) -> Path:
    """Write `folder/step-{step}` atomically; prune to the newest `keep_last` (None keeps all). Every process
    calls it; each writes its own part."""
    keep_last = keep_last or 0
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
        follow_umask([model_file])
        _save_torch(optimizer.state_dict(), optimizer_file)
        written += [model_file, optimizer_file]
    rng = rng_state()
    rng["python"], rng["numpy"] = _python_state_to_json(rng["python"]), _numpy_state_to_json(rng["numpy"])
    rng_file = tmp / processes.name("rng", ".pt")
    _save_torch(rng, rng_file)
    written.append(rng_file)
    files = {}  # every process hashes its own files; the main process lists them all in the manifest
    for part in processes.gather(_synced_and_described(written)):
        files.update(part)
    if processes.main:
        _save_torch(scheduler.state_dict(), tmp / "scheduler.pt")
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
        own = [tmp / "scheduler.pt", tmp / "state.json", tmp / "metrics.jsonl"]
        files.update(_synced_and_described(own))
        _write_manifest(tmp, files, step, processes, config, inputs.read(folder.parent))
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
                 config: dict[str, Any], keep_last: int | None, processes: Processes) -> None:
        self.folder = out / "checkpoints"
        self.model, self.optimizer, self.scheduler, self.streams = model, optimizer, scheduler, streams
        self.config, self.keep_last, self.processes = config, keep_last, processes

    def save(self, step: int, records: list[dict[str, Any]], extra: dict[str, Any]) -> Path:
        """Write `step-{step}` (every process takes part). A failed write (disk full, no permission) is one line
        saying how to go on, and the half-written step is removed. Weights or optimizer states holding a NaN or
        an infinity are never saved: the run stops, its last checkpoint kept (`NonFiniteState`)."""
        found = non_finite_in(self.model, self.optimizer)
        if any(self.processes.gather(found is not None)):
            raise NonFiniteState(step, found, self.folder)
        changed = None
        if self.processes.main:
            try:
                inputs.check_data_unchanged(self.folder.parent, self.config, f"before writing step-{step}")
            except UserError as error:
                changed = str(error)
        changed = self.processes.broadcast(changed)
        if changed is not None:
            raise UserError(changed)
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


class NonFiniteState(RunError):
    """A NaN or an infinity in the weights or the optimizer's states after a step: the run stops without saving
    them (exit code 1), its newest checkpoint kept."""

    def __init__(self, step: int, found: tuple[str, str] | None, folder: Path) -> None:
        where = f"{found[0]} holds {found[1]}" if found else "another process's shard holds a NaN or an infinity"
        kept = list_checkpoints(folder)
        last = f"the last good checkpoint is {kept[-1]}" if kept else "no checkpoint was written (--save-every)"
        super().__init__(f"step {step}: non-finite values after the optimizer step: {where}; nothing saved, "
                         f"{last}; try a lower learning rate, or --precision fp32")


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


class DamagedCheckpoint(UserError):
    """A checkpoint whose files do not match its manifest (or whose manifest cannot be read)."""


# A manifest lists a checkpoint's files and the run's inputs: a few kilobytes. A larger file is not one doplus wrote.
MAX_MANIFEST_BYTES = 16 * 2**20


def read_manifest(manifest_file: Path) -> dict[str, Any]:
    """A checkpoint's manifest.json, read and checked in shape (whatever its bytes: a DamagedCheckpoint line naming
    it otherwise): a JSON object of at most MAX_MANIFEST_BYTES with an integer `format`, `files` mapping plain file
    names to {size: integer >= 0, sha256: string}, and `inputs` and `software`, when present, objects of the shape
    engine/inputs.py records."""
    try:
        with open(manifest_file, "rb") as handle:
            raw = handle.read(MAX_MANIFEST_BYTES + 1)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ValueError(f"larger than {MAX_MANIFEST_BYTES // 2**20} MiB")
        manifest = json.loads(raw.decode("utf-8"))
        problem = _manifest_problem(manifest)
        if problem:
            raise ValueError(problem)
    except RecursionError:
        raise DamagedCheckpoint(f"{manifest_file}: unreadable manifest (JSON nested too deeply)") from None
    except (OSError, ValueError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        reason = " ".join(str(error).split())[:120] or type(error).__name__
        raise DamagedCheckpoint(f"{manifest_file}: unreadable manifest ({reason})") from None
    return manifest


def _manifest_problem(manifest: Any) -> str | None:
    """What makes `manifest` (parsed JSON) no manifest doplus wrote, in a few words; None when it has the shape."""
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}, not an object"
    version, files = manifest.get("format"), manifest.get("files")
    if isinstance(version, bool) or not isinstance(version, int):
        return "no integer 'format'"
    if not isinstance(files, dict):
        return "no 'files' object"
    for name, entry in files.items():
        if not name or "/" in name or "\\" in name or "\0" in name or name.startswith("."):
            return "a file name outside the folder"
        if len(name) > 255 or not name.isprintable() or not _encodable(name):
            return f"a file name no checkpoint holds ({shown(name)})"
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
            return f"no sha256 for {shown(name)}"
        size = entry.get("size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            return f"no size for {shown(name)}"
    for key in ("inputs", "software"):
        if manifest.get(key) is not None and not isinstance(manifest[key], dict):
            return f"'{key}' is not an object"
    inputs = manifest.get("inputs") or {}
    data = inputs.get("data")
    if data is not None and not (isinstance(data, dict) and all(isinstance(entry, dict) for entry in data.values())):
        return "'inputs' holds data entries that are not objects"
    for key in ("model", "software"):
        if inputs.get(key) is not None and not isinstance(inputs[key], dict):
            return f"'inputs.{key}' is not an object"
    return None


def _encodable(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate, which no file name on disk holds
        return False
    return True


def verify_checkpoint(path: Path) -> dict[str, Any] | None:
    """Check every file of checkpoint `path` against its manifest (size, then sha256); return the manifest, or
    None for a checkpoint written without one. A mismatch is one line naming the file and what is wrong."""
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        if not (path / "state.json").is_file():
            raise DamagedCheckpoint(f"{path}: not a doplus checkpoint folder (no {MANIFEST}, no state.json)")
        return None
    manifest = read_manifest(manifest_file)
    version = manifest["format"]
    listed = {name: (entry["size"], entry["sha256"]) for name, entry in manifest["files"].items()}
    if version > MANIFEST_FORMAT:
        raise DamagedCheckpoint(f"{manifest_file}: format {shown(version)}, written by a newer doplus (this one reads "
                                f"up to format {MANIFEST_FORMAT}); resume it with that doplus")
    for name, (size, sha256) in listed.items():
        file = path / name
        if not file.is_file():
            raise DamagedCheckpoint(f"{file}: missing (the checkpoint's manifest lists it)")
        actual = file.stat().st_size
        if actual != size:
            what = "truncated" if actual < size else "longer than written"
            raise DamagedCheckpoint(f"{file}: {what}: {actual} bytes, the manifest says {size}")
        if file_sha256(file) != sha256:
            raise DamagedCheckpoint(f"{file}: its contents changed after it was written (sha256 differs from the "
                                    "manifest's)")
    return manifest


def _say(message: str) -> None:
    """One line on standard error, where the run's progress lines go."""
    print(message, file=sys.stderr, flush=True)


def find_checkpoint(resume: str, out: Path, accept_unverified: bool = False) -> tuple[Path, dict[str, Any] | None]:
    """(the checkpoint, its verified manifest, or None for one without a manifest taken under `accept_unverified`):
    `latest` -> the newest intact checkpoint under OUT/checkpoints, each damaged or unverifiable newer one passed
    over with a line saying why; otherwise the given folder, which must be intact."""
    if resume != "latest":
        path = Path(resume)
        if not path.is_dir():
            raise UserError(f"{resume}: not a doplus checkpoint folder (no such folder)")
        manifest = verify_checkpoint(path)
        if manifest is None and not accept_unverified:
            raise UserError(_unverified(path))
        return path, manifest
    found = list_checkpoints(out / "checkpoints")
    if not found:
        raise UserError(f"{out}: no checkpoint to resume from (checkpoints/step-N/ is written by --save-every)")
    damaged = []
    for path in reversed(found):
        try:
            manifest = verify_checkpoint(path)
        except DamagedCheckpoint as error:
            damaged.append(str(error))
            continue
        if manifest is None and not accept_unverified:
            damaged.append(_unverified(path))
            continue
        for problem in damaged:
            _say(f"{problem}; passed over for the newest intact checkpoint, {path}")
        return path, manifest
    raise UserError(f"{out}: no intact checkpoint to resume from: {'; '.join(damaged)}")


def _unverified(path: Path) -> str:
    return (f"{path}: has no {MANIFEST}, so its files cannot be checked (a damaged file would be trained on); pass "
            "--accept-unverified to resume from it as it is (doplus 0.1 and 0.2 wrote no manifest)")


def read_state(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "state.json").read_text())
    except (OSError, ValueError) as error:
        reason = " ".join(str(error).split())[:120]
        raise UserError(f"{path / 'state.json'}: cannot read the checkpoint's state ({reason})") from None


def open_resume(resume: str, out: Path, config: dict[str, Any], processes: Processes,
                accept_changed: tuple[str, ...] | None = None,
                accept_unverified: bool = False) -> tuple[Path, dict[str, Any]]:
    """(the checkpoint `--resume` names, its saved state), after checking its files against its manifest; refused
    when it was written by another process layout, with a configuration that changes what is computed
    (`config`: this run's, resolved), or on inputs that changed since (data, model, software; engine/inputs.py)
    unless `accept_changed` names them. The main process reads and hashes; every process gets its verdict."""
    verdict, failure = None, None
    if processes.main:
        try:
            verdict = ("ok", *checked_resume(resume, out, config, processes, accept_changed, accept_unverified))
        except Exception as error:  # every process ends, not only the main one
            failure, verdict = error, ("error", type(error).__name__, str(error))
    verdict = processes.broadcast(verdict)
    if failure is not None:
        raise failure
    if verdict[0] == "error":
        raise (DamagedCheckpoint if verdict[1] == DamagedCheckpoint.__name__ else UserError)(verdict[2])
    return Path(verdict[1]), verdict[2]


def checked_resume(resume: str, out: Path, config: dict[str, Any], processes: Processes,
                   accept_changed: tuple[str, ...] | None, accept_unverified: bool,
                   write: bool = True) -> tuple[str, dict[str, Any]]:
    """(the checkpoint `--resume` names, its saved state) once every check passed: its files against its manifest,
    the process layout, the configuration, the inputs (`write` False: nothing recorded, for `--dry-run`)."""
    path, manifest = find_checkpoint(resume, out, accept_unverified)
    if manifest is None:
        _say(f"{path}: written without a {MANIFEST}, so its files could not be verified; resuming from it as it is")
    saved = read_state(path)
    check_processes(path, saved, processes)  # first: another layout also derives other values (warm-up steps)
    keys = differing_keys(saved["config"], config)
    if keys:
        changes = ", ".join(f"{k} ({saved['config'].get(k)!r} -> {config.get(k)!r})" for k in keys)
        raise UserError(f"{path}: cannot resume with a different configuration: {changes}")
    recorded = (manifest or {}).get("inputs") or inputs.read(out)
    software = (manifest or {}).get("software") or (recorded or {}).get("software")
    inputs.check_unchanged(path, recorded, software, config, out, accept_changed, _say, write)
    return str(path), saved


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
    """Restore weights, optimizer, scheduler, data positions and RNG states; return the saved state. A saved state
    that does not fit this run (missing or unexpected names, other shapes) is one line naming the file."""
    processes = processes or Processes()
    state = read_state(path)
    check_processes(path, state, processes)
    model_file = path / processes.weights_name("model", ".safetensors")
    optimizer_file = path / processes.weights_name("optimizer", ".pt")
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    weights = _loaded(model_file, lambda: load_file(
        str(model_file), device=str(local_shard(next(iter(params.values()))).device)))
    _check_weights(model_file, weights, {name: local_shard(p) for name, p in params.items()})
    with torch.no_grad():
        for name, tensor in weights.items():
            local_shard(params[name]).copy_(tensor)
    saved_optimizer = _loaded(optimizer_file, lambda: torch.load(optimizer_file, weights_only=True))
    _loaded(optimizer_file, lambda: optimizer.load_state_dict(saved_optimizer), "does not fit this run's optimizer")
    check_optimizer_shapes(optimizer_file, optimizer)
    scheduler_file = path / "scheduler.pt"
    saved_scheduler = _loaded(scheduler_file, lambda: torch.load(scheduler_file, weights_only=True))
    _loaded(scheduler_file, lambda: scheduler.load_state_dict(saved_scheduler), "does not fit this run's scheduler")
    for name, stream in streams.items():
        position = state.get("streams", {}).get(name)
        if not isinstance(position, dict) or not {"epoch", "position"} <= set(position):
            raise UserError(f"{path / 'state.json'}: no data position for the objective '{name}' (saved: "
                            f"{', '.join(state.get('streams', {})) or 'none'})")
        # a data set accepted with another row count (--accept-changed data) goes on from the same epoch
        stream.load_state_dict({"epoch": position["epoch"], "position": min(int(position["position"]), stream.size)})
    rng_file = path / processes.name("rng", ".pt")
    rng = _loaded(rng_file, lambda: torch.load(rng_file, weights_only=True))
    _loaded(rng_file, lambda: _set_rng_state(rng), "holds no usable RNG states")
    return state


def _loaded(file: Path, load, what: str = "cannot be read"):
    """`load()`, with a file that is missing, unreadable or does not fit said in one line naming it."""
    try:
        return load()
    except UserError:
        raise
    except Exception as error:
        reason = " ".join(str(error).split())[:200] or type(error).__name__
        raise UserError(f"{file}: {what} ({type(error).__name__}: {reason})") from error


def _check_weights(file: Path, saved: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> None:
    """The saved weights name exactly this run's trainable parameters, each with its shape."""
    missing = [name for name in params if name not in saved]
    unexpected = [name for name in saved if name not in params]
    if missing or unexpected:
        parts = ([f"lacks {len(missing)} of this run's parameters (e.g. {missing[0]})"] if missing else []) + (
            [f"holds {len(unexpected)} this run does not train (e.g. {unexpected[0]})"] if unexpected else [])
        raise UserError(f"{file}: {' and '.join(parts)}; was it written by a run of another model, LoRA or RMU "
                        "setting?")
    for name, tensor in saved.items():
        if tensor.shape != params[name].shape:
            raise UserError(f"{file}: {name} has shape {tuple(tensor.shape)}, this run's has "
                            f"{tuple(params[name].shape)}")


def check_optimizer_shapes(file: Path, optimizer) -> None:
    """The loaded moment tensors have their parameter's shape (torch's load_state_dict checks only the groups'
    sizes, and a mismatch would otherwise surface as a traceback in the first step). Per-objective states
    (DualOptim's) are nested one level down; 8-bit block scales (`*_absmax`, bitsandbytes' `absmax1`, `qmap1`) hold
    one value per block of 256 elements, not one per element, so they are not compared with the parameter."""
    inner = optimizer
    for wrapper in ("optimizer", "inner"):  # accelerate's wrapper, then the engine's shared-state wrapper
        if not isinstance(getattr(inner, "state", None), dict) and hasattr(inner, wrapper):
            inner = getattr(inner, wrapper)
    states = getattr(inner, "state", None)
    if not isinstance(states, dict):
        return

    def moments(entry: dict, prefix: str = ""):
        for key, value in entry.items():
            if isinstance(value, dict):
                yield from moments(value, f"{prefix}{key}.")
            elif torch.is_tensor(value) and not ("absmax" in str(key) or str(key).startswith("qmap")):
                yield prefix + str(key), value

    for group in getattr(inner, "param_groups", []):
        for param in group["params"]:
            shape = local_shard(param).shape
            for key, value in moments(states.get(param, {})):
                if (value.is_floating_point() and value.dim() == len(shape) and value.numel() > 1
                        and value.shape != shape):
                    raise UserError(f"{file}: the optimizer state '{key}' has shape {tuple(value.shape)} for a "
                                    f"parameter of shape {tuple(shape)}")


def _set_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def saved_records(path: Path) -> list[dict[str, Any]]:
    with open(path / "metrics.jsonl") as handle:
        return [json.loads(line) for line in handle if line.strip()]
