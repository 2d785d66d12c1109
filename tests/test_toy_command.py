"""A command is its own module: a toy command declared in this file alone gets its model card (its title, its
method's words, the command line that reproduces it), its memory plan (how many optimizer states, whether a
reference model is kept) and its report from its own hooks, with nothing below commands/ edited
(docs/architecture.md); one trains through the one loop. Its help comes from its option names alone
(tests/test_cli.py, the toy there)."""

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
    monkeypatch.setattr(options, "COMMAND_FIELDS", dict(options.COMMAND_FIELDS))
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
    from doplus_cli.commands.align import AlignConfig
    from doplus_cli.commands.multitask import MultitaskConfig
    from doplus_cli.commands.unlearn import UnlearnConfig

    for cls, name in ((UnlearnConfig, "unlearn"), (MultitaskConfig, "multitask"), (AlignConfig, "align")):
        assert command_for(cls()).command == name
    with pytest.raises(KeyError, match="ToyConfig"):
        command_for(ToyConfig())


@dataclass
class ToyTrainingConfig(TrainConfig):
    rows: str | None = None  # (question, answer) rows the toy learns; a recipe key of its own


class ToyTraining(Command):
    """A command that learns its rows with CE through the one loop, everything it reports its own."""

    command, marker, config_class = "toy-training", "rows", ToyTrainingConfig
    help = "A toy command that learns its rows."
    options = ("recipe", "model", "lr", "steps", "out")
    card_title = "toy-trained"

    def open(self) -> None:
        from doplus_cli.data.sources import open_source

        self.source = open_source(self.config.rows, "rows")

    def objectives(self, model, formatter, out, progress, accelerator, resumed):
        from doplus_cli.engine.objectives import Objective
        from doplus_cli.losses import TASK_LOSSES

        return [Objective("rows", self.source, TASK_LOSSES["CE"])]

    def data_report(self):
        return {"rows": len(self.source)}

    def render_report(self, report):
        return f"# toy report\n\n{report['data']['rows']} rows, {report['steps']} steps\n"


def test_a_toy_command_trains_through_the_one_loop_and_writes_its_own_report_and_card(tiny_llama, tofu_dir, tmp_path,
                                                                                       monkeypatch):
    from tests.helpers import write_sets

    monkeypatch.setattr(options, "COMMAND_OPTIONS", dict(options.COMMAND_OPTIONS))
    monkeypatch.setattr(options, "COMMAND_CONFIGS", dict(options.COMMAND_CONFIGS))
    monkeypatch.setattr(options, "COMMAND_FIELDS", dict(options.COMMAND_FIELDS))
    options.declare(ToyTraining.command, ToyTraining.config_class, ToyTraining.options)
    data = write_sets(tofu_dir, tmp_path, 4, 0)
    out = tmp_path / "run"
    config = resolve_config(None, {"model": str(tiny_llama), "rows": str(data / "forget.jsonl"), "steps": 2,
                                   "batch_size": 2, "out": str(out), "lr": 1e-4}, ToyTrainingConfig)
    report = ToyTraining().run(config)
    assert report["data"] == {"rows": 4} and report["steps"] == 2
    assert (out / "report.md").read_text() == "# toy report\n\n4 rows, 2 steps\n"
    card = (out / "final" / "README.md").read_text()
    assert "toy-trained with doplus toy-training" in card and "doplus toy-training" in card
    assert "--steps 2" in card and "rows: " in card  # its flags, and its own recipe key
