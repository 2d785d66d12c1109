"""`doplus evaluate --attacks`: the chosen forget suites run again on attacked copies of the model, after the
unattacked ones (which they never change), into `OUT/attacks/ATTACK/`; eval.json's "attacks" section compares.

The relearning attacks train here, through the engine's one loop (a one-task `multitask` run, the teaching
stage's path: plain AdamW, the CE loss of the answer tokens), on a copy written into a temporary folder; the
model on disk is only read. The quantization and probe attacks are the evaluation layer's
(`evaluation/attacks.py`).
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console

from doplus_cli.commands.multitask import MultitaskConfig
from doplus_cli.config import TASK_DEFAULTS
from doplus_cli.errors import UserError
from doplus_cli.evaluation import attacks as registry
from doplus_cli.evaluation.attack_api import AttackInput, Reading
from doplus_cli.evaluation.compute import packed_linears
from doplus_cli.evaluation.protocol import get_protocol
from doplus_cli.evaluation.runner import SUITE_REGISTRY, run_config
from doplus_cli.evaluation.suite_api import EvalConfig, SuiteContext
from doplus_cli.evaluation.suites import QASet, load_real_world_sets, load_tofu_sets
from doplus_cli.files import write_json
from doplus_cli.models import embedded_gguf_path

# The relearning run's optimizer: torch.optim.AdamW's defaults for betas and weight decay, no warm-up (a
# constant-then-linear-decay schedule over K steps), one objective, so the step is plain AdamW.
RELEARN_BETAS = (0.9, 0.999)
RELEARN_WEIGHT_DECAY = 0.01


def attack_runner(console: Console | None = None) -> Callable[[SuiteContext, dict[str, Any]], dict[str, Any]]:
    """The hook `runner.evaluate_model` calls once the unattacked suites are done: it returns the attacks section."""
    def run(context: SuiteContext, record: dict[str, Any]) -> dict[str, Any]:
        return run_attacks(context, record, console or Console(stderr=True))
    return run


def qa_sets(config: EvalConfig, suite: str) -> list[QASet]:
    """A QA suite's sets as it loads them (forget first, then retain or neighbour)."""
    if suite == "tofu":
        return load_tofu_sets(config.split, config.data_dir, config.max_samples, config.task_id,
                              get_protocol(config.protocol).max_rows)
    return load_real_world_sets(config.forget, config.retain, config.max_samples)


def relearn_rows(config: EvalConfig) -> tuple[list[dict[str, str]], str, str | None, int | None]:
    """(rows to relearn on, where they come from, the QA suite whose held-out half is reported, its first held-out
    row). Default: the first half of the forget rows of the first chosen QA suite; `--relearn-data`: that file."""
    suite = next((s for s in config.suites if s in registry.QA_SUITES), None)
    if config.relearn_data is not None:
        from doplus_cli.data.sources import Keys, open_source

        # question-answer rows, or raw text (a `text` field: every token is trained on, as the relearning of
        # Unlearn-Smooth's MUSE and WMDP code does on the forget corpus)
        source = open_source(config.relearn_data, "--relearn-data", Keys())
        rows = [{"text": row.text} if row.is_text else {"question": row.question, "answer": row.answer}
                for row in (source[i] for i in range(len(source)))]
        return rows, config.relearn_data, None, None
    forget = qa_sets(config, suite)[0]
    half = max(1, len(forget.samples) // 2)
    rows = [{"question": s.question, "answer": s.answer} for s in forget.samples[:half]]
    return rows, f"the first {half} of {len(forget.samples)} forget rows of the {suite} suite ({forget.source})", \
        suite, half


def relearn_config(model: str | None, attack: str, steps: int, data: str, out: str, eval_config: EvalConfig,
                   prompt_template: str | None) -> MultitaskConfig:
    """The relearning run: one task of (question, answer) rows, `attack`'s preset, K = `steps`."""
    lr, batch_size, rank = registry.RELEARN_PRESETS[attack]
    config = MultitaskConfig(
        model=model, dtype=eval_config.dtype, trust_remote_code=eval_config.trust_remote_code,
        prompt_template=prompt_template, max_length=512, scheme="joint", optimizer="adamw", state_bits=32,
        betas=RELEARN_BETAS, weight_decay=RELEARN_WEIGHT_DECAY, steps=steps, lr=lr, batch_size=batch_size,
        warmup_steps=0, seed=eval_config.seed, out=out, overwrite=True, lora_rank=rank,
        lora_alpha=float(rank or 16), tasks=[{**TASK_DEFAULTS, "name": "relearn", "data": data}],
        prompt_key="question", answer_key="answer", eval_rows=0,
    )
    config.validate()
    return config


@contextmanager
def relearned_copy(context: SuiteContext, attack: str, steps: int, rows: list[dict[str, str]],
                   console: Console) -> Iterator[Any]:
    """The model fine-tuned by `attack` for `steps` steps on `rows`: the weights in memory (those the suites just
    evaluated, also during training) saved into a temporary folder, trained from there, the result loaded; the
    folder is removed afterwards and the evaluated model's own files are never opened for writing."""
    from doplus_cli.commands.multitask import run_multitask
    from doplus_cli.models import load_model_and_tokenizer

    config = context.config
    with tempfile.TemporaryDirectory(prefix="doplus-relearn-") as folder:
        data = os.path.join(folder, "relearn.jsonl")
        with open(data, "w") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)
        start = os.path.join(folder, "start")
        weights = context.model
        if hasattr(weights, "merge_and_unload"):  # a LoRA run's weights during training: merged, in a copy
            weights = copy.deepcopy(weights).merge_and_unload()
        weights.save_pretrained(start)
        del weights
        context.tokenizer.save_pretrained(start)
        template = context.formatter.template_name if context.formatter is not None else None
        run = relearn_config(start, attack, steps, data, os.path.join(folder, "run"), config,
                             None if template == "chat" else template)
        if context.progress is not None:  # one live display at a time: the run shows its own
            context.progress.stop()
        try:
            run_multitask(run, console)
        finally:
            if context.progress is not None:
                context.progress.start()
        model, _, _ = load_model_and_tokenizer(os.path.join(folder, "run", "final"), config.dtype,
                                               config.trust_remote_code)
        model.to(next(context.model.parameters()).device)
        model.eval()
        yield model


def run_attacks(context: SuiteContext, record: dict[str, Any], console: Console) -> dict[str, Any]:
    """Each chosen attack on the model, each forget suite on the attacked copy: the attacks section."""
    config = context.config
    unattacked = json.loads((context.out / "SUMMARY.json").read_text())
    suites = [s for s in config.suites if SUITE_REGISTRY[s].forget_metrics]
    runs: list[dict[str, Any]] = []
    summaries: dict[str, dict[str, Any]] = {}
    held_out: dict[str, dict[str, dict[str, float]]] = {}  # suite -> attack id -> values on the held-out half
    relearn = None
    starting = StartingModel(context)
    readings: dict[str, dict[str, Reading]] = {}  # suite -> attack id -> what a reading attack gave
    for attack_name in config.attacks:
        attack = registry.ATTACKS[attack_name]
        steps = config.relearn_steps if attack.kind == "relearn" else (None,)
        for k in steps:
            attack_id = attack_name if k is None else f"{attack_name}-k{k}"
            folder = context.out / "attacks" / attack_id
            folder.mkdir(parents=True, exist_ok=True)
            started = time.perf_counter()
            entry: dict[str, Any] = {"id": attack_id, "attack": attack_name, "what": attack.what,
                                     "source": attack.source, "suites": [s for s in suites if s in attack.suites]}
            if attack.kind == "relearn":
                if relearn is None:
                    relearn = relearn_rows(config)
                rows, where, held_suite, start = relearn
                entry["relearn"] = {"data": where, "rows": len(rows), "steps": k,
                                    "lr": registry.RELEARN_PRESETS[attack_name][0],
                                    "batch_size": registry.RELEARN_PRESETS[attack_name][1],
                                    "lora_rank": registry.RELEARN_PRESETS[attack_name][2],
                                    "held_out_from": None if start is None else
                                    f"{held_suite} forget rows {start} to the end"}
                with relearned_copy(context, attack_name, k, rows, console) as model:
                    summary = _run_suites(context, model, folder, entry, attack_name)
                if held_suite is not None:
                    eval_rows = json.loads((folder / SUITE_REGISTRY[held_suite].forget_rows).read_text())
                    held_out.setdefault(held_suite, {})[attack_id] = registry.held_out_values(
                        eval_rows["sets"]["forget"], start)
            elif attack.kind == "quant":
                model = registry.quantized_copy(context.model, attack_name)
                summary = _run_suites(context, model, folder, entry, attack_name)
                del model
            elif attack.needs_base and starting.get() is None:
                entry["skipped"] = [f"(every suite): it needs the starting model, {starting.why}"]
                entry["suites"], summary = [], {}
            elif attack.kind == "edit":
                model, entry["edit"] = edited_copy(context, attack_name, starting.get())
                summary = _run_suites(context, model, folder, entry, attack_name)
                del model
            elif attack.kind == "read":
                summary = {}
                for suite in list(entry["suites"]):
                    reading = read_attack(context, attack_name, suite, starting.get())
                    entry.setdefault("reading", {})[suite] = {"rows": reading.rows, "details": reading.details}
                    readings.setdefault(suite, {})[attack_id] = reading
                write_json(folder / "READING.json", entry.get("reading", {}))
            else:
                summary = _run_suites(context, context.model, folder, entry, attack_name)
            write_json(folder / "SUMMARY.json", summary)
            entry["seconds"] = time.perf_counter() - started
            runs.append(entry)
            summaries[attack_id] = summary
    rows, checks = [], []
    for suite in suites:
        taken = {run["id"]: summaries[run["id"]] for run in runs
                 if suite in run["suites"] and registry.ATTACKS[run["attack"]].kind != "read"}
        excluded = {}
        if config.utility_budget is not None:
            for attack_id, values in taken.items():
                within, reason = registry.utility_check(SUITE_REGISTRY[suite].utility, unattacked, values,
                                                        config.utility_budget)
                checks.append({"suite": suite, "attack": attack_id, "kept": within, "reason": reason})
                if not within:
                    excluded[attack_id] = reason
        rows += registry.metric_rows(suite, unattacked, taken, SUITE_REGISTRY[suite].directions, excluded)
    for suite, by_attack in readings.items():
        for attack_id, reading in by_attack.items():
            rows += registry.metric_rows(f"{suite} {reading.rows}", reading.unattacked, {attack_id: reading.attacked},
                                         reading.directions)
    for suite, by_attack in held_out.items():
        start = relearn[3]
        base = registry.held_out_values(json.loads((context.out / SUITE_REGISTRY[suite].forget_rows).read_text())
                                        ["sets"]["forget"], start)
        rows += registry.metric_rows(f"{suite} held-out half", base, by_attack, registry.HELD_OUT_METRICS)
    section: dict[str, Any] = {"runs": runs, "metrics": rows}
    if config.utility_budget is not None:
        section["utility_budget"] = {"budget": config.utility_budget, "checks": checks}
    if starting.spec is not None:
        section["starting_model"] = starting.spec
    return section


class StartingModel:
    """The model the unlearning started from, loaded once, when an attack first asks: `--base-model`, else the
    `model` of the run whose final/ folder is evaluated (its config.yaml), else none (`why` says so)."""

    def __init__(self, context: SuiteContext) -> None:
        config = context.config
        self.context, self.model, self.spec, self.why = context, None, None, ""
        if config.base_model is not None:
            self.spec = config.base_model
        else:
            record = run_config(config.model)
            if "model" in record:
                self.spec = record["model"] if record["model"] is not None else str(embedded_gguf_path())
            else:
                self.why = "which neither --base-model nor the evaluated model's run record (a run's final/) names"

    def get(self):
        if self.spec is None:
            return None
        if self.model is None:
            from doplus_cli.models import load_model_and_tokenizer

            config = self.context.config
            self.model, tokenizer, _ = load_model_and_tokenizer(self.spec, config.dtype, config.trust_remote_code)
            if tokenizer.get_vocab() != self.context.tokenizer.get_vocab():
                raise UserError(f"--base-model {self.spec}: its tokenizer differs from the evaluated model's, so it "
                                "cannot be the model the unlearning started from")
            self.model.to(next(self.context.model.parameters()).device).eval()
        return self.model


def attack_input(context: SuiteContext, suite: str, base, attack: str) -> AttackInput:
    """What a white-box attack reads: `suite`'s forget and retain (or neighbour) rows as it loads them, and the
    attack's own settings from --attack-option (prune's fraction is an argument of its own)."""
    sets = qa_sets(context.config, suite)
    return AttackInput(context.model, context.tokenizer, context.formatter, sets[0].samples, sets[1].samples
                       if len(sets) > 1 else [], base, context.config.seed, context.config.batch_size,
                       dict(context.config.attack_options.get(attack, {})), context.progress)


def edited_copy(context: SuiteContext, attack: str, base) -> tuple[Any, dict[str, Any]]:
    """An edit attack's copy of the model and what it did; orthogonalize reads the first chosen QA suite's
    forget prompts."""
    from doplus_cli.evaluation import weight_edits

    suite = next((s for s in context.config.suites if s in registry.QA_SUITES), None)
    if attack == "orthogonalize":
        return weight_edits.orthogonalized_copy(attack_input(context, suite, base, attack))
    inp = attack_input(context, suite, base, attack) if suite is not None else \
        AttackInput(context.model, context.tokenizer, context.formatter, [], [], base, context.config.seed,
                    context.config.batch_size)
    return weight_edits.pruned_copy(inp, context.config.prune_fraction)


def read_attack(context: SuiteContext, attack: str, suite: str, base) -> Reading:
    """A reading attack on `suite`'s rows."""
    from doplus_cli.evaluation import soft_prompt, white_box

    inp = attack_input(context, suite, base, attack)
    if attack == "logit-lens":
        return white_box.logit_lens(inp)
    if attack == "linear-probe":
        return white_box.linear_probe(inp)
    return soft_prompt.embedding_attack(inp)


def _run_suites(context: SuiteContext, model, folder: Path, entry: dict[str, Any], attack: str) -> dict[str, Any]:
    """The forget suites on an attacked model (or through a probe's prompts), their files into `folder`; a suite
    whose data cannot take the attack (the paraphrase probe without paraphrased questions) is left out of
    `entry["suites"]` and named in `entry["skipped"]`."""
    summary: dict[str, Any] = {}
    for name in list(entry["suites"]):
        formatter = context.formatter
        if registry.ATTACKS[attack].kind == "probe":
            sets = qa_sets(context.config, name) if attack in registry.PROBES_WITH_ROWS else []
            formatter = registry.probe_formatter(attack, context.formatter, sets)
            if formatter is None:
                entry["suites"].remove(name)
                entry.setdefault("skipped", []).append(f"{name}: its forget rows have no paraphrased_question")
                continue
        # the forget side alone, unless the utility budget needs each copy's utility too
        attacked = replace(context, model=model, formatter=formatter, out=folder,
                           forget_only=context.config.utility_budget is None)
        with packed_linears(model):
            summary.update(SUITE_REGISTRY[name].run(attacked).summary)
    return summary
