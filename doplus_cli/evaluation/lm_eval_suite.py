"""Standard benchmarks (ARC, MMLU, TruthfulQA, TriviaQA, GSM8K, or any lm-eval task) on a model in memory.

Everything is lm-evaluation-harness's own machinery: the model is wrapped in its `HFLM`, tasks come from a
`TaskManager` (built-in tasks plus the YAMLs under `include_path`), and `simple_evaluate` scores them. This
module only turns what a user can get wrong (an unknown task name, a dataset that cannot be fetched offline)
into one-line `UserError`s, and flattens lm-eval's results into a per-task table, a flat summary and one
headline number per task.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import math
import numbers
import os
import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from doplus_cli.errors import UserError
from doplus_cli.evaluation.protocol import DOPLUS_LM_EVAL, get_protocol
from doplus_cli.evaluation.suite_api import Suite, SuiteContext, SuiteResult
from doplus_cli.files import write_json
from doplus_cli.hub_errors import TIMEOUT, bound_hub_waits, diagnose, hub_error

DEFAULT_TASKS = DOPLUS_LM_EVAL.tasks  # the tasks when --tasks is not given, under doplus's protocol

# The metric a report shows for a task, best first; a name matches a cleaned metric exactly or as its prefix
# before a filter name ("exact_match" matches "exact_match_remove_whitespace"). `--protocol paper` reports the
# authors' metrics instead (protocol.PAPER_LM_EVAL).
HEADLINE_METRICS: Mapping[str, tuple[str, ...]] = DOPLUS_LM_EVAL.headline

_LOGGERS = ("lm_eval", "lm-eval")
_NO_FILTER = "none"


def clean_metric_name(key: str) -> str:
    """lm-eval's "metric,filter" key as one name: "acc,none" -> "acc", "exact_match,strict-match" ->
    "exact_match_strict-match"."""
    metric, _, filter_name = key.partition(",")
    return metric if not filter_name or filter_name == _NO_FILTER else f"{metric}_{filter_name}"


def _is_stderr(name: str) -> bool:
    return "_stderr" in name


def _as_number(value: Any) -> float | None:
    """A float for numeric results (numpy scalars included), None for anything else ("N/A" stderrs, aliases)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def clean_metrics(raw: Mapping[str, Any]) -> dict[str, float]:
    """One task's lm-eval results as {clean metric name: float}.

    Only lm-eval's "metric,filter" keys are metrics (name, alias, sample_len and sample_count are bookkeeping);
    non-numeric values ("N/A" stderrs) are dropped.
    """
    metrics: dict[str, float] = {}
    for key, value in raw.items():
        if "," not in key or (number := _as_number(value)) is None:
            continue
        metrics[clean_metric_name(key)] = number
    return metrics


def headline_metric(task: str, metrics: Mapping[str, float],
                    preferences: Mapping[str, tuple[str, ...]] = HEADLINE_METRICS) -> tuple[str, float | None]:
    """The one (metric, value) a report shows for `task`: its preferred metric (`preferences`, the protocol's),
    else the first numeric one."""
    candidates = [name for name in metrics if not _is_stderr(name)]
    for preferred in preferences.get(task, ()):
        if preferred in candidates:
            return preferred, metrics[preferred]
        for name in candidates:
            if name.startswith(preferred + "_"):
                return name, metrics[name]
    if candidates:
        return candidates[0], metrics[candidates[0]]
    return "n/a", None


# Warnings lm-eval always gives for the way this module calls it (a model object, gen_kwargs "from the cli").
_EXPECTED_WARNINGS = (
    "`pretrained` model kwarg is not of type `str`",
    "Passed an already-initialized model through `pretrained`",
    "generation_kwargs: ",
)
_EXPECTED_FROM = ("lm_eval.models.huggingface", "lm_eval.evaluator")


def _unexpected(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_EXPECTED_WARNINGS)


@contextlib.contextmanager
def _quiet_lm_eval() -> Iterator[None]:
    """lm-eval's loggers at WARNING, less the warnings this way of calling it always triggers; restored after."""
    loggers = [logging.getLogger(name) for name in _LOGGERS]
    levels = [logger.level for logger in loggers]
    filtered = [logging.getLogger(name) for name in _EXPECTED_FROM]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    for logger in filtered:
        logger.addFilter(_unexpected)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        for logger in filtered:
            logger.removeFilter(_unexpected)


@contextlib.contextmanager
def _kept_state(model: Any, tokenizer: Any) -> Iterator[None]:
    """Give back the model's train/eval mode, the tokenizer's pad token and the global RNG streams as they were.

    lm-eval puts the model in eval mode, may set a pad token and reseeds python, numpy and torch; a training
    run that evaluates in between must go on exactly as if it had not.
    """
    import numpy as np
    import torch

    training = getattr(model, "training", None)
    pad_token = getattr(tokenizer, "pad_token", None)
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        if training is not None:
            model.train(training)
        if pad_token is None and getattr(tokenizer, "pad_token", None) is not None:
            tokenizer.pad_token = None


def _offline_error_types() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "the dataset could not be fetched": `datasets` raises ConnectionError both
    offline (HF_DATASETS_OFFLINE) and with the hub unreachable; the rest are what the layers below raise."""
    types: list[type[BaseException]] = [ConnectionError, TimeoutError]
    with contextlib.suppress(ImportError):
        from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

        types += [LocalEntryNotFoundError, OfflineModeIsEnabled]
    with contextlib.suppress(ImportError):
        import requests

        types += [requests.exceptions.ConnectionError, requests.exceptions.Timeout]
    with contextlib.suppress(ImportError):
        import httpx

        types += [httpx.TransportError]
    return tuple(types)


def _dataset_not_found_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [FileNotFoundError]
    with contextlib.suppress(ImportError):
        from datasets.exceptions import DatasetNotFoundError

        types.append(DatasetNotFoundError)
    return tuple(types)


class DatasetUnreachable(UserError):
    """A task's dataset is neither in the local HF datasets cache nor downloadable (offline, hub unreachable);
    `task` names the task, so a suite built on these tasks can say which hub datasets it needs."""

    def __init__(self, message: str, task: str) -> None:
        super().__init__(message)
        self.task = task


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _unknown_task(name: str, known: Sequence[str]) -> UserError:
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.75)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return UserError(
        f"unknown lm-eval task '{name}'{hint}; for local task YAMLs pass --lm-eval-include DIR "
        "(a folder of lm-eval task YAML files)"
    )


def _top_level(loaded: Mapping[str, Any], name: str) -> list[Any]:
    """The Task/Group objects that `name` stands for: itself for a task or group, its members for a tag."""
    groups: dict[str, Any] = dict(loaded.get("groups") or {})
    tasks: dict[str, Any] = dict(loaded["tasks"])
    if name in groups:
        return [groups[name]]
    if name in tasks:
        return [tasks[name]]
    children = {child for kids in (loaded.get("group_map") or {}).values() for child in kids}
    top_groups = [group for group_name, group in groups.items() if group_name not in children]
    grouped = {task.task_name for group in top_groups for task in group.get_all_tasks()}
    return top_groups + [task for task_name, task in tasks.items() if task_name not in grouped]


def load_tasks(task_manager: Any, tasks: Sequence[str]) -> list[Any]:
    """Build lm-eval Task/Group objects for `tasks` one name at a time, so an error can name its task.

    Raises UserError for an unknown name and for a dataset that cannot be loaded (offline, not cached, missing).
    """
    known = task_manager.all_tasks
    offline_errors, missing_errors = _offline_error_types(), _dataset_not_found_types()
    bound_hub_waits()
    built: list[Any] = []
    for name in tasks:
        if name not in task_manager.task_index and not (name.endswith((".yaml", ".yml")) and Path(name).is_file()):
            raise _unknown_task(name, known)
        try:
            loaded = task_manager.load([name])
        except KeyError as error:
            raise _unknown_task(name, known) from error
        except Exception as error:
            failure = _dataset_failure(name, error, offline_errors, missing_errors)
            if failure is None:
                raise
            raise failure from error
        built += _top_level(loaded, name)
    return built


def _dataset_failure(name: str, error: Exception, offline_errors: tuple[type[BaseException], ...],
                     missing_errors: tuple[type[BaseException], ...]) -> UserError | None:
    """The one line for task `name` whose dataset did not load: what the hub answered (gated, refused, a server
    error) or that it did not answer in time; else unreachable or offline, or not found; None: not a fetch."""
    diagnosis = diagnose(error, "HF_DATASETS_OFFLINE")
    if diagnosis is not None and (diagnosis.status is not None or diagnosis.kind == TIMEOUT):
        return hub_error(f"lm-eval task '{name}': its dataset", error, repo="", dataset=True, diagnosis=diagnosis)
    if isinstance(error, offline_errors):
        return DatasetUnreachable(
            f"lm-eval task '{name}': its dataset cannot be downloaded, the Hugging Face hub is unreachable or "
            f"offline mode is on, so it must already be in the local HF datasets cache ({_one_line(error)})", name
        )
    if isinstance(error, missing_errors):
        return UserError(f"lm-eval task '{name}': its dataset was not found ({_one_line(error)})")
    return None


def _item_name(item: Any) -> str:
    return item.task_name if hasattr(item, "task_name") else item.name


def _leaf_names(item: Any) -> list[str]:
    return [task.task_name for task in item.get_all_tasks()] if hasattr(item, "get_all_tasks") else [item.task_name]


def summarize(results: Mapping[str, Any], items: Sequence[Any], limit: int | float | None,
              preferences: Mapping[str, tuple[str, ...]] = HEADLINE_METRICS) -> dict[str, Any]:
    """lm-eval's results for the requested `items` as tasks / summary / headline / n_samples / versions, each task's
    headline by `preferences` (the protocol's metrics).

    A group is reported by its aggregate, or by its member tasks when it has none.
    """
    raw_results: Mapping[str, Any] = results.get("results", {})
    n_samples_raw: Mapping[str, Any] = results.get("n-samples", {})
    reported: dict[str, list[str]] = {}
    for item in items:
        name = _item_name(item)
        if clean_metrics(raw_results.get(name, {})) or not hasattr(item, "get_all_tasks"):
            reported[name] = _leaf_names(item)
        else:
            reported.update({leaf: [leaf] for leaf in _leaf_names(item)})

    tasks = {name: clean_metrics(raw_results.get(name, {})) for name in reported}
    summary = {
        f"lmeval_{task}_{metric}": value
        for task, metrics in tasks.items()
        for metric, value in metrics.items()
        if not _is_stderr(metric)
    }
    headline = {task: headline_metric(task, metrics, preferences) for task, metrics in tasks.items()}
    values = [value for _, value in headline.values() if value is not None and not math.isnan(value)]
    n_samples = {
        name: sum(int(n_samples_raw.get(leaf, {}).get("effective", 0)) for leaf in leaves)
        for name, leaves in reported.items()
    }
    subtasks = {
        name: metrics
        for name, raw in raw_results.items()
        if name not in tasks and (metrics := clean_metrics(raw))
    }
    return {
        "tasks": tasks,
        "summary": summary,
        "headline": headline,
        "headline_mean": sum(values) / len(values) if values else None,
        "limit": limit,
        "versions": dict(results.get("versions", {})),
        "n_samples": n_samples,
        "subtasks": subtasks,
    }


def run_lm_eval(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[str],
    limit: int | float | None = None,
    batch_size: int = 8,
    include_path: str | os.PathLike[str] | None = None,
    max_new_tokens: int | None = None,
    seed: int = 0,
    protocol: str = "doplus",
) -> dict[str, Any]:
    """Score the model already in memory on lm-eval `tasks` with lm-eval's `simple_evaluate`.

    Args:
        model: a loaded transformers causal LM; it stays on its device and gets its train/eval mode back.
        tokenizer: its tokenizer.
        tasks: lm-eval task, group or tag names (e.g. DEFAULT_TASKS), or paths of task YAML files.
        limit: at most this many documents per task (a float below 1: that fraction); None for all.
        batch_size: lm-eval's batch size.
        include_path: a folder of extra task YAMLs (local tasks, or built-in tasks pointed at local data).
        max_new_tokens: overrides `max_gen_toks` of generation tasks.
        seed: python, numpy, torch and few-shot sampling seed (global RNG states are restored afterwards).
        protocol: whose headline metrics, and whether `HFLM` prepends the BOS token (`protocol.LmEvalProtocol`).

    Returns:
        {"tasks": {task: {metric: value}}, "summary": {f"lmeval_{task}_{metric}": value} (no stderrs),
        "headline": {task: (metric, value)}, "headline_mean", "limit", "versions", "n_samples": {task: n},
        "subtasks": {member task of a group: {metric: value}}}. Metric names drop lm-eval's ",none" filter
        suffix; other filters are joined with "_" ("exact_match_strict-match").

    Raises:
        UserError: no tasks, an unknown task, or a task whose dataset cannot be loaded (e.g. offline, uncached).
    """
    downstream = get_protocol(protocol).lm_eval
    task_names = [str(task).strip() for task in tasks if str(task).strip()]
    if not task_names:
        raise UserError("no lm-eval tasks given (e.g. --tasks arc_challenge,mmlu)")
    if include_path is not None and not Path(include_path).is_dir():
        raise UserError(f"--lm-eval-include: {include_path} is not a folder of lm-eval task YAMLs")
    if limit is not None and limit <= 0:
        raise UserError(f"lm-eval limit must be positive, got {limit}")

    with _quiet_lm_eval():
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager

        task_manager = TaskManager(include_path=str(include_path) if include_path is not None else None)
        with _kept_state(model, tokenizer):
            items = load_tasks(task_manager, task_names)
            bos = {} if downstream.add_bos_token is None else {"add_bos_token": downstream.add_bos_token}
            lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, **bos)
            gen_kwargs = {"max_gen_toks": int(max_new_tokens)} if max_new_tokens is not None else None
            results = simple_evaluate(
                model=lm,
                tasks=items,
                limit=limit,
                log_samples=False,
                gen_kwargs=gen_kwargs,
                task_manager=task_manager,
                random_seed=seed,
                numpy_random_seed=seed,
                torch_random_seed=seed,
                fewshot_random_seed=seed,
            )
    if results is None:  # only on non-zero ranks of a distributed launch
        raise RuntimeError("lm-eval returned no results: this process is not rank 0 of a distributed launch")
    return summarize(results, items, limit, downstream.headline)


def suite_tasks(config: Any) -> tuple[str, ...]:
    """The lm-eval suite's tasks: --tasks, else the protocol's."""
    return tuple(config.tasks) or get_protocol(config.protocol).lm_eval.tasks


def run_lm_eval_suite(context: SuiteContext) -> SuiteResult:
    """`--tasks` (not given: the protocol's) through lm-eval, into LM_EVAL.json; the mean headline metric is the
    safety OVR's utility AVG."""
    config = context.config
    result = run_lm_eval(context.model, context.tokenizer, list(suite_tasks(config)), limit=config.limit,
                         batch_size=config.batch_size, include_path=config.lm_eval_include, seed=config.seed,
                         protocol=config.protocol)
    write_json(context.out / "LM_EVAL.json", result)
    return SuiteResult(result["summary"], {"suite": "lm-eval", "headline": result.get("headline", {}),
                                           "limit": config.limit}, utility_avg=result.get("headline_mean"))


LM_EVAL_SUITE = Suite("lm-eval", run_lm_eval_suite, files=("LM_EVAL.json",))
