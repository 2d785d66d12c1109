"""LoRA unlearning through peft: wrap the model, report adapter norms, choose what final/ holds.

Only the adapter weights train: the caller builds its optimizer from
`[p for p in model.parameters() if p.requires_grad]` after `apply_lora`, and every base weight stays
bit-identical. peft is imported inside the functions (it takes seconds to import), so runs without LoRA
never pay for it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from doplus_cli.errors import UserError

if TYPE_CHECKING:
    from peft import PeftModel

ALL_LINEAR = "all-linear"  # peft's shorthand: every linear layer except the output head


@dataclass
class LoraSettings:
    """What `--lora-*` asks for; `rank > 0` turns LoRA on."""

    rank: int  # --lora-rank R
    alpha: float = 16.0  # --lora-alpha A; the update is scaled by alpha / rank
    # --lora-targets q_proj,v_proj. None: peft's default modules for the architecture (q_proj, v_proj for
    # Llama), or "all-linear" for an architecture peft has no default for. ("all-linear",) asks for it too.
    targets: tuple[str, ...] | None = None
    dropout: float = 0.0
    gradient_checkpointing: bool = False


def resolve_targets(model: nn.Module, targets: Sequence[str] | None) -> list[str] | str:
    """The `target_modules` handed to peft: the names given, peft's default for `model`'s architecture
    when none are given, else "all-linear"."""
    if targets:
        return ALL_LINEAR if list(targets) == [ALL_LINEAR] else list(targets)
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    default = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
    return list(default) if default else ALL_LINEAR


def _adaptable_types() -> tuple[type, ...]:
    """Layer types peft's LoRA can wrap (bitsandbytes' quantized linears subclass nn.Linear)."""
    from transformers.pytorch_utils import Conv1D  # GPT-2 style linear layers

    return (nn.Linear, Conv1D, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def linear_module_names(model: nn.Module) -> list[str]:
    """Short names (last path component) of the model's linear layers, deduplicated, in model order."""
    from transformers.pytorch_utils import Conv1D

    names = [name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D))]
    return list(dict.fromkeys(names))


def check_targets(model: nn.Module, targets: Sequence[str] | str | None) -> None:
    """Raise UserError (one line) when a target names no module of `model` (matched as peft does: the
    full module path or its last components), or only modules LoRA cannot adapt.

    None and "all-linear" always fit.
    """
    if targets is None or targets == ALL_LINEAR or list(targets) == [ALL_LINEAR]:
        return
    if isinstance(targets, str):
        targets = [targets]
    modules = dict(model.named_modules())
    adaptable = _adaptable_types()
    missing, unsupported = [], []
    for target in targets:
        matched = [m for name, m in modules.items() if name == target or name.endswith("." + target)]
        if not matched:
            missing.append(target)
        elif not any(isinstance(m, adaptable) for m in matched):
            unsupported.append(f"{target!r} ({type(matched[0]).__name__})")
    choices = ", ".join(linear_module_names(model)) or "none"
    if missing:
        names = ", ".join(repr(t) for t in missing)
        raise UserError(f"--lora-targets: {names} matches no module of the model; its linear modules are: {choices}")
    if unsupported:
        raise UserError(
            f"--lora-targets: {', '.join(unsupported)} is not a layer LoRA can adapt; its linear modules are: {choices}"
        )


def _enable_gradient_checkpointing(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing, inputs that require grad, and no KV cache while training."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise UserError(f"gradient checkpointing: {type(model).__name__} does not support it")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x names it so
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # Frozen embeddings give outputs without grad; checkpointed blocks then need their input to require
    # grad for the adapters inside them to get gradients. Newer transformers add this hook themselves.
    if not hasattr(model, "_require_grads_hook"):
        model.enable_input_require_grads()
    model.config.use_cache = False


def apply_lora(model: nn.Module, settings: LoraSettings) -> PeftModel:
    """Wrap `model` (a transformers causal LM) with a fresh LoRA adapter and return the PeftModel.

    The base weights are frozen (requires_grad False); only the adapter's lora_A / lora_B weights train.
    lora_B starts at zero, so the wrapped model computes exactly what `model` did. The adapter weights are
    float32 even on a bfloat16 base (peft's default). With `gradient_checkpointing`, checkpointing is
    turned on (it acts in train mode only) and the KV cache off.
    """
    from peft import LoraConfig, TaskType, get_peft_model

    if settings.rank <= 0:
        raise UserError(f"--lora-rank must be > 0 to use LoRA, got {settings.rank}")
    if not 0.0 <= settings.dropout < 1.0:
        raise UserError(f"LoRA dropout must be in [0, 1), got {settings.dropout}")
    targets = resolve_targets(model, settings.targets)
    check_targets(model, targets)
    if settings.gradient_checkpointing:
        _enable_gradient_checkpointing(model)
    config = LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        bias="none",
    )
    with warnings.catch_warnings():  # peft reads transformers' deprecated `is_gradient_checkpointing`
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, config)


def _adapter_pairs(layer: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """(A, B, scale) of each adapter in one peft LoRA layer, as 2-d matrices with B @ A the update."""
    pairs = []
    for name, a in layer.lora_A.items():
        pairs.append((a.weight, layer.lora_B[name].weight, layer.scaling[name]))
    for name, a in layer.lora_embedding_A.items():  # LoRA on embeddings holds bare parameters
        pairs.append((a, layer.lora_embedding_B[name], layer.scaling[name]))
    return [(a.detach().float().flatten(1), b.detach().float().flatten(1), s) for a, b, s in pairs]


@torch.no_grad()
def adapter_norms(model: nn.Module) -> dict[str, float]:
    """Frobenius norms of the adapters, for the run report.

    total: sqrt(sum over all lora_A, lora_B weights of ||W||_F^2).
    delta_total: sqrt(sum over adapted modules of ||scale * B @ A||_F^2), scale = alpha / rank: the size of
    the change LoRA makes to the base weights. ||B A||_F^2 = sum((B^T B) * (A A^T)), so no full-size
    matrix is formed.
    modules: how many (layer, adapter) pairs there are.
    """
    from peft.tuners.lora import LoraLayer

    total_sq, delta_sq, count = 0.0, 0.0, 0
    for layer in model.modules():
        if not isinstance(layer, LoraLayer):
            continue
        for a, b, scale in _adapter_pairs(layer):
            total_sq += float(a.square().sum() + b.square().sum())
            delta_sq += scale**2 * float(((b.T @ b) * (a @ a.T)).sum())
            count += 1
    return {"total": math.sqrt(total_sq), "delta_total": math.sqrt(max(delta_sq, 0.0)), "modules": count}


def final_model(model: nn.Module, save_adapter_only: bool) -> nn.Module:
    """What final/ holds; call `save_pretrained` on the result.

    save_adapter_only: the PeftModel itself; save_pretrained writes adapter_config.json and
    adapter_model.safetensors, loadable with peft.AutoPeftModelForCausalLM.from_pretrained(folder) or
    PeftModel.from_pretrained(base, folder).
    Otherwise the adapters are merged IN PLACE (merge_and_unload: no second copy of the model in memory)
    and the plain transformers model is returned, loadable with AutoModelForCausalLM.from_pretrained;
    the PeftModel passed in must not be used afterwards. If apply_lora turned checkpointing on, the merged
    model gets it off and the KV cache back on. A model without adapters is returned as is.
    """
    from peft import PeftModel

    if save_adapter_only or not isinstance(model, PeftModel):
        return model
    merged = model.merge_and_unload()
    if is_checkpointing(merged):
        if hasattr(merged, "activation_checkpointing_disable"):
            merged.activation_checkpointing_disable()
        else:
            merged.gradient_checkpointing_disable()
        merged.disable_input_require_grads()
        merged.config.use_cache = True  # every transformers causal LM's default; apply_lora turned it off
    return merged


def is_checkpointing(model: nn.Module) -> bool:
    """Whether activation (gradient) checkpointing is on, under either transformers name for it."""
    if hasattr(model, "is_activation_checkpointing"):  # transformers >= 5.x; the old name warns there
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))
