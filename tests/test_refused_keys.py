"""Recipe keys every training command's config holds but a command has no use for are refused when that command's
config is validated, one line naming the key and why, rather than taken and ignored: `ref_offload` in multitask and
align (their one loss, CE, builds no reference model), `eval_every`, `select_by` and `stop_when` in align (it
evaluates after training only). Given in a recipe, as a value on the command line's path (`resolve_config`'s
overrides) or with `doplus bench schemes --set`, the same line, exit code 2, before anything is loaded or written."""

from __future__ import annotations

import pytest

from doplus_cli.commands.align import AlignConfig
from doplus_cli.commands.multitask import MultitaskConfig
from doplus_cli.commands.unlearn import UnlearnConfig
from doplus_cli.config import resolve_config
from doplus_cli.errors import UserError
from tests.helpers import run_cli

REFERENCE = ("trains with CE, which has no reference model; ref_offload places the reference model of unlearn's NPO, "
             "DPO, KL and UNDIAL")
AFTER_TRAINING = "doplus align evaluates after training only (held_out, eval_suite)"
# (command, key, recipe value, the line)
REFUSED = [
    ("multitask", "ref_offload", "cpu", f"ref_offload cpu: doplus multitask {REFERENCE}"),
    ("multitask", "ref_offload", "8bit", f"ref_offload 8bit: doplus multitask {REFERENCE}"),
    ("align", "ref_offload", "cpu", f"ref_offload cpu: doplus align {REFERENCE}"),
    ("align", "eval_every", 5, f"eval_every 5: {AFTER_TRAINING}, never during it; eval_every is for unlearn and "
                               "multitask"),
    ("align", "select_by", "MU", f"select_by MU: {AFTER_TRAINING}, so no evaluated step can be kept as best/; "
                                 "select_by is for unlearn and multitask"),
    ("align", "stop_when", "MU>=1", f"stop_when MU>=1: {AFTER_TRAINING}, so no evaluation can end the run early; "
                                    "stop_when is for unlearn and multitask"),
]
CLASSES = {"unlearn": UnlearnConfig, "multitask": MultitaskConfig, "align": AlignConfig}


def recipe_text(command: str) -> str:
    """The least a recipe of `command` needs to pass validation (the files are not opened by it)."""
    return {"unlearn": "forget: f.jsonl\nretain: r.jsonl\n",
            "multitask": "tasks:\n  - name: a\n    data: a.jsonl\n",
            "align": "safety: s.jsonl\ngeneral: g.jsonl\n"}[command]


@pytest.mark.parametrize("command,key,value,line", REFUSED, ids=[f"{c}-{k}-{v}" for c, k, v, _ in REFUSED])
def test_a_key_the_command_has_no_use_for_is_one_line_from_a_recipe_or_a_flag_value(tmp_path, capsys, command, key,
                                                                                   value, line):
    recipe = tmp_path / f"{command}.yaml"
    recipe.write_text(recipe_text(command) + f"{key}: {value}\n")
    with pytest.raises(UserError) as raised:
        resolve_config(str(recipe), {}, CLASSES[command])
    assert str(raised.value) == line
    # the same value given over a recipe that does not set it
    recipe.write_text(recipe_text(command))
    with pytest.raises(UserError) as raised:
        resolve_config(str(recipe), {key: value}, CLASSES[command])
    assert str(raised.value) == line
    # the command itself: the one line on stderr, exit code 2, no run folder
    recipe.write_text(recipe_text(command) + f"{key}: {value}\n")
    capsys.readouterr()
    assert run_cli(command, "--recipe", recipe, "--out", tmp_path / "run") == 2
    assert capsys.readouterr().err.strip() == f"error: {line}"
    assert not (tmp_path / "run").exists()


def test_bench_schemes_set_refuses_them_before_any_run(tmp_path, capsys):
    recipe = tmp_path / "align.yaml"
    recipe.write_text(recipe_text("align") + "held_out: 2\n")
    for key, value, line in [(k, v, text) for c, k, v, text in REFUSED if c == "align"]:
        capsys.readouterr()
        assert run_cli("bench", "schemes", "--recipe", recipe, "--out", tmp_path / "bench", "--list-runs",
                       "--set", f"{key}={value}") == 2
        assert capsys.readouterr().err.strip() == f"error: {line}"
    assert not (tmp_path / "bench").exists()


def test_the_commands_that_use_them_still_take_them_and_align_takes_their_unset_values(tmp_path):
    # unlearn places its NPO reference model; multitask evaluates during training and keeps its best step
    unlearn = resolve_config(None, {"forget": "f.jsonl", "retain": "r.jsonl", "ref_offload": "cpu", "eval_every": 2,
                                    "select_by": "MU"}, UnlearnConfig)
    assert (unlearn.ref_offload, unlearn.eval_every, unlearn.select_by) == ("cpu", 2, "MU")
    multitask = tmp_path / "multitask.yaml"
    multitask.write_text(recipe_text("multitask") + "eval_every: 3\nselect_by: a\n")
    config = resolve_config(str(multitask), {}, MultitaskConfig)
    assert (config.eval_every, config.select_by, config.ref_offload) == (3, "a", None)
    # the values that mean "not set" are what align runs with anyway
    align = tmp_path / "align.yaml"
    align.write_text(recipe_text("align") + "eval_every: 0\nselect_by: null\nref_offload: null\n")
    config = resolve_config(str(align), {}, AlignConfig)
    assert (config.eval_every, config.select_by, config.ref_offload) == (0, None, None)
