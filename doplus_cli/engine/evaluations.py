"""The evaluation a training command runs, mapped once from its config.

Each builder gives `doplus evaluate`'s option values (by option name, as the flags carry them), and `Evaluation`
makes from them both the `EvalConfig` the command evaluates with in its own process (unlearn during training,
align on final/) and the `doplus evaluate` flags its kind runs as a process (`bench schemes`' evaluation of final/
or of the starting model): one mapping, so the two cannot differ (tests/test_evaluations.py parses the flags with
`doplus evaluate`'s own options and compares).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from doplus_cli.config import AlignConfig, UnlearnConfig, eval_batch_size
from doplus_cli.evaluation.runner import parse_suites
from doplus_cli.evaluation.suite_api import EvalConfig
from doplus_cli.options import command_flags


@dataclass(frozen=True)
class Evaluation:
    """`doplus evaluate`'s options by name (`suite` comma-separated, as typed; None: not given), in the order the
    command line lists them, and whether the model's own code is trusted."""

    options: dict[str, Any]
    trust_remote_code: bool

    def config(self, model: str | None, out: str | None = None) -> EvalConfig:
        """The EvalConfig of `doplus evaluate --model MODEL` with these options (and `--out OUT --overwrite`)."""
        values = {name: value for name, value in self.options.items() if value is not None}
        return EvalConfig(model=model, suites=parse_suites(values.pop("suite")), out=out, overwrite=out is not None,
                          trust_remote_code=self.trust_remote_code, **values)

    def flags(self) -> list[tuple[str, Any]]:
        """(flag, value) of each option, for `kinds.base.doplus_evaluate` (which leaves out the None values and adds
        --model, --trust-remote-code, --out and --overwrite)."""
        flags = command_flags("evaluate")
        return [(flags[name][0][0], value) for name, value in self.options.items()]


def unlearn_evaluation(config: UnlearnConfig, task_id: int | None = None) -> Evaluation:
    """The recipe's eval_* values, with the run's batch size, seed and dtype. TOFU also takes the run's prompt
    template: `doplus evaluate` reads it from a run's final/ by itself, but the starting model `bench schemes`
    evaluates as the first point of the curves is no run of this recipe, and its answers must be prompted as the
    evaluations during training prompt them. `task_id`: the forget task the run unlearns (None: the config's)."""
    common = {"batch_size": eval_batch_size(config), "seed": config.seed, "dtype": config.dtype}
    if config.eval_suite == "muse":
        options = {"suite": "muse", "muse_corpus": config.eval_split, "muse_data": config.eval_data_dir,
                   "max_samples": config.eval_max_samples, **common}
    elif config.eval_suite == "wmdp":
        options = {"suite": "wmdp", "limit": config.eval_max_samples, **common}
    else:
        options = {"suite": config.eval_suite, "split": config.eval_split, "data_dir": config.eval_data_dir,
                   "max_samples": config.eval_max_samples, "max_new_tokens": config.eval_max_new_tokens,
                   "protocol": config.eval_protocol, "nli_model": config.eval_nli_model,
                   "embedding_model": config.eval_embedding_model, **common,
                   "task_id": config.task_id if task_id is None else task_id,
                   "prompt_template": config.prompt_template}
    return Evaluation(options, config.trust_remote_code)


def align_evaluation(config: AlignConfig) -> Evaluation:
    """`eval_suite` (safety, xstest or both) with the recipe's eval_* values and the run's seed and dtype."""
    return Evaluation({"suite": config.eval_suite, "max_samples": config.eval_max_samples,
                       "max_new_tokens": config.eval_max_new_tokens, "batch_size": config.eval_batch_size,
                       "guard_model": config.eval_guard_model, "refusal_model": config.eval_refusal_model,
                       "safety_data_dir": config.eval_safety_data_dir, "seed": config.seed, "dtype": config.dtype},
                      config.trust_remote_code)
