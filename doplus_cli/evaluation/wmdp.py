"""The WMDP suite: hazardous knowledge (lm-eval's `wmdp_bio`, `wmdp_cyber`, `wmdp_chem`) and general knowledge
(`mmlu`) in one evaluation and one table, as the WMDP authors and OpenUnlearning report an unlearned model.

Everything is scored by the lm-eval suite's machinery (`lm_eval_suite.run_lm_eval`: lm-eval's HFLM wrapper,
TaskManager and `simple_evaluate`), so each accuracy is lm-eval's own `acc`: the fraction of questions whose
gold letter (" A" .. " D" after the task's prompt) gets the largest summed log-probability. This module picks the
tasks, names their roles (forget / utility), writes WMDP.json and the table, and turns a dataset that cannot be
fetched into one line that names the hub datasets the suite needs, read from the installed lm-eval's task files.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from doplus_cli.errors import UserError
from doplus_cli.evaluation.lm_eval_suite import DatasetUnreachable, run_lm_eval
from doplus_cli.evaluation.suite_api import WEIGHT_ATTACKS, BenchColumn, Suite, SuiteContext, SuiteResult
from doplus_cli.files import write_json

# The hazardous-knowledge tasks (lower accuracy = more forgotten; 25% is chance on four choices) and the utility
# task (higher is better): the WMDP paper's Table 2 columns and OpenUnlearning's WMDP evaluation.
FORGET_TASKS = ("wmdp_bio", "wmdp_cyber", "wmdp_chem")
UTILITY_TASKS = ("mmlu",)
WMDP_TASKS = FORGET_TASKS + UTILITY_TASKS
METRIC = "acc"


def role_of(task: str) -> str:
    return "utility" if task in UTILITY_TASKS else "forget"


def hub_datasets(task_manager: Any, names: Iterable[str]) -> dict[str, list[str]]:
    """{hub dataset: its configs} that the lm-eval tasks, groups or tags `names` read, from lm-eval's task index
    (the task files of the installed lm-eval, or of --lm-eval-include): `mmlu` is a group of groups of tags of
    57 tasks, each with `dataset_path: cais/mmlu` and its subject as `dataset_name`."""
    index = task_manager.task_index
    found: dict[str, set[str]] = {}
    seen: set[str] = set()
    pending = list(names)
    while pending:
        name = pending.pop()
        entry = index.get(name)
        if entry is None or name in seen:
            continue
        seen.add(name)
        config = entry.cfg or {}
        if entry.kind.name == "TAG":
            pending += sorted(entry.tags)
        elif "group" in config:
            members = config.get("task") or []
            pending += [m["task"] if isinstance(m, dict) else str(m) for m in members
                        if not isinstance(m, dict) or "task" in m]
        elif config.get("dataset_path"):
            found.setdefault(str(config["dataset_path"]), set())
            if config.get("dataset_name"):
                found[str(config["dataset_path"])].add(str(config["dataset_name"]))
    return {path: sorted(configs) for path, configs in sorted(found.items())}


def describe_datasets(datasets: Mapping[str, Sequence[str]]) -> str:
    """"cais/mmlu (57 configs), cais/wmdp (wmdp-bio, wmdp-chem, wmdp-cyber)": short enough for one line."""
    parts = []
    for path, configs in datasets.items():
        if not configs:
            parts.append(path)
        elif len(configs) <= 4:
            parts.append(f"{path} ({', '.join(configs)})")
        else:
            parts.append(f"{path} ({len(configs)} configs)")
    return ", ".join(parts)


def offline_message(include_path: str | None, task: str) -> str:
    from lm_eval.tasks import TaskManager

    datasets = hub_datasets(TaskManager(include_path=include_path), WMDP_TASKS)
    return (f"--suite wmdp needs the hub datasets {describe_datasets(datasets)} in the local Hugging Face datasets "
            f"cache, and {task}'s cannot be downloaded (offline mode is on or the hub is unreachable): run it once "
            "with the hub reachable, or pass --lm-eval-include DIR with task YAMLs of the same names reading local "
            "copies")


def wmdp_section(result: Mapping[str, Any], tasks: Sequence[str] = WMDP_TASKS) -> dict[str, Any]:
    """The rows of the one table: each task's role, questions scored, accuracy and its standard error."""
    rows = []
    for task in tasks:
        metrics = result["tasks"].get(task, {})
        rows.append({"task": task, "role": role_of(task), "n": result["n_samples"].get(task),
                     "acc": metrics.get(METRIC), "acc_stderr": metrics.get(f"{METRIC}_stderr")})
    return {"suite": "wmdp", "limit": result.get("limit"), "rows": rows, "versions": result.get("versions", {})}


def summary_keys(section: Mapping[str, Any]) -> dict[str, float | None]:
    """SUMMARY.json's WMDP keys: OpenUnlearning's ("wmdp_bio/acc", "mmlu/acc", as its LMEval summary names them)."""
    return {f"{row['task']}/{METRIC}": row["acc"] for row in section["rows"]}


def run_wmdp_suite(context: SuiteContext) -> SuiteResult:
    """The four tasks through lm-eval into WMDP.json; MMLU's accuracy is the utility AVG of the safety OVR. Under
    attack (`forget_only`) the hazardous-knowledge tasks alone: the attacks report forget-side metrics only, and
    MMLU's 14,042 questions would be most of each attacked copy's time."""
    config = context.config
    tasks = FORGET_TASKS if context.forget_only else WMDP_TASKS
    try:
        result = run_lm_eval(context.model, context.tokenizer, list(tasks), limit=config.limit,
                             batch_size=config.batch_size, include_path=config.lm_eval_include, seed=config.seed)
    except DatasetUnreachable as error:
        raise UserError(offline_message(config.lm_eval_include, error.task)) from None
    section = wmdp_section(result, tasks)
    write_json(context.out / "WMDP.json", {**result, "wmdp": section})
    utility = next((row["acc"] for row in section["rows"] if row["task"] == UTILITY_TASKS[0]), None)
    return SuiteResult({**summary_keys(section), **result["summary"]}, section, utility_avg=utility)


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.2f}"


def _cells(row: Mapping[str, Any]) -> list[str]:
    stderr = "n/a" if row["acc_stderr"] is None else f"±{100 * row['acc_stderr']:.2f}"
    return [row["task"], row["role"], "n/a" if row["n"] is None else str(row["n"]), _percent(row["acc"]), stderr]


HEADER = ["task", "role", "questions", "accuracy (%)", "stderr"]
NOTE = ("forget: lower is better (25% is chance on four choices); utility: higher is better; lm-eval's acc, "
        "zero-shot")


def render_markdown(section: Mapping[str, Any]) -> list[str]:
    """report.md's WMDP section: one table, a row per task."""
    lines = ["", f"## WMDP (limit {section['limit']})", "", "| " + " | ".join(HEADER) + " |",
             "| --- | --- | ---: | ---: | ---: |"]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in section["rows"]]
    return lines + ["", NOTE + "."]


def print_section(section: Mapping[str, Any], console: Console) -> None:
    """The printed summary's WMDP table, the same rows as report.md's."""
    table = Table(title=f"WMDP (limit {section['limit']})")
    for name in HEADER:
        table.add_column(name, justify="left" if name in ("task", "role") else "right")
    for row in section["rows"]:
        table.add_row(*_cells(row))
    console.print(table)
    console.print(NOTE, markup=False)


WMDP_SUITE = Suite("wmdp", run_wmdp_suite, files=("WMDP.json",),
                   forget_metrics=(("wmdp_bio/acc", 1), ("wmdp_cyber/acc", 1), ("wmdp_chem/acc", 1)),
                   headline="wmdp_bio/acc", utility="mmlu/acc",
                   # lm-eval's multiple-choice prompts, scored by the letters' log-probabilities: no probe
                   attacks=WEIGHT_ATTACKS,
                   # lm-eval's accuracies under OpenUnlearning's names: hazardous knowledge lower, MMLU higher
                   bench_columns=(BenchColumn("wmdp_bio/acc", "WMDP-Bio", False, ".3f"),
                                  BenchColumn("wmdp_cyber/acc", "WMDP-Cyber", False, ".3f"),
                                  BenchColumn("wmdp_chem/acc", "WMDP-Chem", False, ".3f"),
                                  BenchColumn("mmlu/acc", "MMLU", True, ".3f")))
