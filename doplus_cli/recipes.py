"""The shipped recipes: `doplus recipes list` and `doplus recipes copy NAME DEST`.

The recipes live in the repository's `recipes/` folder. A wheel carries the same files as the package
`doplus_cli._recipes` (pyproject.toml maps that package to `recipes/`), so they are found from a checkout, an
editable install and an installed wheel alike. A recipe's name is its path under the recipes root without
`.yaml` (`quickstart`, `tofu/phi-1.5/idk_gd`, `bench/mini_tofu`). `doplus recipes list` says which recipes run as
shipped and which read data doplus does not ship, naming each set (`data/fetching.py`, docs/data-sets.md).
"""

from __future__ import annotations

import difflib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from doplus_cli.commands import command_marked
from doplus_cli.config import PATH_KEYS, TASK_PATH_KEYS, read_recipe
from doplus_cli.data.fetching import DATA_SETS, data_set_of
from doplus_cli.errors import UserError, writing


def recipes_root() -> Path:
    """The folder the recipes are read from: the checkout's `recipes/` when doplus runs from a checkout (or an
    editable install of one), else the copy a wheel installs as `doplus_cli/_recipes/`."""
    package = Path(__file__).resolve().parent
    checkout = package.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / "recipes" / "quickstart.yaml").is_file():
        return checkout / "recipes"
    installed = package / "_recipes"
    if installed.is_dir():
        return installed
    raise UserError(f"no recipes found: neither {checkout / 'recipes'} nor {installed} exists "
                    "(reinstall doplus-cli, or run from a checkout)")


@dataclass
class Recipe:
    name: str
    path: Path
    command: str
    description: str
    needs: tuple[str, ...] = ()  # the data sets it reads that do not ship with doplus (empty: it runs as shipped)


def _command_of(data: dict[str, Any]) -> str:
    """The command a recipe is for (the command whose marker it sets), or `accelerate config` for an accelerate
    config file."""
    training = command_marked(data)
    if training is not None:
        return training.command
    if "distributed_type" in data or "compute_environment" in data:
        return "accelerate config"
    return "-"


def _first_comment(path: Path) -> str:
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
        if line.strip():
            break
    return ""


def list_recipes(root: Path | None = None) -> list[Recipe]:
    """Every `.yaml` file under the recipes root, sorted by name."""
    root = recipes_root() if root is None else root
    found = []
    for path in sorted(root.rglob("*.yaml")):
        data = read_recipe(path)
        name = path.relative_to(root).with_suffix("").as_posix()
        description = data.get("description")
        description = str(description) if description is not None else _first_comment(path)
        found.append(Recipe(name, path, _command_of(data), description, data_needed(path, root)))
    return found


# The data an evaluation suite reads from the hub when the recipe names no folder for it.
SUITE_DATA = {"muse": "muse", "wmdp": "wmdp", "safety": "safety-evaluation", "xstest": "xstest"}


def data_needed(path: Path, root: Path, seen: set[Path] | None = None) -> tuple[str, ...]:
    """The data sets the recipe at `path` reads that do not ship under the recipes root, each once: the local
    files it names that are not there, the hub sets it trains on, the hub data of its evaluation suite; and its
    teaching recipe's. A set of `DATA_SETS` by its short name, any other hub set as `hub NAME`, any other file by
    its path."""
    seen = set() if seen is None else seen
    path = path.resolve()
    if path in seen:
        return ()
    seen.add(path)
    data = read_recipe(path)
    needed: list[str] = []
    for key, value in _local_paths(data):
        if key == "model" or value == "tofu-authors":  # a model is no data; the authors' retain set is forget's
            continue
        if value.startswith("hf:"):
            name = data_set_of(value)
            needed.append(DATA_SETS[name].short if name else "hub " + value[3:].split(":")[0].split("@")[0])
            continue
        file = (path.parent / _strip_rows(value)).resolve() if not os.path.isabs(value) else Path(value)
        if _inside(file, root.resolve()) and file.exists():
            if key == "teach":
                needed += data_needed(file, root, seen)
            continue
        name = data_set_of(_strip_rows(value))
        needed.append(DATA_SETS[name].short if name else _strip_rows(value))
    suites = str(data.get("eval_suite") or "").split(",")
    local = {"muse": data.get("eval_data_dir"), "safety": data.get("eval_safety_data_dir"),
             "xstest": data.get("eval_safety_data_dir")}
    needed += [DATA_SETS[SUITE_DATA[suite.strip()]].short for suite in suites
               if suite.strip() in SUITE_DATA and not local.get(suite.strip())]
    return tuple(dict.fromkeys(needed))


def find_recipe(name: str, root: Path | None = None) -> Recipe:
    """The recipe called `name` (`.yaml` and a leading `recipes/` are accepted), or one line with the closest."""
    recipes = list_recipes(root)
    wanted = name.strip().removeprefix("recipes/").removesuffix(".yaml").removesuffix(".yml")
    for recipe in recipes:
        if recipe.name == wanted:
            return recipe
    names = [r.name for r in recipes]
    close = difflib.get_close_matches(wanted, names, n=3, cutoff=0.4)
    close += [n for n in names if n.rsplit("/", 1)[-1] == wanted.rsplit("/", 1)[-1] and n not in close]
    hint = f"; did you mean {', '.join(close[:3])}?" if close else ""
    raise UserError(f"no recipe named '{name}'{hint} (`doplus recipes list` shows them all)")


@dataclass
class CopyResult:
    recipe: Path  # where the recipe was written
    command: str  # the command it is for (as `doplus recipes list` shows it)
    copied: list[Path] = field(default_factory=list)  # every file written, the recipe included
    missing: list[str] = field(default_factory=list)  # one line per file the recipe names that is not shipped


def _local_paths(data: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, value) for every string value that may be a local path (row ranges `[START:STOP]` kept)."""
    found = []
    for key in PATH_KEYS:
        value = data.get(key)
        if isinstance(value, str):
            found.append((key, value))
    tasks = data.get("tasks")
    if isinstance(tasks, list):
        for number, task in enumerate(tasks, start=1):
            if not isinstance(task, dict):
                continue
            for key in TASK_PATH_KEYS:
                value = task.get(key)
                if isinstance(value, str):
                    found.append((f"tasks[{number}].{key}", value))
    return found


def _strip_rows(value: str) -> str:
    base, bracket, _ = value.partition("[")
    return base if bracket and value.endswith("]") else value


def _not_a_file(key: str, value: str) -> bool:
    """Values that name no local file: hub sets, the authors' retain set, a model given by hub id."""
    if value.startswith("hf:") or value == "tofu-authors" or os.path.isabs(value):
        return True
    if key == "model":
        return not value.startswith((".", "/"))
    return False


def _inside(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
    except ValueError:
        return False
    return True


def _new_value(value: str, relative: str) -> str:
    _, bracket, rows = value.partition("[")
    return relative + (bracket + rows if bracket and value.endswith("]") else "")


def dest_is_folder(dest: str | os.PathLike) -> bool:
    """Whether DEST names a folder to copy into: an existing folder, a path ending in `/`, or a path that does not
    exist and has no `.yaml`/`.yml` suffix (`my-run/` and `my-run` both mean a folder; `my-run/mine.yaml` a file)."""
    text = os.fspath(dest)
    path = Path(text)
    if path.is_dir() or text.endswith(("/", os.sep)):
        return True
    return not path.exists() and path.suffix not in (".yaml", ".yml")


def copy_recipe(name: str, dest: str | os.PathLike, overwrite: bool = False, root: Path | None = None) -> CopyResult:
    """Copy recipe `name` to `dest` (a folder, created if missing, or a `.yaml` file path), with the data files
    and the teaching recipe it names that ship inside the recipes root, placed so that its relative paths resolve
    from `dest`. Files it names that do not ship (TOFU, the safety sets, TRACE) are listed in `missing`, each with
    where to put it and the flag that overrides it, not copied."""
    root = (recipes_root() if root is None else root).resolve()
    recipe = find_recipe(name, root)
    target = Path(dest) / recipe.path.name if dest_is_folder(dest) else Path(dest)
    if target.exists() and not overwrite:
        raise UserError(f"{target}: exists; pass --overwrite to replace it")
    if target.parent.exists() and not target.parent.is_dir():
        raise UserError(f"{target.parent}: exists and is not a folder")
    result = CopyResult(recipe=target, command=recipe.command)
    _copy(recipe.path.resolve(), target, root, overwrite, result, seen=set())
    return result


def _copy(source: Path, target: Path, root: Path, overwrite: bool, result: CopyResult, seen: set[Path]) -> None:
    if source in seen:
        return
    seen.add(source)
    data = read_recipe(source)
    text = source.read_text()
    label = source.relative_to(root).as_posix()
    missing: dict[str, list[str]] = {}  # path as written -> the keys that name it
    for key, value in _local_paths(data):
        if _not_a_file(key, value):
            continue
        file = (source.parent / _strip_rows(value)).resolve()
        if not _inside(file, root) or not file.exists():
            missing.setdefault(_strip_rows(value), []).append(key)
            continue
        relative = file.relative_to(root).as_posix()
        direct = (target.parent / _strip_rows(value)).resolve()
        if _inside(direct, target.parent.resolve()):
            placed = target.parent / _strip_rows(value)  # the path as written already resolves inside DEST's folder
        else:
            placed = target.parent / relative  # `../data/x.jsonl`: place it as data/x.jsonl and say so in the copy
            text = _replace_value(text, value, _new_value(value, relative))
        if file.suffix in (".yaml", ".yml") and key == "teach":
            _copy(file, placed, root, overwrite, result, seen)
        elif file.is_file():
            _write_file(file, placed, overwrite, result)
        elif file.is_dir():  # a data folder (eval_data_dir: mini-MUSE's layout), with everything in it
            for inner in sorted(path for path in file.rglob("*") if path.is_file()):
                _write_file(inner, placed / inner.relative_to(file), overwrite, result)
    for path, keys in missing.items():
        result.missing.append(_missing_line(path, keys, label, target, main=target == result.recipe))
    if target != result.recipe and target.exists() and not overwrite:
        if target.read_text() == text:
            return
        raise UserError(f"{target}: exists and differs from the shipped {label}; pass --overwrite to replace it")
    with writing(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    result.copied.append(target)


def _missing_line(path: str, keys: list[str], label: str, target: Path, main: bool) -> str:
    """One line for a file the recipe names that doplus does not ship: where to put it so the copy's relative path
    finds it, and the command-line flags that point the copied recipe elsewhere instead (only the copied recipe's
    own top-level keys have flags; a teaching recipe's task paths are edited in the file)."""
    where = (f"put it at {target.parent / path}" if not os.path.isabs(path)
             else f"set {' and '.join(keys)} in {target} to its path")
    flags = [f"--{key.replace('_', '-')} PATH" for key in keys if main and key in PATH_KEYS and key != "teach"]
    if flags:
        where += f", or pass {' and '.join(flags)}"
    elif not os.path.isabs(path):
        where += f", or set {' and '.join(keys)} in {target} to its path"
    return f"{path} ({label}: {', '.join(keys)}): not shipped with doplus; {where}"


def _write_file(file: Path, placed: Path, overwrite: bool, result: CopyResult) -> None:
    if placed.exists() and not overwrite:
        if placed.read_bytes() == file.read_bytes():
            return
        raise UserError(f"{placed}: exists and differs from the shipped {file.name}; pass --overwrite to replace it")
    with writing(placed):
        placed.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, placed)
    result.copied.append(placed)


def _replace_value(text: str, old: str, new: str) -> str:
    """The recipe's text with one path value changed, comments and layout kept (quoted or plain)."""
    for quote in ('"', "'", ""):
        for lead in (": ", ":"):
            written = f"{lead}{quote}{old}{quote}"
            if written in text:
                return text.replace(written, f"{lead}{quote}{new}{quote}")
    return text.replace(old, new)
