"""What a run was started on, recorded so that `--resume` notices when it changed.

`OUT/inputs.json`, written when a run starts (and copied into each checkpoint's manifest), holds:

- **data**: every data file the configuration names (`forget`, `retain`, `safety`, `general`, each multitask
  task's `data` and `eval`, the evaluation folders): its size, sha256 and, for JSON lines and JSON arrays, its
  row count; a hub dataset (`hf:NAME`) by the fingerprint `datasets` gives its cached copy;
- **model**: a hub model by the commit of its cached snapshot; a model folder, a `.gguf` file or the embedded
  model by the size and sha256 of each of its files;
- **software**: the doplus, torch, transformers and accelerate versions.

A resumption compares them with what it finds now and refuses a change, naming it, unless `--accept-changed`
names its kind (`data`, `model`, `software`). A file is hashed again only when its size, inode, modification
time or change time differ from the recorded ones: the change time (ctime) is set by the file system on every
write and cannot be set back by a user, so an unchanged stat means unchanged contents, and resuming on a large
model costs a `stat` per file. A file changed less than two seconds before it was hashed is hashed again (an
edit within the same tick of the file system's clock would keep its ctime). A copied or moved file is hashed
again and passes if its contents are the same.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from doplus_cli.config import PATH_KEYS, TASK_PATH_KEYS, parse_accept_changed
from doplus_cli.errors import UserError
from doplus_cli.files import file_sha256, write_json

INPUTS_FILE = "inputs.json"
SOFTWARE = ("doplus", "torch", "transformers", "accelerate")
_DATA_KEYS = tuple(k for k in PATH_KEYS if k not in ("model", "teach"))
_ROW_RANGE = re.compile(r"^(?P<base>.+)\[(?P<start>-?\d*):(?P<stop>-?\d*)\]$")
_RACY_NS = 2_000_000_000  # ctime within 2 s of the hashing: hashed again on the next check


def software_versions() -> dict[str, str | None]:
    """The installed versions of doplus and of the libraries a run's numbers depend on."""
    from doplus_cli import __version__

    versions: dict[str, str | None] = {"doplus": __version__}
    for package in SOFTWARE[1:]:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def _stat_key(stat: os.stat_result) -> list[int]:
    return [stat.st_size, stat.st_ino, stat.st_mtime_ns, stat.st_ctime_ns]


def describe_file(path: Path, recorded: dict[str, Any] | None = None, rows: bool = False) -> dict[str, Any]:
    """{path, size, sha256, stat[, rows]} of a file; the recorded sha256 and rows are reused when its stat is the
    recorded one (see the module's docstring)."""
    stat = path.stat()
    entry: dict[str, Any] = {"path": str(path), "size": stat.st_size, "stat": _stat_key(stat)}
    # as git's "racily clean" files: a file changed in the last seconds before it was hashed could change again
    # within the same tick of the file system's clock, so its record is trusted only for a change well before
    settled = stat.st_ctime_ns < (recorded or {}).get("hashed_at_ns", 0) - _RACY_NS
    if recorded and recorded.get("stat") == entry["stat"] and "sha256" in recorded and settled:
        entry["sha256"], entry["hashed_at_ns"] = recorded["sha256"], recorded["hashed_at_ns"]
        if "rows" in recorded:
            entry["rows"] = recorded["rows"]
        return entry
    entry["hashed_at_ns"] = time.time_ns()
    if rows and path.suffix == ".jsonl":
        digest, count = hashlib.sha256(), 0
        with open(path, "rb") as handle:
            for line in handle:  # one pass: the hash and the rows (non-blank lines) of a JSON-lines file
                digest.update(line)
                count += bool(line.strip())
        entry["rows"], entry["sha256"] = count, digest.hexdigest()
    else:
        entry["sha256"] = file_sha256(path)
    if rows and path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
            entry["rows"] = len(data) if isinstance(data, list) else None
        except (OSError, ValueError):
            entry["rows"] = None
    return entry


def _describe_folder(folder: Path, recorded: dict[str, Any] | None, recursive: bool) -> dict[str, Any]:
    files = sorted(p for p in (folder.rglob("*") if recursive else folder.iterdir()) if p.is_file())
    before = (recorded or {}).get("files", {})
    return {"path": str(folder), "files": {str(p.relative_to(folder)): _without_path(
        describe_file(p, before.get(str(p.relative_to(folder))))) for p in files}}


def _without_path(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if k != "path"}


def _describe_data(spec: str, recorded: dict[str, Any] | None) -> dict[str, Any]:
    """A data spec: a file (a `[START:STOP]` row range hashes the whole file), a folder, a hub dataset."""
    if spec.startswith("hf:"):
        return {"hub": spec, "fingerprint": _hub_dataset_fingerprint(spec)}
    path = Path(os.path.expanduser(spec))
    match = _ROW_RANGE.match(spec)
    if not path.exists() and match:
        path = Path(os.path.expanduser(match["base"]))
    if path.is_file():
        return describe_file(path, recorded, rows=True)
    if path.is_dir():
        return _describe_folder(path, recorded, recursive=True)
    return {"spec": spec}  # a name the command resolves itself (tofu-authors, a release downloaded later)


def _hub_dataset_fingerprint(spec: str) -> str | None:
    """The fingerprint `datasets` gives the cached copy of a hub dataset (its contents and the processing)."""
    try:
        import datasets

        from doplus_cli.data.sources import parse_hub_spec

        name, config, split = parse_hub_spec(spec)
        return datasets.load_dataset(name, config, split=split)._fingerprint
    except Exception:  # noqa: BLE001 - not loadable here: the data check then compares the spec alone
        return None


def _data_specs(config: dict[str, Any]) -> dict[str, str]:
    specs = {key: config[key] for key in _DATA_KEYS if isinstance(config.get(key), str) and config[key]}
    for index, task in enumerate(config.get("tasks") or []):
        for key in TASK_PATH_KEYS:
            if isinstance(task, dict) and isinstance(task.get(key), str) and task[key]:
                specs[f"task {task.get('name') or index} {key}"] = task[key]
    return specs


def _describe_model(spec: str | None, recorded: dict[str, Any] | None) -> dict[str, Any]:
    from doplus_cli.models import embedded_gguf_path, looks_like_path

    if spec is None:
        path = embedded_gguf_path()
        return {"embedded": str(path), "files": {path.name: _without_path(
            describe_file(path, (recorded or {}).get("files", {}).get(path.name)))}}
    path = Path(os.path.expanduser(spec))
    if path.is_file():
        return {"path": str(path), "files": {path.name: _without_path(
            describe_file(path, (recorded or {}).get("files", {}).get(path.name)))}}
    if path.is_dir():
        return _describe_folder(path, recorded, recursive=False)
    if looks_like_path(spec):
        return {"path": spec, "files": {}}
    return {"hub": spec, "revision": hub_revision(spec)}


def hub_revision(repo_id: str) -> str | None:
    """The commit of the cached snapshot of a hub model (None: not in the cache yet)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 - an id huggingface_hub refuses: the model loader says what is wrong
        return None
    return Path(found).parent.name if isinstance(found, str) else None


def current(config: dict[str, Any], recorded: dict[str, Any] | None = None) -> dict[str, Any]:
    """The inputs `config` names, as they are now (`recorded`: a run's record, whose hashes are reused for files
    that were not written since)."""
    recorded = recorded or {}
    before = recorded.get("data", {})
    return {
        "data": {label: _describe_data(spec, before.get(label)) for label, spec in _data_specs(config).items()},
        "model": _describe_model(config.get("model"), recorded.get("model")),
        "software": software_versions(),
    }


def record(out: Path, config: dict[str, Any]) -> dict[str, Any]:
    """Write OUT/inputs.json for a run starting now; return it."""
    inputs = current(config)
    write_json(out / INPUTS_FILE, inputs)
    return inputs


def read(out: Path) -> dict[str, Any] | None:
    """A run's recorded inputs (None: not recorded); a hub model's revision found since its download is filled in."""
    try:
        inputs = json.loads((out / INPUTS_FILE).read_text())
    except (OSError, ValueError):
        return None
    model = inputs.get("model") if isinstance(inputs, dict) else None
    if isinstance(model, dict) and "hub" in model and model.get("revision") is None:
        model["revision"] = hub_revision(model["hub"])
    return inputs if isinstance(inputs, dict) else None


def _file_change(label: str, before: dict[str, Any], now: dict[str, Any]) -> str | None:
    if before.get("sha256") == now.get("sha256"):
        return None
    rows_before, rows_now = before.get("rows"), now.get("rows")
    if rows_before is not None and rows_now is not None and rows_before != rows_now:
        how = f"{rows_before} -> {rows_now} rows"
    elif rows_before is not None and rows_before == rows_now:
        how = f"edited, same {rows_now} rows"
    else:
        how = f"edited, {before.get('size')} -> {now.get('size')} bytes"
    return f"{label} {now.get('path', '')} ({how})".replace("  ", " ")


def _entry_changes(label: str, before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    if "sha256" in before or "sha256" in now:
        change = _file_change(label, before, now)
        return [change] if change else []
    if "files" in before or "files" in now:
        old, new = before.get("files", {}), now.get("files", {})
        changes = [f"{label} {name} (removed)" for name in sorted(set(old) - set(new))]
        changes += [f"{label} {name} (added)" for name in sorted(set(new) - set(old))]
        changes += [c for name in sorted(set(old) & set(new))
                    if (c := _file_change(f"{label} {name}", old[name], {**new[name], "path": ""}))]
        return changes
    if "hub" in before or "hub" in now:
        key = "revision" if "revision" in before or "revision" in now else "fingerprint"
        if before.get("hub") != now.get("hub"):
            return [f"{label} {before.get('hub')} -> {now.get('hub')}"]
        if before.get(key) and now.get(key) and before[key] != now[key]:
            return [f"{label} {now['hub']} ({key} {before[key][:12]} -> {now[key][:12]})"]
        return []
    return [] if before == now else [f"{label} ({before.get('spec')} -> {now.get('spec')})"]


def changes(recorded: dict[str, Any], now: dict[str, Any]) -> dict[str, list[str]]:
    """{kind: what changed} between a run's recorded inputs and the current ones (kinds without a change left out)."""
    found: dict[str, list[str]] = {}
    old_data, new_data = recorded.get("data") or {}, now.get("data") or {}
    data = [f"{label} (no longer given)" for label in sorted(set(old_data) - set(new_data))]
    data += [f"{label} (not given before)" for label in sorted(set(new_data) - set(old_data))]
    for label in sorted(set(old_data) & set(new_data)):
        data += _entry_changes(label, old_data[label], new_data[label])
    if data:
        found["data"] = data
    if recorded.get("model") is not None:
        model = _entry_changes("model", recorded["model"], now["model"])
        if model:
            found["model"] = model
    old_software, new_software = recorded.get("software") or {}, now.get("software") or {}
    software = [f"{name} {old_software[name]} -> {new_software.get(name)}" for name in SOFTWARE
                if name in old_software and old_software[name] != new_software.get(name)]
    if software:
        found["software"] = software
    return found


def check_data_unchanged(out: Path, config: dict[str, Any], when: str) -> None:
    """Stop a run whose data files changed since it recorded them (an edit made while the run reads its rows
    lazily, which would train on rows that no record names): one line naming the file. A `stat` per file unless it
    was written since; hub datasets are left out (their cached copy does not change under a run)."""
    recorded = read(out)
    if recorded is None:
        return
    before = recorded.get("data") or {}
    now = {label: _describe_data(spec, before.get(label)) for label, spec in _data_specs(config).items()
           if not spec.startswith("hf:") and label in before}
    found = changes({"data": {label: before[label] for label in now}}, {"data": now}).get("data")
    if found:
        raise UserError(f"{'; '.join(found)}: changed while the run was reading it; the run stopped {when} (the "
                        "checkpoints written before are kept): restore the file and run the same command with "
                        "--resume, or start the run again on the new file")


def check_unchanged(checkpoint: Path, recorded: dict[str, Any] | None, software: dict[str, Any] | None,
                    config: dict[str, Any], out: Path, accept_changed: tuple[str, ...] | None,
                    say: Callable[[str], None], write: bool = True) -> None:
    """Refuse to resume `checkpoint` on inputs other than those recorded, in one line naming each change and the
    flag that accepts it; with that flag, say what changed, record the inputs as they are now and go on (`write`
    False: the same checks and lines, nothing recorded, as `--dry-run` does)."""
    accepted = parse_accept_changed(accept_changed)
    if recorded is None and software is None:
        say(f"{checkpoint}: the run's inputs were not recorded (no {INPUTS_FILE}), so changed data, model or "
            "software could not be checked; recording them now for the checkpoints to come")
        if write:
            write_json(out / INPUTS_FILE, current(config))
        return
    baseline = {**(recorded or {}), "software": software or (recorded or {}).get("software")}
    now = current(config, recorded)
    found = changes(baseline, now)
    refused = {kind: what for kind, what in found.items() if kind not in accepted}
    if refused:
        kinds = ",".join(refused)
        listed = "; ".join(f"{kind}: {', '.join(what)}" for kind, what in refused.items())
        raise UserError(f"{checkpoint}: cannot resume, the run's inputs changed since it started ({listed}); "
                        f"restore them, or resume on them with --accept-changed {kinds}")
    if found:
        listed = "; ".join(f"{kind}: {', '.join(what)}" for kind, what in found.items())
        say(f"resuming on changed inputs, accepted with --accept-changed: {listed}")
    if (found or recorded is None) and write:
        write_json(out / INPUTS_FILE, now)  # later checkpoints record the inputs the run goes on with
