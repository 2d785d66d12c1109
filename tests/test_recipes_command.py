"""`doplus recipes list` and `doplus recipes copy NAME DEST`: the shipped recipes, seen and copied anywhere."""

from __future__ import annotations

import re
from pathlib import Path

from doplus_cli.commands.multitask import MultitaskConfig
from doplus_cli.commands.unlearn import UnlearnConfig
from doplus_cli.config import load_recipe, resolve_config
from doplus_cli.recipes import list_recipes, recipes_root
from tests.helpers import REPO, run_cli


def test_list_shows_every_recipe_with_its_command(capsys):
    assert run_cli("recipes", "list") == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()[2:] if line.strip()}
    assert rows["quickstart"] == "unlearn"
    assert rows["tofu/phi-1.5/idk_gd"] == "unlearn"
    assert rows["bench/mini_tofu"] == "unlearn"
    assert rows["bench/mini_tofu_teach"] == "multitask"  # a teaching recipe is a multitask recipe
    assert rows["multitask/demo"] == "multitask"
    assert rows["align/demo"] == "align"
    assert "Quickstart - forget Marie Curie and Mozart" in out  # the description field
    assert len(rows) == len(list(recipes_root().rglob("*.yaml")))


def test_list_says_which_recipes_run_as_shipped_and_which_data_the_others_need(capsys):
    """The data column: `ships with doplus` when every file a recipe reads is in the recipes folder (written by
    doplus, or generated there), else `needs` and each data set it reads from elsewhere."""
    assert run_cli("recipes", "list") == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines[1].index("data")
    data = {line.split()[0]: line[start:].split("  ")[0].strip() for line in lines[2:] if line.strip()}
    for name in ("quickstart", "multitask/demo", "bench/muse_mini", "bench/real_world_mini", "real_world/idk_gd"):
        assert data[name] == "ships with doplus", name
    assert data["tofu/phi-1.5/npo_gd"] == data["bench/mini_tofu"] == "needs TOFU"  # mini_tofu: its teaching stage too
    assert data["align/demo"] == "needs Safety-Tuned LLaMAs, Alpaca"
    assert data["muse/news_npo_gd"] == "needs MUSE" and data["wmdp/rmu_zephyr"] == "needs WMDP"
    assert data["multitask/trace_llama2"] == "needs TRACE" and data["cluster/accelerate_fsdp"] == "-"


def test_copy_quickstart_brings_its_data_and_the_copy_resolves(tmp_path, capsys):
    assert run_cli("recipes", "copy", "quickstart", tmp_path) == 0
    out = capsys.readouterr().out
    copied = tmp_path / "quickstart.yaml"
    assert copied.read_text() == (recipes_root() / "quickstart.yaml").read_text()
    for name in ("quickstart_forget.jsonl", "quickstart_retain.jsonl"):
        assert (tmp_path / "data" / name).read_bytes() == (recipes_root() / "data" / name).read_bytes()
    assert "not shipped" not in out
    values = load_recipe(copied, UnlearnConfig)
    assert Path(values["forget"]) == tmp_path / "data" / "quickstart_forget.jsonl"
    config = resolve_config(str(copied), {}, UnlearnConfig)
    assert Path(config.retain) == tmp_path / "data" / "quickstart_retain.jsonl"


def test_copy_to_a_file_path_and_a_recipe_whose_data_sits_one_folder_up(tmp_path):
    dest = tmp_path / "mine.yaml"
    assert run_cli("recipes", "copy", "multitask/demo", dest) == 0
    # `../data/x.jsonl` in the shipped recipe: data/x.jsonl next to the copy
    tasks = load_recipe(dest, MultitaskConfig)["tasks"]
    assert [Path(t["data"]) for t in tasks] == [tmp_path / "data" / f"multitask_{n}.jsonl"
                                                for n in ("math", "choice", "code")]
    assert all(Path(t["data"]).is_file() for t in tasks)


def test_copy_of_a_tofu_recipe_names_the_missing_files_where_to_put_them_and_the_flags(tmp_path, capsys):
    assert run_cli("recipes", "copy", "bench/mini_tofu", tmp_path) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "mini_tofu.yaml").is_file()
    assert (tmp_path / "mini_tofu_teach.yaml").is_file()  # the teaching recipe it names comes along
    missing = [line for line in out.splitlines() if "not shipped" in line]
    assert any("forget01.json" in line and "tasks[1].data" in line for line in missing)  # the teaching recipe's
    forget = next(line for line in missing if "forget01.json (bench/mini_tofu.yaml:" in line)
    assert f"put it at {tmp_path / 'data' / 'tofu' / 'forget01.json'}" in forget and "--forget PATH" in forget
    assert any("retain90.json" in line and "--retain PATH" in line for line in missing)
    assert not any(p.suffix == ".json" for p in tmp_path.rglob("*"))  # TOFU is never copied


def test_copy_into_a_folder_that_does_not_exist_yet(tmp_path, monkeypatch, capsys):
    """The README's lines: `doplus recipes copy quickstart my-run/`, then `--recipe my-run/quickstart.yaml`,
    in a fresh directory; without the slash too."""
    monkeypatch.chdir(tmp_path)
    for dest in ("my-run/", "other-run"):
        assert run_cli("recipes", "copy", "quickstart", dest) == 0
        folder = tmp_path / dest.rstrip("/")
        assert folder.is_dir() and (folder / "quickstart.yaml").is_file()
        assert (folder / "data" / "quickstart_forget.jsonl").is_file()
        assert f"run it with: doplus unlearn --recipe {Path(dest) / 'quickstart.yaml'}" in capsys.readouterr().out
        config = resolve_config(str(Path(dest) / "quickstart.yaml"), {}, UnlearnConfig)
        assert Path(config.forget).resolve() == folder / "data" / "quickstart_forget.jsonl"


def test_copy_to_a_yaml_path_in_a_new_folder(tmp_path):
    dest = tmp_path / "new" / "mine.yaml"
    assert run_cli("recipes", "copy", "quickstart", dest) == 0
    assert dest.read_text() == (recipes_root() / "quickstart.yaml").read_text()
    assert (tmp_path / "new" / "data" / "quickstart_retain.jsonl").is_file()


def test_unknown_name_exits_2_with_the_closest_names(tmp_path, capsys):
    assert run_cli("recipes", "copy", "quikstart", tmp_path) == 2
    err = capsys.readouterr().err
    assert "quikstart" in err and "quickstart" in err
    assert len(err.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())


def test_existing_dest_file_needs_overwrite(tmp_path, capsys):
    dest = tmp_path / "q.yaml"
    dest.write_text("mine\n")
    assert run_cli("recipes", "copy", "quickstart", dest) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert dest.read_text() == "mine\n"
    assert run_cli("recipes", "copy", "quickstart", dest, "--overwrite") == 0
    assert dest.read_text() == (recipes_root() / "quickstart.yaml").read_text()


def test_every_recipe_loads():
    for recipe in list_recipes():
        assert recipe.description, recipe.name


def test_the_wheel_lists_every_package():
    """pyproject.toml lists the packages (the recipes ship as doplus_cli._recipes): none may be left out."""
    block = re.search(r"^packages = \[(.*?)\]", (REPO / "pyproject.toml").read_text(), re.S | re.M).group(1)
    listed = set(re.findall(r'"([^"]+)"', block))
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "doplus_cli").rglob("__init__.py")}
    assert found | {"doplus_cli._recipes"} == listed
