"""`doplus bench schemes`: the update schemes on one recipe over seeds, as paper-ready tables and figures.

    doplus bench schemes --recipe R.yaml --schemes joint,alternate,dualoptim,doplus --seeds 0,1,2 --out OUT

Every scheme x seed (x sweep value) is an ordinary run of the CLI, `doplus unlearn`, `doplus multitask` or
`doplus align` by the recipe's kind, started as a subprocess from a recipe of its own and evaluated with the
recipe's suite:

    OUT/bench.json                the experiment (kind, recipe values, --set, --sweep key) and the runs it holds
    OUT/recipes/NAME.yaml         the run's recipe: the given one (paths absolute), scheme, seed, --set, sweep
    OUT/runs/NAME/                the run itself (config.yaml, metrics.jsonl, report.json, final/, and its
                                  checkpoints/ until it is evaluated; --keep-checkpoints keeps them)
    OUT/runs/NAME.log             its output (and its evaluation's), appended at every start
    OUT/runs/NAME/eval/           `doplus evaluate` of final/ (unlearn, unless the run evaluated at its last step;
                                  align with eval_suite, written by the run itself)
    OUT/SCHEMES.json, SCHEMES.md  per scheme (and sweep value): mean and sample standard deviation over seeds
    OUT/tradeoff.png, curves.png, update_similarity.png

NAME is SCHEME-sSEED, or SCHEME-KEY=VALUE-sSEED with --sweep. The same command run again continues: a run
that finished and was evaluated is skipped, one with a checkpoint resumes, anything else starts afresh.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from doplus_cli.bench.tradeoff import ordered, summarise_tradeoff
from doplus_cli.bench.tradeoff import render as render_tradeoff
from doplus_cli.config import (
    EXCLUSIVE_OPTIONS,
    PATH_KEYS,
    SCHEME_KEYS,
    SCHEMES,
    AlignConfig,
    MultitaskConfig,
    TrainConfig,
    UnlearnConfig,
    _coerce,
    default_of,
    eval_batch_size,
    field_names,
    load_recipe,
    parse_task_ids,
    read_recipe,
)
from doplus_cli.engine.checkpoint import list_checkpoints
from doplus_cli.engine.outputs import atomic_write_text
from doplus_cli.errors import RunError, UserError, writing

# ---- schemes ------------------------------------------------------------------------------------------------


BENCH_KEYS = ("seed", "out", "overwrite", "resume")  # the bench sets these for every run
DEFAULT_SCHEMES = "joint,alternate,dualoptim,doplus"
DEFAULT_SEEDS = "0,1,2"
# tofu: the suite the eval_* keys describe. answers: the run's own before/after answers to `show_samples` questions
# of each set (ROUGE-L recall of the answer after against the one before), for recipes without reference answers
# (the real-world setting, where the targets are the model's own answers).
EVALUATED_SUITES = ("tofu", "answers")


def scheme_values(name: str) -> dict[str, Any]:
    """The recipe values of scheme `name`: every SCHEME_KEYS entry, the ones it does not name at their default."""
    return {**{key: default_of(key, TrainConfig) for key in SCHEME_KEYS}, **SCHEMES[name].values}


# ---- what is measured ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    higher_is_better: bool | None  # None: no best is marked (a description, not a goal)
    spec: str = ".2f"  # format of the mean and the standard deviation

    @property
    def header(self) -> str:
        arrow = {True: " ↑", False: " ↓", None: ""}[self.higher_is_better]
        return self.label + arrow


# The paper's aggregates (percent, higher is better; TOFU_SUMMARY.json) and OpenUnlearning's (fractions).
UNLEARN_METRICS = (
    Metric("UFE", "UFE", True), Metric("TFE", "TFE", True), Metric("MU", "MU", True), Metric("OVR", "OVR", True),
    Metric("model_utility", "model_utility", True, ".3f"), Metric("forget_quality", "forget_quality", True, ".3g"),
    # whether forgetting ran its course, and the taught retain answers were kept (ROUGE-L recall of greedy answers)
    Metric("forget_Q_A_ROUGE", "forget ROUGE-L", False, ".3f"),
    Metric("retain_Q_A_ROUGE", "retain ROUGE-L", True, ".3f"),
)
ANSWER_METRICS = (Metric("forget_rouge", "forget ROUGE-L", False, ".3f"),
                  Metric("retain_rouge", "retain ROUGE-L", True, ".3f"))
UPDATE_COSINE = Metric("update_cosine", "update cos (mean over the 2nd half of steps)", None, ".3f")
# Paper, Table 8: time and memory (the optimizer-state column's unit is chosen per table, see _state_metric).
RESOURCE_METRICS = (
    Metric("train_time_s", "train time (s)", False, ".1f"), Metric("peak_memory_gb", "peak memory (GB)", False),
)
AVERAGE = "average"  # multitask: the mean of the tasks' scores (engine/multitask.py)


# ---- the kinds of recipe -------------------------------------------------------------------------------------


class Kind:
    """What the bench needs to know about one kind of recipe: the command that runs it, the key that marks a
    recipe as this kind, its config, whether it has an evaluation suite, how a run is evaluated and scored."""

    command = ""
    marker = ""  # a recipe (or --set) key that only this kind has
    config: type[TrainConfig] = TrainConfig
    metrics: tuple[Metric, ...] = ()

    def check_evaluation(self, given: set[str], config: TrainConfig, recipe: Path) -> None:
        raise NotImplementedError

    def metric_list(self, config: TrainConfig) -> tuple[Metric, ...]:
        return self.metrics

    def describe(self, config: TrainConfig, swept: str | None) -> str:
        """What the recipe trains, in a few words for the caption (leaving out what `swept` changes)."""
        return ""

    def evaluation(self, folder: Path, report: dict[str, Any]) -> Path | None:
        """The folder of the evaluation of the finished run in `folder`, or None when it has none yet."""
        return folder

    def evaluate_command(self, run: Run, model: str | None = None, out: Path | None = None) -> list[str]:
        raise NotImplementedError

    def has_start(self, config: TrainConfig) -> bool:
        """Whether the bench evaluates the starting model too (the first point of every run's curve)."""
        return False

    def scores(self, report: dict[str, Any], evaluation: Path) -> tuple[dict[str, Any], dict[str, str]]:
        """({metric key: value}, {metric key: what it covers, when partial}) of a run and its evaluation."""
        raise NotImplementedError

    def curve_names(self, config: TrainConfig) -> tuple[str, ...]:
        return tuple(m.key for m in self.metric_list(config))

    def planned_steps(self, config: TrainConfig) -> int:
        """The run's optimizer steps, as far as the bench can tell before it runs (for `save_every`)."""
        return config.steps


class UnlearnKind(Kind):
    command, marker, config, metrics = "unlearn", "forget", UnlearnConfig, UNLEARN_METRICS

    def check_evaluation(self, given: set[str], config: UnlearnConfig, recipe: Path) -> None:
        if "eval_suite" not in given:
            raise UserError(f"{recipe}: no evaluation suite: the bench compares runs by it; set eval_suite: tofu in "
                            "the recipe (with eval_data_dir, eval_split, eval_max_samples, ...) or pass --set "
                            "eval_suite=tofu")
        if config.eval_suite not in EVALUATED_SUITES:
            raise UserError(f"{recipe}: eval_suite '{config.eval_suite}': the bench evaluates with "
                            f"{', '.join(EVALUATED_SUITES)} (the suite the eval_* keys describe, or the run's own "
                            "before/after answers)")
        if config.eval_suite == "answers" and config.show_samples == 0:
            raise UserError(f"{recipe}: eval_suite answers scores the run's before/after answers to show_samples "
                            "questions of each set; show_samples is 0")

    def metric_list(self, config: UnlearnConfig) -> tuple[Metric, ...]:
        return ANSWER_METRICS if config.eval_suite == "answers" else self.metrics

    def describe(self, config: UnlearnConfig, swept: str | None) -> str:
        parts = [] if swept == "loss" else [config.loss]
        if swept not in ("forget_freq", "retain_freq"):
            parts.append(f"F_f:F_r = {config.forget_freq}:{config.retain_freq}")
        return ", ".join(parts)

    def evaluation(self, folder: Path, report: dict[str, Any]) -> Path | None:
        """The run's own evaluation at its last step (`eval_every`), else OUT/runs/NAME/eval/; for the answers
        suite the run itself."""
        if report["config"].get("eval_suite") == "answers":
            return folder if report.get("sample_rouge_mean") else None
        evals = report.get("evals") or []
        if evals and evals[-1].get("step") == report["steps"]:
            own = folder / "evals" / f"step-{report['steps']}"
            if (own / "eval.json").is_file():
                return own
        after = folder / "eval"
        return after if (after / "eval.json").is_file() else None

    def evaluate_command(self, run: Run, model: str | None = None, out: Path | None = None) -> list[str]:
        """`doplus evaluate` of final/ (or of `model` into `out`: the starting model) with the recipe's eval_*
        values and what the run's own evaluation during training would use (batch size, seed, dtype); the prompt
        template and OVR formula come from the run."""
        c: UnlearnConfig = run.config
        options = [("--suite", c.eval_suite), ("--split", c.eval_split), ("--data-dir", c.eval_data_dir),
                   ("--max-samples", c.eval_max_samples), ("--max-new-tokens", c.eval_max_new_tokens),
                   ("--protocol", c.eval_protocol), ("--nli-model", c.eval_nli_model),
                   ("--embedding-model", c.eval_embedding_model), ("--batch-size", eval_batch_size(c)),
                   ("--seed", c.seed), ("--dtype", c.dtype), ("--task-id", c.task_id)]
        return _evaluate_command(run, options, c.trust_remote_code, model, out)

    def has_start(self, config: TrainConfig) -> bool:
        return config.eval_suite == "tofu" and bool(config.eval_every)

    def scores(self, report: dict[str, Any], evaluation: Path) -> tuple[dict[str, Any], dict[str, str]]:
        if report["config"].get("eval_suite") == "answers":
            means = report["sample_rouge_mean"]
            return {"forget_rouge": means.get("forget"), "retain_rouge": means.get("retain")}, {}
        summary = _read_json(evaluation / "SUMMARY.json")
        record = _read_json(evaluation / "eval.json")
        values = {m.key: summary.get(m.key) for m in self.metrics}
        notes = {a["name"]: a["note"] for section in record.get("sections", []) if section.get("suite") == "tofu"
                 for a in section.get("aggregates", []) if a.get("note")}
        return values, notes

    def curve_names(self, config: TrainConfig) -> tuple[str, ...]:
        return () if config.eval_suite == "answers" else ("MU", "UFE", "TFE", "OVR")


class MultitaskKind(Kind):
    command, marker, config = "multitask", "tasks", MultitaskConfig

    def check_evaluation(self, given: set[str], config: MultitaskConfig, recipe: Path) -> None:
        if config.eval_rows == 0 and not any(task["eval"] for task in config.tasks):
            raise UserError(f"{recipe}: no evaluation suite: eval_rows is 0 and no task has an eval file, so no "
                            "task is scored; set eval_rows > 0 or give the tasks eval files")

    def metric_list(self, config: MultitaskConfig) -> tuple[Metric, ...]:
        return (*(Metric(task["name"], task["name"], True) for task in config.tasks), Metric(AVERAGE, AVERAGE, True))

    def describe(self, config: MultitaskConfig, swept: str | None) -> str:
        return "tasks " + ", ".join(f"{t['name']} ({t['metric']})" for t in config.tasks)

    def scores(self, report: dict[str, Any], evaluation: Path) -> tuple[dict[str, Any], dict[str, str]]:
        """The held-out scores after training (report.json, like the paper's Table 4)."""
        return dict(report["scores"]["after"]), {}


class AlignKind(Kind):
    """`doplus align`: scored by the run's own report (the held-out refusal rates, the final losses) and, with
    `eval_suite`, by `doplus evaluate`'s safety suites on final/ (run by align itself into OUT/runs/NAME/eval/)."""

    command, marker, config = "align", "safety", AlignConfig

    def check_evaluation(self, given: set[str], config: AlignConfig, recipe: Path) -> None:
        if config.held_out == 0 and config.eval_suite is None:
            raise UserError(f"{recipe}: no evaluation: held_out is 0 and there is no eval_suite, so only the training "
                            "losses would be compared; set held_out > 0 or eval_suite: safety (or xstest)")

    def metric_list(self, config: AlignConfig) -> tuple[Metric, ...]:
        suites = config.eval_suite.split(",") if config.eval_suite else []
        return (*(ALIGN_EVAL_METRICS if "safety" in suites else ()),
                *(XSTEST_METRICS if "xstest" in suites else ()),
                *(ALIGN_HELD_OUT_METRICS if config.held_out else ()), *ALIGN_LOSS_METRICS)

    def describe(self, config: AlignConfig, swept: str | None) -> str:
        length = f"{config.epochs:g} epoch(s)" if config.epochs is not None else f"{config.steps} steps"
        return ("" if swept == "freq" else f"F_s:F_g = {config.freq}, ") + length

    def evaluation(self, folder: Path, report: dict[str, Any]) -> Path | None:
        if not report["config"].get("eval_suite"):
            return folder
        return folder / "eval" if (folder / "eval" / "eval.json").is_file() else None

    def evaluate_command(self, run: Run, model: str | None = None, out: Path | None = None) -> list[str]:
        """What align's own evaluation runs (`engine/align.py`, evaluate_final), for a run stopped before it."""
        c: AlignConfig = run.config
        options = [("--suite", c.eval_suite), ("--max-samples", c.eval_max_samples),
                   ("--max-new-tokens", c.eval_max_new_tokens), ("--batch-size", c.eval_batch_size),
                   ("--guard-model", c.eval_guard_model), ("--refusal-model", c.eval_refusal_model),
                   ("--safety-data-dir", c.eval_safety_data_dir),
                   ("--seed", c.seed), ("--dtype", c.dtype)]
        return _evaluate_command(run, options, c.trust_remote_code)

    def scores(self, report: dict[str, Any], evaluation: Path) -> tuple[dict[str, Any], dict[str, str]]:
        rates = (report.get("held_out") or {}).get("refusal_rate", {})
        values = {f"held_out_{name}_refusal": 100 * rate["after"] for name, rate in rates.items()}
        for objective_terms in report["losses"].values():
            for term in ("safety_loss", "general_loss"):
                if term in objective_terms:
                    values[term] = objective_terms[term]["end_mean10"]
        notes = {}
        summary_path = evaluation / "SUMMARY.json"
        if evaluation.name == "eval" and summary_path.is_file():
            summary = _read_json(summary_path)
            for metric in (*ALIGN_EVAL_METRICS, *XSTEST_METRICS):
                value = summary.get(metric.key)
                values[metric.key] = None if value is None else 100 * value
            judge = summary.get("safety_judge") or ""
            if judge.startswith("offline refusal judge"):
                notes["safety_rate_avg"] = "refusal rate standing in for the safety rate: no guard model"
        return values, notes

    def curve_names(self, config: TrainConfig) -> tuple[str, ...]:
        return ()

    def planned_steps(self, config: AlignConfig) -> int:
        """--epochs: the steps on one process (`epoch_steps`; more processes take fewer)."""
        if config.epochs is None or not (config.safety and config.general):  # validation says what is missing
            return config.steps
        from doplus_cli.engine.align import AlignPlan

        plan = AlignPlan(config)
        plan.open()
        return plan.total_steps(config.batch_size * config.grad_accum)


# doplus align: the safety suites' rates (percent) and what the run measures itself.
ALIGN_EVAL_METRICS = (Metric("safety_rate_avg", "safety AVG (%)", True),)
XSTEST_METRICS = (Metric("xstest_over_refusal", "XSTest over-refusal (%)", False),
                  Metric("xstest_unsafe_refusal", "XSTest unsafe refusal (%)", True))
ALIGN_HELD_OUT_METRICS = (Metric("held_out_safety_refusal", "held-out harmful refused (%)", True, ".1f"),
                          Metric("held_out_general_refusal", "held-out benign refused (%)", False, ".1f"))
ALIGN_LOSS_METRICS = (Metric("safety_loss", "safety loss", False, ".3f"),
                      Metric("general_loss", "general loss", False, ".3f"))

# A recipe is of the first kind whose marker it sets.
KINDS: dict[str, Kind] = {"multitask": MultitaskKind(), "unlearn": UnlearnKind(), "align": AlignKind()}


def kind_of(recipe: Path, keys: set[str]) -> Kind:
    for kind in KINDS.values():
        if kind.marker in keys:
            return kind
    markers = ", ".join(f"{k.marker} ({name})" for name, k in KINDS.items())
    raise UserError(f"{recipe}: not a recipe bench schemes can run: it sets none of {markers}")


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
    kind: Kind
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

    def experiment(self) -> dict[str, Any]:
        """What every run of OUT shares; a later command into the same OUT must give the same."""
        return json.loads(json.dumps({
            "kind": self.kind.command, "recipe": _plain(self.base), "set": _plain(self.set_values),
            "sweep_key": self.sweep_key, "log_update_similarity": self.log_update_similarity}, default=str))


def plan_bench(recipe: str, schemes: str, seeds: str, out: str, set_options: list[str], sweep: str | None,
               log_update_similarity: bool, task_ids: str | None = None) -> Bench:
    """Every check on the command and the recipe, and the runs it asks for; nothing is written."""
    scheme_names = parse_schemes(schemes)
    seed_list = parse_seeds(seeds)
    task_list: list[int | None] = [None] if task_ids is None else list(parse_task_ids(task_ids, "--task-ids"))
    path = Path(recipe).expanduser().resolve()
    raw = read_recipe(path)
    set_pairs = [_split_pair(text, "--set") for text in set_options]
    sweep_pair = _split_pair(sweep, "--sweep") if sweep is not None else None
    given = {str(k).replace("-", "_") for k in raw} | {k.replace("-", "_") for k, _ in set_pairs}
    kind = kind_of(path, given | ({sweep_pair[0].replace("-", "_")} if sweep_pair else set()))
    names = field_names(kind.config)
    base = _absolute_paths(load_recipe(path, kind.config))
    for key in ("out", "overwrite", "resume"):
        base.pop(key, None)
    set_values: dict[str, Any] = {}
    for key, text in set_pairs:
        key = _option_key(key, "--set", names)
        set_values[key] = _absolute_paths({key: _coerce(key, _null(text), f"--set {key}", kind.config)})[key]
    sweep_key, sweep_values = None, [None]
    if sweep_pair is not None:
        sweep_key = _option_key(sweep_pair[0], "--sweep", names)
        if sweep_key in set_values:
            raise UserError(f"--set {sweep_key} and --sweep {sweep_key}: give it once")
        items = [item.strip() for item in sweep_pair[1].split(",")]
        if not all(items):
            raise UserError(f"--sweep {sweep_pair[0]}={sweep_pair[1]}: write KEY=V1,V2,... with no empty value")
        sweep_values = [_absolute_paths({sweep_key: _coerce(sweep_key, _null(v), f"--sweep {sweep_key}",
                                                            kind.config)})[sweep_key] for v in items]
        if len({json.dumps(_plain(v)) for v in sweep_values}) < len(sweep_values):
            raise UserError(f"--sweep {sweep_key}: a value is given twice ({sweep_pair[1]})")
    if task_ids is not None:
        if kind.command != "unlearn":
            raise UserError(f"--task-ids picks the forget tasks of an unlearn recipe; {path.name} is a "
                            f"{kind.command} recipe")
        if "task_id" in set_values or sweep_key == "task_id":
            raise UserError("--task-ids and --set/--sweep task_id: give the tasks once, with --task-ids")
    bench = Bench(path, kind, base, set_values, sweep_key, sweep_values, scheme_names, seed_list,
                  Path(out).expanduser().resolve(), log_update_similarity, task_ids=task_list)
    # Forget task, then seed outermost: a bench stopped part-way has every scheme on the first tasks and seeds, and
    # the schemes' runs alternate in time, so a change in the machine's speed falls on every scheme alike.
    for task in task_list:
        for seed in seed_list:
            for scheme in scheme_names:
                for value in sweep_values:
                    bench.runs.append(_plan_run(bench, scheme, value, seed, task))
    for run in bench.runs:
        kind.check_evaluation(given | ({sweep_key} if sweep_key else set()), run.config, path)
    names_seen = [run.name for run in bench.runs]
    if len(set(names_seen)) < len(names_seen):
        raise UserError(f"--sweep {sweep_key}: two values give the same run folder name; choose distinct values")
    return bench


def parse_schemes(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise UserError(f"--schemes is empty: choose from {', '.join(SCHEMES)}")
    for name in names:
        if name not in SCHEMES:
            hint = difflib.get_close_matches(name, list(SCHEMES), n=1)
            raise UserError(f"unknown scheme '{name}' in --schemes" + (f" (did you mean '{hint[0]}'?)" if hint else "")
                            + f": choose from {', '.join(SCHEMES)}")
        if names.count(name) > 1:
            raise UserError(f"--schemes names '{name}' twice")
    return names


def parse_seeds(text: str) -> list[int]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise UserError("--seeds is empty: give one or more seeds, e.g. --seeds 0,1,2")
    if not all(item.isdigit() for item in items):
        bad = next(item for item in items if not item.isdigit())
        raise UserError(f"--seeds {text}: '{bad}' is not a whole number >= 0")
    seeds = [int(item) for item in items]
    if len(set(seeds)) < len(seeds):
        raise UserError(f"--seeds {text}: a seed is given twice")
    return seeds


def _split_pair(text: str, flag: str) -> tuple[str, str]:
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
                        f"choose them in --schemes ({', '.join(SCHEMES)})")
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
    values = {**copy.deepcopy(bench.base), **scheme_values(scheme), "seed": seed, **bench.set_values}
    sources = {key: str(bench.recipe) for key in bench.base}
    sources.update({key: f"--schemes {scheme}" for key in SCHEME_KEYS} | {"seed": "--seeds"})
    sources.update({key: f"--set {key}" for key in bench.set_values})
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
    steps = bench.kind.planned_steps(_config(bench.kind, values, sources))
    # So that every run can resume after a kill: checkpoints about every tenth of the run, the newest kept.
    values.setdefault("save_every", max(1, steps // 10))
    values.setdefault("keep_last", 1)
    if bench.log_update_similarity:
        values["log_update_similarity"] = True
    if str(values.get("report_to") or "none").lower() != "none":  # one tracker run per run, in one place
        group = scheme + (f"-{bench.sweep_key}={_name_part(sweep_value)}" if bench.sweep_key is not None else "")
        values.update({"tracker_project": f"doplus-bench-{bench.out.name}", "tracker_run_name": name,
                       "tracker_group": group, "tracker_dir": str(bench.out / "trackers")})
    config = _config(bench.kind, values, sources)
    copy.deepcopy(config).validate()
    return Run(name, scheme, seed, sweep_value, _plain(values), config, bench.out / "runs" / name, task)


def _config(kind: Kind, values: dict[str, Any], sources: dict[str, str]) -> TrainConfig:
    config = kind.config()
    for key, value in copy.deepcopy(values).items():
        setattr(config, key, _coerce(key, value, sources.get(key, "bench schemes"), kind.config))
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
    text = f"{value:g}" if isinstance(value, float) else str(_plain(value))
    return re.sub(r"[^A-Za-z0-9._+-]", "_", text)


def _absolute_paths(values: dict[str, Any]) -> dict[str, Any]:
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


def _plain(value: Any) -> Any:
    """YAML/JSON-safe: tuples as lists, all the way down."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# ---- OUT: what is there, and what it must agree with ----------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _read_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _differences(saved: Any, current: Any, prefix: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(current, dict):
        found = []
        for key in dict.fromkeys([*saved, *current]):
            found += _differences(saved.get(key), current.get(key), f"{prefix}{key} " if prefix else f"{key} ")
        return found
    if saved != current:
        return [f"{prefix.strip()} ({saved!r} -> {current!r})"]
    return []


def check_out(bench: Bench) -> dict[str, Any]:
    """OUT's bench.json, refusing an OUT that holds another experiment, or a run whose recipe differs."""
    index_path = bench.out / "bench.json"
    index: dict[str, Any] = {"experiment": bench.experiment(), "runs": {}}
    if index_path.is_file():
        index = _read_json(index_path)
        changed = _differences(index["experiment"], bench.experiment())
        if changed:
            raise UserError(f"{bench.out}: holds runs of another experiment ({'; '.join(changed[:3])}"
                            f"{'; ...' if len(changed) > 3 else ''}); use another --out")
    elif bench.out.exists() and not bench.out.is_dir():
        raise UserError(f"{bench.out}: --out is a file, not a folder")
    elif bench.out.is_dir() and any(bench.out.iterdir()):
        raise UserError(f"{bench.out}: not empty and not a bench schemes folder (no bench.json); use another --out")
    for run in bench.runs:
        if run.recipe_path.is_file():
            changed = _differences(_read_yaml(run.recipe_path), run.recipe)
            if changed:
                raise UserError(f"{run.recipe_path}: the run {run.name} was made from another recipe "
                                f"({'; '.join(changed[:3])}); use another --out")
        elif run.folder.exists():
            raise UserError(f"{run.folder}: a run folder without its recipe {run.recipe_path}; use another --out")
    return index


def _record_runs(bench: Bench, index: dict[str, Any]) -> None:
    """bench.json first (an OUT without it is refused later), then each run's recipe."""
    for run in bench.runs:
        index["runs"][run.name] = {"scheme": run.scheme, "seed": run.seed, "sweep_value": _plain(run.sweep_value),
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
    for section in _read_json(path).get("sections", []):
        for aggregate in section.get("aggregates", []):
            if aggregate["name"] in ("MU", "UFE", "TFE") and aggregate["value"] is not None:
                point[aggregate["name"]] = 100 * aggregate["value"]
    return point


def _completed_report(run_folder: Path) -> dict[str, Any] | None:
    path = run_folder / "report.json"
    if not path.is_file():
        return None
    report = _read_json(path)
    return report if report.get("status") == "completed" else None


# ---- running ------------------------------------------------------------------------------------------------


class Stopped(UserError):
    """SIGTERM or Ctrl-C: the current run checkpointed and stopped; the same command continues."""

    def __init__(self, number: int, what: str | None) -> None:
        during = f" during {what}" if what else ""
        super().__init__(f"stopped by {signal.Signals(number).name}{during}; run the same command again to continue "
                         "(finished runs and checkpoints are kept)")
        self.exit_code = 128 + number


class _Signals:
    """While the bench runs, SIGTERM and SIGINT go to the current run (which finishes its step, writes a
    checkpoint and exits); the bench then stops instead of starting the next run."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for number in (signal.SIGTERM, signal.SIGINT):
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def _handle(self, number: int, frame) -> None:
        self.received = number
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(number)


class Runner:
    """Runs each command as a subprocess with its output appended to the run's log, one at a time."""

    def __init__(self, bench: Bench, say: Callable[[str], None], num_processes: int | None, fsdp: bool,
                 keep_checkpoints: bool = False) -> None:
        self.bench, self.say, self.num_processes, self.fsdp = bench, say, num_processes, fsdp
        self.keep_checkpoints = keep_checkpoints
        self.signals = _Signals()

    def run_all(self) -> None:
        with self.signals:
            total = len(self.bench.runs)
            for number, run in enumerate(self.bench.runs, start=1):
                if self.signals.received:
                    raise Stopped(self.signals.received, None)
                self.run_one(run, f"[{number}/{total}] {run.name}")
            self.evaluate_starts()

    def evaluate_starts(self) -> None:
        """The model every run of a forget task starts from (the taught model), evaluated once per task into
        OUT/start/task-T/ (OUT/start/all/ without --task-ids) with the runs' evaluation settings: the first point of
        their curves. Its path is the one the task's first finished run reports."""
        if not self.bench.kind.has_start(self.bench.runs[0].config):
            return
        for task in self.bench.task_ids:
            folder = start_folder(self.bench, task)
            if (folder / "eval.json").is_file():
                continue
            first = next(((r, report) for r in self.bench.runs if r.task_id == task
                          and (report := _completed_report(r.folder)) is not None), None)
            if first is None:
                continue
            if self.signals.received:
                raise Stopped(self.signals.received, None)
            run, model = first[0], first[1]["model"]
            what = "the starting model" + ("" if task is None else f" of task {task}")
            self._say("start", f"evaluating {what}: {model}")
            log = folder.with_name(folder.name + ".log")
            command = self.bench.kind.evaluate_command(run, model, folder)
            seconds = self._call(command, log, f"the evaluation of {what}")
            if not (folder / "eval.json").is_file():
                raise RunError(f"the evaluation of {what} wrote no eval.json; see its log {log}")
            self._say("start", f"evaluated {what} in {_duration(seconds)}")

    def run_one(self, run: Run, label: str) -> None:
        """Skip, train (afresh, resumed or restarted) and/or evaluate one run, saying which in one line each."""
        kind = self.bench.kind
        report = _completed_report(run.folder)
        if report is not None and kind.evaluation(run.folder, report) is not None:
            self._say(label, "skipped: finished and evaluated")
            self._remove_checkpoints(run, label)
            return
        if report is None:
            report = self._train(run, label)
        if kind.evaluation(run.folder, report) is None:
            self._say(label, "evaluating")
            seconds = self._call(kind.evaluate_command(run), run.log, f"the evaluation of {run.name}")
            if kind.evaluation(run.folder, report) is None:
                raise RunError(f"the evaluation of {run.name} wrote no eval.json; see its log {run.log}")
            self._say(label, f"evaluated in {_duration(seconds)}")
        self._remove_checkpoints(run, label)

    def _remove_checkpoints(self, run: Run, label: str) -> None:
        """A finished and evaluated run's checkpoints go (only an unfinished run resumes from one), so the disk a
        bench needs stays about one run's checkpoints; `--keep-checkpoints` keeps them. The folder is renamed
        out of sight first: a kill mid-removal leaves nothing that looks like a checkpoint."""
        folder = run.folder / "checkpoints"
        if self.keep_checkpoints or not folder.is_dir():
            return
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        aside = run.folder / ".checkpoints.removing"
        shutil.rmtree(aside, ignore_errors=True)
        with writing(folder):
            os.replace(folder, aside)
            shutil.rmtree(aside)
        self._say(label, f"removed its checkpoints ({size / 1e9:.2f} GB; --keep-checkpoints keeps them)")

    def _train(self, run: Run, label: str) -> dict[str, Any]:
        command = [sys.executable, "-m", "doplus_cli", self.bench.kind.command, "--recipe", str(run.recipe_path),
                   "--out", str(run.folder)]
        checkpoints = list_checkpoints(run.folder / "checkpoints")
        if checkpoints:
            command.append("--resume")
            self._say(label, f"resumed from {checkpoints[-1].name} (log: {run.log})")
        elif run.folder.exists() and any(run.folder.iterdir()):
            command.append("--overwrite")
            self._say(label, f"started again: its folder held no checkpoint (log: {run.log})")
        else:
            self._say(label, f"started (log: {run.log})")
        if self.num_processes and self.num_processes > 1:
            command += ["--num-processes", str(self.num_processes)]
        if self.fsdp:
            command.append("--fsdp")
        seconds = self._call(command, run.log, f"run {run.name}")
        report = _completed_report(run.folder)
        if report is None:
            raise RunError(f"run {run.name} ended without a completed report.json; see its log {run.log}")
        self._say(label, f"finished in {_duration(seconds)}")
        return report

    def _say(self, label: str, text: str) -> None:
        self.say(f"{time.strftime('%H:%M:%S')} {label}: {text}")

    def _call(self, command: list[str], log_path: Path, what: str) -> float:
        """Run `command` (`what`, in words), its output appended to the log; the seconds it took. A failure stops
        the bench."""
        started = time.perf_counter()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a") as log:
            offset = log.tell()  # where this attempt's output starts
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {what}: {shlex.join(command)}\n")
            log.flush()
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
            self.signals.process = process
            try:
                code = process.wait()
            finally:
                self.signals.process = None
        if self.signals.received:
            raise Stopped(self.signals.received, what)
        if code != 0:
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            last = _last_error(log_path, offset)
            raise RunError(f"{what} failed ({how}){': ' + last if last else ''}; see its log {log_path} (finished "
                           "runs are kept: the same command goes on from here)")
        return time.perf_counter() - started


def _last_error(log: Path, offset: int) -> str:
    """The last `error: ...` line (the CLI's one-line errors) the log got from `offset` on, else its last line."""
    with open(log, "rb") as handle:
        handle.seek(offset)
        text = handle.read().decode(errors="replace")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    line = errors[-1] if errors else (lines[-1] if lines else "")
    return line[:300]


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{int(seconds // 60)} min {seconds % 60:02.0f} s"


# ---- results ------------------------------------------------------------------------------------------------


@dataclass
class Result:
    """One finished and evaluated run's numbers."""

    name: str
    scheme: str
    seed: int
    sweep_value: Any
    values: dict[str, Any]  # every column's value for this run (None: not available)
    notes: dict[str, str]  # aggregate -> what it covers, when partial
    evals: list[dict[str, Any]]  # the report's evaluations during training
    update_cosines: list[tuple[int, float]]  # (step, update_cosine) where recorded
    facts: dict[str, Any]  # model, steps, device, world size, evaluation folder
    task_id: int | None = None  # --task-ids: the run's forget task
    start: dict[str, Any] | None = None  # the starting model's evaluation as a step-0 curve point (unlearn, tofu)

    @property
    def curve(self) -> list[dict[str, Any]]:
        """The evaluations in step order, the starting model's first when it was evaluated."""
        return ordered(self.start, self.evals)


def collect(bench: Bench, index: dict[str, Any]) -> tuple[list[Result], list[str]]:
    """(results of every finished and evaluated run in OUT, names of its other runs)."""
    results, unfinished = [], []
    for name, entry in index["runs"].items():
        folder = bench.out / "runs" / name
        report = _completed_report(folder)
        evaluation = bench.kind.evaluation(folder, report) if report is not None else None
        if report is None or evaluation is None:
            unfinished.append(name)
            continue
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
        scores, notes = bench.kind.scores(report, evaluation)
        values = {**scores, **resources(report, records)}
        cosines = [(r["step"], r["update_cosine"]) for r in records if r.get("update_cosine") is not None]
        values[UPDATE_COSINE.key] = second_half_mean(cosines, report["steps"])
        env = report.get("environment", {})
        facts = {"model": report.get("model"), "steps": report["steps"], "device": env.get("device"),
                 "world_size": env.get("world_size", 1), "peak_memory_kind": report.get("peak_memory_kind"),
                 "evaluation": str(evaluation.relative_to(bench.out)), "wall_time_s": report.get("wall_time_s"),
                 "evaluated_during_training": evaluation.parent.name == "evals"}
        results.append(Result(name, entry["scheme"], entry["seed"], entry["sweep_value"], values, notes,
                              report.get("evals") or [], cosines, facts, entry.get("task_id"),
                              start_point(bench, entry.get("task_id"))))
    return results, unfinished


def resources(report: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """Paper, Table 8: training time (the sum of the optimizer steps' seconds, so a resumed run counts every step
    once and evaluation and loading are left out), peak memory over the steps, optimizer-state bytes."""
    seconds = [r["seconds"] for r in records if "seconds" in r]
    peaks = [r["peak_memory_gb"] for r in records if r.get("peak_memory_gb") is not None]
    return {"train_time_s": sum(seconds) if seconds else None,
            "peak_memory_gb": max(peaks) if peaks else report.get("peak_memory_gb"),
            "optimizer_state_bytes": report.get("optimizer_state_bytes")}


def second_half_mean(points: list[tuple[int, float]], steps: int) -> float | None:
    """Mean of the values recorded at steps after the first half of the run; None when there are none (joint
    steps, or runs without --log-update-similarity)."""
    tail = [value for step, value in points if step > steps / 2]
    return statistics.mean(tail) if tail else None


def mean_std(values: list[Any]) -> dict[str, Any]:
    """Mean and sample standard deviation (ddof = 1) of the available values; std None below two."""
    present = [v for v in values if v is not None]
    return {"mean": statistics.mean(present) if present else None,
            "std": statistics.stdev(present) if len(present) > 1 else None, "n": len(present)}


def _state_metric(results: list[Result]) -> tuple[Metric, float]:
    """The optimizer-state column and its unit in bytes: MB, or GB when some run holds a GB or more."""
    largest = max((r.values.get("optimizer_state_bytes") or 0 for r in results), default=0)
    unit = 1e9 if largest >= 1e9 else 1e6
    return Metric("optimizer_state_bytes", f"optimizer states ({'GB' if unit == 1e9 else 'MB'})", False), unit


def summarise(bench: Bench, results: list[Result], unfinished: list[str]) -> dict[str, Any]:
    """SCHEMES.json: per scheme and sweep value, every column's mean ± std over seeds, the best marked."""
    scores = [m for m in bench.kind.metric_list(bench.runs[0].config)
              if any(r.values.get(m.key) is not None for r in results)]
    state, unit = _state_metric(results)
    columns = [*scores, *RESOURCE_METRICS, state]
    roles = {**{m.key: "score" for m in scores}, **{m.key: "resource" for m in (*RESOURCE_METRICS, state)}}
    if bench.log_update_similarity or any(r.values.get(UPDATE_COSINE.key) is not None for r in results):
        columns.append(UPDATE_COSINE)
        roles[UPDATE_COSINE.key] = "similarity"
    sweep_order = [json.dumps(v) for v in _sweep_values_seen(bench, results)]
    groups: dict[tuple[str, str], list[Result]] = {}
    for result in sorted(results, key=lambda r: (list(SCHEMES).index(r.scheme),
                                                 sweep_order.index(json.dumps(r.sweep_value)),
                                                 -1 if r.task_id is None else r.task_id, r.seed)):
        groups.setdefault((result.scheme, json.dumps(result.sweep_value)), []).append(result)
    rows = []
    for (scheme, _), members in groups.items():
        row_metrics = {}
        for column in columns:
            scale = unit if column is state else 1.0
            per_run = [None if r.values.get(column.key) is None else r.values[column.key] / scale for r in members]
            row_metrics[column.key] = {**mean_std(per_run), "values": per_run}
        rows.append({"scheme": scheme, "label": SCHEMES[scheme].label, "sweep_value": members[0].sweep_value,
                     "seeds": [r.seed for r in members], "runs": [r.name for r in members], "metrics": row_metrics,
                     "tasks": [r.task_id for r in members] if any(r.task_id is not None for r in members) else None})
    _mark_best(rows, columns)
    sweep = {"key": bench.sweep_key, "values": _sweep_values_seen(bench, results)} if bench.sweep_key else None
    tradeoff = None
    if bench.kind.command == "unlearn":
        by_name = {r.name: {"start": r.start, "evals": r.evals} for r in results}
        tradeoff = summarise_tradeoff(by_name, [(_row_label(row, sweep), row["runs"]) for row in rows])
    partial: dict[str, list[dict[str, Any]]] = {}  # column -> each note on what it covers, with its run count
    for column in columns:
        counts: dict[str, int] = {}
        for result in results:
            note = result.notes.get(column.key)
            if note:
                counts[note] = counts.get(note, 0) + 1
        if counts:
            partial[column.key] = [{"note": note, "runs": n} for note, n in counts.items()]
    return {
        "caption": caption(bench, results),
        "kind": bench.kind.command,
        "recipe": str(bench.recipe),
        "set": _plain(bench.set_values),
        "sweep": sweep,
        "columns": [{"key": c.key, "label": c.label, "role": roles[c.key], "format": c.spec,
                     "better": {True: "higher", False: "lower", None: None}[c.higher_is_better]} for c in columns],
        "rows": rows,
        "partial": partial,
        "runs_total": len(results),
        "unfinished": unfinished,
        "definitions": definitions(bench, results, UPDATE_COSINE in columns),
        "tradeoff": tradeoff,
        "over": over(results),
        "runs": {r.name: {"scheme": r.scheme, "seed": r.seed, "sweep_value": r.sweep_value, "task_id": r.task_id,
                          **r.facts,
                          "values": r.values, "notes": r.notes} for r in results},
    }


def _sweep_values_seen(bench: Bench, results: list[Result]) -> list[Any]:
    """The sweep values of the runs in OUT (as in JSON): in increasing order when they are all numbers, else in
    the order they were first given."""
    seen = {json.dumps(r.sweep_value): r.sweep_value for r in results}
    values = list(seen.values())
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        values.sort()
    return values


def _mark_best(rows: list[dict[str, Any]], columns: list[Metric]) -> None:
    """Each row's `best`: the columns where its mean is the best of the rows with the same sweep value (as shown,
    so ties at the shown precision are all marked); nothing is marked where every row shows the same."""
    for row in rows:
        row["best"] = []
    by_value: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_value.setdefault(json.dumps(row["sweep_value"]), []).append(row)
    for group in by_value.values():
        for column in columns:
            if column.higher_is_better is None:
                continue
            shown = [(row, format(row["metrics"][column.key]["mean"], column.spec)) for row in group
                     if row["metrics"][column.key]["mean"] is not None]
            if len({text for _, text in shown}) < 2:  # a lone row, or every row the same: no best
                continue
            pick = max if column.higher_is_better else min
            best = pick(row["metrics"][column.key]["mean"] for row, _ in shown)
            best_text = format(best, column.spec)
            for row, text in shown:
                if text == best_text:
                    row["best"].append(column.key)


def _distinct(values: list[Any]) -> str:
    return ", ".join(str(v) for v in dict.fromkeys(values))


def over(results: list[Result]) -> str:
    """What a row's mean and std run over: "seeds", or "forget tasks and seeds" with --task-ids."""
    tasks = any(r.task_id is not None for r in results)
    seeds = len({r.seed for r in results}) > 1
    return "forget tasks and seeds" if tasks and seeds else "forget tasks" if tasks else "seeds"


def caption(bench: Bench, results: list[Result]) -> str:
    """Recipe, what it trains, model, steps, seeds, device: the table's caption."""
    config = bench.runs[0].config
    seeds = sorted({r.seed for r in results})
    tasks = sorted({r.task_id for r in results if r.task_id is not None})
    devices = _distinct([f"{r.facts['device']}" + (f" x {r.facts['world_size']} processes"
                                                   if r.facts["world_size"] > 1 else "") for r in results])
    what = bench.kind.describe(config, bench.sweep_key)
    return (f"Update schemes on {bench.recipe.name} (doplus {bench.kind.command}{', ' + what if what else ''}): "
            f"model {_distinct([r.facts['model'] for r in results])}, {_distinct([r.facts['steps'] for r in results])}"
            f" steps, " + (f"forget tasks {', '.join(map(str, tasks))} (task_id), " if tasks else "")
            + f"seeds {', '.join(map(str, seeds))}, {devices}"
            + (f"; --set {', '.join(f'{k}={v}' for k, v in bench.set_values.items())}" if bench.set_values else "")
            + (f". Mean ± sample standard deviation over {over(results)}, every run of a scheme pooled (n/a: one run)"
               if tasks else ". Mean ± sample standard deviation over seeds (n/a: one seed)")
            + "; best per column in bold"
            + (f" among the schemes at the same {bench.sweep_key}" if bench.sweep_key else "") + ".")


def definitions(bench: Bench, results: list[Result], update_cosine: bool) -> list[str]:
    """What each column is, for the lines under the table."""
    config = bench.runs[0].config
    kinds = _distinct([r.facts["peak_memory_kind"] for r in results])
    lines = []
    if isinstance(config, UnlearnConfig) and config.eval_suite == "answers":
        lines.append(f"forget/retain ROUGE-L: ROUGE-L recall of each run's greedy answers after unlearning against "
                     f"the starting model's, on {config.show_samples} questions of each set spread evenly through it "
                     "(report.json sample_rouge_mean); lower is better on forget, higher on retain.")
    elif isinstance(config, UnlearnConfig):
        where = _distinct(["during training (eval_every)" if r.facts["evaluated_during_training"] else
                           "by doplus evaluate on final/" for r in results])
        lines.append(f"UFE, TFE, MU, OVR: % ({config.eval_suite} suite, split {config.eval_split}, "
                     + (f"the first {config.eval_max_samples} question(s) of each set, " if config.eval_max_samples
                        else "")
                     + f"protocol {config.eval_protocol}; evaluated {where}); model_utility, forget_quality: "
                     "OpenUnlearning's (a fraction; a KS-test p-value against --retain-logs).")
    elif isinstance(config, AlignConfig):
        if config.eval_suite:
            lines.append(f"safety AVG, XSTest: `doplus evaluate --suite {config.eval_suite}` on final/ ("
                         + (f"the first {config.eval_max_samples} prompt(s) of each set; " if config.eval_max_samples
                            else "")
                         + "the judge is named under Partial aggregates when it is the refusal judge standing in for "
                         "a guard model).")
        if config.held_out:
            lines.append(f"held-out harmful/benign refused: % of the last {config.held_out} rows of the safety/general "
                         "set (kept out of training) whose greedy response after training the rules-only refusal "
                         "judge calls a refusal (report.json held_out).")
        lines.append("safety/general loss: the response cross-entropy over the last 10 steps that logged it (joint: "
                     "over each mixed batch's rows of that set).")
    else:
        lines.append("Task scores: % on each task's held-out rows after training (its metric); average: their mean.")
    lines += [
        "train time: the sum of the optimizer steps' seconds in metrics.jsonl (a resumed run counts each step "
        "once; loading and evaluation left out).",
        f"peak memory: the largest peak_memory_gb of the steps ({kinds}).",
        "optimizer states: bytes of every optimizer-state tensor (numel x element size; 8-bit states: codes and "
        "block scales), on one process.",
    ]
    if update_cosine:
        lines.append("update cos: cosine similarity between the latest updates of the objectives (mean over "
                     "objective pairs), averaged over the steps in the second half of the run, then over seeds; "
                     "n/a for joint (no separate objective steps) and for runs that did not record it.")
    return lines


# ---- SCHEMES.md ---------------------------------------------------------------------------------------------


def _cell(stats: dict[str, Any], spec: str, bold: bool) -> str:
    if stats["mean"] is None:
        return "n/a"
    std = "n/a" if stats["std"] is None else format(stats["std"], spec)
    text = f"{format(stats['mean'], spec)} ± {std}"
    return f"**{text}**" if bold else text


def render_markdown(summary: dict[str, Any], figures: list[str]) -> str:
    columns = summary["columns"]
    sweep = summary["sweep"]
    arrow = {"higher": " ↑", "lower": " ↓", None: ""}
    with_tasks = any(row.get("tasks") for row in summary["rows"])
    headers = ["Method", *([sweep["key"]] if sweep else []), *[c["label"] + arrow[c["better"]] for c in columns],
               "tasks x seeds" if with_tasks else "seeds"]
    lines = [f"**Table.** {summary['caption']}", "",
             "| " + " | ".join(headers) + " |",
             "| --- |" + (" ---: |" if sweep else "") + " ---: |" * len(columns) + " ---: |"]
    for row in summary["rows"]:
        cells = [row["label"], *([str(row["sweep_value"])] if sweep else [])]
        cells += [_cell(row["metrics"][c["key"]], c["format"], c["key"] in row["best"]) for c in columns]
        cells.append(f"{len(set(row['tasks']))} x {len(set(row['seeds']))}" if row.get("tasks")
                     else str(len(row["seeds"])))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if summary["partial"]:
        lines.append("Partial aggregates (a judge model was missing where these runs were evaluated):")
        labels = {c["key"]: c["label"] for c in columns}
        for key, notes in summary["partial"].items():
            for entry in notes:
                lines.append(f"- {labels[key]}: {entry['note']} ({entry['runs']} of {summary['runs_total']} runs)")
        lines.append("")
    lines += [f"- {line}" for line in summary["definitions"]]
    if summary.get("tradeoff"):
        lines += [""] + render_tradeoff(summary["tradeoff"], summary.get("over", "seeds"))
    if summary["unfinished"]:
        lines += ["", f"Not included (not finished or not evaluated): {', '.join(summary['unfinished'])}."]
    if figures:
        lines += [""] + [f"![{Path(f).stem}]({f})" for f in figures]
    return "\n".join(lines) + "\n"


# ---- figures ------------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> str:
    """Save as PNG under a temporary name, then rename (as `atomic_write_text` does for text)."""
    tmp = path.with_name(path.name + ".tmp")
    fig.tight_layout()
    fig.savefig(tmp, dpi=120, format="png")
    os.replace(tmp, path)
    _pyplot().close(fig)
    return path.name


def _row_label(row: dict[str, Any], sweep: dict[str, Any] | None) -> str:
    return row["label"] + (f" {sweep['key']}={row['sweep_value']}" if sweep else "")


def plot_tradeoff(summary: dict[str, Any], out: Path) -> str | None:
    """Unlearning: forget efficacy (UFE) against utility (MU) per scheme, error bars the std over seeds.
    Alignment: the safety loss against the general loss. Multitask: each task's score per scheme as grouped bars."""
    plt = _pyplot()
    rows, sweep = summary["rows"], summary["sweep"]
    keys = {c["key"] for c in summary["columns"]}
    if summary["kind"] == "unlearn" and {"forget_rouge", "retain_rouge"} <= keys:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for row in rows:
            kept, gone = row["metrics"]["retain_rouge"], row["metrics"]["forget_rouge"]
            if kept["mean"] is None or gone["mean"] is None:
                continue
            ax.errorbar(kept["mean"], 1 - gone["mean"], xerr=kept["std"], yerr=gone["std"], fmt="o", capsize=4,
                        label=_row_label(row, sweep))
        ax.set_xlabel("retain ROUGE-L  (kept, higher is better)")
        ax.set_ylabel("1 - forget ROUGE-L  (forgotten, higher is better)")
    elif summary["kind"] == "unlearn":
        if not {"MU", "UFE"} <= keys:
            return None
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for row in rows:
            mu, ufe = row["metrics"]["MU"], row["metrics"]["UFE"]
            if mu["mean"] is None or ufe["mean"] is None:
                continue
            ax.errorbar(mu["mean"], ufe["mean"], xerr=mu["std"], yerr=ufe["std"], fmt="o", capsize=4,
                        label=_row_label(row, sweep))
        ax.set_xlabel("MU (%)  (utility, higher is better)")
        ax.set_ylabel("UFE (%)  (forget efficacy, higher is better)")
    elif summary["kind"] == "align":
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for row in rows:
            general, safety = row["metrics"]["general_loss"], row["metrics"]["safety_loss"]
            if general["mean"] is None or safety["mean"] is None:
                continue
            ax.errorbar(general["mean"], safety["mean"], xerr=general["std"], yerr=safety["std"], fmt="o", capsize=4,
                        label=_row_label(row, sweep))
        ax.set_xlabel("general loss  (utility kept, lower is better)")
        ax.set_ylabel("safety loss  (safe responses learned, lower is better)")
    else:
        tasks = [c["key"] for c in summary["columns"] if c["role"] == "score"]
        fig, ax = plt.subplots(figsize=(max(6.0, 2 + 0.6 * len(tasks) * len(rows)), 4.5))
        width = 0.8 / max(1, len(rows))
        for i, row in enumerate(rows):
            means = [row["metrics"][t]["mean"] or 0.0 for t in tasks]
            errors = [row["metrics"][t]["std"] or 0.0 for t in tasks]
            ax.bar([x + (i - (len(rows) - 1) / 2) * width for x in range(len(tasks))], means, width, yerr=errors,
                   capsize=3, label=_row_label(row, sweep))
        ax.set_xticks(range(len(tasks)), tasks)
        ax.set_ylabel("held-out score after training (%)")
    ax.set_title("mean over seeds; error bars: sample std (none with one seed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out / "tradeoff.png")


def plot_tradeoff_curves(summary: dict[str, Any], out: Path) -> str | None:
    """Each run's path through (MU, UFE), from the starting model through its evaluations, one colour per
    scheme; the dotted lines are the matched levels of the trade-off tables."""
    tradeoff = summary.get("tradeoff")
    if not tradeoff:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.8))
    for i, row in enumerate(tradeoff["rows"]):
        colour = f"C{i % 10}"
        for j, name in enumerate(row["runs"]):
            curve = tradeoff["curves"].get(name)
            if not curve:
                continue
            ufe, mu = zip(*curve)
            ax.plot(mu, ufe, color=colour, marker="o", markersize=3, alpha=0.8, label=row["label"] if j == 0 else None)
            ax.plot(mu[-1], ufe[-1], color=colour, marker="s", markersize=6)
    for level in tradeoff["ufe_levels"]:
        ax.axhline(level, color="grey", linestyle=":", linewidth=0.8)
    for level in tradeoff["mu_levels"]:
        ax.axvline(level, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("MU (%)  (utility, higher is better)")
    ax.set_ylabel("UFE (%)  (forget efficacy, higher is better)")
    ax.set_title("each run from its starting model (small dots) to its end (square)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out / "tradeoff_curves.png")


def _mean_curve(series: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    by_step: dict[int, list[float]] = {}
    for points in series:
        for step, value in points:
            by_step.setdefault(step, []).append(value)
    return [(step, statistics.mean(values)) for step, values in sorted(by_step.items())]


def _groups(summary: dict[str, Any], results: list[Result]) -> Iterator[tuple[str, list[Result]]]:
    by_name = {r.name: r for r in results}
    for row in summary["rows"]:
        yield _row_label(row, summary["sweep"]), [by_name[name] for name in row["runs"]]


def plot_curves(summary: dict[str, Any], results: list[Result], names: tuple[str, ...], out: Path) -> str | None:
    """The evaluations during training: one panel per aggregate (or task), a line per scheme, mean over seeds."""
    names = tuple(n for n in names if any(e.get(n) is not None for r in results for e in r.curve))
    if not names or not any(len(r.curve) > 1 for r in results):
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        for label, members in _groups(summary, results):
            curve = _mean_curve([[(e["step"], e[name]) for e in r.curve if e.get(name) is not None] for r in members])
            if curve:
                ax.plot(*zip(*curve), marker="o", label=label)
        ax.set_title(f"{name} (%)")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    return _save(fig, out / "curves.png")


def plot_update_similarity(summary: dict[str, Any], results: list[Result], out: Path) -> str | None:
    """update_cosine against the step per scheme (mean over seeds): the paper's Figure 2a."""
    if not any(r.update_cosines for r in results):
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, members in _groups(summary, results):
        curve = _mean_curve([r.update_cosines for r in members])
        if curve:
            ax.plot(*zip(*curve), label=label)
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("update_cosine (latest updates of the objectives)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out / "update_similarity.png")


# ---- the command --------------------------------------------------------------------------------------------


def write_outputs(bench: Bench, index: dict[str, Any]) -> dict[str, Any]:
    """SCHEMES.json, SCHEMES.md and the figures, from every finished and evaluated run in OUT."""
    results, unfinished = collect(bench, index)
    summary = summarise(bench, results, unfinished)
    figures = [f for f in (plot_tradeoff(summary, bench.out), plot_tradeoff_curves(summary, bench.out),
                           plot_curves(summary, results, bench.kind.curve_names(bench.runs[0].config), bench.out),
                           plot_update_similarity(summary, results, bench.out)) if f]
    summary["figures"] = figures
    atomic_write_text(bench.out / "SCHEMES.json", json.dumps(summary, indent=2) + "\n")
    atomic_write_text(bench.out / "SCHEMES.md", render_markdown(summary, figures))
    return summary


def run_schemes_bench(recipe: str, schemes: str, seeds: str, out: str | None, set_options: list[str],
                      sweep: str | None, log_update_similarity: bool, num_processes: int | None, fsdp: bool,
                      say: Callable[[str], None], task_ids: str | None = None,
                      keep_checkpoints: bool = False) -> dict[str, Any]:
    """Plan and check everything, run what is missing, then write the tables and figures; return SCHEMES.json."""
    out = out or os.path.join("bench", Path(recipe).stem)
    bench = plan_bench(recipe, schemes, seeds, out, set_options, sweep, log_update_similarity, task_ids)
    index = check_out(bench)
    _record_runs(bench, index)
    tasks = f" x {len(bench.task_ids)} forget tasks" if task_ids is not None else ""
    say(f"{len(bench.runs)} runs ({len(bench.schemes)} schemes{tasks} x {len(bench.seeds)} seeds"
        + (f" x {len(bench.sweep_values)} values of {bench.sweep_key}" if bench.sweep_key else "")
        + f") of doplus {bench.kind.command} into {bench.out}")
    Runner(bench, say, num_processes, fsdp, keep_checkpoints).run_all()
    summary = write_outputs(bench, index)
    say(f"tables: {bench.out / 'SCHEMES.md'}, {bench.out / 'SCHEMES.json'}; figures: "
        + ", ".join(str(bench.out / f) for f in summary["figures"]))
    return summary


def print_summary(summary: dict[str, Any], console) -> None:
    """The means (± std) as a table on the console."""
    from rich.table import Table

    table = Table(title=f"bench schemes: mean ± std over {summary.get('over', 'seeds')}", title_justify="left")
    sweep = summary["sweep"]
    table.add_column("scheme")
    if sweep:
        table.add_column(sweep["key"], justify="right")
    for column in summary["columns"]:
        table.add_column(column["label"].replace(" (mean over the 2nd half of steps)", ""), justify="right")
    for row in summary["rows"]:
        cells = [row["label"], *([str(row["sweep_value"])] if sweep else [])]
        cells += [_cell(row["metrics"][c["key"]], c["format"], False) for c in summary["columns"]]
        table.add_row(*cells)
    console.print(table)


def _evaluate_command(run: Run, options: list[tuple[str, Any]], trust_remote_code: bool, model: str | None = None,
                      out: Path | None = None) -> list[str]:
    """`doplus evaluate` of the run's final/ (or `model`) into its eval/ folder (or `out`), with the options whose
    value is not None."""
    command = [sys.executable, "-m", "doplus_cli", "evaluate", "--model", model or str(run.folder / "final")]
    for option, value in options:
        if value is not None:
            command += [option, str(value)]
    if trust_remote_code:
        command.append("--trust-remote-code")
    return command + ["--out", str(out or run.folder / "eval"), "--overwrite"]
