"""Data doplus does not ship has a way in: a missing data file's one-line error names its data set and the command
that fetches it where it was looked for, every such file a shipped recipe names belongs to a known set, and
docs/data-sets.md gives each set's commands."""

from __future__ import annotations

from pathlib import Path

import pytest

from doplus_cli.config import PATH_KEYS, TASK_PATH_KEYS, read_recipe
from doplus_cli.data.fetching import DATA_SETS, data_set_of, fetch_hint
from doplus_cli.recipes import list_recipes, recipes_root
from tests.helpers import run_cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("path", "data_set"), [
    ("data/tofu/forget10.json", "tofu"), ("DIR/retain_perturbed.json", "tofu"), ("data/tofu", "tofu"),
    ("data/safety/safety_instructions.json", "safety"), ("data/safety/I-CoNa.json", "safety-evaluation"),
    ("data/safety/xstest_prompts.csv", "xstest"), ("data/safety/alpaca_seed_tasks.jsonl", "alpaca"),
    ("data/wmdp/forget.jsonl", "wmdp"), ("TRACE/Py150/train.json", "trace"),
    ("hf:muse-bench/MUSE-News:raw@forget", "muse"), ("hf:yahma/alpaca-cleaned@train[:20004]", "alpaca"),
    ("forget.jsonl", None), ("data/mine/retain.jsonl", None), ("hf:someone/else", None),
])
def test_a_path_is_known_by_its_folder_or_file_name(path, data_set):
    assert data_set_of(path) == data_set


def test_the_hint_is_the_fetch_command_for_the_folder_looked_in():
    hint = fetch_hint("runs/x/data/tofu/forget10.json")
    assert hint.startswith("TOFU as the DualOptim+ authors ship it: git clone --depth 1 "
                           "https://github.com/CityU-MLO/DualOptimPlus")
    assert "cp DualOptimPlus/data/tofu/*.json runs/x/data/tofu/" in hint and "docs/data-sets.md" in hint
    assert "curl -L --create-dirs -o data/safety/safety_instructions.json " in fetch_hint(
        "data/safety/safety_instructions.json")
    assert "--out data/wmdp" in fetch_hint("data/wmdp/retain.jsonl")
    assert 'LLM-CL-Benchmark_5000" work/TRACE' in fetch_hint("work/TRACE/ScienceQA/test.json")
    assert fetch_hint("mine/forget.jsonl") is None and fetch_hint("hf:muse-bench/MUSE-News:raw@forget") is None


def test_a_missing_tofu_file_is_one_line_with_its_fetch_command(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "retain.jsonl").write_text('{"question": "q", "answer": "a"}\n')
    assert run_cli("unlearn", "--forget", "data/tofu/forget10.json", "--retain", "retain.jsonl",
                   "--out", tmp_path / "run") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "data/tofu/forget10.json: file not found; TOFU as the DualOptim+ authors ship it: git clone" in err
    assert "cp DualOptimPlus/data/tofu/*.json data/tofu/" in err


def test_a_missing_file_of_no_known_set_says_only_that(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run_cli("unlearn", "--forget", "mine.jsonl", "--loss", "NPO", "--out", tmp_path / "run") == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("mine.jsonl: file not found") and "docs/data-sets.md" not in err


def _paths(recipe: Path) -> list[str]:
    data = read_recipe(recipe)
    found = [data[key] for key in PATH_KEYS if key != "model" and isinstance(data.get(key), str)]
    found += [task[key] for task in data.get("tasks") or [] for key in TASK_PATH_KEYS if isinstance(task.get(key), str)]
    return [value.partition("[")[0] for value in found if value != "tofu-authors"]


def test_every_file_a_shipped_recipe_reads_and_doplus_does_not_ship_belongs_to_a_known_set():
    """So the error for any of them names a command."""
    unknown = []
    for recipe in list_recipes():
        for value in _paths(recipe.path):
            shipped = not value.startswith("hf:") and (recipe.path.parent / value).resolve().exists()
            if not shipped and data_set_of(value) is None:
                unknown.append(f"{recipe.name}: {value}")
    assert unknown == []
    assert recipes_root() == ROOT / "recipes"


def test_the_data_sets_page_gives_each_sets_commands_and_is_linked():
    page = (ROOT / "docs" / "data-sets.md").read_text()
    for data in DATA_SETS.values():
        command = data.fetch.split(" (")[0]
        for word in command.split():  # the URLs and scripts of each command, as the page writes them
            if word.startswith(("https://", "recipes/")) and "{" not in word:
                assert word.rstrip(",").removesuffix("'s") in page, (data.short, word)
    assert "(data-sets.md)" in (ROOT / "docs" / "index.md").read_text()
    assert "(data-sets.md)" in (ROOT / "docs" / "install.md").read_text()
