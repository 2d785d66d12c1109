"""The options that take a list are parsed once, where a flag or a recipe gives them, into typed tuples; a run
records them as their flags are typed."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from doplus_cli.commands.align import AlignConfig
from doplus_cli.commands.multitask import MultitaskConfig
from doplus_cli.commands.unlearn import UnlearnConfig
from doplus_cli.config import coerce_option, list_fields, recipe_form, resolve_config, task_from_option
from doplus_cli.errors import UserError

CONFIGS = (UnlearnConfig, MultitaskConfig, AlignConfig)


def test_the_list_options_are_the_fields_typed_as_tuples():
    shared = {"lora_targets": str, "accept_changed": str, "report_to": str}
    assert list_fields(UnlearnConfig) == {**shared, "task_ids": int, "rmu_update_layers": int, "rmu_modules": str,
                                          "eval_attacks": str}
    assert list_fields(MultitaskConfig) == {**shared, "freq": int}
    assert list_fields(AlignConfig) == {**shared, "eval_suite": str, "eval_attacks": str}
    for cls in CONFIGS:  # no list option keeps its items in one comma-separated text
        for field in dataclasses.fields(cls):
            if field.name in list_fields(cls):
                assert field.default is None or isinstance(field.default, tuple)


@pytest.mark.parametrize("cls", CONFIGS)
def test_a_flag_text_and_a_recipe_list_give_the_same_tuple_and_record_the_flag_form(cls, tmp_path):
    for name, item in list_fields(cls).items():
        values = (3, 1, 2) if item is int else ("b", "a")
        text = " , ".join(str(v) for v in values) + ","  # spaces and an empty item, as a shell line may hold
        from_flag = coerce_option(name, text, "command line", cls)
        from_recipe = coerce_option(name, list(values), "r.yaml", cls)
        assert from_flag == from_recipe == values
        assert recipe_form(name, from_flag, cls) == ",".join(str(v) for v in values)
    assert recipe_form("betas", (0.9, 0.95), cls) == (0.9, 0.95)  # a tuple that is no list option stays one


def test_a_bad_item_is_one_line_naming_the_flag_or_the_recipe_key():
    with pytest.raises(UserError, match=r"^--task-ids 1,x: 'x' is not a whole number >= 0$"):
        coerce_option("task_ids", "1,x", "command line", UnlearnConfig)
    with pytest.raises(UserError, match=r"^r\.yaml: option 'freq' 1,-2: '-2' is not a whole number >= 0$"):
        coerce_option("freq", [1, -2], "r.yaml", MultitaskConfig)
    with pytest.raises(UserError, match="must be names separated by commas"):
        coerce_option("lora_targets", [{"q": 1}], "r.yaml", UnlearnConfig)


def test_the_engine_gets_tuples_and_config_yaml_keeps_the_flag_form(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("forget: f.jsonl\nretain: r.jsonl\ntask_ids: [2, 1]\ncontinual: true\n"
                      "rmu_update_layers: 5,6,7\nrmu_modules: [mlp.down_proj]\n")
    config = resolve_config(str(recipe), {"lora_targets": "q_proj,v_proj", "report_to": "none"}, UnlearnConfig)
    assert (config.task_ids, config.rmu_update_layers, config.rmu_modules, config.lora_targets, config.report_to) == (
        (2, 1), (5, 6, 7), ("mlp.down_proj",), ("q_proj", "v_proj"), ("none",))
    recorded = config.to_dict()
    assert (recorded["task_ids"], recorded["rmu_update_layers"], recorded["rmu_modules"], recorded["lora_targets"],
            recorded["report_to"]) == ("2,1", "5,6,7", "mlp.down_proj", "q_proj,v_proj", "none")
    again = tmp_path / "again.yaml"  # what a run records reads back to the same config
    again.write_text(yaml.safe_dump({k: v for k, v in recorded.items() if v is not None}))
    assert resolve_config(str(again), {}, UnlearnConfig) == config


def test_repeated_task_ids_and_a_freq_per_task_are_checked_on_the_tuple(tmp_path):
    with pytest.raises(UserError, match=r"^--task-ids 1,2,1: task 1 is given twice$"):
        resolve_config(None, {"forget": "f.jsonl", "task_ids": "1,2,1", "continual": True}, UnlearnConfig)
    with pytest.raises(UserError, match=r"^--freq 1,2: 2 frequencies for 1 tasks \(a\)"):
        resolve_config(None, {"tasks": [task_from_option("a=a.jsonl")], "freq": "1,2"}, MultitaskConfig)
    config = resolve_config(None, {"tasks": [task_from_option("a=a.jsonl"), task_from_option("b=b.jsonl")],
                                   "freq": "3,0"}, MultitaskConfig)
    assert [task["freq"] for task in config.tasks] == [3, 0] and config.freq == (3, 0)
