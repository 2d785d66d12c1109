"""A recipe's teaching stage (`teach: TEACH.yaml`): the starting model is first taught something, then the run
starts from the taught model.

The unlearning benchmarks that run without the hub need a model that actually knows what it will be asked
to forget (the paper's TOFU models were fine-tuned on the fictitious authors first). `teach:` names a
`multitask` recipe; its run's final model becomes this run's `model`. The taught model is cached under
`$DOPLUS_CACHE/taught/KEY/` where KEY hashes everything that decides its weights: the teaching recipe's
resolved configuration, the bytes of every local data file it reads, the base model (its files' names,
sizes and times for a local folder) and the doplus version. A second run, or every run of a benchmark,
reuses it. A lock keeps two jobs on one cache from teaching the same model twice; an interrupted teaching
leaves only a `KEY.partial` folder, never a cache entry that looks finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from doplus_cli import __version__
from doplus_cli.commands.multitask import MultitaskConfig
from doplus_cli.config import TASK_PATH_KEYS, resolve_config
from doplus_cli.engine import training_precision
from doplus_cli.errors import UserError
from doplus_cli.models import cache_root, embedded_gguf_path, resolve_dtype

# Options of the teaching recipe that do not change the taught weights.
_NOT_IN_KEY = ("out", "overwrite", "resume", "description", "save_every", "save_minutes", "keep_last",
               "log_update_similarity", "eval_rows", "eval_batch_size", "report_to", "tracker_project",
               "tracker_run_name", "tracker_group", "tracker_dir")


def _file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _source_identity(spec: str | None) -> str | None:
    """A data source's identity: its bytes for a local file (a row range keeps its bounds), the spec for hf:."""
    if spec is None or spec.startswith("hf:"):
        return spec
    base, bracket, rows = spec.partition("[")
    path = spec if os.path.exists(spec) else base
    if not os.path.isfile(path):
        return spec  # opening it will say what is wrong
    return _file_digest(path) + (bracket + rows if path != spec else "")


def _model_identity(model: str | None) -> str:
    if model is None:
        path = embedded_gguf_path()
        return f"embedded:{path.name}:{path.stat().st_size}"
    if os.path.isdir(model):
        files = sorted(Path(model).iterdir())
        return "folder:" + ";".join(f"{p.name}:{p.stat().st_size}:{int(p.stat().st_mtime)}"
                                    for p in files if p.is_file())
    return model  # a hub id (its revision is the hub's latest)


# Options added to the training configs after the key's form was fixed, with their default: left out of the key
# while at that default (where they change nothing), so that a model taught before they existed is found again.
_ADDED_SINCE = {"stop_when": None}


_FLOAT32 = {"precision": "fp32", "dtype": "float32", "save_dtype": "float32"}


def _resolved_precision(config) -> dict[str, str]:
    """The teaching run's precision, load dtype and saved dtype as this machine resolves `auto`: bfloat16 on a GPU,
    float32 on a CPU, so that a cache shared by both (a cluster's home folder) never hands a run the model the other
    taught. float32 throughout is written `auto`, as the keys made before this rule held it, so that the models
    taught on a CPU are found again (and a recipe that says float32 finds them too)."""
    precision, save_dtype = training_precision.resolve(config.precision, config.dtype, config.save_dtype)
    dtype = str(resolve_dtype(config.dtype)).removeprefix("torch.")
    resolved = {"precision": precision, "dtype": dtype, "save_dtype": save_dtype}
    return {key: "auto" for key in resolved} if resolved == _FLOAT32 else resolved


def teaching_key(config) -> str:
    settings = {k: v for k, v in config.to_dict().items()
                if k not in _NOT_IN_KEY and not (k in _ADDED_SINCE and v == _ADDED_SINCE[k])}
    # a file by its bytes, not by how its path is written (a bench hands the recipe over with absolute paths)
    settings["tasks"] = [{**task, **{k: _source_identity(task[k]) for k in TASK_PATH_KEYS if task.get(k)}}
                         for task in config.tasks]
    settings["model"] = _model_identity(config.model)
    settings["doplus"] = __version__
    settings.update(_resolved_precision(config))
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _teaching(teach_recipe: str) -> tuple[MultitaskConfig, Path]:
    """(the teaching recipe's multitask config, the folder of its taught model in the cache), checked."""
    if not os.path.isfile(teach_recipe):
        raise UserError(f"{teach_recipe}: teaching recipe not found (option 'teach')")
    config = resolve_config(teach_recipe, {}, MultitaskConfig)
    if not config.tasks:
        raise UserError(f"{teach_recipe}: a teaching recipe is a multitask recipe; it has no tasks")
    if config.teach:
        raise UserError(f"{teach_recipe}: a teaching recipe cannot have a teaching stage of its own")
    return config, cache_root() / "taught" / teaching_key(config)


def teaching_plan(config, open_data: Callable[[MultitaskConfig], None]) -> tuple[str, str | None]:
    """`--dry-run` of the teaching stage of `config` (which has one): (what it would do, the model it starts
    from), with the checks `apply_teaching` makes and the teaching recipe's data opened (`open_data`: the multitask
    command's); nothing run or written."""
    _check_model_and_teach(config)
    teach, folder = _teaching(config.teach)
    if (folder / "report.json").is_file():
        return f"reuses the taught model {folder / 'final'}", teach.model
    open_data(teach)
    return (f"runs {config.teach} first ({teach.steps} steps of doplus multitask on {len(teach.tasks)} tasks) into "
            f"{folder}, once"), teach.model


def _check_model_and_teach(config) -> None:
    if config.model is not None and not config.taught:
        raise UserError(f"option 'teach' gives the starting model; remove 'model' ({config.model}) or 'teach'")


def taught_model(teach_recipe: str, console: Console, allow_teaching: bool = True) -> tuple[str, dict[str, Any]]:
    """(the taught model's folder, a report entry) for the teaching recipe, teaching it once if needed."""
    from filelock import FileLock

    config, folder = _teaching(teach_recipe)
    key, root = folder.name, folder.parent
    partial = root / f"{key}.partial"
    entry = {"recipe": os.path.abspath(teach_recipe), "cache": str(folder)}
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{key}.lock")):
        if (folder / "report.json").is_file():
            console.print(f"teaching stage: reusing {folder}", highlight=False)
            return str(folder / "final"), {**entry, "reused": True}
        if not allow_teaching:
            raise UserError(f"{teach_recipe}: the teaching stage has not run yet, and it cannot run inside a launch "
                            f"of several processes; run it first: doplus multitask --recipe {teach_recipe}, or "
                            "start this command with --num-processes")
        from doplus_cli.commands.multitask import run_multitask

        console.print(f"teaching stage: {teach_recipe} -> {folder} (once; later runs reuse it)", highlight=False)
        shutil.rmtree(partial, ignore_errors=True)
        run_multitask(config.replace(out=str(partial), overwrite=True), console)
        os.replace(partial, folder)
    return str(folder / "final"), {**entry, "reused": False}


def apply_teaching(config, console: Console):
    """`config` itself without a teaching stage; with one, a new config whose model is the taught model and whose
    `taught` is the report's entry for it (the config given stays as validated)."""
    if not config.teach:
        return config
    _check_model_and_teach(config)
    launched = "LOCAL_RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    model, taught = taught_model(config.teach, console, allow_teaching=not launched)
    return config.replace(model=model, taught=taught)
