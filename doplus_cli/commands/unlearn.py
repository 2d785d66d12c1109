"""`doplus unlearn`: the forget set with its forget loss, then (optionally) the retain set with its retain loss,
as the objective list ["forget", "retain"] on the forget-first F_f:F_r cycle; everything else is the one loop.
`--continual`: the forget tasks one after another (below), each an ordinary run of this command.

Before training: `--answers-from-model` replaces the answers by the model's own, and `--show-samples`
questions are answered. During training: `--eval-every` runs `doplus evaluate`'s TOFU suite. After: the same
questions are answered again, with their ROUGE-L recall against the answers before.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from rich.console import Console
from rich.table import Table

from doplus_cli import ownership
from doplus_cli.commands.base import Command
from doplus_cli.config import (
    ANSWER_TOKENS_HELP,
    FORGET_LOSS_NAMES,
    NLI_DEFAULT,
    PROTOCOL_HELP,
    PROTOCOL_NAMES,
    RETAIN_LOSS_NAMES,
    STOP_WHEN_HELP,
    TOFU_FOLDER_HELP,
    WARMUP_HELP,
    StopRule,
    TrainConfig,
    check_distinct_tasks,
    check_evaluated_steps,
    check_protocol,
    chosen_trackers,
    recorded,
)
from doplus_cli.data.muse import TextWindows
from doplus_cli.data.sources import Keys, Source, available_tasks, open_source, task_rows
from doplus_cli.data.tofu import AUTHORS_RETAIN, authors_retain, describe_retain
from doplus_cli.engine import outputs
from doplus_cli.engine.checkpoint import list_checkpoints
from doplus_cli.engine.evaluations import Evaluation
from doplus_cli.engine.loop import default_out_dir, run_training, wants_fsdp
from doplus_cli.engine.objectives import Objective
from doplus_cli.engine.schedule import authors_epoch_steps, authors_warmup
from doplus_cli.engine.selection import best_lines, stop_lines, stop_rule_for
from doplus_cli.errors import UserError, shown
from doplus_cli.evaluation.attacks import parse_attacks
from doplus_cli.evaluation.metrics import rouge_l_recall
from doplus_cli.evaluation.protocol import get_protocol
from doplus_cli.evaluation.runner import evaluate_model, load_judges
from doplus_cli.evaluation.suites import load_tofu_sets
from doplus_cli.files import atomic_write_text
from doplus_cli.generation import greedy_generate, write_self_answered
from doplus_cli.losses import FORGET_LOSSES, RETAIN_LOSSES, LossParams, LossSpec, checked_rmu_layer, prepare_rmu
from doplus_cli.models import embedded_gguf_path
from doplus_cli.option import DEFAULT, EVALUATION, METHOD, MODEL_DATA, TRAINING, option

# ---- the options of doplus unlearn: its config class, declared field by field, and its checks ----

# The suites an unlearn run is evaluated by (its recipe's eval_suite; `bench schemes` compares runs by it). tofu: the
# suite the eval_* keys describe, also during training (--eval-every). answers: the run's own before/after answers to
# `show_samples` questions of each set (ROUGE-L recall of the answer after against the one before), for recipes
# without reference answers (the real-world setting, where the targets are the model's own answers). muse, wmdp:
# those suites on final/.
UNLEARN_EVAL_SUITES = ("tofu", "answers", "muse", "wmdp")
# The TOFU aggregates (percent) `--select-by` can keep the best evaluated step by; higher is better for each.
UNLEARN_SELECTABLE = {"MU": True, "UFE": True, "TFE": True, "OVR": True}
# What `--stop-when` can bound: the TOFU aggregates (percent) and the other values the bench compares runs by
# (the TOFU suite's bench columns: model_utility, forget_quality and the forget and retain ROUGE-L, as fractions).
UNLEARN_STOPPABLE = (*UNLEARN_SELECTABLE, "model_utility", "forget_quality", "forget_Q_A_ROUGE", "retain_Q_A_ROUGE")


@dataclass
class UnlearnConfig(TrainConfig):
    """Every option of `doplus unlearn`. Field names are the recipe keys; `--forget-lr` is `forget_lr`."""

    # TrainConfig's options as unlearn words them
    option_words: ClassVar[dict[str, str]] = {"warmup_steps": WARMUP_HELP.format(
        warmup="one epoch of the F_f:F_r cycle as the DualOptim+ authors count it: ceil(forget rows / effective "
               "batch) x (F_f + F_r) / F_f steps (counted on the retain rows when the retain side runs out first; "
               "Joint: ceil(forget rows / effective batch)), at most --steps; none when that is 1"),
        "stop_when": STOP_WHEN_HELP.format(metrics=", ".join(UNLEARN_STOPPABLE[:-1]) + " or "
                                           + UNLEARN_STOPPABLE[-1])}

    # Data
    forget: str | None = option(None, "Forget set: FILE.jsonl or hf:NAME[:CONFIG][@SPLIT].", panel=MODEL_DATA)
    retain: str | None = option(
        None,
        "Retain set: FILE.jsonl, hf:NAME[:CONFIG][@SPLIT], or tofu-authors (the DualOptim+ authors' retain set for "
        "--forget's file and task).",
        panel=MODEL_DATA)
    # Files whose rows carry task_id (the DualOptim+ authors' TOFU files): the forget task to unlearn; None: task 1
    task_id: int | None = option(
        None,
        "Forget files whose rows carry task_id (the authors' TOFU files): the task to unlearn [default: 1]",
        panel=MODEL_DATA)
    task_ids: tuple[int, ...] | None = option(None, "With --continual: the tasks, in order (1,2,3).", panel=MODEL_DATA)
    continual: bool = option(
        False,
        "Unlearn --task-ids one after another, each from the previous task's final model." + DEFAULT,
        flags="--continual/--no-continual",
        panel=MODEL_DATA)
    question_key: str = option("question", "Question field." + DEFAULT, panel=MODEL_DATA)
    answer_key: str = option("answer", "Answer field." + DEFAULT, panel=MODEL_DATA)
    answers_from_model: bool = option(
        False,
        "Use the starting model's own greedy answers as targets (real-world setting)." + DEFAULT,
        flags="--answers-from-model/--no-answers-from-model",
        panel=MODEL_DATA)
    # Sets of text rows cut into windows of this many tokens, joined first (MUSE trains on 2048; data/muse.py);
    # None: each text row is one example, cut at max_length
    text_window: int | None = option(
        None,
        "Join the text rows of the forget and retain sets and cut them into windows of N tokens, as MUSE trains "
        "(N=2048, with --max-length 2048) [default: each text row is one example]",
        panel=MODEL_DATA)
    # Losses
    loss: str = option(
        "NPO+GD",
        "FORGET[+RETAIN]: FORGET in GA, NPO, DPO, ME, IDK, SimNPO, RMU, UNDIAL, WGA, SatImp, CE-U; RETAIN "
        "in GD, KL, AP, EMBED (RMU's activation term)." + DEFAULT,
        panel=METHOD)
    beta: float = option(0.1, "Temperature of NPO, DPO and AP." + DEFAULT, panel=METHOD)
    forget_coeff: float = option(1.0, "Weight of the forget loss." + DEFAULT, panel=METHOD)
    retain_coeff: float = option(1.0, "Weight of the retain loss." + DEFAULT, panel=METHOD)
    # The hyper-parameters of SimNPO, UNDIAL, WGA, SatImp and RMU/EMBED; defaults and sources: losses.LossParams
    simnpo_beta: float = option(LossParams.simnpo_beta, "SimNPO's beta." + DEFAULT, panel=METHOD)
    simnpo_gamma: float = option(LossParams.simnpo_gamma, "SimNPO's reward margin gamma." + DEFAULT, panel=METHOD)
    undial_beta: float = option(
        LossParams.undial_beta,
        "UNDIAL's reduction of the true token's reference logit." + DEFAULT,
        panel=METHOD)
    wga_beta: float = option(LossParams.wga_beta, "WGA's exponent on p_t." + DEFAULT, panel=METHOD)
    satimp_beta1: float = option(LossParams.satimp_beta1, "SatImp's exponent on p_t." + DEFAULT, panel=METHOD)
    satimp_beta2: float = option(LossParams.satimp_beta2, "SatImp's exponent on 1 - p_t." + DEFAULT, panel=METHOD)
    rmu_layer: int | None = option(
        LossParams.rmu_layer,
        "RMU/EMBED: the decoder layer whose output is steered or held [default: 7; 7/32 of the depth of a model with "
        "7 layers or fewer]",
        panel=METHOD)
    rmu_coeff: float = option(LossParams.rmu_coeff, "RMU's steering coefficient c." + DEFAULT, panel=METHOD)
    rmu_update_layers: tuple[int, ...] | None = option(
        LossParams.rmu_update_layers,
        "RMU: layers whose modules train, e.g. 5,6,7 [default: the RMU layer and the two before it]",
        panel=METHOD)
    rmu_modules: tuple[str, ...] | None = option(
        LossParams.rmu_modules,
        "RMU: the modules of those layers that train, e.g. mlp.down_proj [default: the MLP's output projection]",
        panel=METHOD)
    # The forget-first F_f:F_r cycle
    forget_freq: int = option(1, "F_f: forget steps per cycle." + DEFAULT, panel=METHOD)
    retain_freq: int = option(5, "F_r: retain steps per cycle." + DEFAULT, panel=METHOD)
    forget_lr: float | None = option(None, "Learning rate of forget steps [default: --lr]", panel=TRAINING)
    show_samples: int = option(3, "Questions per set shown before/after (0: none)." + DEFAULT, panel=EVALUATION)
    # `doplus evaluate`'s suites during training (into OUT/evals/step-N/)
    eval_suite: str = option("tofu", "Suite run during training." + DEFAULT, panel=EVALUATION)
    eval_split: str = option("forget10", "TOFU forget split." + DEFAULT, panel=EVALUATION)
    eval_data_dir: str | None = option(None, TOFU_FOLDER_HELP + "]", panel=EVALUATION)
    eval_max_samples: int | None = option(None, "Questions per set [default: all]", panel=EVALUATION)
    eval_max_new_tokens: int = option(64, ANSWER_TOKENS_HELP + DEFAULT, panel=EVALUATION)
    eval_nli_model: str | None = option(None, "NLI model " + NLI_DEFAULT, panel=EVALUATION)
    eval_embedding_model: str | None = option(None, "Embedding model [default: the protocol's]", panel=EVALUATION)
    # or "paper": the DualOptim+ authors' judges and generation budget
    eval_protocol: str = option("doplus", PROTOCOL_HELP + DEFAULT, panel=EVALUATION, choices=PROTOCOL_NAMES)
    # prompts per batch of the evaluation during training; None: max(batch_size, 8)
    eval_batch_size: int | None = option(
        None,
        "Prompts per batch of the evaluation during training [default: the larger of --batch-size and 8]",
        panel=EVALUATION)
    # `doplus evaluate --attacks` for the last evaluation
    eval_attacks: tuple[str, ...] | None = option(
        None,
        "The last evaluation (--eval-every) also runs on attacked copies of the final weights: relearn, "
        "relearn-lora, quant-8bit, quant-4bit, quant-fp4, probe, white-box (logit-lens, linear-probe, embedding, "
        "orthogonalize, prune) or all, comma-separated (docs/attacks.md) [default: none]",
        panel=EVALUATION)

    @property
    def forget_loss(self) -> str:
        return self.loss.split("+")[0]

    @property
    def retain_loss(self) -> str | None:
        parts = self.loss.split("+")
        return parts[1] if len(parts) > 1 else None

    def check(self) -> None:
        super().check()
        validate_unlearn(self)

    def selectable_metrics(self) -> dict[str, bool]:
        return dict(UNLEARN_SELECTABLE)

    def stoppable_metrics(self) -> tuple[str, ...]:
        return UNLEARN_STOPPABLE


def validate_loss_params(config: UnlearnConfig) -> None:
    """The hyper-parameters of SimNPO, UNDIAL, WGA, SatImp and RMU (`losses.LossParams`): numbers >= 0, SimNPO's
    beta > 0 (it divides by it), RMU's layers whole numbers >= 0 (their range is checked on the model)."""
    for name in ("simnpo_beta", "undial_beta", "wga_beta", "satimp_beta1", "satimp_beta2", "rmu_coeff"):
        value = getattr(config, name)
        if not value >= 0 or value == float("inf"):
            raise UserError(f"--{name.replace('_', '-')} must be a number >= 0, got {value}")
    if config.simnpo_beta == 0 and config.forget_loss == "SimNPO":
        raise UserError("--simnpo-beta must be > 0 for SimNPO (it divides by it)")
    if config.simnpo_gamma != config.simnpo_gamma or abs(config.simnpo_gamma) == float("inf"):
        raise UserError(f"--simnpo-gamma must be a finite number, got {config.simnpo_gamma}")
    if config.rmu_layer is not None and config.rmu_layer < 0:
        raise UserError(f"--rmu-layer must be a layer number >= 0, got {config.rmu_layer}")


def eval_batch_size(config: UnlearnConfig) -> int:
    """Prompts per batch of the TOFU evaluation during training (and of the bench's evaluation of final/)."""
    return config.eval_batch_size or max(config.batch_size, 8)


def validate_unlearn(config: UnlearnConfig) -> None:
    """The options of `doplus unlearn` on top of `validate_training`."""
    if config.eval_batch_size is not None and config.eval_batch_size < 1:
        raise UserError(f"--eval-batch-size must be at least 1, got {config.eval_batch_size}")
    parts = config.loss.split("+")
    if len(parts) > 2 or parts[0] not in FORGET_LOSS_NAMES or (len(parts) == 2 and parts[1] not in RETAIN_LOSS_NAMES):
        raise UserError(
            f"unknown loss {shown(config.loss)}: write FORGET or FORGET+RETAIN with FORGET in "
            f"{{{', '.join(FORGET_LOSS_NAMES)}}} and RETAIN in {{{', '.join(RETAIN_LOSS_NAMES)}}}, e.g. NPO+GD"
        )
    for name in ("forget_freq", "retain_freq", "show_samples"):
        if getattr(config, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(config, name)}")
    if config.forget_freq == 0:
        raise UserError("--forget-freq must be at least 1: every cycle starts with forget steps")
    for name in ("beta", "forget_coeff", "retain_coeff"):
        value = getattr(config, name)
        if not value >= 0 or value != value:
            raise UserError(f"--{name.replace('_', '-')} must be a number >= 0, got {value}")
    if config.beta == 0 and config.forget_loss in ("NPO", "DPO") or config.beta == 0 and config.retain_loss == "AP":
        raise UserError("--beta must be > 0 for NPO, DPO and AP (they divide by it)")
    validate_loss_params(config)
    if config.forget_lr is not None and not config.forget_lr >= 0:
        raise UserError(f"--forget-lr must be a number >= 0, got {config.forget_lr}")
    check_protocol(config.eval_protocol)
    if config.eval_suite not in UNLEARN_EVAL_SUITES:
        raise UserError(f"unknown --eval-suite {shown(config.eval_suite)}: choose {', '.join(UNLEARN_EVAL_SUITES)}")
    if config.eval_every and config.eval_suite != "tofu":
        raise UserError(f"unknown --eval-suite {shown(config.eval_suite)} for evaluation during training: only tofu "
                        "(run `doplus evaluate --suite ...` on final/ afterwards for the others)")
    check_evaluated_steps(config)
    if config.forget is None:
        raise UserError("no forget set: pass --forget FILE.jsonl (or hf:NAME[:CONFIG][@SPLIT]) or set it in the recipe")
    if config.text_window is not None and not 2 <= config.text_window <= config.max_length:
        raise UserError(f"--text-window must be between 2 and --max-length ({config.max_length}), got "
                        f"{config.text_window}")
    if config.task_id is not None and config.task_id < 0:
        raise UserError(f"--task-id must be a whole number >= 0, got {config.task_id}")
    if config.continual and config.task_ids is None:
        raise UserError("--continual needs --task-ids T1,T2,...: the forget tasks in the order they are unlearned")
    if config.task_ids is not None:
        check_distinct_tasks(config.task_ids, "--task-ids")
        if not config.continual:
            raise UserError("--task-ids unlearns tasks one after another: add --continual (for independent runs "
                            "per task, from the same starting model, use doplus bench schemes --task-ids)")
        if config.task_id is not None and config.task_id not in config.task_ids:
            raise UserError(f"--task-id {config.task_id} is not in --task-ids {recorded(config.task_ids)}")
    if config.retain_loss is not None and config.retain is None:
        raise UserError(f"loss {config.loss} has a retain term: pass --retain FILE.jsonl or use a forget loss alone")
    if config.scheme in ("joint",) and config.forget_lr is not None:
        raise UserError("--forget-lr needs a scheme with separate forget steps (alternate, dualoptim, doplus)")
    if config.forget_lr is not None and config.forget_lr != config.lr and config.lr == 0:
        raise UserError("--forget-lr needs --lr > 0 (the forget rate is applied as a multiple of it)")
    if config.retain_loss is None and config.scheme != "joint" and config.retain_freq > 0:
        config.retain_freq = 0  # a forget loss alone: every step is a forget step


# ---- the command ----

# OUT/answers/: the starting model's own answers to the forget and retain questions (--answers-from-model)
ANSWERS = "answers"


def run_unlearn(config: UnlearnConfig, console: Console | None = None) -> dict[str, Any]:
    """Run one unlearning job as configured; return the report (also written to `config.out`)."""
    return run_training(config, UnlearnCommand(config), console)


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


class UnlearnCommand(Command):
    command, marker, config_class = "unlearn", "forget", UnlearnConfig
    help = "Unlearn a forget set while keeping a retain set; writes final/, metrics.jsonl and a report."
    examples = ("doplus unlearn --recipe recipes/quickstart.yaml",
                "doplus unlearn --recipe recipes/tofu/phi-1.5/npo_gd.yaml --out runs/npo-doplus",
                "doplus unlearn --recipe recipes/tofu/phi-1.5/npo_gd.yaml --task-id 3")
    activity = "unlearning"
    card_title = "forgotten"
    lr_options = "--lr or --forget-lr"

    def __init__(self, config: UnlearnConfig | None = None) -> None:
        super().__init__(config)
        if config is not None:
            self.beta = config.beta
            self.loss_params = LossParams(**{f.name: getattr(config, f.name)
                                             for f in dataclasses.fields(LossParams)})
            self.forget_spec = FORGET_LOSSES[config.forget_loss]
            self.retain_spec = RETAIN_LOSSES.get(config.retain_loss or "")
        self.forget_source: Source | None = None
        self.retain_source: Source | None = None
        self.samples: list[tuple[str, str, str | None]] = []  # (set, question, its answer in the set)
        self.eval_state: dict[str, Any] = {}
        self.task: dict[str, Any] = {}  # the forget task, for files whose rows carry task_id
        self.epoch_steps: int | None = None
        self.rmu_trained: list[str] = []  # RMU: "LAYER.MODULE" of the modules it left trainable

    def open(self) -> None:
        config = self.config
        keys = Keys(config.question_key, config.answer_key, need_answer=not config.answers_from_model)
        forget_file = open_source(config.forget, "forget", keys)
        self.forget_source = forget_file
        tasks = available_tasks(forget_file)
        if tasks:  # the authors' TOFU files: one forget task at a time (data/tofu.py)
            task_id = 1 if config.task_id is None else config.task_id
            self.forget_source = task_rows(forget_file, config.forget, task_id)
            unlearned = [task_id]
            if config.continual:  # the tasks unlearned before this one leave the retain set too
                order = list(config.task_ids)
                unlearned = order[:order.index(task_id) + 1]
            self.task = {"task_id": task_id, "task_given": config.task_id is not None, "file_tasks": tasks,
                         "forget_file_rows": len(forget_file), "unlearned": unlearned}
        elif config.task_id is not None or config.continual:
            raise UserError(f"{config.forget}: its rows have no task_id, so --task-id/--task-ids cannot pick a "
                            "forget task (the DualOptim+ authors' TOFU files carry one; a hub split is one set)")
        if self.retain_spec is not None:
            if config.retain == AUTHORS_RETAIN:
                self.retain_source = authors_retain(config.forget, forget_file, self.task.get("unlearned", []), keys)
            else:
                self.retain_source = open_source(config.retain, "retain", keys)
        if config.text_window is not None:  # MUSE's training windows over the joined text rows
            self.forget_source, self.retain_source = _text_windows(config, self.forget_source, self.retain_source)
        if config.eval_attacks:  # a bad name stops the run here
            _check_eval_attacks(config)
        if config.eval_every and config.eval_suite == "tofu":  # a missing file or task stops the run here
            load_tofu_sets(config.eval_split, config.eval_data_dir, config.eval_max_samples, self.task.get("task_id"),
                           get_protocol(config.eval_protocol).max_rows)

    def default_warmup(self, effective_batch: int) -> int:
        """The DualOptim+ authors' warm-up: one epoch of the scheme in use (engine/schedule.py)."""
        config = self.config
        retain_rows = len(self.retain_source) if self.retain_source is not None else 0
        self.epoch_steps = authors_epoch_steps(config.scheme, len(self.forget_source), retain_rows,
                                               config.forget_freq, config.retain_freq, effective_batch)
        return authors_warmup(self.epoch_steps)

    def objectives(self, model, formatter, out, progress, accelerator, resumed: bool) -> list[Objective]:
        config = self.config
        if config.answers_from_model:
            self.forget_source, self.retain_source = _self_answer(
                model, formatter, config, out, self.forget_source, self.retain_source, progress, accelerator,
                reuse=resumed,
            )
        _check_rows_fit(self.forget_source, self.forget_spec)
        forget_lr = {}
        if config.forget_lr is not None and config.forget_lr != config.lr:
            forget_lr = {"lr_multiplier": config.forget_lr / config.lr}
        objectives = [Objective("forget", self.forget_source, self.forget_spec, config.forget_coeff,
                                config.forget_freq, **forget_lr)]
        if self.retain_source is not None:
            _check_rows_fit(self.retain_source, self.retain_spec)
            objectives.append(Objective("retain", self.retain_source, self.retain_spec, config.retain_coeff,
                                        config.retain_freq))
        return objectives

    def prepare_model(self, model) -> None:
        if self.forget_spec.name == "RMU":  # RMU trains its chosen modules only (WMDP: mlp.down_proj of 3 layers)
            self.rmu_trained = prepare_rmu(model, self.loss_params)
        elif self.retain_spec is not None and self.retain_spec.name == "EMBED":  # its layer exists
            checked_rmu_layer(model, self.loss_params)

    def before(self, model, formatter, progress, accelerator, saved: Any | None) -> Any:
        self.samples = _pick_samples(self.forget_source, self.retain_source, self.config.show_samples)
        if saved is not None:
            return saved
        if self.config.answers_from_model:  # the targets are this model's greedy answers: the answers before
            return [answer for _, _, answer in self.samples]
        return _answers(model, formatter, self.samples, self.config, progress, "answers before") if self.samples else []

    def evaluate(self, step: int, model, tokenizer, formatter, out, progress, accelerator) -> dict[str, Any]:
        self.eval_state.setdefault("task_id", self.task.get("task_id"))
        return _evaluate_tofu(step, accelerator, model, tokenizer, self.config, out, progress, self.eval_state)

    def after(self, model, formatter, progress, accelerator, before: Any) -> dict[str, Any]:
        after = _answers(model, formatter, self.samples, self.config, progress, "answers after") if self.samples else []
        return _sample_report(self.samples, before, after)

    def card_method(self, config: dict[str, Any]) -> str:
        return f"loss {config.get('loss')}, F_f:F_r = {config.get('forget_freq')}:{config.get('retain_freq')}"

    def state_objectives(self) -> int:
        return 2 if self.config.retain_loss is not None else 1

    def needs_reference(self) -> bool:
        """NPO, DPO, KL, UNDIAL and EMBED compare with the frozen starting model."""
        return self.forget_spec.needs_reference or (self.retain_spec is not None and self.retain_spec.needs_reference)

    def data_report(self) -> dict[str, Any]:
        report = {"forget_rows": len(self.forget_source),
                  "retain_rows": len(self.retain_source) if self.retain_source else 0,
                  "epoch_steps": self.epoch_steps}
        if self.task:
            report["task"] = self.task
        if self.rmu_trained:
            report["rmu_trained_modules"] = self.rmu_trained
        if self.retain_source is not None:
            report["retain"] = {"kind": "authors" if self.config.retain == AUTHORS_RETAIN else "as given",
                                **describe_retain(self.retain_source)}
        return report

    def render_report(self, report: dict[str, Any]) -> str:
        return render_unlearn_report(report)

    def outputs(self, config: UnlearnConfig) -> tuple[str, ...]:
        """answers/: the model's own answers it trains on (--answers-from-model)."""
        return (ANSWERS,) if config.answers_from_model else ()

    def planned_out(self, config: UnlearnConfig, out: Path) -> str | None:
        """--continual: a run per task in OUT/task-T/, checked as the run checks them (nothing written)."""
        if not config.continual:
            return None
        order = list(config.task_ids)
        prepare_continual(config, out, order, write=False)
        return f"out: {out}: tasks {', '.join(map(str, order))}, one run each in task-T/"

    def curve_names(self, config: UnlearnConfig) -> tuple[str, ...]:
        """The TOFU suite's aggregates; the other suites plot none."""
        return ("MU", "UFE", "TFE", "OVR") if config.eval_suite == "tofu" else ()

    # ---- the command

    def run(self, config: UnlearnConfig, console: Console | None = None) -> dict[str, Any]:
        """One run, or with `continual` the forget tasks one after another, each from the previous final model."""
        if config.continual:
            return run_continual(config, console, run_unlearn)
        return run_unlearn(config, console)

    def print_summary(self, report: dict[str, Any], console: Console) -> None:
        """The answers before and after and the losses; for `continual`, each task's evaluation."""
        if "running_mean" in report:  # run_continual's report
            print_continual(report, console)
        else:
            print_summary(report, console)

    def evaluation(self, config: UnlearnConfig) -> Evaluation:
        """The recipe's eval_* values as `doplus evaluate` takes them (`unlearn_evaluation`)."""
        return unlearn_evaluation(config)


def _text_windows(config: UnlearnConfig, forget: Source, retain: Source | None) -> tuple[Source, Source | None]:
    """The forget and retain sets with text rows in `--text-window`-token windows (data/muse.py); a set of
    question/answer rows stays as it is."""
    from doplus_cli.models import load_tokenizer

    tokenizer = load_tokenizer(config.model, config.trust_remote_code)
    windowed = [TextWindows(source, tokenizer, config.text_window)
                if source is not None and getattr(source, "text_rows", 0) else source for source in (forget, retain)]
    if windowed[0] is forget and windowed[1] is retain:
        raise UserError("--text-window: neither the forget nor the retain set has text rows (rows with just a "
                        "'text' field) to cut into windows")
    return windowed[0], windowed[1]


def _check_rows_fit(source: Source, loss: LossSpec) -> None:
    if loss.needs_rejection and source.text_rows:
        raise UserError(
            f"{source.name}: {source.text_rows} rows have only a 'text' field; {loss.name} needs question/answer rows"
        )


def _evaluate_tofu(step, accelerator, model, tokenizer, config, out, progress, state) -> dict[str, Any]:
    """`doplus evaluate`'s TOFU suite on the current weights into OUT/evals/step-N/; returns the step's
    aggregates for the curves in the run report. The main process evaluates; under FSDP every process runs
    the same evaluation in step with it (each forward pass gathers every process's shards) and throws its
    copy of the files away."""
    row: dict[str, Any] = {"step": step}
    in_step = accelerator.is_main_process or (wants_fsdp(config, accelerator) and accelerator.num_processes > 1)
    if in_step:
        # What `doplus evaluate` of these weights would run, the run's dtype and trust_remote_code included: the
        # relearning attack (--eval-attacks) trains and loads its copy with them, as on final/.
        eval_config = unlearn_evaluation(config, state.get("task_id")).config(config.model)
        attacks = attack_when = None
        stop = stop_rule_for(config)
        # the last evaluation runs also under attack: the one at --steps, or the one --stop-when ends the run at
        if config.eval_attacks and (step == config.steps or stop is not None):
            from doplus_cli.engine.attacks import attack_runner

            # the white-box attacks' starting model: the one this run began from
            eval_config = dataclasses.replace(eval_config, attacks=parse_attacks(config.eval_attacks,
                                                                                 eval_config.suites),
                                              base_model=config.model or str(embedded_gguf_path()))
            attacks = attack_runner(progress.console if progress is not None else None)
            if step != config.steps:
                attack_when = functools.partial(_meets, stop)
        unwrapped = accelerator.unwrap_model(model)
        if "judges" not in state:
            device = "cuda" if accelerator.device.type == "cuda" else "cpu"
            state["judges"] = load_judges(eval_config, device, need=True)
        if accelerator.is_main_process:
            folder = out / "evals" / f"step-{step}"
            folder.mkdir(parents=True, exist_ok=True)
        else:
            folder = Path(tempfile.mkdtemp(prefix="doplus-eval-"))
        targeted = FORGET_LOSSES[config.forget_loss].targeted
        record = evaluate_model(unwrapped, tokenizer, eval_config, folder, f"step {step}", progress, targeted,
                                state["judges"], attacks=attacks, attack_when=attack_when)
        unwrapped.train()
        if stop is not None and stop.metric not in UNLEARN_SELECTABLE:  # what --stop-when reads, as SUMMARY.json has it
            row[stop.metric] = _summary(record).get(stop.metric)
        if not accelerator.is_main_process:
            shutil.rmtree(folder, ignore_errors=True)
        for section in record["sections"]:
            for aggregate in section.get("aggregates", []):
                row[aggregate["name"]] = None if aggregate["value"] is None else 100 * aggregate["value"]
                if aggregate["note"]:
                    row.setdefault("notes", {})[aggregate["name"]] = aggregate["note"]
        row["folder"] = str(folder)
    accelerator.wait_for_everyone()
    return row


def _summary(record: dict[str, Any]) -> dict[str, Any]:
    """An evaluation record's SUMMARY.json values: its suites' summaries (the TOFU suite's during training)."""
    return {key: value for section in record["sections"] for key, value in (section.get("summary") or {}).items()}


def _meets(stop: StopRule, record: dict[str, Any]) -> bool:
    """Whether an evaluation record meets --stop-when (its last evaluation then runs the attacks)."""
    return stop.holds(_summary(record))


def _check_eval_attacks(config: UnlearnConfig) -> None:
    """--eval-attacks: known names, an evaluation to attack, one process (the attacked copies are whole models)."""
    parse_attacks(config.eval_attacks, (config.eval_suite,))
    if not config.eval_every:
        raise UserError("--eval-attacks needs --eval-every N (the last evaluation is the one run under attack)")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("--eval-attacks runs in one process; run `doplus evaluate --attacks ...` on final/ after a "
                        "run of several processes")


def _self_answer(model, formatter, config, out, forget_source, retain_source, progress, accelerator, reuse=False):
    """Replace the sets' answers by the model's own greedy answers, written to out/answers/*.jsonl (a resumed run
    reads the files its first part wrote)."""
    keys = Keys()
    paths = {"forget": str(out / ANSWERS / "forget.jsonl"), "retain": str(out / ANSWERS / "retain.jsonl")}
    reuse = reuse and all(os.path.isfile(p) for p in paths.values())
    if accelerator.is_main_process and not reuse:
        write_self_answered(model, formatter, forget_source, paths["forget"], config.max_new_tokens, progress)
        if retain_source is not None:
            write_self_answered(model, formatter, retain_source, paths["retain"], config.max_new_tokens, progress)
    accelerator.wait_for_everyone()
    forget = open_source(paths["forget"], "forget", keys)
    retain = open_source(paths["retain"], "retain", keys) if retain_source is not None else None
    return forget, retain


def _pick_samples(forget: Source, retain: Source | None, n: int) -> list[tuple[str, str, str | None]]:
    """`n` question rows of each set, evenly spaced through it, for the before/after table: (set, question,
    answer)."""
    picked = []
    for name, source in (("forget", forget), ("retain", retain)):
        if source is None or n == 0 or source.text_rows == len(source):
            continue
        spaced = sorted({i * len(source) // n for i in range(n)})
        rows = [source[i] for i in spaced]
        picked += [(name, r.question, r.answer) for r in rows if not r.is_text]
    return picked


def _answers(model, formatter, samples, config, progress, description) -> list[str]:
    texts, _ = greedy_generate(
        model, formatter, [q for _, q, _ in samples], config.max_new_tokens, progress=progress, description=description
    )
    return texts


def _sample_report(samples, before, after) -> dict[str, Any]:
    if not samples:
        return {}
    rows = [
        {"set": s, "question": q, "before": b, "after": a, "rouge_l_recall": rouge_l_recall(a, b)}
        for (s, q, _), b, a in zip(samples, before, after)
    ]
    means = {}
    for name in dict.fromkeys(r["set"] for r in rows):
        values = [r["rouge_l_recall"] for r in rows if r["set"] == name]
        means[name] = sum(values) / len(values)
    return {"samples": rows, "sample_rouge_mean": means}


def print_summary(report: dict[str, Any], console: Console) -> None:
    """The before/after table and where the outputs are."""
    if report.get("samples"):
        table = Table(title="Answers before and after unlearning", show_lines=True)
        for column in ("set", "question", "before", "after"):
            table.add_column(column, overflow="fold")
        table.add_column("ROUGE-L", justify="right")
        for s in report["samples"]:
            style = "red" if s["set"] == "forget" else "green"
            score = f"{s['rouge_l_recall']:.2f}"
            table.add_row(f"[{style}]{s['set']}[/]", s["question"], s["before"], s["after"], score)
        console.print(table)
        means = ", ".join(f"{k} {v:.2f}" for k, v in report["sample_rouge_mean"].items())
        console.print(f"Mean ROUGE-L recall of the answer after against before: {means} (1 = unchanged)")
    losses = report["losses"]
    parts = []
    for terms in losses.values():
        for term, values in terms.items():
            if term != "steps":
                parts.append(f"{term} {values['start']:.3f} -> {values['end']:.3f}")
    console.print(f"{report['steps']} steps in {report['wall_time_s']:.0f} s; " + "; ".join(parts))
    outputs.print_update_warning(report, console)
    console.print(f"model: {report['final']}   report: {Path(report['final']).parent / 'report.md'}")


UNLEARN = UnlearnCommand()


# ---- report.md ----------------------------------------------------------------------------------------------


def task_note(data: dict[str, Any]) -> str:
    """`: task 2 of tasks 1-3 (task_id; 120 rows in the file)` for a forget file whose rows carry task_id."""
    task = data.get("task")
    if not task:
        return ""
    how = "" if task["task_given"] else ", the default"
    note = (f": task {task['task_id']}{how} of the file's tasks {', '.join(map(str, task['file_tasks']))} "
            f"({task['forget_file_rows']} rows in the file)")
    if len(task["unlearned"]) > 1:
        note += f"; continual, tasks unlearned so far {', '.join(map(str, task['unlearned']))}"
    return note


def retain_note(data: dict[str, Any]) -> str:
    """`: the authors' retain set, retain90 (3,600) + other tasks (360)`, or the parts of an explicit set."""
    retain = data.get("retain")
    if not retain:
        return ""
    parts = " + ".join(f"{part['source']} ({part['rows']:,})" for part in retain["parts"])
    return f": the authors' retain set, {parts}" if retain["kind"] == "authors" else ""


def warmup_note(cfg: dict[str, Any], report: dict[str, Any]) -> str:
    epoch = report.get("data", {}).get("epoch_steps")
    if epoch is None:
        return " (set by warmup_steps)"
    return f" (one epoch of {epoch} steps by the DualOptim+ authors' rule for {cfg['scheme']})"


def render_unlearn_report(report: dict[str, Any]) -> str:
    cfg = report["config"]
    env = report["environment"]
    lines = [
        f"# doplus unlearn: {cfg['loss']} with {cfg['scheme']}",
        "",
        f"- model: {report['model']}" + outputs.teach_note(report.get("teach")),
        f"- forget: {cfg['forget']} ({report['data']['forget_rows']} rows{task_note(report['data'])}); "
        f"retain: {cfg['retain']} ({report['data']['retain_rows']} rows{retain_note(report['data'])})",
        f"- scheme {cfg['scheme']}, optimizer {cfg['optimizer']} ({cfg['state_bits']}-bit states"
        + (f", {cfg.get('doplus_rule', 'paper')} rule" if cfg["scheme"] == "doplus" else "") + "), "
        f"F_f:F_r = {cfg['forget_freq']}:{cfg['retain_freq']}, lr {cfg['lr']}"
        + (f" (forget {cfg['forget_lr']})" if cfg.get("forget_lr") is not None else "")
        + f", betas {tuple(cfg['betas'])}, weight decay {cfg['weight_decay']}, warmup {report['warmup_steps']} steps"
        + warmup_note(cfg, report),
        f"- {report['steps']} steps ({', '.join(f'{k}: {v}' for k, v in report['steps_per_objective'].items())}), "
        f"effective batch {env['effective_batch']}, seed {env['seed']}",
        f"- wall time {report['wall_time_s']:.1f} s, peak memory {report['peak_memory_gb']:.2f} GB "
        f"({report['peak_memory_kind']})",
        *outputs.lora_lines(report.get("lora")),
        "",
        "## Losses",
        "",
        "| objective | term | start | end | mean of last 10 |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for objective, terms in report["losses"].items():
        for term, values in terms.items():
            if term == "steps":
                continue
            lines.append(
                f"| {objective} | {term} | {values['start']:.4f} | {values['end']:.4f} | {values['end_mean10']:.4f} |"
            )
    lines += outputs.update_lines(report.get("update_sizes") or {})
    if report.get("samples"):
        lines += [
            "",
            "## Answers before and after",
            "",
            "ROUGE-L recall of the answer after unlearning against the answer before (1: unchanged).",
            "",
            "| set | question | before | after | ROUGE-L |",
            "| --- | --- | --- | --- | ---: |",
        ]
        for s in report["samples"]:
            lines.append(
                f"| {s['set']} | {outputs.cell(s['question'], 60)} | {outputs.cell(s['before'])} "
                f"| {outputs.cell(s['after'])} | {s['rouge_l_recall']:.2f} |"
            )
        for name, value in report.get("sample_rouge_mean", {}).items():
            lines.append(f"\nMean ROUGE-L recall, {name}: {value:.3f}")
    if report.get("evals"):
        names = [n for n in ("MU", "UFE", "TFE", "OVR") if any(e.get(n) is not None for e in report["evals"])]
        lines += ["", "## Evaluations during training (TOFU suite, %)", "",
                  "| step | " + " | ".join(names) + " |", "| ---: |" + " ---: |" * len(names)]
        for e in report["evals"]:
            cells = ["n/a" if e.get(n) is None else f"{e[n]:.2f}" for n in names]
            lines.append(f"| {e['step']} | " + " | ".join(cells) + " |")
        notes = {note for e in report["evals"] for note in e.get("notes", {}).values()}
        lines += [f"\nCoverage: {note}" for note in sorted(notes)]
        if report.get("eval_curves"):
            lines += ["", "![curves](evals/curves.png)"]
    lines += best_lines(report)
    lines += stop_lines(report)
    lines += outputs.environment_lines(env)
    return "\n".join(lines) + "\n"


# ---- --continual ----------------------------------------------------------------------------------------------
# Continual unlearning (`doplus unlearn --task-ids 1,2,3 --continual`): forget tasks one after another.
#
# Each task is an ordinary `doplus unlearn` run in OUT/task-T/, started from the previous task's final model; its
# retain set drops every task unlearned so far (the DualOptim+ authors' `forget.py` with TASK_LIST, whose
# `get_task_data` keeps the forget file's rows of the tasks not unlearned yet). Each task is evaluated at its last
# step on its own forget rows, as the authors evaluate each task of a sequence. The same command run again with
# `--resume latest` skips the finished tasks and resumes the unfinished one from its newest checkpoint.
#
#     OUT/config.yaml                the continual run's options
#     OUT/task-T/                    task T's run (config.yaml, metrics.jsonl, report.*, final/, evals/)
#     OUT/continual.json, report.md  one evaluation row per task and the running mean over the tasks so far

CONTINUAL_AGGREGATES = ("MU", "UFE", "TFE", "OVR")


def task_folder(out: Path, task: int) -> Path:
    return out / f"task-{task}"


def _completed_report(folder: Path) -> dict[str, Any] | None:
    path = folder / "report.json"
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    return report if report.get("status") == "completed" else None


CONTINUAL = "doplus unlearn --continual"  # the command the folder's record names (ownership.py)


def continual_outputs(config: UnlearnConfig, order: list[int]) -> tuple[str, ...]:
    """The entries a continual run writes in OUT: recorded before it writes any of them."""
    names = ["config.yaml", "continual.json", "report.md", *(task_folder(Path(), task).name for task in order)]
    if chosen_trackers(config.report_to) and config.tracker_dir is None:
        names.append("trackers")  # the tasks' tracker runs, side by side
    return tuple(names)


def prepare_continual(config: UnlearnConfig, out: Path, order: list[int], write: bool = True) -> None:
    """A fresh OUT, or one this command may continue (--resume) or replace (--overwrite: what its record lists);
    `write` False checks the same without recording or removing anything (`--dry-run`)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: --out exists and is a file, not a folder")
    names = continual_outputs(config, order)
    if config.resume is None:
        then = ", or --resume latest to continue its tasks"
        if write:
            ownership.begin(out, CONTINUAL, names, config.overwrite, then=then)
        else:
            ownership.check_start(out, CONTINUAL, names, config.overwrite, then=then)
        return
    if not ownership.is_started(out, CONTINUAL):
        if not ((out / "config.yaml").is_file() and any(task_folder(out, task).is_dir() for task in order)):
            raise UserError(f"{out}: no `{CONTINUAL}` was started here (no {ownership.RECORD_NAME}), so there is "
                            "nothing to resume; start it without --resume")
        if write:
            ownership.adopt(out, CONTINUAL, names)  # a continual run of a doplus that kept no record
    saved = out / "config.yaml"
    if saved.is_file():
        import yaml

        before = yaml.safe_load(saved.read_text()) or {}
        now = {**config.to_dict(), "out": str(out), "resume": before.get("resume")}
        changed = sorted(k for k in now if k not in ("resume", "overwrite", "accept_changed", "accept_unverified")
                         and before.get(k) != now[k])
        if changed:
            raise UserError(f"{out}: the continual run there was started with other options ({', '.join(changed)})"
                            "; resume with the same ones, or start a new --out")
    if write:
        ownership.claim(out, CONTINUAL, names)


def run_continual(config: UnlearnConfig, console: Console | None,
                  run_unlearn: Callable[[UnlearnConfig, Console | None], dict[str, Any]]) -> dict[str, Any]:
    """Unlearn `config.task_ids` in order, each task one run of `run_unlearn` (`doplus unlearn`'s single run,
    handed over by its command); return the continual report (also written to OUT)."""
    console = console or Console(stderr=True)
    order = list(config.task_ids)
    if config.task_id is not None:
        raise UserError("--task-id and --continual: the tasks come from --task-ids (give --task-ids only)")
    out = Path(config.out or default_out_dir("unlearn"))
    config = config.replace(out=str(out))
    out.mkdir(parents=True, exist_ok=True)
    prepare_continual(config, out, order)
    outputs.write_config(out, {**config.to_dict(), "out": str(out)})
    model, rows = config.model, []
    for index, task in enumerate(order):
        folder = task_folder(out, task)
        report = _completed_report(folder)
        if report is None:
            changes: dict[str, Any] = {"task_id": task, "model": model, "out": str(folder)}
            if config.tracker_dir is None:  # --report-to: the tasks' tracker runs side by side, in OUT/trackers/
                changes.update(tracker_dir=str(out / "trackers"), tracker_run_name=f"{out.name}-task-{task}",
                               tracker_group=config.tracker_group or out.name)
            if index > 0:
                changes["taught"] = None  # the starting model is the previous task's, not the taught one
            changes["eval_every"] = config.eval_every or config.steps  # each task evaluated at its last step at least
            resume = "latest" if config.resume is not None and list_checkpoints(folder / "checkpoints") else None
            # a task folder without a checkpoint starts afresh
            part = copy.deepcopy(config).replace(**changes, resume=resume, overwrite=resume is None)
            console.print(f"continual: task {task} ({index + 1} of {len(order)}), starting from "
                          f"{model or 'the embedded model'}" + (" (resuming)" if part.resume else ""), highlight=False)
            report = run_unlearn(part, console)
        else:
            console.print(f"continual: task {task} finished before, skipped", highlight=False)
        model = str(folder / "final")  # the same path on every process
        if report:
            rows.append(_task_row(task, report))
    if not rows:  # not the main process
        return {}
    summary = {"status": "completed", "out": str(out), "task_ids": order, "rows": rows,
               "running_mean": _continual_running_mean(rows), "final": str(task_folder(out, order[-1]) / "final"),
               "config": config.to_dict()}
    atomic_write_text(out / "report.md", render_continual_report(summary))
    atomic_write_text(out / "continual.json", json.dumps(summary, indent=2) + "\n")
    return summary


def _task_row(task: int, report: dict[str, Any]) -> dict[str, Any]:
    last = (report.get("evals") or [{}])[-1]
    data = report.get("data", {})
    return {"task_id": task, "forget_rows": data.get("forget_rows"), "retain_rows": data.get("retain_rows"),
            "steps": report.get("steps"), "wall_time_s": report.get("wall_time_s"), "folder": str(
                Path(report["final"]).parent), **{name: last.get(name) for name in CONTINUAL_AGGREGATES}}


def _continual_running_mean(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """After each task: the mean of each aggregate over the tasks unlearned so far (each on its own forget rows)."""
    result = []
    for count in range(1, len(rows) + 1):
        entry: dict[str, Any] = {"after_task": rows[count - 1]["task_id"], "tasks": count}
        for name in CONTINUAL_AGGREGATES:
            values = [row[name] for row in rows[:count] if row.get(name) is not None]
            entry[name] = sum(values) / len(values) if len(values) == count else None
        result.append(entry)
    return result


def _continual_cell(value: Any) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def render_continual_report(summary: dict[str, Any]) -> str:
    cfg = summary["config"]
    lines = [f"# doplus unlearn --continual: {cfg['loss']} with {cfg['scheme']}", "",
             f"- forget: {cfg['forget']}, tasks {', '.join(map(str, summary['task_ids']))} in this order, each from "
             "the previous task's final model; retain: " + str(cfg["retain"]) + " without the tasks unlearned so far",
             f"- each task: {cfg['steps']} steps, evaluated at its last step on its own forget rows (TOFU suite, %)",
             "", "## Each task after it was unlearned", "",
             "| task | forget rows | retain rows | steps | wall time (s) | " + " | ".join(CONTINUAL_AGGREGATES) + " |",
             "| ---: | ---: | ---: | ---: | ---: |" + " ---: |" * len(CONTINUAL_AGGREGATES)]
    for row in summary["rows"]:
        lines.append(f"| {row['task_id']} | {row['forget_rows']} | {row['retain_rows']} | {row['steps']} | "
                     f"{row['wall_time_s']:.1f} | "
                     + " | ".join(_continual_cell(row[n]) for n in CONTINUAL_AGGREGATES) + " |")
    lines += ["", "## Running mean over the tasks unlearned so far", "",
              "| after task | tasks | " + " | ".join(CONTINUAL_AGGREGATES) + " |",
              "| ---: | ---: |" + " ---: |" * len(CONTINUAL_AGGREGATES)]
    for entry in summary["running_mean"]:
        lines.append(f"| {entry['after_task']} | {entry['tasks']} | "
                     + " | ".join(_continual_cell(entry[n]) for n in CONTINUAL_AGGREGATES) + " |")
    lines += ["", f"Final model: {summary['final']}"]
    return "\n".join(lines) + "\n"


def print_continual(summary: dict[str, Any], console: Console) -> None:
    table = Table(title="Continual unlearning: each task after it was unlearned (TOFU suite, %)")
    for column in ("task", "forget rows", "retain rows", *CONTINUAL_AGGREGATES):
        table.add_column(column, justify="right")
    for row in summary["rows"]:
        table.add_row(str(row["task_id"]), str(row["forget_rows"]), str(row["retain_rows"]),
                      *(_continual_cell(row[n]) for n in CONTINUAL_AGGREGATES))
    console.print(table)
    console.print(f"model: {summary['final']}   report: {Path(summary['out']) / 'report.md'}")
