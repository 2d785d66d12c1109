"""A validated config is final: assignment raises, `replace` makes a new one, and a run keeps what it derives
when it opens (steps, warm-up, precision, save dtype, FSDP, its folder) apart from the config it was given,
while recording the resolved values as its config."""

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from doplus_cli.commands.align import AlignConfig
from doplus_cli.commands.multitask import MultitaskConfig
from doplus_cli.commands.unlearn import UnlearnConfig, run_unlearn
from doplus_cli.config import resolve_config
from doplus_cli.engine.loop import Opened
from tests.helpers import write_sets


@pytest.mark.parametrize("cls", [UnlearnConfig, MultitaskConfig, AlignConfig])
def test_a_config_is_open_until_validated_then_refuses_assignment(cls):
    config = cls()
    config.steps = 7  # building one field by field (the bench does) is allowed
    assert not config.final
    required = {UnlearnConfig: {"forget": "f.jsonl", "retain": "r.jsonl"},
                AlignConfig: {"safety": "s.json", "general": "g.json"},
                MultitaskConfig: {"tasks": [{"name": "a", "data": "a.jsonl", "metric": "exact", "freq": 1,
                                             "weight": 1.0, "eval": None, "lr_multiplier": 1.0}]}}[cls]
    config = dataclasses.replace(config, **required)
    config.validate()
    assert config.final
    with pytest.raises(dataclasses.FrozenInstanceError,
                       match=rf"cannot assign to field 'steps': a validated {cls.__name__} is final"):
        config.steps = 8
    with pytest.raises(AttributeError, match="config.replace"):
        config.out = "elsewhere"
    assert config.steps == 7 and config.out is None
    assert copy.deepcopy(config).final  # a copy of a final config is final too


def test_validation_settles_values_before_the_config_is_final():
    # a forget loss alone: unlearn's validation turns the retain steps off, which is part of validating
    config = resolve_config(None, {"forget": "f.jsonl", "loss": "GA", "retain_freq": 5}, UnlearnConfig)
    assert config.final and config.retain_freq == 0


def test_replace_leaves_the_config_as_it_was_and_gives_a_final_one():
    config = resolve_config(None, {"forget": "f.jsonl", "retain": "r.jsonl", "steps": 2}, UnlearnConfig)
    before = config.to_dict()
    changed = config.replace(out="runs/x", steps=5, taught={"recipe": "t.yaml"})
    assert config.to_dict() == before and config.taught is None
    assert changed.final and type(changed) is UnlearnConfig
    assert changed.to_dict() == {**before, "out": "runs/x", "steps": 5}
    assert changed.taught == {"recipe": "t.yaml"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        changed.model = "other"
    # an unvalidated config's copy stays open, as it was
    assert not UnlearnConfig().replace(steps=3).final


def test_opened_is_frozen_and_applies_as_a_new_config():
    config = resolve_config(None, {"forget": "f.jsonl", "retain": "r.jsonl", "steps": 4}, UnlearnConfig)
    opened = Opened(fsdp=False, precision="fp32", save_dtype="float32", steps=4, warmup_steps=1, out="runs/y")
    with pytest.raises(dataclasses.FrozenInstanceError):
        opened.steps = 5
    run_config = opened.applied_to(config)
    assert (config.precision, config.save_dtype, config.warmup_steps, config.out) == ("auto", "auto", None, None)
    assert (run_config.precision, run_config.save_dtype, run_config.warmup_steps, run_config.out) == (
        "fp32", "float32", 1, "runs/y")
    assert run_config.final


def test_a_run_leaves_its_config_as_given_and_records_the_derived_values(tiny_llama, tofu_dir, tmp_path,
                                                                         monkeypatch):
    sets = write_sets(tofu_dir, tmp_path, 4, 4)
    monkeypatch.chdir(tmp_path)  # the default folder, runs/unlearn-DATE-TIME, lands here
    config = resolve_config(None, {"model": tiny_llama, "forget": str(sets / "forget.jsonl"),
                                   "retain": str(sets / "retain.jsonl"), "steps": 2, "batch_size": 2,
                                   "max_length": 32, "show_samples": 0, "loss": "GA+GD"}, UnlearnConfig)
    given = copy.deepcopy(config)
    report = run_unlearn(config)
    assert config == given and config.to_dict() == given.to_dict()  # nothing written into the caller's config
    assert (config.out, config.precision, config.save_dtype, config.warmup_steps) == (None, "auto", "auto", None)
    recorded = report["config"]
    out = Path(recorded["out"])
    assert out.parent == Path("runs") and out.name.startswith("unlearn-") and (tmp_path / out / "final").is_dir()
    # the resolved values, on the CPU: float32 weights, saved in float32; warm-up at most the steps
    assert (recorded["precision"], recorded["save_dtype"], recorded["fsdp"], recorded["steps"]) == (
        "fp32", "float32", False, 2)
    assert isinstance(recorded["warmup_steps"], int) and 0 <= recorded["warmup_steps"] <= 2
    assert recorded["warmup_steps"] == report["warmup_steps"] and report["steps"] == 2
    # config.yaml, which --resume compares a run with, holds the same resolved values
    saved = yaml.safe_load((tmp_path / out / "config.yaml").read_text())
    assert {k: saved[k] for k in ("out", "precision", "save_dtype", "steps", "warmup_steps", "fsdp")} == {
        k: recorded[k] for k in ("out", "precision", "save_dtype", "steps", "warmup_steps", "fsdp")}
    assert json.loads((tmp_path / out / "report.json").read_text())["config"] == recorded
