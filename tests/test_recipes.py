"""Every shipped recipe resolves to a valid configuration with the paper's settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from doplus_cli.commands.align import AlignConfig
from doplus_cli.commands.multitask import MultitaskConfig
from doplus_cli.commands.unlearn import UnlearnConfig
from doplus_cli.config import read_recipe, resolve_config
from tests.helpers import recipe_beside_shared_data

ROOT = Path(__file__).resolve().parents[1] / "recipes"
# recipes/cluster/ holds an accelerate configuration, not a doplus recipe (tests/test_distributed.py runs it)
RECIPES = sorted(p for p in ROOT.rglob("*.yaml") if "cluster" not in p.parts)


def _name(path: Path) -> str:
    return path.relative_to(ROOT).with_suffix("").as_posix()


def test_no_shipped_recipe_names_a_path_outside_doplus():
    """Data doplus does not ship is named by a path beside the recipe (data/tofu/..., data/safety/...), which the
    user provides; no recipe climbs out of the recipes folder to a development-only folder."""
    for path in [*RECIPES, *ROOT.rglob("*.sh")]:
        assert "shared/" not in path.read_text(), path


def test_the_paper_settings_are_shipped():
    names = {str(p.relative_to(p.parents[2])) if "tofu" in p.parts else p.name for p in RECIPES}
    for model in ("phi-1.5", "llama2-7b"):
        for loss in ("idk_gd", "me_gd", "dpo_gd", "npo_gd"):
            assert f"tofu/{model}/{loss}.yaml" in names
    assert "quickstart.yaml" in names


@pytest.mark.parametrize("shipped", RECIPES, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_recipe_resolves(shipped, tmp_path):
    path = recipe_beside_shared_data(_name(shipped), tmp_path)  # as a user runs it: copied, the data beside it
    if path.name.endswith("_teach.yaml"):  # a teaching stage: one joint fine-tuning on two TOFU or mini-MUSE slices
        config = resolve_config(str(path), {}, MultitaskConfig)
        assert [t["name"] for t in config.tasks] in (["forget_authors", "retain_authors"],
                                                     ["forget_news", "retain_news"])
        assert all(Path(t["data"].partition("[")[0]).is_file() for t in config.tasks)
        return
    if "align" in shipped.parts:
        config = resolve_config(str(path), {}, AlignConfig)
        assert config.description
        assert Path(config.safety.partition("[")[0]).is_file()
        if path.name == "demo.yaml":  # the embedded model, the data beside it, a few CPU minutes
            assert config.model is None and Path(config.general.partition("[")[0]).is_file() and config.held_out > 0
            assert config.epochs is not None and config.batch_size * config.grad_accum <= 8
        if path.name == "safety_llama3.yaml":  # the paper's setting (Section 4.4 and Appendix)
            assert config.model == "PKU-Alignment/alpaca-8b-reproduced-llama-3" and config.scheme == "doplus"
            assert config.freq == "1:10"
            assert (config.lr, config.epochs, config.batch_size * config.grad_accum) == (1e-5, 3.0, 128)
            assert config.safety.endswith("[0:2004]") and config.general.endswith("[:20004]") and config.held_out == 4
        return
    if "multitask" in shipped.parts:
        config = resolve_config(str(path), {}, MultitaskConfig)
        assert config.description and len(config.tasks) == 3
        if path.name == "demo.yaml":  # the embedded model; task files the project writes itself
            assert config.model is None and all(Path(t["data"]).is_file() for t in config.tasks)
            assert [t["metric"] for t in config.tasks] == ["exact", "choice", "edit_sim"]
        if path.name == "trace_llama2.yaml":  # the paper's Table 4 setting
            assert config.model == "meta-llama/Llama-2-7b-hf" and config.scheme == "doplus"
            assert config.state_bits == 8 and config.betas == (0.9, 0.95) and config.weight_decay == 0.01
            assert [t["name"] for t in config.tasks] == ["py150", "scienceqa", "numglue_cm"]
        return
    config = resolve_config(str(path), {}, UnlearnConfig)
    assert config.description
    if "tofu" in shipped.parts:
        # the authors' files, task 1, their retain set (the hub's locuslab/TOFU has no forget tasks)
        assert Path(config.forget).name == "forget10.json" and Path(config.forget).is_file()
        assert config.retain == "tofu-authors" and config.task_id == 1 and config.warmup_steps is None
        assert Path(config.eval_data_dir).is_dir() and config.eval_split == "forget10"
        assert (config.lr, config.steps, config.forget_freq, config.retain_freq) == (1e-5, 300, 1, 5)
        assert config.betas == (0.9, 0.95) and config.weight_decay == 0.01 and config.beta == 0.1
        effective = {"phi-1.5": 40, "llama2-7b": 128}[shipped.parent.name]
        assert config.batch_size * config.grad_accum == effective
        assert config.model == {"phi-1.5": "locuslab/tofu_ft_phi-1.5", "llama2-7b": "locuslab/tofu_ft_llama2-7b"}[
            shipped.parent.name]
        assert config.forget_coeff == (0.1 if config.loss == "ME+GD" else 1.0)
        # `doplus bench schemes` compares runs by the suite the recipe names (the default is not enough)
        assert read_recipe(path)["eval_suite"] == "tofu" and config.eval_every == 0  # the paper: final/ only
    if "bench" in shipped.parts:  # `doplus bench schemes` needs an evaluation suite
        assert config.eval_suite in ("tofu", "answers", "muse") and Path(config.forget.partition("[")[0]).is_file()
        if config.eval_suite == "muse":  # mini-MUSE, copied with the recipe: the teaching stage and the MUSE folder
            assert Path(config.teach).is_file() and (Path(config.eval_data_dir) / "verbmem" / "forget.jsonl").is_file()
            assert config.eval_split == "news" and config.text_window == config.max_length
        elif config.eval_suite == "tofu":
            assert Path(config.teach).is_file() and Path(config.eval_data_dir).is_dir()
        else:
            assert config.answers_from_model and config.show_samples > 0
    if "real_world" in shipped.parts:
        assert config.model == "meta-llama/Meta-Llama-3-8B-Instruct" and config.lr == 5e-6
        assert config.batch_size * config.grad_accum == 128 and config.answers_from_model
        assert Path(config.forget).is_file() and Path(config.retain).is_file()
        # the bench scores each run by its answers before and after, on every question of each set
        assert config.eval_suite == "answers"
        assert config.show_samples >= max(len(_rows(config.forget)), len(_rows(config.retain)))
    if "wmdp" in shipped.parts:  # the WMDP authors' zephyr RMU run (rmu/unlearn.py, run_rmu_zephyr.ipynb)
        assert config.model == "HuggingFaceH4/zephyr-7b-beta" and config.loss == "RMU+EMBED"
        assert (config.rmu_layer, config.rmu_update_layers, config.rmu_coeff, config.retain_coeff) == (
            7, (5, 6, 7), 6.5, 1200.0)
        assert (config.lr, config.batch_size, config.max_length, config.seed) == (5e-5, 4, 512, 42)
        assert config.steps == {"joint": 150}.get(config.scheme, 300) and config.eval_suite == "wmdp"
        assert "shared" not in config.forget and config.forget.endswith("data/wmdp/forget.jsonl")
    if "muse" in shipped.parts:  # MUSE's baselines/scripts and OpenUnlearning's unlearn/muse experiments
        corpus = "books" if path.name.startswith("books") else "news"
        assert config.eval_suite == "muse" and config.eval_split == corpus and config.loss in ("NPO+GD", "GA+GD")
        assert (config.lr, config.batch_size, config.text_window, config.max_length) == (1e-5, 4, 2048, 2048)
        assert config.betas == (0.9, 0.999) and config.weight_decay == 0.0 and config.beta == 0.1
        assert config.forget.startswith(f"hf:muse-bench/MUSE-{corpus.capitalize()}:")
        assert config.retain == f"hf:muse-bench/MUSE-{corpus.capitalize()}:raw@retain1"
        if "news_sust" not in shipped.parts or path.stem.endswith("_1"):
            assert config.model == f"muse-bench/MUSE-{corpus.capitalize()}_target"
    if path.name == "quickstart.yaml":
        assert config.model is None and config.answers_from_model  # the embedded model, its own answers
        assert Path(config.forget).is_file() and Path(config.retain).is_file()


def _rows(spec: str) -> list[dict]:
    """The rows of a JSON-lines FILE[START:STOP] spec, read here without doplus."""
    import json

    path, _, cut = spec.partition("[")
    rows = [json.loads(line) for line in open(path) if line.strip()]
    if cut:
        start, _, stop = cut.rstrip("]").partition(":")
        rows = rows[int(start or 0):int(stop) if stop else None]
    return rows


def test_the_tofu_protocol_bench_keeps_the_paper_protocol(tmp_path):
    """The GD set holds every retain row that MU scores; the teaching stage taught the forget tasks 1-3 and those
    retain rows; 1:5, the authors' warm-up rule, the paper protocol, 40 or more questions per set."""
    root = recipe_beside_shared_data("bench/tofu_protocol", tmp_path).parent
    config = resolve_config(str(root / "tofu_protocol.yaml"), {}, UnlearnConfig)
    teach = resolve_config(str(root / "tofu_protocol_teach.yaml"), {}, MultitaskConfig)
    assert (config.forget_freq, config.retain_freq, config.warmup_steps, config.loss) == (1, 5, None, "IDK+GD")
    assert config.eval_protocol == "paper" and config.eval_max_samples >= 40 and config.eval_every < config.steps
    scored = [r["question"] for r in _rows(str(Path(config.eval_data_dir) / "retain_perturbed.json"))]
    scored = scored[:config.eval_max_samples]
    retain = [r["question"] for r in _rows(config.retain)]
    assert set(scored) <= set(retain)
    forget_rows = _rows(config.forget)
    taught = {t["name"]: [r["question"] for r in _rows(t["data"])] for t in teach.tasks}
    for task in (1, 2, 3):  # every forget task the bench unlearns was taught
        assert {r["question"] for r in forget_rows if str(r["task_id"]) == str(task)} <= set(taught["forget_authors"])
    assert set(retain) <= set(taught["retain_authors"])
