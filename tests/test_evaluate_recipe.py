"""`doplus evaluate --recipe FILE`: a YAML file of evaluate's options, under the flags and over the defaults, with
relative paths found next to the recipe; a bad key or value is one line naming the file and the key."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_cli

TOFU_FILES = ("forget10_perturbed", "retain_perturbed", "real_authors_perturbed", "world_facts_perturbed")


def small_tofu(tofu_dir, folder, rows: int = 3):
    """The first `rows` rows of each TOFU evaluation file in `folder`."""
    folder.mkdir(parents=True)
    for name in TOFU_FILES:
        (folder / f"{name}.json").write_text("".join(list(open(tofu_dir / f"{name}.json"))[:rows]))
    return folder


def recorded_config(out) -> dict:
    return json.loads((out / "eval.json").read_text())["config"]


def test_a_recipe_sets_options_as_their_flags_do(tiny_llama, tofu_dir, tmp_path):
    """The same options as recipe keys and as flags give the same SUMMARY.json, byte for byte; `data_dir: tofu`
    is the folder beside the recipe, though the command runs elsewhere; a list is the option's comma-separated
    value."""
    data = small_tofu(tofu_dir, tmp_path / "recipes" / "tofu")
    recipe = tmp_path / "recipes" / "eval.yaml"
    recipe.write_text(f"model: {tiny_llama}\nsuite: [tofu]\ndata_dir: tofu\nmax_samples: 2\nmax-new-tokens: 2\n"
                      "seed: 3\ntargeted: true\n")
    assert run_cli("evaluate", "--recipe", recipe, "--out", tmp_path / "from-recipe") == 0
    assert run_cli("evaluate", "--model", tiny_llama, "--suite", "tofu", "--data-dir", data, "--max-samples", 2,
                   "--max-new-tokens", 2, "--seed", 3, "--targeted", "--out", tmp_path / "from-flags") == 0
    summary = (tmp_path / "from-recipe" / "SUMMARY.json").read_bytes()
    assert summary == (tmp_path / "from-flags" / "SUMMARY.json").read_bytes()
    # the recipe's values took effect (each differs from the default), not the defaults in both runs
    config = recorded_config(tmp_path / "from-recipe")
    assert (config["max_samples"], config["max_new_tokens"], config["seed"], config["targeted"]) == (2, 2, 3, True)
    assert config["data_dir"] == str(data)
    assert "OVR_targeted" not in json.loads(summary)  # --targeted: one OVR formula, not both


def test_a_flag_overrides_the_recipe_even_with_the_default_value(tiny_llama, tofu_dir, tmp_path):
    data = small_tofu(tofu_dir, tmp_path / "tofu")
    recipe = tmp_path / "eval.yaml"
    recipe.write_text(f"model: {tiny_llama}\ndata_dir: {data}\nmax_samples: 2\nmax_new_tokens: 3\nbatch_size: 4\n")
    out = tmp_path / "eval"
    # --batch-size 64 is the default: given on the command line, it still wins over the recipe's 4
    assert run_cli("evaluate", "--recipe", recipe, "--max-samples", 1, "--batch-size", 64, "--out", out) == 0
    config = recorded_config(out)
    assert (config["max_samples"], config["batch_size"], config["max_new_tokens"]) == (1, 64, 3)
    per_sample = json.loads((out / "TOFU_EVAL.json").read_text())["sets"]
    assert [len(per_sample[s]) for s in ("forget", "retain", "real_authors", "world_facts")] == [1, 1, 1, 1]


@pytest.mark.parametrize(
    "text,message",
    [
        ("max_sample: 2\n", "unknown option 'max_sample' (did you mean 'max_samples'?)"),
        ("compare: true\n", "unknown option 'compare'"),
        ("batch_size: 0\n", "option 'batch_size': input should be greater than or equal to 1, got 0"),
        ("seed: many\n", "option 'seed': input should be a valid integer, unable to parse string as an integer, "
         "got 'many'"),
        ("max_new_tokens: 2.5\n", "option 'max_new_tokens': input should be a valid integer, unable to parse "
         "string as an integer, got 2.5"),
        ("seed: true\n", "option 'seed': input should be a valid integer, unable to parse string as an integer, "
         "got True"),
        ("targeted: maybe\n", "option 'targeted': input should be a valid boolean, unable to interpret input, "
         "got 'maybe'"),
        ("suite: {tofu: 1}\n", "option 'suite' must be one value, got {'tofu': 1}"),
        ("split:\n", "option 'split' cannot be empty"),
    ],
)
def test_a_bad_key_or_value_is_one_line_naming_the_file_and_key(tmp_path, capsys, text, message):
    recipe = tmp_path / "eval.yaml"
    recipe.write_text(text)
    out = tmp_path / "eval"
    capsys.readouterr()
    assert run_cli("evaluate", "--recipe", recipe, "--out", out) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {recipe}: {message}", err
    assert not out.exists()  # refused before anything is loaded or written


def test_evaluate_takes_the_options_its_table_lists():
    """options.COMMAND_OPTIONS["evaluate"] names evaluate's options with the flags the command parses, which takes
    them in the order of its help's panels: the recipe keys with_recipe accepts are these names."""
    import typer.main

    from doplus_cli.cli import app
    from doplus_cli.options import command_flags, in_panels

    params = typer.main.get_command(app).commands["evaluate"].params
    parsed = {p.name: (p.opts, p.secondary_opts) for p in params if p.param_type_name == "option"}
    flags = command_flags("evaluate")
    assert list(parsed.items()) == [(name, flags[name]) for name in in_panels("evaluate") if name in flags]
    assert [p.name for p in params if p.param_type_name == "argument"] == ["folders"]
