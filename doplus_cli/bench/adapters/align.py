"""`doplus bench schemes` on `doplus align` recipes (commands/align.py).

The bench scores its runs by the run's own report (the held-out refusal rates, the final losses) and, with
`eval_suite`, by `doplus evaluate`'s safety suites on final/ (run by align itself into OUT/runs/NAME/eval/).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from doplus_cli.bench.adapters.base import BenchAdapter, Metric, TradeoffAxes, doplus_evaluate, read_json
from doplus_cli.commands.align import ALIGN, AlignCommand, AlignConfig
from doplus_cli.config import list_value, recorded
from doplus_cli.errors import UserError
from doplus_cli.evaluation.suite_registry import SUITE_REGISTRY

# What the run measures itself; the safety suites' columns are their Suite's `bench_columns` (`eval_metrics`).
ALIGN_HELD_OUT_METRICS = (Metric("held_out_safety_refusal", "held-out harmful refused (%)", True, ".1f"),
                          Metric("held_out_general_refusal", "held-out benign refused (%)", False, ".1f"))
ALIGN_LOSS_METRICS = (Metric("safety_loss", "safety loss", False, ".3f"),
                      Metric("general_loss", "general loss", False, ".3f"))


def eval_metrics(eval_suite: tuple[str, ...] | str | None) -> tuple[Metric, ...]:
    """The columns of the suites `eval_suite` names (safety, xstest or both; the config's tuple, or a report's
    record of it), in `--suite`'s order: each suite's `bench_columns`, rates the bench shows in percent."""
    chosen = set(list_value(eval_suite or "", str, False, "eval_suite"))
    return tuple(Metric(*column) for name, suite in SUITE_REGISTRY.items() if name in chosen
                 for column in suite.bench_columns)


class AlignAdapter(BenchAdapter):
    training = ALIGN

    def check_evaluation(self, given: set[str], config: AlignConfig, recipe: Path) -> None:
        if config.held_out == 0 and config.eval_suite is None:
            raise UserError(f"{recipe}: no evaluation: held_out is 0 and there is no eval_suite, so only the training "
                            "losses would be compared; set held_out > 0 or eval_suite: safety (or xstest)")

    def metric_list(self, config: AlignConfig) -> tuple[Metric, ...]:
        return (*eval_metrics(config.eval_suite), *(ALIGN_HELD_OUT_METRICS if config.held_out else ()),
                *ALIGN_LOSS_METRICS)

    def describe(self, config: AlignConfig, swept: str | None) -> str:
        length = f"{config.epochs:g} epoch(s)" if config.epochs is not None else f"{config.steps} steps"
        return ("" if swept == "freq" else f"F_s:F_g = {config.freq}, ") + length

    def score_definitions(self, config: AlignConfig, facts: list[dict[str, Any]]) -> list[str]:
        lines = []
        if config.eval_suite:
            lines.append(f"safety AVG, XSTest: `doplus evaluate --suite {recorded(config.eval_suite)}` on final/ ("
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
        return lines

    def tradeoff_axes(self, keys: set[str]) -> TradeoffAxes | None:
        """The safety loss against the general loss."""
        return TradeoffAxes("general_loss", "safety_loss", "general loss  (utility kept, lower is better)",
                            "safety loss  (safe responses learned, lower is better)")

    def evaluation(self, folder: Path, report: dict[str, Any]) -> Path | None:
        if not report["config"].get("eval_suite"):
            return folder
        return folder / "eval" if (folder / "eval" / "eval.json").is_file() else None

    def evaluate_command(self, config: AlignConfig, folder: Path, model: str | None = None,
                         out: Path | None = None) -> list[str]:
        """What align's own evaluation runs (commands/align.py, evaluate_final), for a run stopped before it."""
        evaluation = self.training.evaluation(config)
        return doplus_evaluate(folder, evaluation.flags(), evaluation.trust_remote_code)

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
            summary = read_json(summary_path)
            for metric in eval_metrics(report["config"].get("eval_suite")):  # fractions in SUMMARY.json
                value = summary.get(metric.key)
                values[metric.key] = None if value is None else 100 * value
            judge = summary.get("safety_judge") or ""
            if judge.startswith("offline refusal judge"):
                notes["safety_rate_avg"] = "refusal rate standing in for the safety rate: no guard model"
        return values, notes

    def planned_steps(self, config: AlignConfig) -> int:
        """--epochs: the steps on one process (`epoch_steps`; more processes take fewer)."""
        if config.epochs is None or not (config.safety and config.general):  # validation says what is missing
            return config.steps
        run = AlignCommand(config)
        run.open()
        return run.total_steps(config.batch_size * config.grad_accum)


ALIGN_ADAPTER = AlignAdapter()
