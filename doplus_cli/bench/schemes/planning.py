"""What a bench schemes command asks for: the scheme x seed (x sweep value, x forget task) runs, each with its
recipe and validated config, and the OUT folder they go to (bench.json, recipes/), checked before anything runs."""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from doplus_cli.bench.adapters import BenchAdapter, adapter_of
from doplus_cli.bench.adapters.base import read_json
from doplus_cli.config import (
    EXCLUSIVE_OPTIONS,
    PATH_KEYS,
    SCHEME_KEYS,
    SCHEMES,
    TrainConfig,
    coerce_option,
    default_of,
    field_names,
    list_value,
    load_recipe,
    parse_task_ids,
    read_recipe,
    recipe_form,
)
from doplus_cli.errors import UserError
from doplus_cli.files import atomic_write_text
from doplus_cli.lifecycle import folder_entries

BENCH_KEYS = ("seed", "out", "overwrite", "resume")  # the bench sets these for every run
BENCH_SAVE_MINUTES = 10  # a run's checkpoint cadence unless the recipe or --set gives save_every or save_minutes
CADENCE = ("save_every", "save_minutes", "keep_last")
TUNE_FOLDER = "tune"  # --tune: OUT/tune/SCHEME/ holds each scheme's study (doplus tune)
DEFAULT_SCHEMES = "joint,alternate,dualoptim,doplus"
DEFAULT_SEEDS = "0,1,2"


def scheme_values(name: str) -> dict[str, Any]:
    """The recipe values of scheme `name`: every SCHEME_KEYS entry, the ones it does not name at their default."""
    return {**{key: default_of(key, TrainConfig) for key in SCHEME_KEYS}, **SCHEMES[name].values}


# ---- the runs -----------------------------------------------------------------------------------------------


@dataclass
class Run:
    name: str
    scheme: str
    seed: int
    sweep_value: Any  # None without --sweep
    recipe: dict[str, Any]  # what OUT/recipes/NAME.yaml holds
    config: TrainConfig  # the recipe resolved and validated
    folder: Path  # OUT/runs/NAME
    task_id: int | None = None  # --task-ids: the forget task of this run

    @property
    def recipe_path(self) -> Path:
        return self.folder.parent.parent / "recipes" / f"{self.name}.yaml"

    @property
    def log(self) -> Path:
        return self.folder.with_name(self.name + ".log")


@dataclass
class Bench:
    """One invocation: the experiment (what every run shares) and the runs it asks for."""

    recipe: Path
    adapter: BenchAdapter  # what the bench asks of the recipe's command
    base: dict[str, Any]  # the recipe's values, paths absolute
    set_values: dict[str, Any]
    sweep_key: str | None
    sweep_values: list[Any]
    schemes: list[str]
    seeds: list[int]
    out: Path
    log_update_similarity: bool
    runs: list[Run] = field(default_factory=list)
    task_ids: list[int | None] = field(default_factory=lambda: [None])  # --task-ids: forget tasks, an axis
    summarize_from: str = "final"  # --summarize-from: each run's final model, or its best/ step (--select-by)
    tuned: dict[str, dict[str, Any]] = field(default_factory=dict)  # --tune: each scheme's best values
    tuning: str | None = None  # --tune: how the values were found, in words (SCHEMES.md)

    def experiment(self) -> dict[str, Any]:
        """What every run of OUT shares; a later command into the same OUT must give the same."""
        return json.loads(json.dumps({
            "kind": self.adapter.command, "recipe": plain(self.base), "set": plain(self.set_values),
            "sweep_key": self.sweep_key, "log_update_similarity": self.log_update_similarity,
            **({"tuned": plain(self.tuned)} if self.tuned else {})}, default=str))


def plan_bench(recipe: str, schemes: str, seeds: str, out: str, set_options: list[str], sweep: str | None,
               log_update_similarity: bool, task_ids: str | None = None,
               tuned: dict[str, dict[str, Any]] | None = None) -> Bench:
    """Every check on the command and the recipe, and the runs it asks for; nothing is written. `tuned`: each
    scheme's own values (doplus tune's best, `--tune`), over the recipe and --set."""
    scheme_names = parse_schemes(schemes)
    seed_list = parse_seeds(seeds)
    task_list: list[int | None] = [None] if task_ids is None else list(parse_task_ids(task_ids, "--task-ids"))
    path = Path(recipe).expanduser().resolve()
    raw = read_recipe(path)
    set_pairs = [split_pair(text, "--set") for text in set_options]
    sweep_pair = split_pair(sweep, "--sweep") if sweep is not None else None
    given = {str(k).replace("-", "_") for k in raw} | {k.replace("-", "_") for k, _ in set_pairs}
    adapter = adapter_of(path, given | ({sweep_pair[0].replace("-", "_")} if sweep_pair else set()))
    names = field_names(adapter.config_class)
    base = absolute_paths(load_recipe(path, adapter.config_class))
    for key in ("out", "overwrite", "resume"):
        base.pop(key, None)
    set_values: dict[str, Any] = {}
    for key, text in set_pairs:
        key = _option_key(key, "--set", names)
        value = recipe_form(key, coerce_option(key, _null(text), f"--set {key}", adapter.config_class),
                            adapter.config_class)
        set_values[key] = absolute_paths({key: value})[key]
    sweep_key, sweep_values = None, [None]
    if sweep_pair is not None:
        sweep_key = _option_key(sweep_pair[0], "--sweep", names)
        if sweep_key in set_values:
            raise UserError(f"--set {sweep_key} and --sweep {sweep_key}: give it once")
        items = [item.strip() for item in sweep_pair[1].split(",")]
        if not all(items):
            raise UserError(f"--sweep {sweep_pair[0]}={sweep_pair[1]}: write KEY=V1,V2,... with no empty value")
        sweep_values = [absolute_paths({sweep_key: recipe_form(
            sweep_key, coerce_option(sweep_key, _null(v), f"--sweep {sweep_key}", adapter.config_class),
            adapter.config_class)})[sweep_key] for v in items]
        if len({json.dumps(plain(v)) for v in sweep_values}) < len(sweep_values):
            raise UserError(f"--sweep {sweep_key}: a value is given twice ({sweep_pair[1]})")
    if task_ids is not None:
        if not adapter.takes_task_ids:
            raise UserError(f"--task-ids picks the forget tasks of an unlearn recipe; {path.name} is a "
                            f"{adapter.command} recipe")
        if "task_id" in set_values or sweep_key == "task_id":
            raise UserError("--task-ids and --set/--sweep task_id: give the tasks once, with --task-ids")
    bench = Bench(path, adapter, base, set_values, sweep_key, sweep_values, scheme_names, seed_list,
                  Path(out).expanduser().resolve(), log_update_similarity, task_ids=task_list, tuned=dict(tuned or {}))
    for values in bench.tuned.values():
        clash = sorted(set(values) & ({sweep_key} | set(set_values)))
        if clash:
            raise UserError(f"--tune searches {clash[0]}, which --set or --sweep also gives; give it once")
    # Forget task, then seed outermost: a bench stopped part-way has every scheme on the first tasks and seeds, and
    # the schemes' runs alternate in time, so a change in the machine's speed falls on every scheme alike.
    for task in task_list:
        for seed in seed_list:
            for scheme in scheme_names:
                for value in sweep_values:
                    bench.runs.append(_plan_run(bench, scheme, value, seed, task))
    for run in bench.runs:
        adapter.check_evaluation(given | ({sweep_key} if sweep_key else set()), run.config, path)
    names_seen = [run.name for run in bench.runs]
    if len(set(names_seen)) < len(names_seen):
        raise UserError(f"--sweep {sweep_key}: two values give the same run folder name; choose distinct values")
    return bench


def parse_schemes(text: str) -> list[str]:
    names = list(list_value(text, str, False, "--schemes"))
    if not names:
        raise UserError(f"--schemes is empty: choose from {SCHEMES.listing()}")
    for name in names:
        if name not in SCHEMES:
            hint = difflib.get_close_matches(name, list(SCHEMES), n=1)
            raise UserError(f"unknown scheme '{name}' in --schemes" + (f" (did you mean '{hint[0]}'?)" if hint else "")
                            + f": choose from {SCHEMES.listing()}")
        if names.count(name) > 1:
            raise UserError(f"--schemes names '{name}' twice")
    return names


def parse_seeds(text: str) -> list[int]:
    seeds = list(list_value(text, int, False, "--seeds"))
    if not seeds:
        raise UserError("--seeds is empty: give one or more seeds, e.g. --seeds 0,1,2")
    if len(set(seeds)) < len(seeds):
        raise UserError(f"--seeds {text}: a seed is given twice")
    return seeds


def split_pair(text: str, flag: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise UserError(f"{flag} '{text}': write KEY=VALUE" + ("S (comma-separated)" if flag == "--sweep" else ""))
    return key.strip(), value.strip()


def _option_key(raw: str, flag: str, names: list[str]) -> str:
    key = raw.replace("-", "_")
    if key not in names:
        hint = difflib.get_close_matches(key, names, n=1)
        raise UserError(f"{flag} {raw}: unknown option '{raw}'" + (f" (did you mean '{hint[0]}'?)" if hint else ""))
    if key in SCHEME_KEYS:
        raise UserError(f"{flag} {raw}: the scheme names set {key} (e.g. doplus-8bit, doplus-paper, doplus-muon); "
                        f"choose them in --schemes ({SCHEMES.listing()})")
    if key in BENCH_KEYS:
        raise UserError(f"{flag} {raw}: the bench sets {key} itself" + (" (use --seeds)" if key == "seed" else ""))
    return key


def _null(text: str) -> str | None:
    """`--set KEY=null` (or ~, YAML's nulls) sets an optional option back to None. "none" stays a value: some options
    give it a meaning (`eval_guard_model=none`: no guard model, where None means the default 8B guard)."""
    return None if text.lower() in ("null", "~") else text


def _plan_run(bench: Bench, scheme: str, sweep_value: Any, seed: int, task: int | None = None) -> Run:
    """The run's recipe (recipe < scheme < seed < --set < sweep value < the bench's checkpoint defaults) and its
    validated config."""
    tuned = bench.tuned.get(scheme, {})
    values = {**copy.deepcopy(bench.base), **scheme_values(scheme), "seed": seed, **bench.set_values, **tuned}
    sources = {key: str(bench.recipe) for key in bench.base}
    sources.update({key: f"--schemes {scheme}" for key in SCHEME_KEYS} | {"seed": "--seeds"})
    sources.update({key: f"--set {key}" for key in bench.set_values})
    sources.update({key: f"--tune {key}" for key in tuned})
    name = scheme
    if bench.sweep_key is not None:
        values[bench.sweep_key] = sweep_value
        sources[bench.sweep_key] = f"--sweep {bench.sweep_key}"
        name += f"-{bench.sweep_key}={_name_part(sweep_value)}"
    if task is not None:
        values["task_id"] = task
        sources["task_id"] = "--task-ids"
        name += f"-t{task}"
    name += f"-s{seed}"
    _keep_one_of_exclusive(values, sources, [str(bench.recipe), "--set", "--sweep"])
    # So that a run can resume after a kill: a checkpoint every 10 minutes, the newest kept (a preemption's SIGTERM
    # writes one anyway). By time, not by steps: with DualOptim+'s states a checkpoint of the embedded model is
    # 3.8 GB and took 12 s to write on 2 CPU cores, so one every tenth of a 96-step run cost 2 minutes of it, and
    # 38 GB of writes against steps of about 0.13 s on a GPU.
    if "save_every" not in values:
        values.setdefault("save_minutes", BENCH_SAVE_MINUTES)
    values.setdefault("keep_last", 1)
    if bench.log_update_similarity:
        values["log_update_similarity"] = True
    if str(values.get("report_to") or "none").lower() != "none":  # one tracker run per run, in one place
        group = scheme + (f"-{bench.sweep_key}={_name_part(sweep_value)}" if bench.sweep_key is not None else "")
        values.update({"tracker_project": f"doplus-bench-{bench.out.name}", "tracker_run_name": name,
                       "tracker_group": group, "tracker_dir": str(bench.out / "trackers")})
    config = config_of(bench.adapter, values, sources)
    copy.deepcopy(config).validate()
    return Run(name, scheme, seed, sweep_value, plain(values), config, bench.out / "runs" / name, task)


def config_of(kind: BenchAdapter, values: dict[str, Any], sources: dict[str, str]) -> TrainConfig:
    config = kind.config_class()
    for key, value in copy.deepcopy(values).items():
        setattr(config, key, coerce_option(key, value, sources.get(key, "bench schemes"), kind.config_class))
    return config


def _keep_one_of_exclusive(values: dict[str, Any], sources: dict[str, str], levels: list[str]) -> None:
    """Of two options a run takes one of (`steps`, `epochs`): the one given on the higher level (recipe < --set <
    --sweep) stays; both on the same level is an error."""
    def level(key: str) -> int:
        return next(i for i, prefix in enumerate(levels) if sources[key].startswith(prefix))

    for first, second in EXCLUSIVE_OPTIONS:
        if first in values and second in values:
            if level(first) == level(second):
                raise UserError(f"{sources[first]} and {sources[second]}: {first} and {second} both given; give one")
            dropped = min((first, second), key=level)
            del values[dropped], sources[dropped]


def _name_part(value: Any) -> str:
    text = f"{value:g}" if isinstance(value, float) else str(plain(value))
    return re.sub(r"[^A-Za-z0-9._+-]", "_", text)


def absolute_paths(values: dict[str, Any]) -> dict[str, Any]:
    """Relative model and data paths (found next to the recipe by load_recipe, or from the working directory)
    made absolute, so the run's recipe works from OUT/recipes/."""

    def absolute(value: Any) -> Any:  # FILE[START:STOP] keeps its row range
        if isinstance(value, str) and not value.startswith("hf:") and not os.path.isabs(value):
            base = value if os.path.exists(value) else value.partition("[")[0]
            if os.path.exists(base):
                return os.path.abspath(base) + value[len(base):]
        return value

    result = dict(values)
    for key in PATH_KEYS:
        if key in result:
            result[key] = absolute(result[key])
    if isinstance(result.get("tasks"), list):
        result["tasks"] = [{**task, "data": absolute(task.get("data")), "eval": absolute(task.get("eval"))}
                           if isinstance(task, dict) else task for task in result["tasks"]]
    return result


def plain(value: Any) -> Any:
    """YAML/JSON-safe: tuples as lists, all the way down."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value



# ---- OUT: what is there, and what it must agree with ----------------------------------------------------------


def _read_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def differences(saved: Any, current: Any, prefix: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(current, dict):
        found = []
        for key in dict.fromkeys([*saved, *current]):
            found += differences(saved.get(key), current.get(key), f"{prefix}{key} " if prefix else f"{key} ")
        return found
    if saved != current:
        return [f"{prefix.strip()} ({saved!r} -> {current!r})"]
    return []


def _without_cadence(recipe: Any) -> Any:
    """A run's recipe without its checkpoint cadence, which changes no result (a run resumes under another one):
    a bench continues the runs of a doplus whose default cadence differed."""
    return {k: v for k, v in recipe.items() if k not in CADENCE} if isinstance(recipe, dict) else recipe


def check_out(bench: Bench) -> dict[str, Any]:
    """OUT's bench.json, refusing an OUT that holds another experiment, or a run whose recipe differs."""
    index_path = bench.out / "bench.json"
    index: dict[str, Any] = {"experiment": bench.experiment(), "runs": {}}
    if index_path.is_file():
        index = read_json(index_path)
        changed = differences(index["experiment"], bench.experiment())
        if changed:
            raise UserError(f"{bench.out}: holds runs of another experiment ({'; '.join(changed[:3])}"
                            f"{'; ...' if len(changed) > 3 else ''}); use another --out")
    elif bench.out.exists() and not bench.out.is_dir():
        raise UserError(f"{bench.out}: --out is a file, not a folder")
    elif bench.out.is_dir() and [entry for entry in folder_entries(bench.out)  # the lock's files do not count
                                 if not (bench.tuned and entry.name == TUNE_FOLDER)]:  # nor --tune's studies
        raise UserError(f"{bench.out}: not empty and not a bench schemes folder (no bench.json); use another --out")
    for run in bench.runs:
        if run.recipe_path.is_file():
            changed = differences(_without_cadence(_read_yaml(run.recipe_path)), _without_cadence(run.recipe))
            if changed:
                raise UserError(f"{run.recipe_path}: the run {run.name} was made from another recipe "
                                f"({'; '.join(changed[:3])}); use another --out")
        elif run.folder.exists():
            raise UserError(f"{run.folder}: a run folder without its recipe {run.recipe_path}; use another --out")
    return index


def record_runs(bench: Bench, index: dict[str, Any]) -> None:
    """bench.json first (an OUT without it is refused later), then each run's recipe."""
    for run in bench.runs:
        index["runs"][run.name] = {"scheme": run.scheme, "seed": run.seed, "sweep_value": plain(run.sweep_value),
                                   **({"task_id": run.task_id} if run.task_id is not None else {})}
    (bench.out / "recipes").mkdir(parents=True, exist_ok=True)
    atomic_write_text(bench.out / "bench.json", json.dumps(index, indent=2) + "\n")
    for run in bench.runs:
        atomic_write_text(run.recipe_path, yaml.safe_dump(run.recipe, sort_keys=False))


def start_folder(bench: Bench, task: int | None) -> Path:
    """Where the evaluation of the model the runs of `task` start from goes."""
    return bench.out / "start" / ("all" if task is None else f"task-{task}")


def start_point(bench: Bench, task: int | None) -> dict[str, Any] | None:
    """The starting model's aggregates (percent) as a curve point at step 0, or None when it was not evaluated."""
    path = start_folder(bench, task) / "eval.json"
    if not path.is_file():
        return None
    point: dict[str, Any] = {"step": 0, "folder": str(path.parent)}
    for section in read_json(path).get("sections", []):
        for aggregate in section.get("aggregates", []):
            if aggregate["name"] in ("MU", "UFE", "TFE") and aggregate["value"] is not None:
                point[aggregate["name"]] = 100 * aggregate["value"]
    return point


def completed_report(run_folder: Path) -> dict[str, Any] | None:
    path = run_folder / "report.json"
    if not path.is_file():
        return None
    report = read_json(path)
    return report if report.get("status") == "completed" else None
