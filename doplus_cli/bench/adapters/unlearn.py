"""`doplus bench schemes` on `doplus unlearn` recipes (commands/unlearn.py).

The bench compares its runs by `doplus evaluate`'s TOFU suite (the paper's aggregates, at the run's last step or
on final/), by its MUSE or WMDP suite on final/ (`eval_suite: muse` / `wmdp`), or by the run's own before/after
answers (`eval_suite: answers`, for recipes without reference answers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from doplus_cli.bench.adapters.base import BenchAdapter, Metric, TradeoffAxes, doplus_evaluate, read_json
from doplus_cli.commands.unlearn import UNLEARN, UNLEARN_EVAL_SUITES, UnlearnConfig
from doplus_cli.errors import UserError
from doplus_cli.evaluation.suite_registry import SUITE_REGISTRY

# `eval_suite: answers` is no suite of `doplus evaluate`: it scores the run's own before/after answers (the
# unlearn command's report.json), so its columns are the bench's own; every other eval_suite's are its Suite's
# `bench_columns`.
ANSWER_METRICS = (Metric("forget_rouge", "forget ROUGE-L", False, ".3f"),
                  Metric("retain_rouge", "retain ROUGE-L", True, ".3f"))
MUSE_CORPORA = ("news", "books")
EVALUATED_SUITES = UNLEARN_EVAL_SUITES  # config.py says what each is


def suite_metrics(eval_suite: str | None) -> tuple[Metric, ...]:
    """The score columns of runs evaluated by `eval_suite`: the answers' own, else the suite's `bench_columns`
    (None, or a name that is no registered suite: those of UnlearnConfig's default suite, TOFU)."""
    if eval_suite == "answers":
        return ANSWER_METRICS
    suite = SUITE_REGISTRY.get(eval_suite or "", SUITE_REGISTRY[UnlearnConfig.eval_suite])
    return tuple(Metric(*column) for column in suite.bench_columns)


class UnlearnAdapter(BenchAdapter):
    training = UNLEARN
    takes_task_ids = True
    matched_tradeoff = True

    def check_evaluation(self, given: set[str], config: UnlearnConfig, recipe: Path) -> None:
        if "eval_suite" not in given:
            raise UserError(f"{recipe}: no evaluation suite: the bench compares runs by it; set eval_suite: tofu in "
                            "the recipe (with eval_data_dir, eval_split, eval_max_samples, ...) or pass --set "
                            "eval_suite=tofu")
        if config.eval_suite not in EVALUATED_SUITES:
            raise UserError(f"{recipe}: eval_suite '{config.eval_suite}': the bench evaluates with "
                            f"{', '.join(EVALUATED_SUITES)} (the suite the eval_* keys describe, or the run's own "
                            "before/after answers)")
        if config.eval_suite == "muse" and config.eval_split not in MUSE_CORPORA:
            raise UserError(f"{recipe}: eval_suite muse takes the corpus in eval_split: news or books (got "
                            f"'{config.eval_split}'); eval_data_dir is the MUSE folder or hf:NAME")
        if config.eval_suite == "answers" and config.show_samples == 0:
            raise UserError(f"{recipe}: eval_suite answers scores the run's before/after answers to show_samples "
                            "questions of each set; show_samples is 0")

    def metric_list(self, config: UnlearnConfig) -> tuple[Metric, ...]:
        return suite_metrics(config.eval_suite)

    def describe(self, config: UnlearnConfig, swept: str | None) -> str:
        parts = [] if swept == "loss" else [config.loss]
        if swept not in ("forget_freq", "retain_freq"):
            parts.append(f"F_f:F_r = {config.forget_freq}:{config.retain_freq}")
        return ", ".join(parts)

    def score_definitions(self, config: UnlearnConfig, facts: list[dict[str, Any]]) -> list[str]:
        if config.eval_suite == "answers":
            return [f"forget/retain ROUGE-L: ROUGE-L recall of each run's greedy answers after unlearning against "
                    f"the starting model's, on {config.show_samples} questions of each set spread evenly through it "
                    "(report.json sample_rouge_mean); lower is better on forget, higher on retain."]
        rows = f"the first {config.eval_max_samples} rows of each set" if config.eval_max_samples else "every row"
        if config.eval_suite == "muse":
            return [f"MUSE suite on final/ ({config.eval_split}, {config.eval_data_dir or 'the hub'}, {rows}): "
                    "VerbMem forget = ROUGE-L F1 of the greedy 128-token continuation; KnowMem forget/retain = ROUGE-L "
                    "F1 of the answer after MUSE's in-context prefix (retain: utility preservation); PrivLeak = "
                    "(AUC - AUC_retrained) / AUC_retrained of Min-40% forget vs holdout, % (0 like the retrained "
                    "model, -100 still knows the forget set)."]
        if config.eval_suite == "wmdp":
            limit = f"the first {config.eval_max_samples} questions of each task" if config.eval_max_samples else \
                "every question"
            return [f"WMDP suite on final/ ({limit}): lm-eval's zero-shot accuracy on wmdp_bio, wmdp_cyber, wmdp_chem "
                    "(hazardous knowledge, lower is better, 0.25 is chance) and mmlu (utility, higher is better)."]
        where = ", ".join(dict.fromkeys("during training (eval_every)" if run["evaluated_during_training"] else
                                        "by doplus evaluate on final/" for run in facts))
        return [f"UFE, TFE, MU, OVR: % ({config.eval_suite} suite, split {config.eval_split}, "
                + (f"the first {config.eval_max_samples} question(s) of each set, " if config.eval_max_samples else "")
                + f"protocol {config.eval_protocol}; evaluated {where}); model_utility, forget_quality: "
                "OpenUnlearning's (a fraction; a KS-test p-value against --retain-logs)."]

    def tradeoff_axes(self, keys: set[str]) -> TradeoffAxes | None:
        """Forget efficacy (UFE) against utility (MU); with the answers suite, forgotten against kept answers."""
        if {"forget_rouge", "retain_rouge"} <= keys:
            return TradeoffAxes("retain_rouge", "forget_rouge", "retain ROUGE-L  (kept, higher is better)",
                                "1 - forget ROUGE-L  (forgotten, higher is better)", y_complement=True)
        if {"retain_knowmem_ROUGE", "forget_verbmem_ROUGE"} <= keys:
            return TradeoffAxes("retain_knowmem_ROUGE", "forget_verbmem_ROUGE",
                                "KnowMem retain  (utility, higher is better)",
                                "1 - VerbMem forget  (forgotten, higher is better)", y_complement=True)
        if {"mmlu/acc", "wmdp_bio/acc"} <= keys:
            return TradeoffAxes("mmlu/acc", "wmdp_bio/acc", "MMLU accuracy  (utility, higher is better)",
                                "1 - WMDP-Bio accuracy  (forgotten, higher is better)", y_complement=True)
        if {"MU", "UFE"} <= keys:
            return TradeoffAxes("MU", "UFE", "MU (%)  (utility, higher is better)",
                                "UFE (%)  (forget efficacy, higher is better)")
        return None

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

    keeps_best = True

    def at_best(self, folder: Path, report: dict[str, Any]) -> tuple[dict[str, Any], Path] | None:
        """The evaluation during training at the best step (OUT/evals/step-N/), which scored best/."""
        step = (report.get("best") or {}).get("step")
        own = folder / "evals" / f"step-{step}"
        return (report, own) if step is not None and (own / "eval.json").is_file() else None

    def evaluate_command(self, config: UnlearnConfig, folder: Path, model: str | None = None,
                         out: Path | None = None) -> list[str]:
        """`doplus evaluate` of final/ (or of `model` into `out`: the starting model) with the recipe's eval_*
        values and what the run's own evaluation during training uses (batch size, seed, dtype, TOFU's prompt
        template: the command's one evaluation builder maps both); the OVR formula comes from the run."""
        evaluation = self.training.evaluation(config)
        return doplus_evaluate(folder, evaluation.flags(), evaluation.trust_remote_code, model, out)

    def has_start(self, config: UnlearnConfig) -> bool:
        return config.eval_suite == "tofu" and bool(config.eval_every)

    def scores(self, report: dict[str, Any], evaluation: Path) -> tuple[dict[str, Any], dict[str, str]]:
        if report["config"].get("eval_suite") == "answers":
            means = report["sample_rouge_mean"]
            return {"forget_rouge": means.get("forget"), "retain_rouge": means.get("retain")}, {}
        summary = read_json(evaluation / "SUMMARY.json")
        record = read_json(evaluation / "eval.json")
        metrics = suite_metrics(report["config"].get("eval_suite"))
        values = {m.key: summary.get(m.key) for m in metrics}
        notes = {a["name"]: a["note"] for section in record.get("sections", []) if section.get("suite") == "tofu"
                 for a in section.get("aggregates", []) if a.get("note")}
        return values, notes

UNLEARN_ADAPTER = UnlearnAdapter()
