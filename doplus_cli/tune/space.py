"""The search space of `doplus tune`: which recipe options a trial sets and the range each is drawn from.

`--space` is given once or more, each either one option (`KEY=SPEC`) or a YAML file of them (`KEY: SPEC` lines):

    lr=log:1e-6:1e-3          a float drawn log-uniformly between the bounds (both > 0)
    beta=0.05:0.5       a float drawn uniformly between the bounds (`float:0.5:2` says the same)
    retain_freq=int:1:5       a whole number between the bounds, both included (`int:1:9:2` steps by 2)
    loss=IDK+GD|NPO+GD        one of the values, each read as the recipe would read it

In a YAML file a spec is the same text, or a mapping: `{low: 1e-6, high: 1e-3, log: true}`, `{low: 1, high: 5,
type: int}`, `{choices: [IDK+GD, NPO+GD]}`. Each bound and choice is checked as the recipe's own value would be
(its type, its range), so a space that would make a run fail says so before the first trial.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from doplus_cli.config import TrainConfig, coerce_option, field_names, read_recipe
from doplus_cli.errors import UserError, shown

# What a trial may not set: the tune sets the run's folder itself, and a trial never resumes another's.
TUNE_KEYS = ("out", "overwrite", "resume")
KINDS = ("float", "log", "int")


@dataclass(frozen=True)
class Param:
    """One option of the space: `kind` float (uniform), log (log-uniform), int or choice."""

    key: str
    kind: str
    low: float | int | None = None
    high: float | int | None = None
    step: int | None = None
    choices: tuple[Any, ...] = ()

    def describe(self) -> str:
        if self.kind == "choice":
            return f"{self.key} in {{{', '.join(str(c) for c in self.choices)}}}"
        step = f" step {self.step}" if self.step and self.step != 1 else ""
        how = {"log": "log-uniform", "float": "uniform", "int": "whole number"}[self.kind]
        return f"{self.key}: {how} in [{self.low:g}, {self.high:g}]{step}"

    def suggest(self, trial: Any) -> Any:
        """The value of this option in an Optuna trial."""
        if self.kind == "choice":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high), step=self.step or 1)
        return trial.suggest_float(self.key, float(self.low), float(self.high), log=self.kind == "log")

    def plain(self) -> dict[str, Any]:
        """As tune.json records it (a later command into the same folder must give the same space)."""
        if self.kind == "choice":
            return {"choices": list(self.choices)}
        return {"type": self.kind, "low": self.low, "high": self.high, **({"step": self.step} if self.step else {})}


def parse_space(items: list[str], config_class: type[TrainConfig], fixed: set[str] | None = None) -> list[Param]:
    """Every `--space` item (KEY=SPEC, or a YAML file of them) as parameters, in the order given; one line for an
    unknown option, a malformed range, a value the option does not take, or an option given twice."""
    if not items:
        raise UserError("--space is empty: give at least one option to search, e.g. --space lr=log:1e-6:1e-3")
    entries: list[tuple[str, Any, str]] = []  # (key, spec, where it was given)
    for item in items:
        key, sep, spec = item.partition("=")
        if sep and key.strip() and "\n" not in key:
            entries.append((key.strip(), spec.strip(), f"--space {shown(item, limit=80, quoted=False)}"))
            continue
        path = Path(item).expanduser()
        if path.suffix.lower() not in (".yaml", ".yml") and not path.is_file():
            raise UserError(f"--space {shown(item)}: write KEY=SPEC (lr=log:1e-6:1e-3, retain_freq=int:1:5, "
                            "loss=IDK+GD|NPO+GD) or give a YAML file of KEY: SPEC lines")
        mapping = read_recipe(path)  # a recipe's reader: bounded, one line for a broken file
        if not mapping:
            raise UserError(f"{path}: the space file names no option")
        entries += [(str(key), spec, f"{path}: option '{key}'") for key, spec in mapping.items()]
    names = field_names(config_class)
    params: list[Param] = []
    for key, spec, where in entries:
        name = key.replace("-", "_")
        if name not in names:
            hint = difflib.get_close_matches(name, names, n=1)
            raise UserError(f"{where}: unknown option '{key}'" + (f" (did you mean '{hint[0]}'?)" if hint else ""))
        if name in TUNE_KEYS:
            raise UserError(f"{where}: doplus tune sets {name} itself (each trial is a run of its own in DIR/trials/)")
        if fixed and name in fixed:
            raise UserError(f"{where}: {name} is also given by --set; give it once")
        if any(p.key == name for p in params):
            raise UserError(f"{where}: {name} is in the space twice")
        params.append(_param(name, spec, where, config_class))
    return params


def _param(key: str, spec: Any, where: str, config_class: type[TrainConfig]) -> Param:
    if isinstance(spec, dict):
        return _from_mapping(key, spec, where, config_class)
    if isinstance(spec, (list, tuple)):
        return _choices(key, list(spec), where, config_class)
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(f"{where}: no range: write log:LOW:HIGH, LOW:HIGH, int:LOW:HIGH or A|B|C")
    text = spec.strip()
    if "|" in text:
        return _choices(key, [part.strip() for part in text.split("|")], where, config_class)
    parts = [part.strip() for part in text.split(":")]
    kind = parts.pop(0) if parts[0] in KINDS else "float"
    if len(parts) not in (2, 3) or (len(parts) == 3 and kind != "int"):
        raise UserError(f"{where}: {shown(spec)} is not a range: write log:LOW:HIGH, LOW:HIGH, int:LOW:HIGH[:STEP] "
                        "or A|B|C")
    return _range(key, kind, *parts, where=where, config_class=config_class)


def _from_mapping(key: str, spec: dict[str, Any], where: str, config_class: type[TrainConfig]) -> Param:
    known = {"low", "high", "log", "type", "step", "choices"}
    unknown = sorted(str(k) for k in spec if k not in known)
    if unknown:
        raise UserError(f"{where}: unknown key '{unknown[0]}' in the range: low, high, log, type (float or int), step, "
                        "or choices")
    if "choices" in spec:
        if set(spec) != {"choices"} or not isinstance(spec["choices"], list):
            raise UserError(f"{where}: choices is a list, given alone")
        return _choices(key, spec["choices"], where, config_class)
    if "low" not in spec or "high" not in spec:
        raise UserError(f"{where}: a range needs low and high")
    kind = str(spec.get("type", "float"))
    if kind not in ("float", "int"):
        raise UserError(f"{where}: type {shown(kind)}: float or int")
    if spec.get("log") is True:
        if kind == "int":
            raise UserError(f"{where}: a log range is of floats")
        kind = "log"
    elif spec.get("log") not in (None, False):
        raise UserError(f"{where}: log is true or false")
    step = spec.get("step")
    if step is not None and kind != "int":
        raise UserError(f"{where}: step goes with type: int")
    return _range(key, kind, str(spec["low"]), str(spec["high"]), *([str(step)] if step is not None else []),
                  where=where, config_class=config_class)


def _number(text: str, whole: bool, where: str) -> float | int:
    try:
        value = int(text) if whole else float(text)
    except ValueError:
        raise UserError(f"{where}: {shown(text)} is not a {'whole number' if whole else 'number'}") from None
    if not math.isfinite(value):
        raise UserError(f"{where}: bounds are finite numbers (got {shown(text)})")
    return value


def _range(key: str, kind: str, low_text: str, high_text: str, step_text: str | None = None, *, where: str,
           config_class: type[TrainConfig]) -> Param:
    whole = kind == "int"
    low, high = _number(low_text, whole, where), _number(high_text, whole, where)
    if not low < high:
        raise UserError(f"{where}: the low bound ({low:g}) must be below the high bound ({high:g})")
    if kind == "log" and low <= 0:
        raise UserError(f"{where}: a log range needs bounds above 0 (got {low:g})")
    step = None
    if step_text is not None:
        step = _number(step_text, True, where)
        if step < 1 or (high - low) % step:
            raise UserError(f"{where}: step {step} must be >= 1 and divide high - low ({high - low})")
    for bound in (low, high):  # the option takes each bound, so it takes everything between
        coerce_option(key, bound, where, config_class)
    return Param(key, kind, low, high, step)


def _choices(key: str, values: list[Any], where: str, config_class: type[TrainConfig]) -> Param:
    if len(values) < 2 or any(value in (None, "") for value in values):
        raise UserError(f"{where}: give two or more choices, none empty")
    chosen = tuple(coerce_option(key, value, where, config_class) for value in values)
    if not all(isinstance(value, (str, int, float, bool)) for value in chosen):
        raise UserError(f"{where}: {key} takes a list or a mapping; a space chooses among single values only")
    if len(set(chosen)) < len(chosen):
        raise UserError(f"{where}: a choice is given twice")
    return Param(key, "choice", choices=chosen)
