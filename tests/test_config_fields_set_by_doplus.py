"""The fields of a training config that doplus sets itself (the teaching stage's report entry, the precision
bench's compensation switch): typed, never an option or a recipe key, never in what a run records."""

import dataclasses

import pytest

from doplus_cli.commands.align import AlignConfig
from doplus_cli.commands.multitask import MultitaskConfig
from doplus_cli.commands.unlearn import UnlearnConfig
from doplus_cli.config import field_names, load_recipe, resolve_config
from doplus_cli.errors import UserError

SET_BY_DOPLUS = {"taught", "compensation"}


@pytest.mark.parametrize("cls", [UnlearnConfig, MultitaskConfig, AlignConfig])
def test_fields_set_by_doplus_are_neither_options_nor_recorded(cls):
    every = {f.name for f in dataclasses.fields(cls)}
    assert SET_BY_DOPLUS <= every
    assert set(field_names(cls)) == every - SET_BY_DOPLUS
    plain = cls()
    marked = dataclasses.replace(plain, taught={"recipe": "/r/teach.yaml", "cache": "/c/k", "reused": True},
                                 compensation=False)
    recorded = marked.to_dict()
    # what config.yaml, a checkpoint and report.json hold: every option, and the same bytes with or without them
    assert set(recorded) == every - SET_BY_DOPLUS
    assert recorded == plain.to_dict()
    assert "taught" not in repr(marked) and "compensation" not in repr(marked)


def test_defaults_teach_nothing_and_compensate():
    config = resolve_config(None, {"forget": "f.jsonl", "retain": "r.jsonl", "steps": 2}, UnlearnConfig)
    assert config.taught is None and config.compensation is True


@pytest.mark.parametrize("key", ["taught", "compensation", "extra"])
def test_a_recipe_cannot_set_them(tmp_path, key):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"steps: 2\n{key}: false\n")
    with pytest.raises(UserError, match=rf"recipe\.yaml: unknown option '{key}'"):
        load_recipe(recipe, UnlearnConfig)
