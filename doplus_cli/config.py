"""The resolved configuration of an unlearning run: defaults, YAML recipes, command-line overrides.

Precedence, lowest to highest: the dataclass defaults below (the one source of truth for every default),
the recipe (`--recipe FILE.yaml`), the flags given on the command line. Every problem with a value is a
`UserError` naming where the value came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import yaml

from doplus_cli.data.formatting import TEMPLATE_HELP, check_prompt_template
from doplus_cli.data.sources import path_problem
from doplus_cli.errors import UserError, shown
from doplus_cli.losses import FORGET_LOSSES, RETAIN_LOSSES
from doplus_cli.option import (
    CHECKPOINTS,
    DEFAULT,
    DISTRIBUTED,
    EVALUATION,
    MEASURE,
    METHOD,
    MODEL_DATA,
    OUTPUT,
    SEARCH,
    TRAINING,
    option,
)
from doplus_cli.registry import Registry

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11; doplus supports 3.10


@dataclass(frozen=True)
class Scheme:
    """A named way of updating: the paper's name for it (the bench's tables) and the recipe values it sets; the
    other SCHEME_KEYS take their defaults."""

    label: str
    values: dict[str, Any]


# The one table of schemes: `doplus bench schemes --schemes` takes every name, `--scheme` the update schemes they
# are built on (UPDATE_SCHEMES).
SCHEMES: Registry[Scheme] = Registry("scheme", Scheme, {
    "joint": Scheme("Joint", {"scheme": "joint"}),
    "joint-8bit": Scheme("Joint 8bit", {"scheme": "joint", "state_bits": 8}),  # bitsandbytes AdamW8bit
    "alternate": Scheme("Alternate", {"scheme": "alternate"}),
    "alternate-8bit": Scheme("Alternate 8bit", {"scheme": "alternate", "state_bits": 8}),
    "dualoptim": Scheme("DO", {"scheme": "dualoptim"}),
    "dualoptim-8bit": Scheme("DO 8bit", {"scheme": "dualoptim", "state_bits": 8}),
    "doplus": Scheme("DO+", {"scheme": "doplus"}),
    "doplus-8bit": Scheme("DO+ 8bit", {"scheme": "doplus", "state_bits": 8}),
    "doplus-paper": Scheme("DO+ (paper rule)", {"scheme": "doplus", "doplus_rule": "paper"}),
    "doplus-muon": Scheme("DO+ Muon", {"scheme": "doplus", "optimizer": "muon"}),
    # the paper's federated-learning baselines (its Table tab:fl; doplus_cli/optim/fl_schemes.py)
    "scaffold": Scheme("SCAFFOLD", {"scheme": "scaffold"}),
    "fedcm": Scheme("FedCM", {"scheme": "fedcm"}),
    "local-adam": Scheme("Local Adam", {"scheme": "local-adam"}),
    # the paper's ablations of DualOptim+'s base state (its Tables tab:priority_base, tab:update_rule_base)
    "doplus-before-delta": Scheme("DO+ (base before Δ)", {"scheme": "doplus", "base_update": "before-delta"}),
    "doplus-after-delta": Scheme("DO+ (base after Δ)", {"scheme": "doplus", "base_update": "after-delta"}),
    "doplus-grad-minus-delta": Scheme("DO+ (base by g − Δ̂)", {"scheme": "doplus", "base_source": "grad-minus-delta"}),
})
# What a scheme name fixes, whatever the recipe says: `doplus` is 32-bit AdamW-rule DualOptim+ even on a recipe
# that sets state_bits: 8. The bench's --set and --sweep may not change these (choose other scheme names instead).
SCHEME_KEYS = ("scheme", "state_bits", "optimizer", "doplus_rule", "base_update", "base_source")
UPDATE_SCHEMES = tuple(dict.fromkeys(scheme.values["scheme"] for scheme in SCHEMES.values()))  # joint ... doplus

OPTIMIZERS = ("adamw", "muon")
DTYPES = ("auto", "float32", "bfloat16")
PRECISIONS = ("auto", "fp32", "bf16-mixed", "bf16")  # engine/training_precision.py
SAVE_DTYPES = ("auto", "float32", "bfloat16")
STATE_BITS = (32, 8)
FORGET_LOSS_NAMES = tuple(FORGET_LOSSES)  # GA, NPO, DPO, ME, IDK, SimNPO, WGA, SatImp, UNDIAL, CE-U, RMU
RETAIN_LOSS_NAMES = tuple(RETAIN_LOSSES)  # GD, KL, AP, EMBED
REF_OFFLOADS = (None, "cpu", "8bit")
DOPLUS_RULES = ("safeguarded", "paper")
BASE_UPDATES = ("after-param", "before-delta", "after-delta")  # optim.dualoptim_plus.BASE_UPDATES
BASE_SOURCES = ("grad", "grad-minus-delta")  # optim.dualoptim_plus.BASE_SOURCES
# `--eval-protocol` / `doplus evaluate --protocol`: the protocols' settings are evaluation/protocol.py's PROTOCOLS,
# a registry declared over these names
PROTOCOL_NAMES = ("doplus", "paper")
# `--report-to`: the trackers engine/tracking.py hands to accelerate; each one's module and PyPI package share its name
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")

# The help texts of options that several declare alike (a training field and an option of `doplus evaluate`)
# or that are long.
REPORT_TO_HELP = ("Experiment trackers through accelerate: none, or one or more of tensorboard, wandb, mlflow, "
                  "trackio, all (comma-separated; files under OUT/trackers/, W&B offline unless WANDB_MODE says "
                  "otherwise)" + DEFAULT)
SIMILARITY_HELP = ("Record in metrics.jsonl the cosine similarity of the objectives' latest updates and gradients "
                   "(update_cosine, grad_cosine; the paper's Figure 2). Costs a copy of the weights per objective.")
PROTOCOL_HELP = ("Judges, generation budget and lm-eval metrics: doplus (all-MiniLM-L6-v2, --max-new-tokens new "
                 "tokens, Token Entropy over the generated ids) or paper (the DualOptim+ code: "
                 "paraphrase-MiniLM-L6-v2, 200 tokens in total, Token Entropy over the re-tokenised text, TOFU sets "
                 "cut to 300 rows, lm-eval with the BOS token, TruthfulQA mc1, TriviaQA remove_whitespace, GSM8K "
                 "flexible-extract).")
PRECISION_HELP = ("Training precision: fp32 (float32 weights and compute), bf16-mixed (float32 master weights and "
                  "optimizer states, bf16 autocast compute) or bf16 (bf16 weights with a compensated update in every "
                  "optimizer); auto: bf16-mixed where the model loads in bf16 (CUDA), fp32 otherwise.")
SAVE_DTYPE_HELP = "final/'s dtype: float32 or bfloat16; auto: float32 under fp32, bfloat16 under the bf16 precisions."
DTYPE_HELP = ("Load dtype (the reference model of NPO/DPO/KL, LoRA's frozen base under bf16-mixed): auto (bf16 on "
              "CUDA, fp32 on CPU), float32, bfloat16.")
SOURCE_HELP = "FILE.jsonl, FILE.json (one JSON array) or hf:NAME[:CONFIG][@SPLIT]; FILE[START:STOP] takes those rows."
# Worded alike by `doplus evaluate` and the training commands' evaluation options (--eval-*).
ANSWER_TOKENS_HELP = "Greedy tokens per answer."
TOFU_FOLDER_HELP = "Folder of TOFU JSON-lines files [default: hf:locuslab/TOFU"
NLI_DEFAULT = "[default: sileod/deberta-v3-base-tasksource-nli]"
SAFETY_FILES_HELP = "with I-*.json, Q-Harm.json, xstest_prompts.csv [default: download the releases' files]"
GUARD_DEFAULT = "[default: meta-llama/Meta-Llama-Guard-2-8B if it loads, else the offline refusal judge"
SELECT_BY_HELP = ("Keep the evaluated step that is best by METRIC as OUT/best/ beside final/: {metrics} (higher is "
                  "better); METRIC:max or METRIC:min sets the direction [default: keep none]")
STOP_WHEN_HELP = ("End the run at the first evaluation during training where METRIC<=VALUE or METRIC>=VALUE holds "
                  "(METRIC: {metrics}); final/ is the model after that step, and the learning-rate schedule stays "
                  "the one of --steps [default: run every step]")
WARMUP_HELP = "Linear warmup, then linear decay to 0 [default: {warmup}]"


# Keys in a recipe whose relative paths are looked up next to the recipe file first.
# Recipe keys whose value may be a local path, read next to the recipe; and the path keys of a `tasks:` entry.
PATH_KEYS = ("model", "teach", "forget", "retain", "eval_data_dir", "safety", "general", "eval_safety_data_dir")
TASK_PATH_KEYS = ("data", "eval")
# TrainConfig's fields that doplus sets itself: no option, no recipe key, not in config.yaml or a checkpoint
NOT_OPTIONS = ("taught", "compensation")
# Options of which a run takes one: given both on the same level (both flags, both in the recipe) is an error;
# a flag for one replaces the recipe's other.
EXCLUSIVE_OPTIONS = (("steps", "epochs"),)


@dataclass
class TrainConfig:
    """The options every training command shares: model, update scheme, optimizer, training, outputs, LoRA,
    processes, checkpoints. A command's config, in the command's own module, adds its own data and
    objectives; field names are the recipe keys."""

    # A command's own help for an option it shares with the others (align's --steps), by option name
    option_words: ClassVar[dict[str, str]] = {}

    description: str = ""
    # Model
    model: str | None = option(
        None,
        "Hub id, local model folder or .gguf file [default: embedded SmolLM2-135M-Instruct]",
        panel=MODEL_DATA)
    teach: str | None = None  # a multitask recipe taught first (cached); its final model is the starting model
    dtype: str = option(
        "auto",
        DTYPE_HELP + DEFAULT,
        words={"bench optimizer": "Parameter dtype: float32 or bfloat16."},
        variant={"bench optimizer": {"panel": MEASURE, "choices": ("float32", "bfloat16")}},
        panel=MODEL_DATA,
        choices=DTYPES)
    # fp32, bf16-mixed (float32 master weights, bf16 autocast) or bf16 (bf16 weights, compensated updates);
    # auto: bf16-mixed where the model loads in bfloat16 (CUDA), fp32 otherwise (engine/training_precision.py)
    precision: str = option("auto", PRECISION_HELP + DEFAULT, panel=TRAINING, choices=PRECISIONS)
    save_dtype: str = option("auto", SAVE_DTYPE_HELP + DEFAULT, panel=CHECKPOINTS, choices=SAVE_DTYPES)
    trust_remote_code: bool = option(
        False,
        "Allow the model's own code to run." + DEFAULT,
        flags="--trust-remote-code/--no-trust-remote-code",
        panel=MODEL_DATA)
    max_length: int = option(256, "Tokens per example." + DEFAULT, panel=MODEL_DATA)
    # None: the tokenizer's chat template, `question-answer` without one; else a preset (chat, question-answer,
    # phi-tofu, llama2) or a string with {question} (doplus_cli.data.formatting.PROMPT_TEMPLATES)
    prompt_template: str | None = option(None, TEMPLATE_HELP, panel=MODEL_DATA)
    max_new_tokens: int = option(48, "Tokens generated per answer (targets, sample table)." + DEFAULT, panel=EVALUATION)
    # Update scheme and optimizer
    scheme: str = option(
        "doplus",
        "joint, alternate, dualoptim, doplus, or the paper's federated-learning baselines scaffold, fedcm, "
        "local-adam." + DEFAULT,
        panel=METHOD,
        choices=UPDATE_SCHEMES)
    optimizer: str = option("adamw", "adamw or muon (doplus)." + DEFAULT, panel=METHOD, choices=OPTIMIZERS)
    doplus_rule: str = option(
        "safeguarded",
        "DualOptim+'s AdamW rule: safeguarded (floor on the denominator, steps at most 10 lr) or paper "
        "(exactly as published)." + DEFAULT,
        panel=METHOD,
        choices=DOPLUS_RULES)
    # the safeguarded rule's floor ρ on its denominator, a fraction of v̂_B + |v̂_k| (0: the clamp alone);
    # chosen by the criterion in docs/optimizers.md, "Choosing the floor"
    v_floor: float = option(
        0.02,
        "DualOptim+'s safeguarded rule: the floor rho on its denominator, as a fraction of v_B + |v_k|, in "
        "[0, 1) (0: the clamp at 10 lr alone)." + DEFAULT,
        words={"bench optimizer": "With --stability: the safeguarded rule's floors to run, comma-separated, each in "
                                  "[0, 1) (0: the clamp alone), e.g. 0,0.01,0.02,0.05 [default: the default floor]"},
        variant={"bench optimizer": {"type": str, "panel": MEASURE}},
        panel=METHOD)
    # DualOptim+'s base state, the paper's ablations (Tables 10, 11): when it takes the gradient, and what it takes
    base_update: str = option(
        "after-param",
        "DualOptim+'s base state takes the gradient after-param (the rule), before-delta or after-delta "
        "(the paper's ablation)." + DEFAULT,
        panel=METHOD,
        choices=BASE_UPDATES)
    base_source: str = option(
        "grad",
        "DualOptim+'s base state takes grad (the rule) or grad-minus-delta, g minus the delta (the paper's "
        "ablation)." + DEFAULT,
        panel=METHOD,
        choices=BASE_SOURCES)
    state_bits: int = option(32, "32 or 8 (blockwise 8-bit states)." + DEFAULT, panel=METHOD, choices=STATE_BITS)
    betas: tuple[float, float] = option((0.9, 0.95), "AdamW betas as B1,B2" + DEFAULT, panel=TRAINING)
    # Training
    steps: int = option(
        300,
        "Optimizer steps." + DEFAULT,
        words={"bench optimizer": "Timed steps per optimizer (median is reported).",
               "bench precision": "Steps per run (IDK+GD, DualOptim+)."},
        variant={"bench optimizer": {"min": 5, "panel": MEASURE},
                 "bench precision": {"min": 3, "panel": MEASURE}},
        panel=TRAINING)
    lr: float = option(
        1e-5,
        "Peak learning rate." + DEFAULT,
        words={"bench precision": "Peak learning rate, decaying linearly to 0."},
        variant={"bench precision": {"panel": MEASURE}},
        panel=TRAINING)
    batch_size: int = option(4, "Examples per device per micro-step." + DEFAULT, panel=TRAINING)
    grad_accum: int = option(1, "Micro-steps per optimizer step (averaged)." + DEFAULT, panel=TRAINING)
    # None: the command's default (unlearn: the DualOptim+ authors' one epoch)
    warmup_steps: int | None = option(None, WARMUP_HELP.format(warmup="a tenth of the steps"), panel=TRAINING)
    weight_decay: float = option(0.01, "AdamW weight decay." + DEFAULT, panel=TRAINING)
    max_grad_norm: float = option(1.0, "Gradient clipping (0: off)." + DEFAULT, panel=TRAINING)
    seed: int = option(
        0,
        "Seed for weights' RNG and data order." + DEFAULT,
        words={"tune": "Seed of the TPE sampler (each further worker on the study adds its number to it); the runs' "
                       "own seed is the recipe's (--set seed=N).",
               "bench optimizer": ""},
        variant={"tune": {"panel": SEARCH},
                 "bench optimizer": {"panel": MEASURE}},
        panel=TRAINING)
    # Outputs
    out: str | None = option(
        None,
        "Output folder [default: runs/{command}-DATE-TIME]",
        words={"bench precision": "Output folder (one run per mode, precision.json).",
               "bench schemes": "Output folder [default: bench/RECIPE-NAME]",
               "tune": "The study's folder (DIR): its settings, trials, best.yaml and report [default: "
                       "tune/RECIPE-NAME]"},
        panel=OUTPUT)
    overwrite: bool = option(
        False,
        "Replace the run in a non-empty --out folder." + DEFAULT,
        flags="--overwrite/--no-overwrite",
        panel=CHECKPOINTS)
    # LoRA and memory
    lora_rank: int = option(0, "Train LoRA adapters of rank R (peft) [default: {default}, every weight]", panel=METHOD)
    lora_alpha: float = option(16.0, "LoRA alpha." + DEFAULT, panel=METHOD)
    # module names (q_proj,v_proj); None: peft's default for the model
    lora_targets: tuple[str, ...] | None = option(
        None,
        "Modules to adapt, comma-separated [default: peft's for the architecture]",
        panel=METHOD)
    lora_dropout: float = option(0.0, "LoRA dropout." + DEFAULT, panel=METHOD)
    gradient_checkpointing: bool = option(
        False,
        "Recompute activations in backward (less memory)." + DEFAULT,
        flags="--gradient-checkpointing/--no-gradient-checkpointing",
        panel=TRAINING)
    save_adapter_only: bool = option(
        False,
        "final/ holds the LoRA adapter only [default: merged model]",
        flags="--save-adapter-only/--save-merged",
        panel=CHECKPOINTS)
    ref_offload: str | None = option(
        None,
        "cpu: keep the reference model (NPO, DPO, KL) on the CPU; 8bit: load it with LLM.int8 weights (bitsandbytes) "
        "on the device [default: a full copy on the device; its shards under FSDP]",
        panel=TRAINING)
    fsdp: bool = option(
        False,
        "Shard weights, gradients and optimizer states across processes (FSDP2).",
        flags="--fsdp/--no-fsdp",
        words={"bench schemes": "Run every run with FSDP2 (with --num-processes)."},
        variant={"bench schemes": {"flags": "--fsdp"}},
        panel=DISTRIBUTED)
    # Checkpoints and resume
    save_every: int = option(0, "Write checkpoints/step-N/ every N steps [default: never]", panel=CHECKPOINTS)
    save_minutes: float = option(
        0.0,
        "Also write a checkpoint once M minutes have passed since the last one (or the start) [default: never]",
        panel=CHECKPOINTS)
    keep_last: int | None = option(
        None,
        "Keep the newest K checkpoints (K >= 1) [default: all]",
        min=1,
        panel=CHECKPOINTS)
    resume: str | None = option(
        None,
        "Continue the run in --out: `--resume` alone takes its latest checkpoint, `--resume PATH` the checkpoint "
        "folder given.",
        panel=CHECKPOINTS)
    accept_changed: tuple[str, ...] | None = option(
        None,
        "With --resume: go on although these inputs changed since the run started: data, model, software "
        "(comma-separated, or all). Without it such a resumption is refused, naming what changed.",
        panel=CHECKPOINTS)
    accept_unverified: bool = option(
        False,
        "With --resume: go on from a checkpoint that has no manifest.json (doplus 0.1 and 0.2 wrote none), whose "
        "files therefore cannot be checked. Without it such a checkpoint is refused.",
        panel=CHECKPOINTS)
    # Evaluation during training, at every N-th step and at the end
    eval_every: int = option(
        0,
        "Evaluate every N steps (and at the end) into OUT/evals/step-N/ [default: never]",
        panel=EVALUATION)
    # Keep the evaluated step that is best by this metric as OUT/best/ (unlearn: MU, UFE, TFE, OVR; multitask: a
    # task's name or average); METRIC:max or METRIC:min names the direction, else the metric's own
    select_by: str | None = option(None, SELECT_BY_HELP.format(metrics="MU, UFE, TFE or OVR"), panel=EVALUATION)
    # End the run early once an evaluation during training meets a bound (a matched-forgetting comparison trains each
    # scheme until its forget metric reaches the same value); the schedule is the one of --steps
    stop_when: str | None = option(None, STOP_WHEN_HELP.format(metrics="MU, UFE, TFE or OVR"), panel=EVALUATION)
    # The paper's Figure 2 diagnostic: cosine of the objectives' latest updates and gradients, in metrics.jsonl
    log_update_similarity: bool = option(
        False,
        SIMILARITY_HELP,
        words={"bench schemes": "Record update_cosine/grad_cosine in every run and compare them."},
        panel=OUTPUT)
    # Experiment trackers through accelerate (engine/tracking.py): none, or tensorboard, wandb, mlflow, trackio, all
    report_to: tuple[str, ...] = option(("none",), REPORT_TO_HELP, panel=OUTPUT, choices=TRACKERS, many=True)
    tracker_project: str | None = None  # None: doplus-COMMAND (W&B and trackio project, MLflow experiment)
    tracker_run_name: str | None = None  # None: the --out folder's name
    tracker_group: str | None = None  # W&B and trackio group, an MLflow tag (bench schemes: scheme and sweep value)
    tracker_dir: str | None = None  # None: OUT/trackers; WANDB_DIR, MLFLOW_TRACKING_URI, TRACKIO_DIR go first
    # Set by doplus, never by an option or a recipe, and not recorded with the options (NOT_OPTIONS):
    # the teaching stage's report entry (engine/teach.py), None without a teaching stage
    taught: dict[str, Any] | None = field(default=None, repr=False)
    # False only in `doplus bench precision`: --precision bf16 updated in place without compensation buffers
    compensation: bool = field(default=True, repr=False)

    def __post_init__(self) -> None:
        # A config made in code (a test, a bench, `replace`) takes a list option as its flag's text too; what a
        # recipe or a flag gives is parsed by `coerce_option`, at the boundary, the same way.
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), list_kind(f.type)
            if kind is not None and value is not None and not isinstance(value, tuple):
                object.__setattr__(self, f.name, list_value(value, *kind, f"--{f.name.replace('_', '-')}"))

    def to_dict(self) -> dict[str, Any]:
        """The options as config.yaml, a checkpoint and the teaching cache record them: each list option in the
        form its flag is typed (`q_proj,v_proj`), so what a run records reads as it was given."""
        data = dataclasses.asdict(self)
        for name in NOT_OPTIONS:
            data.pop(name)
        data["betas"] = list(self.betas)
        for name in list_fields(type(self)):
            data[name] = recorded(data[name])
        return data

    # A validated config is final: what was checked is what runs, and no code downstream changes a value under
    # the code that holds the same object. What doplus derives later (a run's steps, precision and folder when it
    # opens, the taught model, a continual task's settings) goes into a new config made by `replace`.
    def __setattr__(self, name: str, value: Any) -> None:
        if self.final:
            raise dataclasses.FrozenInstanceError(
                f"cannot assign to field '{name}': a validated {type(self).__name__} is final; make a new one with "
                f"config.replace({name}=...)")
        object.__setattr__(self, name, value)

    @property
    def final(self) -> bool:
        """Whether the config was validated (and so refuses assignment)."""
        return self.__dict__.get("_final", False)

    def validate(self) -> None:
        """Check option values and combinations (`check`), then make the config final."""
        self.check()
        object.__setattr__(self, "_final", True)  # not a field: neither recorded nor compared

    def check(self) -> None:
        """Check option values and combinations; every message is one line naming the option. A command's config
        extends it with its own checks (which may still settle a value, e.g. unlearn's retain_freq)."""
        validate_training(self)

    def selectable_metrics(self) -> dict[str, bool]:
        """The metrics `--select-by` takes for a run of this config, each with whether higher is better (the
        command's config says; none here)."""
        return {}

    def stoppable_metrics(self) -> tuple[str, ...]:
        """The metrics `--stop-when` takes: what the evaluation during training reports (the command's config
        says; by default the `--select-by` metrics)."""
        return tuple(self.selectable_metrics())

    def replace(self, **changes: Any) -> Self:
        """A copy with `changes`, final when this config is. The changes are values doplus settles itself (the
        run's derived values, the taught model, a continual task's folder), not options: they are not checked
        again, since a check of the options could refuse a combination doplus made on purpose (a continual task
        with nothing to resume under --accept-changed)."""
        new = dataclasses.replace(self, **changes)
        if self.final:
            object.__setattr__(new, "_final", True)
        return new


# The names of multitask's metrics, checked here before the evaluation is imported: the one list of them, over which
# evaluation/task_metrics.py declares its registry (it refuses any other name and every one must have a metric).
TASK_METRIC_NAMES = ("exact", "choice", "edit_sim", "rouge_l")
# A task's keys (recipe `tasks:` entries, `--task NAME=SOURCE,key=value,...`) and their defaults.
TASK_DEFAULTS: dict[str, Any] = {"name": None, "data": None, "metric": "exact", "freq": 1, "weight": 1.0,
                                 "eval": None, "lr_multiplier": 1.0}
_TASK_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
RESERVED_TASK_NAMES = ("joint", "total")  # a joint step's name and its summed loss term
AVERAGE = "average"  # the mean of the tasks' scores, reported beside each task's (commands/multitask.py)





# The options that take a list: their fields are typed `tuple[str, ...]` or `tuple[int, ...]` (whole numbers >= 0).
# A flag gives one comma-separated text (`--lora-targets q_proj,v_proj`), a recipe that text or a YAML list; both
# are parsed once, by `list_value`, and the engine only ever sees the tuple. A run records each in its flag's form
# (`recorded`).
LIST_KINDS: dict[str, type] = {"tuple[str, ...]": str, "tuple[int, ...]": int}


def list_kind(annotation: Any) -> tuple[type, bool] | None:
    """A field's (item type, optional) when its annotation is a list option's, else None."""
    kind = str(annotation)
    item = LIST_KINDS.get(kind.removesuffix(" | None"))
    return None if item is None else (item, kind.endswith(" | None"))


def list_fields(cls: type[TrainConfig]) -> dict[str, type]:
    """`cls`'s list options, each with the type of its items."""
    return {f.name: kind[0] for f in dataclasses.fields(cls) if (kind := list_kind(f.type)) is not None}


def list_value(value: Any, item: type, optional: bool, where: str) -> tuple[Any, ...] | None:
    """A list option's value as the engine takes it: `q_proj, v_proj,` or [q_proj, v_proj] -> ("q_proj", "v_proj"),
    `5,6,7` -> (5, 6, 7) for whole numbers; empty items dropped, and None for an optional option given no item. One
    line naming `where` for an item that is not one."""
    parts = value.split(",") if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else [value]
    items: list[Any] = []
    for part in parts:
        if part is None or isinstance(part, (bool, dict, list, tuple, float)):
            raise UserError(f"{where} must be {'whole numbers' if item is int else 'names'} separated by commas, "
                            f"got {shown(value)}")
        text = str(part).strip()
        if text and item is int and not text.isdigit():
            raise UserError(f"{where} {shown(recorded(value), quoted=False)}: {shown(text)} is not a whole number "
                            ">= 0")
        if text:
            items.append(int(text) if item is int else text)
    return None if optional and not items else tuple(items)


def recorded(value: Any) -> Any:
    """A list option's value as its flag is typed (`(5, 6, 7)` -> `5,6,7`); None and any other value as it is."""
    return ",".join(str(item) for item in value) if isinstance(value, (list, tuple)) else value


def recipe_form(key: str, value: Any, cls: type[TrainConfig]) -> Any:
    """A checked value as a recipe writes it: a list option in its flag's form, any other as it is."""
    return recorded(value) if key in list_fields(cls) else value


def parse_task_ids(text: Any, flag: str = "--task-ids") -> tuple[int, ...]:
    """`1,2,3` -> (1, 2, 3): whole numbers >= 0, none repeated (`bench schemes --task-ids`, `--tune-task`)."""
    ids = list_value(text, int, True, flag)
    if ids is None:
        raise UserError(f"{flag} is empty: give one or more task ids, e.g. {flag} 1,2,3")
    check_distinct_tasks(ids, flag)
    return ids


def check_distinct_tasks(ids: tuple[int, ...], flag: str) -> None:
    repeated = next((task for task in ids if ids.count(task) > 1), None)
    if repeated is not None:
        raise UserError(f"{flag} {recorded(ids)}: task {repeated} is given twice")


def parse_cycle(text: str) -> tuple[int, int]:
    """`F_s:F_g` (or `F_s,F_g`) -> (safety steps, general steps) per cycle, each a whole number >= 1."""
    items = [item.strip() for item in str(text).replace(",", ":").split(":")]
    if len(items) != 2 or not all(item.isdigit() and int(item) >= 1 for item in items):
        raise UserError(f"--freq {shown(str(text), quoted=False)}: write F_s:F_g, safety steps then general steps "
                        "per cycle, each a whole number >= 1 (the paper's 1:10)")
    return int(items[0]), int(items[1])


def task_from_option(text: str) -> dict[str, Any]:
    """`NAME=SOURCE[,metric=M][,freq=F][,weight=W][,eval=FILE][,lr_multiplier=X]` -> a task dict."""
    first, *rest = text.split(",")
    name, sep, data = first.partition("=")
    if not sep or not name.strip() or not data.strip():
        raise UserError(f"--task {shown(text)}: write NAME=SOURCE[,metric=M][,freq=F][,weight=W][,eval=FILE] "
                        "(a task needs a name and a data source)")
    task: dict[str, Any] = {"name": name.strip(), "data": data.strip()}
    for item in rest:
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"--task {shown(text)}: {shown(item)} is not KEY=VALUE")
        task[key.strip()] = value.strip()
    return _checked_task(task, f"--task {shown(text)}")


def _checked_task(task: Any, where: str) -> dict[str, Any]:
    """A task dict with every key known, typed and defaulted, or one line naming where it came from."""
    if not isinstance(task, dict):
        raise UserError(f"{where}: a task is a mapping with name, data and optionally metric, freq, weight, eval")
    for key in task:
        if key not in TASK_DEFAULTS:
            hint = difflib.get_close_matches(str(key), list(TASK_DEFAULTS), n=1)
            raise UserError(f"{where}: unknown task key {shown(str(key))}"
                            + (f" (did you mean '{hint[0]}'?)" if hint else ""))
    task = {**TASK_DEFAULTS, **task}
    if not task["name"] or not isinstance(task["name"], str):
        raise UserError(f"{where}: a task without a name (give it name: NAME)")
    name = task["name"]
    if not _TASK_NAME.match(name) or name in RESERVED_TASK_NAMES:
        raise UserError(f"{where}: task name {shown(name)} must start with a letter and hold only letters, digits, "
                        f"'_' and '-', and not be {' or '.join(RESERVED_TASK_NAMES)}")
    if not task["data"] or not isinstance(task["data"], str):
        raise UserError(f"{where}: task {shown(name)} has no data source (data: FILE.jsonl or "
                        "hf:NAME[:CONFIG][@SPLIT])")
    if task["metric"] not in TASK_METRIC_NAMES:
        raise UserError(f"{where}: task {shown(name)}: unknown metric {shown(task['metric'])}: choose one of "
                        f"{', '.join(TASK_METRIC_NAMES)}")
    for key, kind in (("freq", int), ("weight", float), ("lr_multiplier", float)):
        value, field_where = task[key], f"{where}: task {shown(name)}: {key}"
        try:
            if isinstance(value, bool) or (kind is int and float(value) != int(float(value))):
                raise ValueError
            task[key] = kind(float(value)) if kind is int else finite(float(value), field_where)
        except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
            raise UserError(f"{field_where} must be a number, got {shown(value)}") from None
        if not task[key] >= 0:
            raise UserError(f"{where}: task {shown(name)}: {key} must be >= 0, got {shown(value)}")
    return task


def field_names(cls: type[TrainConfig]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.name not in NOT_OPTIONS]


def default_of(name: str, cls: type[TrainConfig]) -> Any:
    """The default of one option, for help texts (so the CLI never repeats a default)."""
    return {f.name: f.default for f in dataclasses.fields(cls)}[name]


# A recipe is a short file of option values (the shipped ones hold at most 5 KB), and is read within these bounds
# whoever wrote it: at most 256 KiB (PyYAML's parser reads about 100 KB a second at worst), mappings and lists
# nested at most 20 deep (the shipped recipes nest 3 deep), no YAML anchors or aliases (one alias may stand for a
# value of any size: a "billion laughs" file of a few hundred bytes), no key twice in a mapping (YAML would keep the
# last one without a word).
MAX_RECIPE_BYTES = 256 * 2**10
MAX_RECIPE_DEPTH = 20


class RecipeRefused(yaml.MarkedYAMLError):
    """A recipe that is valid YAML but outside what a recipe may hold; its mark is where."""


class RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader with a recipe's bounds: anchors and aliases, nesting deeper than MAX_RECIPE_DEPTH and a
    key given twice in a mapping are refused where they are found, and a value that a constructor cannot make (an
    integer past Python's digit limit, a date that does not exist) is refused with its mark."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent, index):  # PyYAML's signature
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            what = "an alias" if isinstance(event, yaml.AliasEvent) else "an anchor"
            sign = "*" if isinstance(event, yaml.AliasEvent) else "&"
            raise RecipeRefused(problem=f"{what} ({sign}{event.anchor[:30]}): recipes take no YAML "
                                        "anchors or aliases, write each value out", problem_mark=event.start_mark)
        nested = isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent))
        if nested and self.depth >= MAX_RECIPE_DEPTH:
            raise RecipeRefused(problem=f"nested more than {MAX_RECIPE_DEPTH} levels deep, deeper than a recipe's "
                                        "values go", problem_mark=event.start_mark)
        self.depth += nested
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= nested

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as error:
            value = node.value if isinstance(node, yaml.ScalarNode) else node.tag
            reason = " ".join(str(error).split())[:80]
            raise RecipeRefused(problem=f"cannot read {shown(value)} ({reason})",
                                problem_mark=node.start_mark) from None

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            self.flatten_mapping(node)
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                twice = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the constructor below says so
                continue
            if twice:
                raise RecipeRefused(problem=f"key {shown(key)} is given twice in the same mapping (YAML would keep "
                                            "the last one without a word); give it once",
                                    problem_mark=key_node.start_mark)
        return super().construct_mapping(node, deep)


def read_recipe(path: str | os.PathLike) -> dict[str, Any]:
    """A YAML recipe's mapping as written (keys not checked), or one line saying why it cannot be read: naming the
    file and, where YAML or a recipe's bounds (`RecipeLoader`, MAX_RECIPE_BYTES) are broken, the line."""
    path = Path(path)
    problem = path_problem(path)
    if problem is not None:
        raise UserError(f"{path}: recipe file not found" if problem == "file not found" else f"{path}: {problem}")
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_RECIPE_BYTES + 1)
    except OSError as error:
        raise UserError(f"{path}: cannot read the recipe ({error.strerror or type(error).__name__})") from error
    if len(raw) > MAX_RECIPE_BYTES:
        raise UserError(f"{path}: larger than {MAX_RECIPE_BYTES // 2**10} KiB, the most a recipe may be (a recipe "
                        "holds option values; data goes in the files it names)")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise UserError(f"{path}:{line}: cannot read the recipe (byte 0x{raw[error.start]:02x} is not UTF-8; a "
                        "recipe is UTF-8 text)") from None
    loader = None
    try:
        loader = RecipeLoader(text)  # its reader refuses control characters (a NUL byte) at once
        data = loader.get_single_data()
    except RecipeRefused as error:
        raise UserError(f"{path}:{error.problem_mark.line + 1}: {error.problem}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        if mark is None and isinstance(getattr(error, "position", None), int):  # yaml.reader.ReaderError
            where = f"{path}:{text.count(chr(10), 0, error.position) + 1}"
        else:
            where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(error, "problem", None) or getattr(error, "reason", None) or str(error)
        problem = " ".join(str(problem).split())[:120]
        raise UserError(f"{where}: not valid YAML ({problem})") from None
    finally:
        if loader is not None:
            loader.dispose()
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: a recipe must be a mapping of option: value, got {type(data).__name__}")
    return data


def recipe_options(path: str | os.PathLike, names: list[str],
                   path_keys: tuple[str, ...] = PATH_KEYS) -> dict[str, Any]:
    """A YAML recipe's {option: value}: each key (dashes read as underscores) one of `names`, else one line naming
    the file and the key; a relative path under one of `path_keys` looked up next to the recipe first."""
    path = Path(path)
    data = read_recipe(path)
    values: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key not in names:
            hint = difflib.get_close_matches(key, names, n=1)
            suggestion = f" (did you mean '{hint[0]}'?)" if hint else ""
            raise UserError(f"{path}: unknown option {shown(str(raw_key))}{suggestion}")
        if key in path_keys and isinstance(value, str):
            value = _next_to_recipe(value, path.parent)
        values[key] = value
    return values


def load_recipe(path: str | os.PathLike, cls: type[TrainConfig]) -> dict[str, Any]:
    """Read a YAML recipe into {field: value}, with relative data and model paths made usable."""
    values = recipe_options(path, field_names(cls))
    if "tasks" in values:
        values["tasks"] = _recipe_tasks(values["tasks"], Path(path))
    return values


def _recipe_tasks(tasks: Any, path: Path) -> list[dict[str, Any]]:
    """A recipe's `tasks:` list, each checked, with data and eval paths looked up next to the recipe."""
    if not isinstance(tasks, list) or not tasks:
        raise UserError(f"{path}: tasks must be a list of tasks (name, data, metric, freq, weight, eval)")
    checked = []
    for number, task in enumerate(tasks, start=1):
        task = _checked_task(task, f"{path}: task {number}")
        for key in TASK_PATH_KEYS:
            if isinstance(task[key], str):
                task[key] = _next_to_recipe(task[key], path.parent)
        checked.append(task)
    return checked


def _next_to_recipe(value: str, folder: Path) -> str:
    """A relative path as seen from the recipe's folder, when it exists there (`FILE[START:STOP]` included)."""
    if value.startswith("hf:") or os.path.isabs(value):
        return value
    candidate = folder / value
    if candidate.exists():
        return str(candidate)
    base, bracket, rows = value.partition("[")
    if bracket and (folder / base).exists():
        return str(folder / base) + bracket + rows
    return value


def resolve_config(recipe: str | None, overrides: dict[str, Any], cls: type[TrainConfig]):
    """Defaults, then the recipe, then command-line overrides (None means "not given"); validated. A value the
    recipe set that validation refuses is said against the recipe's file and key (`said_against_recipe`)."""
    config, sources = _resolve(recipe, overrides, cls)
    try:
        config.validate()
    except UserError as error:
        said = said_against_recipe(error, recipe, sources)
        if said is error:
            raise
        raise said from None
    return config


# The option a validation message is about: the first flag it names, or the name in "unknown NAME 'VALUE'" (`_choice`)
_SUBJECT = re.compile(r"--([a-z][a-z0-9-]*)|^unknown ([a-z][a-z0-9-]*) ")


def said_against_recipe(error: UserError, recipe: str | None, sources: dict[str, str]) -> UserError:
    """`error` from validation (whose messages name options by their flags, `--lr ...`), said against the recipe's
    file and key when the option it is about took its value from the recipe: `--lr must be ...` becomes
    `RECIPE: option 'lr' must be ...`; an error about a flag given on the command line stays as it is."""
    message = str(error)
    subject = _SUBJECT.search(message)
    if recipe is None or subject is None:
        return error
    key = (subject[1] or subject[2]).replace("-", "_")
    if sources.get(key) != str(recipe):
        return error
    if subject[1] and subject.start() == 0:  # "--lr must be ..." -> "option 'lr' must be ..."
        message = f"option '{key}'{message[subject.end():]}"
    else:
        message = f"option '{key}': {message}"
    return type(error)(f"{recipe}: {message}")


def _resolve(recipe: str | None, overrides: dict[str, Any], cls: type[TrainConfig]):
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if recipe is not None:
        for key, value in load_recipe(recipe, cls).items():
            values[key] = value
            sources[key] = str(recipe)
    for key, value in overrides.items():
        if value is not None:
            values[key] = value
            sources[key] = "command line"
    for first, second in EXCLUSIVE_OPTIONS:
        if first in values and second in values:
            if sources[first] == sources[second]:
                given = (f"--{first} {values[first]} and --{second} {values[second]}" if sources[first] ==
                         "command line" else f"{sources[first]}: {first} and {second}")
                raise UserError(f"{given}: give one or the other (--{second} sets the steps from the data's size)")
            dropped = first if sources[first] != "command line" else second
            del values[dropped], sources[dropped]
    config = cls()
    for key, value in values.items():
        setattr(config, key, coerce_option(key, value, sources[key], cls))
    return config, sources


def coerce_option(key: str, value: Any, source: str, cls: type[TrainConfig]) -> Any:
    """Turn a recipe or flag value into the field's type, or say which option and where it came from."""
    kind = {f.name: f.type for f in dataclasses.fields(cls)}[key]
    where = f"--{key.replace('_', '-')}" if source == "command line" else f"{source}: option '{key}'"
    if value is None:
        if "None" in kind:
            return None
        raise UserError(f"{where} cannot be empty")
    try:
        if kind.startswith("bool"):
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "yes", "1", "on"):
                return True
            if str(value).lower() in ("false", "no", "0", "off"):
                return False
            raise ValueError
        if kind.startswith("int"):
            if isinstance(value, bool) or float(value) != int(float(value)):
                raise ValueError
            return int(float(value))
        if kind.startswith("float"):
            if isinstance(value, bool):
                raise ValueError
            return finite(float(value), where)  # YAML reads 1e-5 (no dot) as a string; float() takes it
        if list_kind(kind) is not None:
            return list_value(value, *list_kind(kind), where)
        if kind.startswith("tuple"):
            items = value.split(",") if isinstance(value, str) else list(value)
            if len(items) != 2 or any(isinstance(item, bool) for item in items):
                raise ValueError
            return (finite(float(items[0]), where), finite(float(items[1]), where))
        if kind.startswith("dict"):
            return dict(value)
        if kind.startswith("list"):
            if not isinstance(value, list):
                raise ValueError
            return list(value)
        if isinstance(value, (dict, list)):
            raise ValueError
        return str(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf), float(10**400)
        expected = kind.replace(" | None", "").replace("tuple[float, float]", "two numbers like 0.9,0.95")
        raise UserError(f"{where} must be {expected}, got {shown(value)}") from None


def finite(number: float, where: str) -> float:
    """`number`, or one line (`where` must be a finite number) for inf and nan: every float an option or a recipe
    sets is finite (a learning rate, a weight or a beta of inf or nan makes every update inf or nan)."""
    if not math.isfinite(number):
        raise UserError(f"{where} must be a finite number, got {number}")
    return number


def _choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise UserError(f"unknown {name} {shown(str(value))}: choose one of {', '.join(map(str, choices))}")


# Their base update or merge runs once per period: 32-bit states. engine/optimizers.py's FL_OPTIMIZERS is declared
# over these names.
FL_SCHEMES = ("scaffold", "fedcm", "local-adam")



def check_protocol(name: str) -> str:
    """`name`, or a one-line error for a protocol that evaluation/protocol.py does not define."""
    if name not in PROTOCOL_NAMES:
        raise UserError(f"unknown --protocol {shown(str(name))}: choose {', '.join(PROTOCOL_NAMES)}")
    return name




def _tracker_installed(name: str) -> bool:
    """Whether the tracker's package can be imported (found, not imported: trackio reads TRACKIO_DIR on import)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def chosen_trackers(given: tuple[str, ...]) -> list[str]:
    """`--report-to`'s trackers: (none,) -> []; (tensorboard, mlflow) -> both; (all,) -> every installed tracker.
    Unknown names and trackers whose package is missing are one line each (exit 2), before any model is loaded."""
    items = [item.lower() for item in given]
    if not items or items == ["none"]:
        return []
    unknown = [item for item in items if item not in (*TRACKERS, "all")]
    if unknown or ("none" in items):
        bad = unknown[0] if unknown else "none"
        raise UserError(f"--report-to {shown(recorded(given), quoted=False)}: unknown tracker {shown(bad)}: choose "
                        f"none, or one or more of {', '.join(TRACKERS)}, all (comma-separated)")
    if "all" in items:
        names = [name for name in TRACKERS if _tracker_installed(name)]
        if not names:
            raise UserError(f"--report-to all: no tracker is installed; pip install -e '.[tracking]' in the doplus "
                            f"checkout (or one of: {', '.join(TRACKERS)})")
        return names
    names = list(dict.fromkeys(items))
    for name in names:
        if not _tracker_installed(name):
            raise UserError(f"--report-to {name}: the {name} package is not installed; "
                            f"pip install {name} (or pip install -e '.[tracking]' in the doplus checkout)")
    return names





def validate_training(config: TrainConfig) -> None:
    """Check the options every training command shares; every message is one line naming the option."""
    _choice("scheme", config.scheme, UPDATE_SCHEMES)
    _choice("optimizer", config.optimizer, OPTIMIZERS)
    _choice("dtype", config.dtype, DTYPES)
    _choice("precision", config.precision, PRECISIONS)
    _choice("save-dtype", config.save_dtype, SAVE_DTYPES)
    check_precision(config)
    _choice("state-bits", config.state_bits, STATE_BITS)
    _choice("doplus-rule", config.doplus_rule, DOPLUS_RULES)
    check_scheme_options(config)
    for name in ("steps", "batch_size", "grad_accum", "max_length", "max_new_tokens"):
        if getattr(config, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(config, name)}")
    if config.warmup_steps is not None and config.warmup_steps < 0:
        raise UserError(f"--warmup-steps must be >= 0, got {config.warmup_steps}")
    for name in ("lr", "weight_decay", "max_grad_norm"):
        value = getattr(config, name)
        if not value >= 0 or value != value:
            raise UserError(f"--{name.replace('_', '-')} must be a number >= 0, got {value}")
    if not all(0.0 <= b < 1.0 for b in config.betas):
        raise UserError(f"--betas must be two numbers in [0, 1), got {config.betas}")
    if config.lora_rank < 0:
        raise UserError(f"--lora-rank must be >= 0, got {config.lora_rank}")
    if config.save_adapter_only and config.lora_rank == 0:
        raise UserError("--save-adapter-only needs LoRA (--lora-rank R)")
    if config.ref_offload not in REF_OFFLOADS:
        raise UserError(f"unknown --ref-offload {shown(config.ref_offload)}: choose cpu (keep the reference model on "
                        "the CPU) or 8bit (LLM.int8 weights through bitsandbytes)")
    for name in ("save_every", "eval_every", "save_minutes"):
        if getattr(config, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(config, name)}")
    if config.keep_last is not None and config.keep_last < 1:
        raise UserError(f"--keep-last must be at least 1 (the newest checkpoint is always kept), got "
                        f"{config.keep_last}; leave it out to keep every checkpoint")
    if config.resume is not None and config.out is None:
        raise UserError("--resume needs --out: the folder of the run to continue")
    if config.resume is not None and config.overwrite:
        raise UserError("--resume and --overwrite: --resume continues the run in --out, --overwrite replaces it; "
                        "give one of them")
    if config.accept_changed and config.resume is None:
        raise UserError("--accept-changed applies to a resumed run: add --resume")
    if config.accept_unverified and config.resume is None:
        raise UserError("--accept-unverified applies to a resumed run: add --resume")
    parse_accept_changed(config.accept_changed)
    check_prompt_template(config.prompt_template)
    chosen_trackers(config.report_to)  # an unknown tracker or a missing package: one line, before any model loads
    if config.optimizer == "muon" and config.scheme != "doplus":
        raise UserError("--optimizer muon is built for --scheme doplus only; use adamw with the other schemes")


# What `--accept-changed` may accept on resume (engine/inputs.py records and compares them)
ACCEPT_CHANGED_KINDS = ("data", "model", "software")


def parse_accept_changed(given: tuple[str, ...] | None) -> set[str]:
    """`--accept-changed data,model` -> {"data", "model"}; `all` is every kind."""
    if not given:
        return set()
    kinds = set(given)
    if "all" in kinds:
        return set(ACCEPT_CHANGED_KINDS)
    unknown = sorted(kinds - set(ACCEPT_CHANGED_KINDS))
    if unknown:
        raise UserError(f"--accept-changed {shown(recorded(given), quoted=False)}: unknown kind {shown(unknown[0])} "
                        f"(choose from {', '.join(ACCEPT_CHANGED_KINDS)}, all; comma-separated)")
    return kinds


def check_scheme_options(config: TrainConfig) -> None:
    """The base-update ablations belong to DualOptim+'s AdamW rule; the federated-learning schemes keep 32-bit
    states."""
    _choice("base-update", config.base_update, BASE_UPDATES)
    _choice("base-source", config.base_source, BASE_SOURCES)
    if not 0.0 <= config.v_floor < 1.0:  # also refuses NaN
        raise UserError(f"--v-floor must be a number in [0, 1), got {config.v_floor}")
    if config.v_floor != TrainConfig.v_floor and (config.scheme != "doplus" or config.doplus_rule != "safeguarded"):
        raise UserError(f"--v-floor {config.v_floor:g} sets the floor of DualOptim+'s safeguarded rule: it needs "
                        f"--scheme doplus --doplus-rule safeguarded, not --scheme {config.scheme} --doplus-rule "
                        f"{config.doplus_rule}")
    ablation = (config.base_update, config.base_source) != (BASE_UPDATES[0], BASE_SOURCES[0])
    if ablation and (config.scheme != "doplus" or config.optimizer != "adamw"):
        raise UserError(f"--base-update {config.base_update} --base-source {config.base_source} change DualOptim+'s "
                        f"AdamW rule: they need --scheme doplus --optimizer adamw, not --scheme {config.scheme} "
                        f"--optimizer {config.optimizer}")
    if config.scheme in FL_SCHEMES and config.state_bits != 32:
        raise UserError(f"--scheme {config.scheme} keeps 32-bit states: use --state-bits 32 (8-bit states are "
                        "for joint, alternate, dualoptim and doplus)")


def check_precision(config: TrainConfig) -> None:
    """--precision against --dtype and the optimizer: contradictions are one line each."""
    if config.precision == "bf16" and config.dtype == "float32":
        raise UserError("--precision bf16 trains bfloat16 weights, --dtype float32 asks for float32 ones: use "
                        "--precision bf16-mixed (float32 master weights, bf16 compute) or --dtype bfloat16/auto")
    if config.precision == "fp32" and config.dtype == "bfloat16":
        raise UserError("--precision fp32 trains float32 weights, --dtype bfloat16 asks for bfloat16 ones: use "
                        "--precision bf16-mixed (float32 master weights, bf16 compute) or --dtype float32/auto")
    if config.precision == "bf16" and config.state_bits == 8 and config.scheme != "doplus":
        raise UserError(f"--precision bf16 with --state-bits 8 needs --scheme doplus: the {config.scheme} scheme's "
                        "8-bit AdamW (bitsandbytes) has no compensated update for bf16 weights; use 32-bit states "
                        "or --precision bf16-mixed")




def check_no_reference(config: TrainConfig, command: str) -> None:
    """`ref_offload` places the frozen reference model of unlearn's NPO, DPO, KL and UNDIAL; multitask and align
    train with CE alone, which builds none, so the key would do nothing there: refused rather than ignored."""
    if config.ref_offload is not None:
        raise UserError(f"ref_offload {config.ref_offload}: doplus {command} trains with CE, which has no reference "
                        "model; ref_offload places the reference model of unlearn's NPO, DPO, KL and UNDIAL")


# `--select-by METRIC:max|min`. Which metrics a command's evaluation during training reports, and which way is better
# for each, its config class says (`selectable_metrics`: unlearn's TOFU aggregates, multitask's task scores).
DIRECTIONS = {"max": True, "min": False}


def parse_select_by(text: str, known: dict[str, bool]) -> tuple[str, bool]:
    """`--select-by METRIC[:max|:min]` -> (metric, higher is better); one line for an unknown metric."""
    metric, _, direction = str(text).partition(":")
    metric = metric.strip()
    if metric not in known:
        raise UserError(f"--select-by {shown(text, quoted=False)}: unknown metric {shown(metric)}: choose one of "
                        f"{', '.join(known)} (the values the evaluation during training reports)")
    if direction and direction.strip() not in DIRECTIONS:
        raise UserError(f"--select-by {shown(text, quoted=False)}: the direction after ':' is max or min, got "
                        f"{shown(direction)}")
    return metric, DIRECTIONS[direction.strip()] if direction else known[metric]




# `--stop-when METRIC<=VALUE` / `METRIC>=VALUE`: the bound that ends a run at an evaluation during training.
_STOP_WHEN = re.compile(r"^\s*([A-Za-z_][\w/.\-]*)\s*(<=|>=)\s*(\S+)\s*$")


@dataclass(frozen=True)
class StopRule:
    """`--stop-when`: the run ends at the first evaluation whose `metric` is `op` `bound`."""

    metric: str
    op: str  # <= or >=
    bound: float

    def text(self) -> str:
        return f"{self.metric}{self.op}{self.bound:g}"

    def holds(self, row: dict[str, Any]) -> bool:
        """Whether an evaluation's row meets the bound; a missing or non-finite value does not."""
        value = row.get(self.metric)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            return False
        return value <= self.bound if self.op == "<=" else value >= self.bound


def parse_stop_when(text: str, known: Sequence[str]) -> StopRule:
    """`METRIC<=VALUE` or `METRIC>=VALUE`, METRIC among `known`; one line naming what is wrong otherwise."""
    match = _STOP_WHEN.match(str(text))
    if not match:
        raise UserError(f"--stop-when {shown(text, quoted=False)}: write METRIC<=VALUE or METRIC>=VALUE, e.g. "
                        "forget_Q_A_ROUGE<=0.05")
    metric, op, number = match.groups()
    if metric not in known:
        raise UserError(f"--stop-when {shown(text, quoted=False)}: unknown metric {shown(metric)}: choose one of "
                        f"{', '.join(known)} (the values the evaluation during training reports)")
    try:
        bound = float(number)
    except ValueError:
        raise UserError(f"--stop-when {shown(text, quoted=False)}: {shown(number)} is not a number") from None
    if not math.isfinite(bound):
        raise UserError(f"--stop-when {shown(text, quoted=False)}: the bound is a finite number")
    return StopRule(metric, op, bound)


def check_evaluated_steps(config: TrainConfig) -> None:
    """`--select-by` and `--stop-when`: each names a metric the evaluation during training reports, and needs an
    evaluation during training to read it from."""
    for flag, value, parse, known in (("--select-by", config.select_by, parse_select_by, config.selectable_metrics()),
                                      ("--stop-when", config.stop_when, parse_stop_when, config.stoppable_metrics())):
        if value is None:
            continue
        parse(value, known)
        if not config.eval_every:
            raise UserError(f"{flag} {shown(value, quoted=False)}: nothing is evaluated during training; add "
                            "--eval-every N")







