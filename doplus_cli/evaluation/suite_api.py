"""What an evaluation suite of `doplus evaluate` is: a name, a `run(context)` with one signature for all suites,
the files it writes and the judges it needs. Each suite module declares its suites (`suites.TOFU_SUITE`,
`safety.XSTEST_SUITE`, ...); `runner.SUITE_REGISTRY` registers them by name, the way lm-evaluation-harness
registers its tasks, and `runner.evaluate_model` loops over the chosen ones.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from doplus_cli.files import atomic_write_text

if TYPE_CHECKING:
    from doplus_cli.data.formatting import PromptFormatter
    from doplus_cli.evaluation.runner import EvalConfig
    from doplus_cli.evaluation.safety_judges import SafetyJudges
    from doplus_cli.evaluation.suites import Judges


@dataclass
class SuiteContext:
    """What every suite's run receives: the model and how to prompt it, the options, where to write, the judges."""

    model: Any  # None: --responses, nothing to generate
    tokenizer: Any
    formatter: PromptFormatter | None  # None: --responses
    config: EvalConfig
    out: Path
    model_name: str
    progress: Any
    targeted: bool | None  # the OVR formula (None: both)
    judges: Judges  # embedding and NLI models (tofu, real-world)
    safety_judges: SafetyJudges | None  # guard model and refusal judges (safety, xstest)
    retain: tuple[list[float] | None, float | None]  # a retain model's forget truth ratios and Min-K% AUC


@dataclass
class SuiteResult:
    """What a suite's run gives back for SUMMARY.json and the report."""

    summary: dict[str, Any]  # its keys in SUMMARY.json
    section: dict[str, Any]  # its section of eval.json and report.md
    utility_avg: float | None = None  # lm-eval's mean headline metric, for the safety OVR


@dataclass(frozen=True)
class Suite:
    name: str
    run: Callable[[SuiteContext], SuiteResult]
    files: tuple[str, ...]  # what it writes into --out (an evaluation already there is refused or replaced)
    needs_judges: bool = False  # the embedding and NLI models
    needs_safety_judges: bool = False  # the refusal judges
    needs_guard: bool = False  # the guard model too


def write_json(path: Path, data: Any) -> None:
    """`data` as indented JSON, written atomically."""
    atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")
