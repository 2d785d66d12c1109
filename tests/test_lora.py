"""LoRA through peft: only adapters train, checkpointing keeps gradients, norms, merged and adapter-only saves."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from doplus_cli.errors import UserError
from doplus_cli.lora import (
    LoraSettings,
    adapter_norms,
    apply_lora,
    check_targets,
    final_model,
    is_checkpointing,
    resolve_targets,
)

TEXTS = ["Who wrote the novel about the old lighthouse?", "The author was born in a small town by the sea."]
RANK, ALPHA = 4, 16.0


def load(folder: Path) -> torch.nn.Module:
    torch.manual_seed(0)  # the adapters' lora_A initialisation draws from the global generator
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def toy_batch(folder: Path) -> dict[str, torch.Tensor]:
    """Two padded sentences; the labels are the inputs with padding masked out."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return dict(batch)


def train(model: torch.nn.Module, batch: dict[str, torch.Tensor], steps: int = 3) -> None:
    """A few AdamW steps on the parameters that require grad, as the unlearning loop builds its optimizer."""
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()


@torch.no_grad()
def logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    model.eval()
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}


def trained_lora(folder: Path, batch: dict[str, torch.Tensor], **settings) -> torch.nn.Module:
    model = apply_lora(load(folder), LoraSettings(rank=RANK, alpha=ALPHA, **settings))
    train(model, batch)
    return model


def test_only_adapters_train_and_base_weights_stay_bit_identical(tiny_llama):
    batch = toy_batch(tiny_llama)
    base = load(tiny_llama)
    before = {name: t.clone() for name, t in base.state_dict().items()}
    model = apply_lora(base, LoraSettings(rank=RANK, alpha=ALPHA))

    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_A" in name or "lora_B" in name for name in trainable)
    assert all(p.requires_grad for name, p in model.named_parameters() if "lora_" in name)

    adapters_before = adapter_state(model)
    train(model, batch)
    for name, weight in adapter_state(model).items():
        assert not torch.equal(weight, adapters_before[name]), f"{name} did not change"

    after = {
        name.replace(".base_layer", ""): t
        for name, t in model.get_base_model().state_dict().items()
        if "lora_" not in name
    }
    assert after.keys() == before.keys()
    for name, weight in before.items():
        assert torch.equal(after[name], weight), f"base weight {name} changed"


def test_gradient_checkpointing_still_gives_adapter_gradients(tiny_llama):
    batch = toy_batch(tiny_llama)
    grads = {}
    for checkpointing in (False, True):
        model = apply_lora(load(tiny_llama), LoraSettings(rank=RANK, alpha=ALPHA, gradient_checkpointing=checkpointing))
        with torch.no_grad():  # lora_B starts at zero, which would leave lora_A without gradient
            generator = torch.Generator().manual_seed(1)
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
        model.train()
        model(**batch).loss.backward()
        grads[checkpointing] = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
        assert is_checkpointing(model) is checkpointing
    assert model.config.use_cache is False
    for name, grad in grads[True].items():
        assert grad is not None and grad.abs().sum() > 0, f"{name} has no gradient under checkpointing"
        torch.testing.assert_close(grad, grads[False][name], rtol=1e-4, atol=1e-6)


def test_adapter_norms_match_an_independent_computation(tiny_llama):
    model = trained_lora(tiny_llama, toy_batch(tiny_llama))
    norms = adapter_norms(model)

    delta_sq, total_sq, modules = 0.0, 0.0, 0
    for module in model.modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            delta_sq += ((ALPHA / RANK) * b @ a).square().sum().item()
            modules += 1
    for name, p in model.named_parameters():
        if "lora_A" in name or "lora_B" in name:
            total_sq += p.square().sum().item()

    assert norms["modules"] == modules == 4  # q_proj and v_proj (peft's Llama default) in each of 2 layers
    assert norms["delta_total"] > 0
    assert math.isclose(norms["delta_total"], math.sqrt(delta_sq), rel_tol=1e-5)
    assert math.isclose(norms["total"], math.sqrt(total_sq), rel_tol=1e-5)


def test_merged_final_model_loads_and_reproduces_the_lora_logits(tiny_llama, tmp_path):
    batch = toy_batch(tiny_llama)
    model = trained_lora(tiny_llama, batch, gradient_checkpointing=True)
    expected = logits(model, batch)
    assert not torch.allclose(expected, logits(load(tiny_llama), batch), atol=1e-3)  # the adapters do something

    final = final_model(model, save_adapter_only=False)
    final.save_pretrained(tmp_path, safe_serialization=True)
    with safe_open(tmp_path / "model.safetensors", "pt") as saved:
        keys = list(saved.keys())
    assert keys and not any("lora" in key or "base_layer" in key for key in keys)
    assert json.loads((tmp_path / "config.json").read_text())["use_cache"] is True

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    torch.testing.assert_close(logits(reloaded, batch), expected, rtol=0, atol=1e-5)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft reads it
def test_adapter_only_final_model_loads_on_the_base(tiny_llama, tmp_path):
    from peft import AutoPeftModelForCausalLM, PeftModel

    batch = toy_batch(tiny_llama)
    model = trained_lora(tiny_llama, batch)
    expected = logits(model, batch)

    final_model(model, save_adapter_only=True).save_pretrained(tmp_path, safe_serialization=True)
    assert (tmp_path / "adapter_config.json").is_file()
    assert (tmp_path / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "model.safetensors").exists()

    on_base = PeftModel.from_pretrained(load(tiny_llama), tmp_path)
    torch.testing.assert_close(logits(on_base, batch), expected, rtol=0, atol=1e-5)
    auto = AutoPeftModelForCausalLM.from_pretrained(tmp_path)
    torch.testing.assert_close(logits(auto, batch), expected, rtol=0, atol=1e-5)


def test_check_targets_names_the_bogus_module(tiny_llama):
    model = load(tiny_llama)
    check_targets(model, ["q_proj", "self_attn.v_proj", "down_proj"])
    check_targets(model, None)
    with pytest.raises(UserError) as raised:
        check_targets(model, ["q_proj", "qkv_bogus"])
    message = str(raised.value)
    assert "qkv_bogus" in message and "q_proj" in message and "down_proj" in message and "\n" not in message
    assert "'q_proj'" not in message.split(";")[0]  # only the bogus name is blamed
    with pytest.raises(UserError, match="'mlp'"):
        check_targets(model, ["mlp"])  # a LlamaMLP block, not a layer LoRA can wrap
    with pytest.raises(UserError, match="qkv_bogus"):
        apply_lora(model, LoraSettings(rank=RANK, targets=("qkv_bogus",)))


def test_target_defaults(tiny_llama):
    model = load(tiny_llama)
    assert resolve_targets(model, None) == ["q_proj", "v_proj"]
    assert resolve_targets(model, ("all-linear",)) == "all-linear"
    assert resolve_targets(model, ("o_proj",)) == ["o_proj"]
    model.config.model_type = "an-architecture-peft-does-not-know"
    assert resolve_targets(model, None) == "all-linear"
    wrapped = apply_lora(model, LoraSettings(rank=RANK))
    assert adapter_norms(wrapped)["modules"] == 2 * 7  # q, k, v, o, gate, up, down in 2 layers; not lm_head


def test_lora_targets_are_parsed_once_at_the_boundary(tmp_path):
    """A flag's text and a recipe's YAML list give the engine the same tuple; no item, peft's default (None); the run
    records the flag's form."""
    from doplus_cli.commands.unlearn import UnlearnConfig
    from doplus_cli.config import resolve_config

    recipe = tmp_path / "r.yaml"
    recipe.write_text("forget: f.jsonl\nloss: GA\nlora_targets: [q_proj, v_proj]\n")
    assert resolve_config(str(recipe), {}, UnlearnConfig).lora_targets == ("q_proj", "v_proj")
    flagged = resolve_config(None, {"forget": "f.jsonl", "loss": "GA", "lora_targets": "q_proj, v_proj,"},
                             UnlearnConfig)
    assert flagged.lora_targets == ("q_proj", "v_proj") and flagged.to_dict()["lora_targets"] == "q_proj,v_proj"
    for empty in ("", " , "):
        config = resolve_config(None, {"forget": "f.jsonl", "loss": "GA", "lora_targets": empty}, UnlearnConfig)
        assert config.lora_targets is None
    assert UnlearnConfig(lora_targets="down_proj").lora_targets == ("down_proj",)  # made in code: parsed alike
