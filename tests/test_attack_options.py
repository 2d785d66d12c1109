"""`--attack-option ATTACK.NAME=VALUE`: the white-box attacks' own settings, typed once where they are read, and
every bad one a single line that names it."""

from __future__ import annotations

import pytest

from doplus_cli.errors import UserError
from doplus_cli.evaluation.attacks import parse_attack_options
from tests.helpers import run_cli

CHOSEN = ("logit-lens", "linear-probe", "embedding")


def test_values_come_back_typed_by_attack():
    given = ["embedding.steps=5", "embedding.lr=0.01", " embedding.init = random", "embedding.max_seconds=30",
             "logit-lens.max_new_tokens=4", "linear-probe.l2=1e-3"]
    assert parse_attack_options(given, CHOSEN) == {
        "embedding": {"steps": 5, "lr": 0.01, "init": "random", "max_seconds": 30.0},
        "logit-lens": {"max_new_tokens": 4}, "linear-probe": {"l2": 0.001}}
    assert parse_attack_options(None, CHOSEN) == {} and parse_attack_options([], ()) == {}
    # the last of two values of one setting stands, as a repeated flag does
    assert parse_attack_options(["embedding.steps=5", "embedding.steps=7"], CHOSEN) == {"embedding": {"steps": 7}}


@pytest.mark.parametrize("text, attacks, message", [
    ("embedding.steps", CHOSEN, "write ATTACK.NAME=VALUE"),
    ("steps=5", CHOSEN, "write ATTACK.NAME=VALUE"),
    ("embedding.steps=", CHOSEN, "write ATTACK.NAME=VALUE"),
    ("prune.fraction=0.1", ("prune",), "'prune' has no settings; these attacks do: logit-lens, linear-probe"),
    ("embedding.steps=5", ("logit-lens",), "embedding is not among --attacks"),
    ("embedding.stepz=5", CHOSEN, "unknown option 'stepz'"),
    ("embedding.steps=0", CHOSEN, "steps must be a whole number >= 1, got '0'"),
    ("embedding.init=zeros", CHOSEN, "init must be one of text, random"),
    ("logit-lens.max_new_tokens=x", CHOSEN, "logit-lens.max_new_tokens: must be a whole number >= 1"),
    ("linear-probe.l2=-1", CHOSEN, "linear-probe.l2: must be a number > 0"),
    ("linear-probe.C=1", CHOSEN, "unknown option 'C': choose from l2"),
])
def test_a_bad_option_is_one_line_naming_it(text, attacks, message):
    with pytest.raises(UserError) as caught:
        parse_attack_options([text], attacks)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_the_command_stops_before_loading_anything(tmp_path, capsys):
    code = run_cli("evaluate", "--model", tmp_path / "no-model", "--out", tmp_path / "e", "--attacks", "logit-lens",
                   "--attack-option", "embedding.steps=5")
    err = capsys.readouterr().err.strip()
    assert code == 2 and "embedding is not among --attacks" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "e").exists()
