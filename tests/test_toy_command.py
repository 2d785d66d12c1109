"""A command is its own module: a toy command declared in this file alone gets its model card (its title, its
method's words, the command line that reproduces it) and its memory plan (how many optimizer states, whether a
reference model is kept) from its own hooks, with nothing below commands/ edited (docs/architecture.md). Its help
comes from its option names alone (tests/test_cli.py, the toy there)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from doplus_cli import options
from doplus_cli.commands import Command, command_for
from doplus_cli.config import TrainConfig, resolve_config
from doplus_cli.engine.memory_plan import build_plan, model_plan, optimizer_state_bytes
from doplus_cli.engine.model_card import render_model_card

MODEL = Path(__file__).parent / "data" / "model-configs" / "llama-3.2-1b"  # a config.json: planned on the meta device


@dataclass
class ToyConfig(TrainConfig):
    rounds: int = 3  # a recipe key of the toy's own, with no flag


class Toy(Command):
    command, marker, config_class = "toy", "rounds", ToyConfig
    help = "A toy command that trains in rounds."
    options = ("recipe", "model", "lr", "scheme", "out")
    card_title = "toyed"

    def card_method(self, config):
        return f"{config['rounds']} rounds"

    def state_objectives(self) -> int:
        return self.config.rounds

    def needs_reference(self) -> bool:
        return True


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setattr(options, "COMMAND_OPTIONS", dict(options.COMMAND_OPTIONS))
    monkeypatch.setattr(options, "COMMAND_CONFIGS", dict(options.COMMAND_CONFIGS))
    options.declare(Toy.command, Toy.config_class, Toy.options)
    return Toy()


def test_a_toy_commands_model_card_comes_from_its_own_hooks(toy, tmp_path):
    config = resolve_config(None, {"lr": 0.5, "rounds": 5, "out": str(tmp_path / "run")}, ToyConfig)
    report = {"config": {**config.to_dict(), "out": str(tmp_path / "run")}, "model": "SmolLM2-135M-Instruct",
              "environment": {"world_size": 1, "device": "cpu", "seed": 0, "effective_batch": 4},
              "steps": 10, "warmup_steps": 0}
    card = render_model_card(report, [], toy.bound(config))
    assert "# run: toyed with doplus toy" in card
    assert "- command `doplus toy`, scheme doplus, 5 rounds" in card
    assert "doplus toy --lr 0.5 --out" in card  # the flags it declares, nothing of another command's
    assert 'with these recipe keys (no command-line flag): rounds: 5' in card


def test_a_toy_commands_memory_plan_comes_from_its_own_hooks(toy):
    plans = {}
    for rounds in (1, 4):
        config = resolve_config(None, {"model": str(MODEL), "rounds": rounds, "scheme": "doplus", "precision": "fp32",
                                       "dtype": "float32"}, ToyConfig)
        run = toy.bound(config)
        plans[rounds] = build_plan(config, model_plan(config, run), run, cuda=False)
    trainable = [p for p in plans[1].model.params if p.trainable]
    for rounds, plan in plans.items():
        assert plan.settings["objectives"] == rounds and plan.settings["reference"] is True
        assert plan.parts["optimizer states"] == sum(optimizer_state_bytes(p, "doplus", "adamw", 32, rounds)
                                                     for p in trainable)
        assert plan.parts["reference model"] > 0
    # DualOptim+ keeps a base state and a delta state per objective: 2 moments x 4 bytes each
    assert plans[4].parts["optimizer states"] - plans[1].parts["optimizer states"] == 3 * 2 * 4 * sum(
        p.numel for p in trainable)


def test_the_registered_commands_are_found_by_their_config():
    from doplus_cli.config import AlignConfig, MultitaskConfig, UnlearnConfig

    for cls, name in ((UnlearnConfig, "unlearn"), (MultitaskConfig, "multitask"), (AlignConfig, "align")):
        assert command_for(cls()).command == name
    with pytest.raises(KeyError, match="ToyConfig"):
        command_for(ToyConfig())
