"""`doplus multitask`: N supervised tasks as N objectives of the one loop (paper, Table 4).

Each task is a set of prompt/answer rows, trained with the cross-entropy of its answer tokens (prompt
masked), and a held-out evaluation (its eval file, or its last `--eval-rows` rows, kept out of training)
scored with the task's metric on batched greedy generations. With DualOptim+ every task is an objective:
one shared base state and one delta state per task. One task alone is plain supervised fine-tuning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rich.console import Console
from rich.table import Table

from doplus_cli.commands.base import Command
from doplus_cli.config import (
    AVERAGE,
    SELECT_BY_HELP,
    STOP_WHEN_HELP,
    TrainConfig,
    check_evaluated_steps,
    check_no_reference,
    recorded,
    task_from_option,
)
from doplus_cli.data.sources import Keys, RowRange, Source, open_source
from doplus_cli.engine import outputs
from doplus_cli.engine.loop import run_training
from doplus_cli.engine.objectives import Objective
from doplus_cli.engine.selection import best_lines, stop_lines
from doplus_cli.errors import UserError
from doplus_cli.evaluation.task_metrics import TASK_METRICS, task_score
from doplus_cli.generation import greedy_generate
from doplus_cli.losses import TASK_LOSSES
from doplus_cli.option import DEFAULT, EVALUATION, METHOD, MODEL_DATA, option

# ---- the options of doplus multitask: its config class, declared field by field, and its checks ----

@dataclass
class MultitaskConfig(TrainConfig):
    """Every option of `doplus multitask`: the options of every training command plus the tasks."""

    # The options multitask shares with every training command, in its own words
    option_words: ClassVar[dict[str, str]] = {
        "recipe": "YAML recipe (a tasks: list); flags override it.",
        "max_new_tokens": "Greedy tokens per evaluated answer." + DEFAULT,
        "eval_every": "Score every task every N steps (and at the end) [default: never]",
        "select_by": SELECT_BY_HELP.format(metrics="a task's name or average"),
        "stop_when": STOP_WHEN_HELP.format(metrics="a task's name or average"),
    }

    tasks: list[dict[str, Any]] = field(default_factory=list)  # TASK_DEFAULTS keys, one dict per task
    # F1,F2,...: each task's frequency in order (overrides the tasks' own)
    freq: tuple[int, ...] | None = option(
        None,
        "Each task's steps per cycle, in order: 1,2,1 [default: each task's freq, 1]",
        panel=METHOD)
    prompt_key: str = option("prompt", "Prompt field." + DEFAULT, panel=MODEL_DATA)
    answer_key: str = option("answer", "Answer field." + DEFAULT, panel=MODEL_DATA)
    eval_rows: int = option(
        200,
        "Rows kept out of training for evaluation, per task without an eval file (0: none)." + DEFAULT,
        panel=EVALUATION)
    # prompts per greedy generation batch
    eval_batch_size: int = option(16, "Prompts per generation batch." + DEFAULT, panel=EVALUATION)

    def check(self) -> None:
        super().check()
        validate_multitask(self)

    def selectable_metrics(self) -> dict[str, bool]:
        return {**{task["name"]: True for task in self.tasks}, AVERAGE: True}


def validate_multitask(config: MultitaskConfig) -> None:
    """The tasks of `doplus multitask`: at least one, distinct names, `--freq` with one number per task."""
    if not config.tasks:
        raise UserError("no tasks: pass --task NAME=FILE.jsonl (one per task) or a tasks: list in the recipe")
    names = [task["name"] for task in config.tasks]
    for name in names:
        if names.count(name) > 1:
            raise UserError(f"task '{name}' is given {names.count(name)} times: task names must be distinct")
    if config.freq is not None:
        if len(config.freq) != len(names):
            raise UserError(f"--freq {recorded(config.freq)}: {len(config.freq)} frequencies for {len(names)} "
                            f"tasks ({', '.join(names)}); give one per task, in order")
        for task, freq in zip(config.tasks, config.freq):
            task["freq"] = freq
    if config.scheme != "joint" and not any(task["freq"] > 0 for task in config.tasks):
        raise UserError(f"every task has frequency 0 ({', '.join(names)}): at least one needs steps of its own")
    if config.scheme == "joint" and any(task["lr_multiplier"] != 1.0 for task in config.tasks):
        raise UserError("a task's lr_multiplier needs a scheme with separate task steps (alternate, dualoptim, "
                        "doplus)")
    if any(task["lr_multiplier"] != 1.0 for task in config.tasks) and config.lr == 0:
        raise UserError("a task's lr_multiplier needs --lr > 0 (it is applied as a multiple of it)")
    for name in ("eval_rows",):
        if getattr(config, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(config, name)}")
    if config.eval_batch_size < 1:
        raise UserError(f"--eval-batch-size must be at least 1, got {config.eval_batch_size}")
    check_evaluated_steps(config)
    check_no_reference(config, "multitask")


# ---- the command ----

SHOWN_PREDICTIONS = 3  # held-out rows per task whose answers the report shows before and after


@dataclass
class Task:
    name: str
    data: str
    metric: str
    freq: int
    weight: float
    lr_multiplier: float
    eval: str | None
    train: Source | None = None
    held_out: Source | None = None
    held_out_from: str = ""  # where the evaluation rows come from, in words


def run_multitask(config: MultitaskConfig, console: Console | None = None) -> dict[str, Any]:
    """Train on every task as configured; return the report (also written to `config.out`)."""
    return run_training(config, MultitaskCommand(config), console)


class MultitaskCommand(Command):
    command, marker, config_class = "multitask", "tasks", MultitaskConfig
    help = "Train on several tasks at once, one DualOptim+ delta state per task; scores each task before and after."
    examples = ("doplus multitask --recipe recipes/multitask/demo.yaml",
                "doplus multitask --recipe recipes/multitask/trace_llama2.yaml --scheme joint")
    extra_options = ("task",)  # --task, repeated: the tasks list
    without_flags = ("ref_offload", "tasks")
    activity = "training"

    def from_options(self, values: dict[str, Any]) -> dict[str, Any]:
        """--task NAME=FILE,... (repeated) gives the recipe's `tasks` list."""
        values = dict(values)
        task = values.pop("task")
        if task:
            values["tasks"] = [task_from_option(text) for text in task]
        return values

    def __init__(self, config: MultitaskConfig | None = None) -> None:
        super().__init__(config)
        self.tasks = [Task(t["name"], t["data"], t["metric"], t["freq"], t["weight"], t["lr_multiplier"], t["eval"])
                      for t in (config.tasks if config is not None else [])]

    def open(self) -> None:
        config = self.config
        # a task of raw text (rows with only a `text` field) trains on every token, as a corpus: there is no answer
        # to score it by, so it takes no held-out evaluation
        keys = Keys(config.prompt_key, config.answer_key, text_rows=True, question_flag="--prompt-key")
        for task in self.tasks:
            role = f"task '{task.name}'"
            source = _open(task.data, role, keys)
            if source.text_rows and (task.eval is not None or config.eval_rows > 0):
                rows = "1 row" if source.text_rows == 1 else f"{source.text_rows} rows"
                raise UserError(f"{task.data}: {role} has {rows} with only a 'text' field, which train on every "
                                "token and have no answer to score: give it no eval file and set --eval-rows 0")
            if task.eval is not None:
                task.train, task.held_out = source, _open(task.eval, role + " eval", keys)
                task.held_out_from = f"{task.eval} ({len(task.held_out)} rows)"
            elif config.eval_rows == 0:
                task.train, task.held_out, task.held_out_from = source, None, "not evaluated (--eval-rows 0)"
            else:
                if len(source) <= config.eval_rows:
                    raise UserError(f"{task.data}: {role} has {len(source)} rows and --eval-rows {config.eval_rows} "
                                    "would keep every one out of training; give the task an eval file or lower "
                                    "--eval-rows")
                cut = len(source) - config.eval_rows
                task.train, task.held_out = RowRange(source, 0, cut), RowRange(source, cut, len(source))
                task.held_out_from = f"the last {config.eval_rows} rows of {task.data}"

    def default_warmup(self, effective_batch: int) -> int:
        """A tenth of the steps."""
        return math.ceil(self.config.steps / 10)

    def objectives(self, model, formatter, out, progress, accelerator, resumed: bool) -> list[Objective]:
        loss = TASK_LOSSES["CE"]
        return [Objective(t.name, t.train, loss, t.weight, t.freq, t.lr_multiplier) for t in self.tasks]

    def before(self, model, formatter, progress, accelerator, saved: Any | None) -> Any:
        if saved:
            return saved
        return self._scores(model, formatter, progress, "before", accelerator.is_main_process)

    def evaluate(self, step: int, model, tokenizer, formatter, out, progress, accelerator) -> dict[str, Any]:
        scores = self._scores(accelerator.unwrap_model(model), formatter, progress, f"step {step}",
                              accelerator.is_main_process)
        return {"step": step, **{name: value["score"] for name, value in scores.items()}}

    def after(self, model, formatter, progress, accelerator, before: Any) -> dict[str, Any]:
        after = self._scores(model, formatter, progress, "after", accelerator.is_main_process)
        tasks = []
        for task in self.tasks:
            entry = {
                "name": task.name, "data": task.data, "metric": task.metric,
                "metric_formula": TASK_METRICS[task.metric].formula, "freq": task.freq, "weight": task.weight,
                "lr_multiplier": task.lr_multiplier, "train_rows": len(task.train),
                "eval_rows": len(task.held_out) if task.held_out is not None else 0, "eval_from": task.held_out_from,
                "before": before[task.name]["score"], "after": after[task.name]["score"],
                "samples": [{"prompt": p, "reference": r, "before": b, "after": a} for p, r, b, a in zip(
                    before[task.name]["prompts"], before[task.name]["references"],
                    before[task.name]["predictions"], after[task.name]["predictions"])],
            }
            tasks.append(entry)
        return {"tasks": tasks, "scores": {"before": {k: v["score"] for k, v in before.items()},
                                           "after": {k: v["score"] for k, v in after.items()}}}

    def card_method(self, config: dict[str, Any]) -> str:
        return "tasks " + ", ".join(f"{t['name']} ({t['metric']}, freq {t['freq']})" for t in config.get("tasks", []))

    def state_objectives(self) -> int:
        return max(1, len(self.config.tasks))

    def data_report(self) -> dict[str, Any]:
        return {t.name: {"train_rows": len(t.train), "eval_rows": len(t.held_out) if t.held_out is not None else 0}
                for t in self.tasks}

    def render_report(self, report: dict[str, Any]) -> str:
        return render_markdown(report)

    def curve_names(self, config: MultitaskConfig) -> tuple[str, ...]:
        """Each task's held-out score and their average."""
        return (*[task["name"] for task in config.tasks], AVERAGE)

    def run(self, config: MultitaskConfig, console: Console | None = None) -> dict[str, Any]:
        return run_multitask(config, console)

    def print_summary(self, report: dict[str, Any], console: Console) -> None:
        print_summary(report, console)

    def _scores(self, model, formatter, progress, when: str, say: bool) -> dict[str, Any]:
        """Each task's metric on its held-out rows, as a percentage, and their average (tasks not evaluated
        are left out of it), with the first few predictions; `say`: print each score (a batch log shows it)."""
        scores: dict[str, Any] = {}
        for task in self.tasks:
            if task.held_out is None:
                scores[task.name] = {"score": None, "prompts": [], "references": [], "predictions": []}
                continue
            rows = [task.held_out[i] for i in range(len(task.held_out))]
            predictions, _ = greedy_generate(
                model, formatter, [r.question for r in rows], self.config.max_new_tokens,
                batch_size=self.config.eval_batch_size, progress=progress, description=f"{task.name} {when}",
            )
            references = [r.answer for r in rows]
            shown = slice(0, SHOWN_PREDICTIONS)
            scores[task.name] = {"score": 100 * task_score(task.metric, predictions, references),
                                 "prompts": [r.question for r in rows[shown]], "references": references[shown],
                                 "predictions": predictions[shown]}
        values = [v["score"] for v in scores.values() if v["score"] is not None]
        scores[AVERAGE] = {"score": sum(values) / len(values) if values else None}
        if say:
            shown = ", ".join(f"{name} {_number(value['score'])}" for name, value in scores.items())
            progress.console.print(f"held-out scores {when} (%): {shown}", highlight=False)
        return scores


def _open(spec: str, role: str, keys: Keys) -> Source:
    """A task's source; an error in it (a missing field on line 7, an empty file) names the task too."""
    try:
        return open_source(spec, role, keys)
    except UserError as error:
        message = str(error)
        raise UserError(message if role in message else f"{role}: {message}") from None


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def render_markdown(report: dict[str, Any]) -> str:
    cfg, env = report["config"], report["environment"]
    before, after = report["scores"]["before"], report["scores"]["after"]
    lines = [
        f"# doplus multitask: {', '.join(t['name'] for t in report['tasks'])} with {cfg['scheme']}",
        "",
        f"- model: {report['model']}" + outputs.teach_note(report.get("teach")),
        f"- scheme {cfg['scheme']}, optimizer {cfg['optimizer']} ({cfg['state_bits']}-bit states), frequencies "
        + ":".join(str(t["freq"]) for t in report["tasks"]) + f", lr {cfg['lr']}, betas {tuple(cfg['betas'])}, "
        f"weight decay {cfg['weight_decay']}, warmup {report['warmup_steps']} steps",
        f"- {report['steps']} steps ({', '.join(f'{k}: {v}' for k, v in report['steps_per_objective'].items())}), "
        f"effective batch {env['effective_batch']}, seed {env['seed']}",
        f"- wall time {report['wall_time_s']:.1f} s, peak memory {report['peak_memory_gb']:.2f} GB "
        f"({report['peak_memory_kind']})",
        "",
        "## Scores on held-out rows (%)",
        "",
        "| task | metric | train rows | eval rows | before | after |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for t in report["tasks"]:
        lines.append(f"| {t['name']} | {t['metric']} | {t['train_rows']} | {t['eval_rows']} | {_number(t['before'])} "
                     f"| {_number(t['after'])} |")
    lines.append(f"| **average** | | | | {_number(before[AVERAGE])} | {_number(after[AVERAGE])} |")
    lines += ["", "Metrics:"] + [f"- {t['name']}: {t['metric_formula']}; evaluated on {t['eval_from']}"
                                 for t in report["tasks"]]
    lines += ["", "## Losses", "", "| objective | term | start | end | mean of last 10 |",
              "| --- | --- | ---: | ---: | ---: |"]
    for objective, terms in report["losses"].items():
        for term, values in terms.items():
            if term != "steps":
                lines.append(f"| {objective} | {term} | {values['start']:.4f} | {values['end']:.4f} "
                             f"| {values['end_mean10']:.4f} |")
    if report.get("evals"):
        names = [t["name"] for t in report["tasks"]] + [AVERAGE]
        lines += ["", "## Scores during training (%)", "", "| step | " + " | ".join(names) + " |",
                  "| ---: |" + " ---: |" * len(names)]
        for e in report["evals"]:
            lines.append(f"| {e['step']} | " + " | ".join(_number(e.get(n)) for n in names) + " |")
        if report.get("eval_curves"):
            lines += ["", "![curves](evals/curves.png)"]
    lines += best_lines(report)
    lines += stop_lines(report)
    samples = [(t["name"], s) for t in report["tasks"] for s in t["samples"]]
    if samples:
        lines += ["", "## Held-out answers before and after", "", "| task | prompt | reference | before | after |",
                  "| --- | --- | --- | --- | --- |"]
        for name, s in samples:
            lines.append(f"| {name} | {outputs.cell(s['prompt'], 60)} | {outputs.cell(s['reference'], 40)} "
                         f"| {outputs.cell(s['before'], 60)} | {outputs.cell(s['after'], 60)} |")
    lines += outputs.update_lines(report.get("update_sizes") or {})
    lines += outputs.environment_lines(env)
    return "\n".join(lines) + "\n"


def print_summary(report: dict[str, Any], console: Console) -> None:
    """Per-task scores before and after, and where the outputs are."""
    table = Table(title="Held-out scores (%)")
    for column in ("task", "metric", "before", "after"):
        table.add_column(column, justify="left" if column in ("task", "metric") else "right")
    for t in report["tasks"]:
        table.add_row(t["name"], t["metric"], _number(t["before"]), _number(t["after"]))
    scores = report["scores"]
    table.add_row("average", "", _number(scores["before"][AVERAGE]), _number(scores["after"][AVERAGE]))
    console.print(table)
    console.print(f"{report['steps']} steps in {report['wall_time_s']:.0f} s")
    outputs.print_update_warning(report, console)
    console.print(f"model: {report['final']}   report: {report['config']['out']}/report.md")


MULTITASK = MultitaskCommand()
