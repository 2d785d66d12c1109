"""`doplus align`: safety alignment as targeted unlearning (paper, Section 4.4): two objectives of the one loop.

- `safety`: harmful instructions with the safe response to give instead (Safety-Tuned LLaMAs' 2,000), trained
  with the cross-entropy of the response given the prompt (prompt masked): the harmful behaviour is unlearned
  by learning the targeted, safe answer;
- `general`: benign instructions with their responses (Alpaca), the same loss: the utility to keep.

Rows are Alpaca's `instruction`, optional `input` (after a blank line when not empty) and `output`. The
alternating schemes cycle F_s safety steps then F_g general steps (the paper's F_f:F_r = 1:10); `joint` trains
on the mixture: one objective over both sets' rows, each batch drawn from their union, its log split by set.
The last `--held-out` rows of each set are answered before and after training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar

from rich.console import Console
from rich.table import Table
from rich.text import Text

from doplus_cli.commands.base import Command
from doplus_cli.config import (
    ANSWER_TOKENS_HELP,
    GUARD_DEFAULT,
    SAFETY_FILES_HELP,
    SOURCE_HELP,
    WARMUP_HELP,
    TrainConfig,
    check_no_reference,
    parse_cycle,
    recorded,
)
from doplus_cli.data.sources import Keys, MixtureSource, RowRange, Source, open_source
from doplus_cli.engine import outputs
from doplus_cli.engine.evaluations import Evaluation
from doplus_cli.engine.loop import run_training
from doplus_cli.engine.objectives import Objective
from doplus_cli.engine.schedule import JOINT
from doplus_cli.errors import UserError, shown
from doplus_cli.evaluation.attacks import ATTACKS, parse_attacks
from doplus_cli.evaluation.refusal import RefusalJudge, is_refusal
from doplus_cli.evaluation.runner import parse_suites
from doplus_cli.evaluation.safety import prompt_sets
from doplus_cli.generation import greedy_generate
from doplus_cli.losses import TASK_LOSSES
from doplus_cli.option import DEFAULT, EVALUATION, METHOD, MODEL_DATA, TRAINING, option

# ---- the options of doplus align: its config class, declared field by field, and its checks ----

ALIGN_EVAL_SUITES = ("safety", "xstest")  # `doplus evaluate`'s suites an align run can end with


@dataclass
class AlignConfig(TrainConfig):
    """Every option of `doplus align`: the options of every training command plus the safety and general sets."""

    # The options align shares with every training command, in its own words
    option_words: ClassVar[dict[str, str]] = {
        "max_new_tokens": "Greedy tokens per held-out response." + DEFAULT,
        "scheme": "joint (batches from the mixture of both sets), alternate, dualoptim, doplus, scaffold, fedcm or "
                  "local-adam." + DEFAULT,
        "steps": "Optimizer steps (or --epochs)." + DEFAULT,
        "warmup_steps": WARMUP_HELP.format(warmup="the first epoch with --epochs, else a tenth of the steps"),
    }

    safety: str | None = option(
        None,
        "Harmful instructions with the safe response to learn: " + SOURCE_HELP,
        panel=MODEL_DATA)
    general: str | None = option(
        None,
        "Benign instructions with their responses (Alpaca): " + SOURCE_HELP,
        panel=MODEL_DATA)
    instruction_key: str = option("instruction", "Instruction field." + DEFAULT, panel=MODEL_DATA)
    input_key: str = option(
        "input",
        "Optional input field, after the instruction and a blank line when not empty." + DEFAULT,
        panel=MODEL_DATA)
    output_key: str = option("output", "Response field." + DEFAULT, panel=MODEL_DATA)
    freq: str = option("1:10", "F_s:F_g, safety steps then general steps per cycle." + DEFAULT, panel=METHOD)
    epochs: float | None = option(
        None,
        "Passes over the general set, instead of --steps (warmup: the first epoch).",
        panel=TRAINING)
    held_out: int = option(
        4,
        "Each set's last N rows, kept out of training and answered before and after (0: none)." + DEFAULT,
        panel=EVALUATION)
    # prompts per greedy generation batch (held-out rows, the evaluation suite)
    eval_batch_size: int = option(16, "Prompts per generation batch." + DEFAULT, panel=EVALUATION)
    # `doplus evaluate`'s safety suites on final/ after training, into OUT/eval/
    eval_suite: tuple[str, ...] | None = option(
        None,
        "After training, `doplus evaluate` final/ into OUT/eval/: safety, xstest or safety,xstest [default: none]",
        panel=EVALUATION)
    eval_max_samples: int | None = option(None, "The first N prompts of each set [default: all]", panel=EVALUATION)
    eval_max_new_tokens: int = option(64, ANSWER_TOKENS_HELP + DEFAULT, panel=EVALUATION)
    # None: Llama-Guard-2-8B when it loads, else the refusal judge; "none"
    eval_guard_model: str | None = option(
        None,
        "A Llama Guard-protocol model, or none " + GUARD_DEFAULT + "]",
        panel=EVALUATION)
    eval_refusal_model: str | None = option(
        None,
        "A chat model labelling refusals by XSTest's protocol [default: the offline refusal judge]",
        panel=EVALUATION)
    # None: the releases' files, downloaded once
    eval_safety_data_dir: str | None = option(None, "Folder " + SAFETY_FILES_HELP, panel=EVALUATION)
    eval_attacks: tuple[str, ...] | None = option(
        None,
        "The safety suite on final/ (--eval-suite) also runs on attacked copies: quant-8bit, quant-4bit, quant-fp4, "
        "probe-prefix, comma-separated (docs/attacks.md) [default: none]",
        panel=EVALUATION)

    def check(self) -> None:
        super().check()
        validate_align(self)


def validate_align(config: AlignConfig) -> None:
    """The options of `doplus align` on top of `validate_training`."""
    for name, flag in (("safety", "--safety"), ("general", "--general")):
        if getattr(config, name) is None:
            raise UserError(f"no {name} set: pass {flag} FILE (JSON lines, a JSON array, or hf:NAME[:CONFIG][@SPLIT]) "
                            "or set it in the recipe")
    parse_cycle(config.freq)
    if config.epochs is not None and not (config.epochs > 0 and config.epochs < float("inf")):
        raise UserError(f"--epochs must be a number > 0, got {config.epochs}")
    for name in ("held_out",):
        if getattr(config, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(config, name)}")
    if config.eval_batch_size < 1:
        raise UserError(f"--eval-batch-size must be at least 1, got {config.eval_batch_size}")
    if config.eval_suite is not None:
        if any(s not in ALIGN_EVAL_SUITES for s in config.eval_suite):
            raise UserError(f"unknown --eval-suite {shown(recorded(config.eval_suite))} for align: choose safety, "
                            "xstest or safety,xstest (other suites: run `doplus evaluate` on final/)")
    if config.eval_max_samples is not None and config.eval_max_samples < 1:
        raise UserError(f"--eval-max-samples must be at least 1, got {config.eval_max_samples}")
    if config.eval_max_new_tokens < 1:
        raise UserError(f"--eval-max-new-tokens must be at least 1, got {config.eval_max_new_tokens}")
    check_no_reference(config, "align")
    # Align answers its held-out rows and runs --eval-suite once training ends; nothing evaluates a step during it.
    if config.eval_every:
        raise UserError(f"eval_every {config.eval_every}: doplus align evaluates after training only (held_out, "
                        "eval_suite), never during it; eval_every is for unlearn and multitask")
    if config.select_by is not None:
        raise UserError(f"select_by {shown(config.select_by, quoted=False)}: doplus align evaluates after training "
                        "only (held_out, eval_suite), so no evaluated step can be kept as best/; select_by is for "
                        "unlearn and multitask")
    if config.stop_when is not None:
        raise UserError(f"stop_when {shown(config.stop_when, quoted=False)}: doplus align evaluates after training "
                        "only (held_out, eval_suite), so no evaluation can end the run early; stop_when is for "
                        "unlearn and multitask")


# ---- the command ----

SETS = ("safety", "general")
MIXTURE = "mixture"  # the joint scheme's one objective over both sets


@dataclass
class AlignSet:
    name: str
    spec: str
    train: Source
    held_out: Source | None


def run_align(config: AlignConfig, console: Console | None = None) -> dict[str, Any]:
    """Train as configured, then (`eval_suite`) evaluate final/ with `doplus evaluate`'s safety suites; return
    the report (also written to `config.out`)."""
    run = AlignCommand(config)
    report = run_training(config, run, console)
    if report and config.eval_suite:
        report["evaluation"] = evaluate_final(config, report, console)
        outputs.write_report(Path(report["config"]["out"]), report, run.render_report)
    return report


def align_evaluation(config: AlignConfig) -> Evaluation:
    """`eval_suite` (safety, xstest or both) with the recipe's eval_* values and the run's seed and dtype."""
    return Evaluation({"suite": recorded(config.eval_suite), "max_samples": config.eval_max_samples,
                       "max_new_tokens": config.eval_max_new_tokens, "batch_size": config.eval_batch_size,
                       "guard_model": config.eval_guard_model, "refusal_model": config.eval_refusal_model,
                       "safety_data_dir": config.eval_safety_data_dir, "seed": config.seed, "dtype": config.dtype,
                       "attacks": recorded(config.eval_attacks)},
                      config.trust_remote_code)


def alpaca_keys(config: AlignConfig) -> Keys:
    return Keys(config.instruction_key, config.output_key, text_rows=False, question_flag="--instruction-key",
                answer_flag="--output-key", input=config.input_key)


def epoch_steps(epochs: float, safety_rows: int, general_rows: int, effective_batch: int, scheme: str,
                cycle: tuple[int, int]) -> int:
    """Optimizer steps for `epochs` passes over the general set (B = the effective batch, N = training rows).

    Alternating schemes: the general objective takes S_g = ceil(E · N_g / B) steps, and the F_s:F_g cycle puts
    F_s safety steps before every F_g of them (the last cycle ends on the S_g-th general step):
    T = S_g + F_s · ceil(S_g / F_g).
    joint: each step draws B rows of the mixture, on average N_g / (N_s + N_g) of them general, so a pass over the
    general set is a pass over the mixture: T = ceil(E · (N_s + N_g) / B).
    """
    passes = Fraction(str(epochs))  # exact: 0.3 epochs of 10 rows at batch 3 is 1 step, not 2
    if scheme == JOINT:
        return max(1, math.ceil(passes * (safety_rows + general_rows) / effective_batch))
    safety_freq, general_freq = cycle
    general_steps = max(1, math.ceil(passes * general_rows / effective_batch))
    return general_steps + safety_freq * math.ceil(general_steps / general_freq)


def split_held_out(source: Source, rows: int, name: str, spec: str) -> tuple[Source, Source | None]:
    """(training rows, the last `rows` rows kept out of training); a set too small for that is an error."""
    if rows == 0:
        return source, None
    if len(source) <= rows:
        raise UserError(f"{spec}: the {name} set has {len(source)} rows and --held-out {rows} would keep every one "
                        "out of training; lower --held-out")
    cut = len(source) - rows
    return RowRange(source, 0, cut), RowRange(source, cut, len(source))


class AlignCommand(Command):
    command, marker, config_class = "align", "safety", AlignConfig
    help = "Safety alignment as targeted unlearning: learn the safe responses, keep the general ones."
    examples = ("doplus align --recipe recipes/align/demo.yaml --out runs/align-demo",
                "doplus align --recipe recipes/align/safety_llama3.yaml")
    without_flags = ("ref_offload", "eval_every", "select_by", "stop_when")
    activity = "aligning"
    card_title = "aligned"

    def __init__(self, config: AlignConfig | None = None) -> None:
        super().__init__(config)
        self.cycle = parse_cycle(config.freq) if config is not None else (1, 1)
        self.sets: dict[str, AlignSet] = {}
        self.held_out: list[tuple[str, str, str]] = []  # (set, prompt, reference response)

    def open(self) -> None:
        keys = alpaca_keys(self.config)
        for name in SETS:
            spec = getattr(self.config, name)
            try:
                source = open_source(spec, name, keys)
            except UserError as error:
                message = str(error)
                raise UserError(message if f"{name} set" in message else f"{name} set: {message}") from None
            train, held_out = split_held_out(source, self.config.held_out, name, spec)
            self.sets[name] = AlignSet(name, spec, train, held_out)
        for name, part in self.sets.items():
            rows = [part.held_out[i] for i in range(len(part.held_out))] if part.held_out is not None else []
            self.held_out += [(name, row.question, row.answer) for row in rows]
        if self.config.eval_suite:
            check_eval_prompts(self.config)
        if self.config.eval_attacks:  # a bad name stops the run here, before training
            check_eval_attacks(self.config)

    def _epoch_steps(self, epochs: float, effective_batch: int) -> int:
        return epoch_steps(epochs, len(self.sets["safety"].train), len(self.sets["general"].train), effective_batch,
                           self.config.scheme, self.cycle)

    def total_steps(self, effective_batch: int) -> int | None:
        """--epochs E: `epoch_steps`; else None (--steps)."""
        if self.config.epochs is None:
            return None
        return self._epoch_steps(self.config.epochs, effective_batch)

    def default_warmup(self, effective_batch: int) -> int:
        """With --epochs: the first epoch (the paper's warmup); with --steps: a tenth of the steps."""
        if self.config.epochs is not None:
            return self._epoch_steps(1.0, effective_batch)
        return math.ceil(self.config.steps / 10)

    def objectives(self, model, formatter, out, progress, accelerator, resumed: bool) -> list[Objective]:
        loss = TASK_LOSSES["CE"]
        safety, general = self.sets["safety"].train, self.sets["general"].train
        if self.config.scheme == JOINT:  # one batch from the union of both sets per step
            return [Objective(MIXTURE, MixtureSource([("safety", safety), ("general", general)]), loss)]
        safety_freq, general_freq = self.cycle
        return [Objective("safety", safety, loss, frequency=safety_freq),
                Objective("general", general, loss, frequency=general_freq)]

    def before(self, model, formatter, progress, accelerator, saved: Any | None) -> Any:
        if saved:
            return saved
        return self._responses(model, formatter, progress, "before")

    def after(self, model, formatter, progress, accelerator, before: Any) -> dict[str, Any]:
        after = self._responses(model, formatter, progress, "after")
        judge = RefusalJudge(None)  # rules only: no model to load
        labels = {when: [v.label for v in judge.classify(responses)] for when, responses in
                  (("before", before), ("after", after))}
        samples = [{"set": name, "prompt": prompt, "reference": reference, "before": b, "after": a,
                    "refusal_before": rb, "refusal_after": ra}
                   for (name, prompt, reference), b, a, rb, ra in zip(self.held_out, before, after, labels["before"],
                                                                      labels["after"])]
        rates = {}
        for name in SETS:
            rows = [s for s in samples if s["set"] == name]
            if rows:
                rates[name] = {when: sum(is_refusal(s[f"refusal_{when}"]) for s in rows) / len(rows)
                               for when in ("before", "after")}
        measured = {"held_out": {"samples": samples, "refusal_rate": rates, "judge": judge.name}} if samples else {}
        return {"epochs": self.config.epochs, "cycle": list(self.cycle), **measured}

    def outputs(self, config: AlignConfig) -> tuple[str, ...]:
        """eval/: `doplus evaluate` of final/ after training (--eval-suite)."""
        return ("eval",) if config.eval_suite else ()

    def card_method(self, config: dict[str, Any]) -> str:
        return f"safety:general cycle {config.get('freq')}"

    def state_objectives(self) -> int:
        return 2  # the safety and the general sets

    def data_report(self) -> dict[str, Any]:
        return {name: {"source": part.spec, "train_rows": len(part.train),
                       "held_out_rows": len(part.held_out) if part.held_out is not None else 0}
                for name, part in self.sets.items()}

    def render_report(self, report: dict[str, Any]) -> str:
        return render_markdown(report)

    def _responses(self, model, formatter, progress, when: str) -> list[str]:
        if not self.held_out:
            return []
        texts, _ = greedy_generate(model, formatter, [prompt for _, prompt, _ in self.held_out],
                                   self.config.max_new_tokens, batch_size=self.config.eval_batch_size,
                                   progress=progress, description=f"held-out responses {when}")
        return texts

    # ---- the command

    def run(self, config: AlignConfig, console: Console | None = None) -> dict[str, Any]:
        return run_align(config, console)

    def print_summary(self, report: dict[str, Any], console: Console) -> None:
        print_summary(report, console)

    def evaluation(self, config: AlignConfig) -> Evaluation:
        """`eval_suite` on final/ (`align_evaluation`), which `run_align` runs when the recipe names one."""
        return align_evaluation(config)


def check_eval_attacks(config: AlignConfig) -> None:
    """--eval-attacks of align: known names that the safety suite can take; relearning needs text to relearn on,
    which only `doplus evaluate --relearn-data` takes."""
    suites = parse_suites(config.eval_suite) if config.eval_suite else ()
    if "safety" not in suites:
        raise UserError("--eval-attacks needs --eval-suite safety (or safety,xstest): the attacks are scored by the "
                        "safety suite's harmful instructions")
    names = parse_attacks(config.eval_attacks, suites)
    relearn = next((name for name in names if ATTACKS[name].kind == "relearn"), None)
    if relearn is not None:
        raise UserError(f"--eval-attacks {relearn}: relearning an aligned model needs harmful text to relearn on; run "
                        f"`doplus evaluate --model OUT/final --suite safety --attacks {relearn} --relearn-data FILE`")


def check_eval_prompts(config: AlignConfig) -> None:
    """Read the evaluation suites' prompt files (downloading them once when online) before training, so that a
    missing, unreachable or malformed file is one error line now rather than after the run."""
    try:
        for suite in parse_suites(config.eval_suite):
            prompt_sets(suite, config.eval_safety_data_dir, config.eval_max_samples, "--eval-safety-data-dir")
    except UserError as error:
        raise UserError(f"--eval-suite {recorded(config.eval_suite)}: {error}") from None


def evaluate_final(config: AlignConfig, report: dict[str, Any], console: Console | None) -> dict[str, Any]:
    """`doplus evaluate --suite EVAL_SUITE` of final/ into OUT/eval/; its summary for the report."""
    from doplus_cli.evaluation.runner import run_evaluate

    folder = Path(report["config"]["out"]) / "eval"
    eval_config = align_evaluation(config).config(report["final"], str(folder))
    attacks = None
    if eval_config.attacks:
        from doplus_cli.engine.attacks import attack_runner

        attacks = attack_runner(console)
    record = run_evaluate(eval_config, console, attacks)
    summary = {}
    for section in record["sections"]:
        if section["suite"] in ("safety", "xstest"):
            summary[section["suite"]] = {"judge": section.get("judge"), "columns": section["columns"],
                                         "rows": section["rows"]}
    evaluation = {"folder": str(folder), "suites": summary, "wall_time_s": record["wall_time_s"]}
    if "attacks" in record:  # the safety rate on each attacked copy beside final/'s (eval/report.md has the table)
        evaluation["attacks"] = record["attacks"]["metrics"]
    return evaluation


# ---- the report ---------------------------------------------------------------------------------------------

def _number(value: float | None, spec: str = ".4f") -> str:
    return "n/a" if value is None else format(value, spec)


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}"


def _eval_cell(value: Any) -> str:
    """A count as it is, a rate (a fraction) in percent, as `doplus evaluate`'s report writes them."""
    if value is None:
        return "n/a"
    return str(value) if isinstance(value, int) else f"{100 * value:.2f}"


def set_losses(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """safety_loss and general_loss over the whole run, whichever objective logged them: (objective, summary)."""
    found = {}
    for objective, terms in report["losses"].items():
        for term in ("safety_loss", "general_loss"):
            if term in terms:
                found[term] = {"objective": objective, **terms[term]}
    return found


def render_markdown(report: dict[str, Any]) -> str:
    cfg, env, data = report["config"], report["environment"], report["data"]
    joint = cfg["scheme"] == JOINT
    rule = f", {cfg['doplus_rule']} rule" if cfg["scheme"] == "doplus" else ""
    how = ("each step one batch from the mixture of both sets" if joint else
           f"cycle F_s:F_g = {report['cycle'][0]}:{report['cycle'][1]} (safety steps, then general steps)")
    length = (f"{report['steps']} steps = {report['epochs']:g} epoch(s) over the general set"
              if report.get("epochs") is not None else f"{report['steps']} steps")
    lines = [
        f"# doplus align: safety + general with {cfg['scheme']}",
        "",
        f"- model: {report['model']}" + outputs.teach_note(report.get("teach")),
        *[f"- {name}: {d['source']} ({d['train_rows']} rows trained, {d['held_out_rows']} held out)"
          for name, d in data.items()],
        f"- prompt: {cfg['instruction_key']} (then a blank line and {cfg['input_key']} when not empty), template "
        f"{cfg['prompt_template'] or 'default'}; target: {cfg['output_key']} (prompt tokens masked)",
        f"- scheme {cfg['scheme']}, optimizer {cfg['optimizer']} ({cfg['state_bits']}-bit states{rule}), {how}, "
        f"lr {cfg['lr']}, betas {tuple(cfg['betas'])}, weight decay {cfg['weight_decay']}, warmup "
        f"{report['warmup_steps']} steps then linear decay",
        f"- {length} ({', '.join(f'{k}: {v}' for k, v in report['steps_per_objective'].items())}), effective batch "
        f"{env['effective_batch']}, seed {env['seed']}",
        f"- wall time {report['wall_time_s']:.1f} s, peak memory {report['peak_memory_gb']:.2f} GB "
        f"({report['peak_memory_kind']})",
        "",
        "## Losses",
        "",
        "Token-mean cross-entropy of the responses; start and end: the first and last step that logged it.",
        "",
        "| term | logged by | start | end | mean of last 10 |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for term, values in set_losses(report).items():
        lines.append(f"| {term} | {values['objective']} steps | {values['start']:.4f} | {values['end']:.4f} "
                     f"| {values['end_mean10']:.4f} |")
    if joint:
        mixture = report["losses"].get(JOINT, {}).get(f"{MIXTURE}_loss")
        if mixture:
            lines.append(f"| {MIXTURE}_loss (the trained loss) | joint steps | {mixture['start']:.4f} "
                         f"| {mixture['end']:.4f} | {mixture['end_mean10']:.4f} |")
        lines += ["", "joint: each step's loss is one cross-entropy over its mixed batch (mixture_loss); safety_loss "
                  "and general_loss are the same cross-entropy over the batch's rows from each set (metrics.jsonl "
                  "also logs safety_rows and general_rows; a set's loss is null in a step that drew none of its rows)."]
    held = report.get("held_out")
    if held:
        lines += ["", "## Held-out responses before and after", "",
                  "Each set's last rows, kept out of training; greedy responses. Refusal: " + held["judge"] + ".", "",
                  "| set | prompt | reference | before | after | refusal before → after |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for s in held["samples"]:
            lines.append(f"| {s['set']} | {outputs.cell(s['prompt'], 60)} | {outputs.cell(s['reference'], 40)} "
                         f"| {outputs.cell(s['before'], 60)} | {outputs.cell(s['after'], 60)} "
                         f"| {s['refusal_before']} → {s['refusal_after']} |")
        lines.append("")
        for name, rate in held["refusal_rate"].items():
            lines.append(f"- refusal rate on the held-out {name} prompts: {_percent(rate['before'])}% before, "
                         f"{_percent(rate['after'])}% after")
    evaluation = report.get("evaluation")
    if evaluation:
        lines += ["", f"## Evaluation of final/ ({evaluation['folder']})", ""]
        for suite, section in evaluation["suites"].items():
            lines += [f"{suite}: {section['judge']}", "", "| " + " | ".join(section["columns"]) + " |",
                      "| --- |" + " ---: |" * (len(section["columns"]) - 1)]
            for row in section["rows"]:
                cells = [str(row[0])] + [_eval_cell(v) for v in row[1:]]
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
        lines.append(f"The full records and judge notes: {evaluation['folder']}/report.md.")
    lines += outputs.update_lines(report.get("update_sizes") or {})
    lines += outputs.environment_lines(env)
    return "\n".join(lines) + "\n"


def print_summary(report: dict[str, Any], console: Console) -> None:
    """The held-out responses before and after, the losses and where the outputs are."""
    held = report.get("held_out")
    if held:
        table = Table(title="Held-out responses before and after alignment", show_lines=True)
        for column in ("set", "prompt", "before", "after"):
            table.add_column(column, overflow="fold")
        for s in held["samples"]:  # Text: a response may hold [brackets] that rich would read as markup
            table.add_row(Text(s["set"], style="red" if s["set"] == "safety" else "green"), Text(s["prompt"]),
                          Text(s["before"]) + Text(f"\n({s['refusal_before']})", style="dim"),
                          Text(s["after"]) + Text(f"\n({s['refusal_after']})", style="dim"))
        console.print(table)
        console.print("Refusal rate on the held-out prompts: " + "; ".join(
            f"{name} {_percent(r['before'])}% -> {_percent(r['after'])}%" for name, r in held["refusal_rate"].items()),
            markup=False)
    parts = [f"{term} {v['start']:.3f} -> {v['end']:.3f}" for term, v in set_losses(report).items()]
    console.print(f"{report['steps']} steps in {report['wall_time_s']:.0f} s; " + "; ".join(parts), markup=False)
    outputs.print_update_warning(report, console)
    if report.get("evaluation"):
        console.print(f"evaluation: {report['evaluation']['folder']}/report.md", markup=False)
    console.print(f"model: {report['final']}   report: {report['config']['out']}/report.md", markup=False)


ALIGN = AlignCommand()
