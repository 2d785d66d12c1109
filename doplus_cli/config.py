"""The resolved configuration of an unlearning run: defaults, YAML recipes, command-line overrides.

Precedence, lowest to highest: the dataclass defaults below (the one source of truth for every default),
the recipe (`--recipe FILE.yaml`), the flags given on the command line. Every problem with a value is a
`UserError` naming where the value came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from doplus_cli.data.formatting import check_prompt_template
from doplus_cli.errors import UserError
from doplus_cli.evaluation.protocol import get_protocol

SCHEMES = ("joint", "alternate", "dualoptim", "doplus")
OPTIMIZERS = ("adamw", "muon")
DTYPES = ("auto", "float32", "bfloat16")
STATE_BITS = (32, 8)
FORGET_LOSS_NAMES = ("GA", "NPO", "DPO", "ME", "IDK")
RETAIN_LOSS_NAMES = ("GD", "KL", "AP")
# Keys in a recipe whose relative paths are looked up next to the recipe file first.
_PATH_KEYS = ("model", "forget", "retain", "eval_data_dir")


@dataclass
class UnlearnConfig:
    """Every option of `doplus unlearn`. Field names are the recipe keys; `--forget-lr` is `forget_lr`."""

    description: str = ""
    # Model
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    trust_remote_code: bool = False
    # Data
    forget: str | None = None
    retain: str | None = None
    question_key: str = "question"
    answer_key: str = "answer"
    max_length: int = 256
    # None: the tokenizer's chat template, `question-answer` without one; else a preset (chat, question-answer,
    # phi-tofu, llama2) or a string with {question} (doplus_cli.data.formatting.PROMPT_TEMPLATES)
    prompt_template: str | None = None
    answers_from_model: bool = False  # targets are the starting model's own greedy answers (real-world setting)
    max_new_tokens: int = 48
    # Losses
    loss: str = "NPO+GD"
    beta: float = 0.1
    forget_coeff: float = 1.0
    retain_coeff: float = 1.0
    # Update scheme and optimizer
    scheme: str = "doplus"
    optimizer: str = "adamw"
    state_bits: int = 32
    forget_freq: int = 1
    retain_freq: int = 5
    betas: tuple[float, float] = (0.9, 0.95)
    # Training
    steps: int = 300
    lr: float = 1e-5
    forget_lr: float | None = None
    batch_size: int = 4
    grad_accum: int = 1
    warmup_steps: int | None = None  # None: one pass over the forget set
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    seed: int = 0
    # Outputs
    out: str | None = None  # None: runs/unlearn-YYYYmmdd-HHMMSS
    overwrite: bool = False
    show_samples: int = 3
    # LoRA and memory
    lora_rank: int = 0  # 0: train every weight
    lora_alpha: float = 16.0
    lora_targets: str | None = None  # comma-separated module names; None: peft's default for the architecture
    lora_dropout: float = 0.0
    gradient_checkpointing: bool = False
    save_adapter_only: bool = False
    ref_offload: str | None = None  # the reference model (NPO, DPO, KL): "cpu" keeps it there, "8bit" LLM.int8
    fsdp: bool = False  # full shard (FSDP2) across processes: weights, gradients and optimizer states
    # Checkpoints and resume
    save_every: int = 0  # 0: no checkpoints
    keep_last: int = 0  # 0: keep every checkpoint
    resume: str | None = None  # "latest" or a checkpoint folder
    # Evaluation during training (`doplus evaluate`'s suites at every N-th step, into OUT/evals/step-N/)
    eval_every: int = 0  # 0: never
    eval_suite: str = "tofu"
    eval_split: str = "forget10"
    eval_data_dir: str | None = None  # None: hf:locuslab/TOFU
    eval_max_samples: int | None = None
    eval_max_new_tokens: int = 64
    eval_nli_model: str | None = None
    eval_embedding_model: str | None = None
    eval_protocol: str = "doplus"  # or "paper": the DualOptim+ authors' judges and generation budget
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def forget_loss(self) -> str:
        return self.loss.split("+")[0]

    @property
    def retain_loss(self) -> str | None:
        parts = self.loss.split("+")
        return parts[1] if len(parts) > 1 else None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("extra")
        data["betas"] = list(self.betas)
        return data


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(UnlearnConfig) if f.name != "extra"]


def default_of(name: str) -> Any:
    """The default of one option, for help texts (so the CLI never repeats a default)."""
    return {f.name: f.default for f in dataclasses.fields(UnlearnConfig)}[name]


def load_recipe(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML recipe into {field: value}, with relative data and model paths made usable."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: recipe file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise UserError(f"{where}: not valid YAML ({getattr(error, 'problem', error)})") from error
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: a recipe must be a mapping of option: value, got {type(data).__name__}")
    names = field_names()
    values: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key not in names:
            hint = difflib.get_close_matches(key, names, n=1)
            suggestion = f" (did you mean '{hint[0]}'?)" if hint else ""
            raise UserError(f"{path}: unknown option '{raw_key}'{suggestion}")
        if key in _PATH_KEYS and isinstance(value, str):
            value = _next_to_recipe(value, path.parent)
        values[key] = value
    return values


def _next_to_recipe(value: str, folder: Path) -> str:
    if value.startswith("hf:") or os.path.isabs(value):
        return value
    candidate = folder / value
    return str(candidate) if candidate.exists() else value


def resolve_config(recipe: str | None, overrides: dict[str, Any]) -> UnlearnConfig:
    """Defaults, then the recipe, then command-line overrides (None means "not given")."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if recipe is not None:
        for key, value in load_recipe(recipe).items():
            values[key] = value
            sources[key] = str(recipe)
    for key, value in overrides.items():
        if value is not None:
            values[key] = value
            sources[key] = "command line"
    config = UnlearnConfig()
    for key, value in values.items():
        setattr(config, key, _coerce(key, value, sources[key]))
    validate(config)
    return config


def _coerce(key: str, value: Any, source: str) -> Any:
    """Turn a recipe or flag value into the field's type, or say which option and where it came from."""
    kind = {f.name: f.type for f in dataclasses.fields(UnlearnConfig)}[key]
    where = f"{source}: option '{key}'"
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
            return float(value)  # YAML reads 1e-5 (no dot) as a string; float() takes it
        if kind.startswith("tuple"):
            items = value.split(",") if isinstance(value, str) else list(value)
            if len(items) != 2:
                raise ValueError
            return (float(items[0]), float(items[1]))
        if kind.startswith("dict"):
            return dict(value)
        if isinstance(value, (dict, list)):
            raise ValueError
        return str(value)
    except (TypeError, ValueError):
        expected = kind.replace(" | None", "").replace("tuple[float, float]", "two numbers like 0.9,0.95")
        raise UserError(f"{where} must be {expected}, got {value!r}") from None


def _choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise UserError(f"unknown {name} '{value}': choose one of {', '.join(map(str, choices))}")


REF_OFFLOADS = (None, "cpu", "8bit")


def validate(config: UnlearnConfig) -> None:
    """Check option values and combinations; every message is one line naming the option."""
    _choice("scheme", config.scheme, SCHEMES)
    _choice("optimizer", config.optimizer, OPTIMIZERS)
    _choice("dtype", config.dtype, DTYPES)
    _choice("state-bits", config.state_bits, STATE_BITS)
    parts = config.loss.split("+")
    if len(parts) > 2 or parts[0] not in FORGET_LOSS_NAMES or (len(parts) == 2 and parts[1] not in RETAIN_LOSS_NAMES):
        raise UserError(
            f"unknown loss '{config.loss}': write FORGET or FORGET+RETAIN with FORGET in "
            f"{{{', '.join(FORGET_LOSS_NAMES)}}} and RETAIN in {{{', '.join(RETAIN_LOSS_NAMES)}}}, e.g. NPO+GD"
        )
    for name in ("steps", "batch_size", "grad_accum", "max_length", "max_new_tokens"):
        if getattr(config, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(config, name)}")
    for name in ("forget_freq", "retain_freq", "show_samples"):
        if getattr(config, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(config, name)}")
    if config.forget_freq == 0:
        raise UserError("--forget-freq must be at least 1: every cycle starts with forget steps")
    if config.warmup_steps is not None and config.warmup_steps < 0:
        raise UserError(f"--warmup-steps must be >= 0, got {config.warmup_steps}")
    for name in ("lr", "weight_decay", "beta", "max_grad_norm", "forget_coeff", "retain_coeff"):
        value = getattr(config, name)
        if not value >= 0 or value != value:
            raise UserError(f"--{name.replace('_', '-')} must be a number >= 0, got {value}")
    if config.beta == 0 and config.forget_loss in ("NPO", "DPO") or config.beta == 0 and config.retain_loss == "AP":
        raise UserError("--beta must be > 0 for NPO, DPO and AP (they divide by it)")
    if config.forget_lr is not None and not config.forget_lr >= 0:
        raise UserError(f"--forget-lr must be a number >= 0, got {config.forget_lr}")
    if not all(0.0 <= b < 1.0 for b in config.betas):
        raise UserError(f"--betas must be two numbers in [0, 1), got {config.betas}")
    if config.lora_rank < 0:
        raise UserError(f"--lora-rank must be >= 0, got {config.lora_rank}")
    if config.save_adapter_only and config.lora_rank == 0:
        raise UserError("--save-adapter-only needs LoRA (--lora-rank R)")
    if config.ref_offload not in REF_OFFLOADS:
        raise UserError(f"unknown --ref-offload '{config.ref_offload}': choose cpu (keep the reference model on the "
                        "CPU) or 8bit (LLM.int8 weights through bitsandbytes)")
    for name in ("save_every", "keep_last"):
        if getattr(config, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(config, name)}")
    if config.resume is not None and config.out is None:
        raise UserError("--resume needs --out: the folder of the run to continue")
    check_prompt_template(config.prompt_template)
    get_protocol(config.eval_protocol)
    if config.eval_every < 0:
        raise UserError(f"--eval-every must be >= 0, got {config.eval_every}")
    if config.eval_every and config.eval_suite != "tofu":
        raise UserError(f"unknown --eval-suite '{config.eval_suite}' for evaluation during training: only tofu "
                        "(run `doplus evaluate --suite ...` on final/ afterwards for the others)")
    if config.forget is None:
        raise UserError("no forget set: pass --forget FILE.jsonl (or hf:NAME[:CONFIG][@SPLIT]) or set it in the recipe")
    if config.retain_loss is not None and config.retain is None:
        raise UserError(f"loss {config.loss} has a retain term: pass --retain FILE.jsonl or use a forget loss alone")
    if config.scheme in ("joint",) and config.forget_lr is not None:
        raise UserError("--forget-lr needs a scheme with separate forget steps (alternate, dualoptim, doplus)")
    if config.optimizer == "muon" and config.scheme != "doplus":
        raise UserError("--optimizer muon is built for --scheme doplus only; use adamw with the other schemes")
    if config.retain_loss is None and config.scheme != "joint" and config.retain_freq > 0:
        config.retain_freq = 0  # a forget loss alone: every step is a forget step
