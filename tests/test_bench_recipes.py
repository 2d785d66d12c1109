"""`doplus bench optimizer --recipe FILE` and `doplus bench precision --recipe FILE`: a YAML file of the command's
options (dashes or underscores), under the flags given and over the defaults; a bad key, value or file is one line
naming the file and the key, exit 2, before anything runs. The benches themselves are replaced by recorders: these
tests check the values each command hands to its bench, not the measurements."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import run_cli


@pytest.fixture
def optimizer_bench(monkeypatch):
    """The BenchConfig each speed run of `doplus bench optimizer` receives, and the (seed, floors) of each
    --stability run."""
    import doplus_cli.bench.optimizer as bench
    import doplus_cli.bench.stability as stability

    calls = {"speed": [], "stability": []}
    monkeypatch.setattr(bench, "run_optimizer_bench", lambda config, progress: calls["speed"].append(config) or {})
    monkeypatch.setattr(bench, "print_table", lambda result: None)
    monkeypatch.setattr(stability, "stability_rows",
                        lambda seed, progress, floors: calls["stability"].append((seed, floors)) or [])
    monkeypatch.setattr(stability, "print_stability", lambda rows: None)
    return calls


@pytest.fixture
def precision_bench(monkeypatch):
    """The (model, out, steps, lr, modes) each run of `doplus bench precision` receives."""
    import doplus_cli.bench.precision as bench

    calls = []
    monkeypatch.setattr(bench, "run_precision_bench",
                        lambda model, out, steps, lr, modes, say: calls.append((model, out, steps, lr, modes)) or {})
    monkeypatch.setattr(bench, "print_table", lambda result, console: None)
    return calls


def test_bench_optimizer_takes_its_options_from_a_recipe_under_the_flags(tmp_path, optimizer_bench):
    recipe = tmp_path / "speed.yaml"
    recipe.write_text("params: 200k\ndtype: bfloat16\ndevice: cpu\nsteps: 9\nwarmup: 3\nonly: [doplus, adamw]\n"
                      "seed: 4\n")
    # --steps 7 is the default: given on the command line, it still wins over the recipe's 9
    assert run_cli("bench", "optimizer", "--recipe", recipe, "--steps", 7) == 0
    (config,) = optimizer_bench["speed"]
    assert (config.params, config.dtype, config.device, config.steps, config.warmup, config.only, config.seed) == (
        200_000, torch.bfloat16, "cpu", 7, 3, ("adamw", "doplus"), 4)
    # without a recipe, the flags' defaults, as before
    assert run_cli("bench", "optimizer", "--device", "cpu") == 0
    default = optimizer_bench["speed"][1]
    assert (default.params, default.dtype, default.steps, default.warmup, default.only, default.seed) == (
        50_000_000, torch.float32, 7, 2, None, 0)


def test_bench_optimizer_recipe_chooses_the_stability_problem_and_its_floors(tmp_path, optimizer_bench):
    recipe = tmp_path / "stability.yaml"
    recipe.write_text("stability: true\nv-floor: [0, 0.05]\nseed: 2\n")
    assert run_cli("bench", "optimizer", "--recipe", recipe) == 0
    assert run_cli("bench", "optimizer", "--recipe", recipe, "--seed", 0, "--v-floor", "0.01") == 0
    assert optimizer_bench["stability"] == [(2, (0.0, 0.05)), (0, (0.01,))]
    assert optimizer_bench["speed"] == []


def test_bench_precision_takes_its_options_from_a_recipe_under_the_flags(tmp_path, monkeypatch, precision_bench):
    (tmp_path / "recipes" / "tiny").mkdir(parents=True)
    recipe = tmp_path / "recipes" / "precision.yaml"
    recipe.write_text("model: tiny\nout: bench/p\nsteps: 5\nlr: 2.0e-5\nmodes: [fp32, bf16]\n")
    monkeypatch.chdir(tmp_path)  # the model folder is found next to the recipe, not here
    # --lr 1e-5 is the default: given on the command line, it still wins over the recipe's 2e-5
    assert run_cli("bench", "precision", "--recipe", recipe, "--lr", "1e-5") == 0
    assert run_cli("bench", "precision") == 0
    assert precision_bench == [
        (str(tmp_path / "recipes" / "tiny"), "bench/p", 5, 1e-5, ("fp32", "bf16")),
        (None, "bench/precision", 20, 1e-5, ("fp32", "bf16-mixed", "bf16", "bf16-uncompensated")),
    ]


@pytest.mark.parametrize(
    "command,text,message",
    [
        ("optimizer", "param: 50M\n", "unknown option 'param' (did you mean 'params'?)"),
        ("optimizer", "json: true\n", "unknown option 'json'"),  # how the result is printed is no recipe's
        ("optimizer", "warmup: 0\n", "option 'warmup': input should be greater than or equal to 1, got 0"),
        ("optimizer", "seed: many\n", "option 'seed': input should be a valid integer, unable to parse string as an "
         "integer, got 'many'"),
        ("optimizer", "stability: maybe\n", "option 'stability': input should be a valid boolean, unable to "
         "interpret input, got 'maybe'"),
        ("precision", "step: 5\n", "unknown option 'step' (did you mean 'steps'?)"),
        ("precision", "steps: 2.5\n", "option 'steps': input should be a valid integer, unable to parse string as "
         "an integer, got 2.5"),
        ("precision", "lr: {peak: 1}\n", "option 'lr' must be one value, got {'peak': 1}"),
        ("precision", "out:\n", "option 'out' cannot be empty"),
    ],
)
def test_a_bad_bench_recipe_is_one_line_naming_the_file_and_key(tmp_path, capsys, optimizer_bench, precision_bench,
                                                                command, text, message):
    recipe = tmp_path / "bench.yaml"
    recipe.write_text(text)
    capsys.readouterr()
    assert run_cli("bench", command, "--recipe", recipe) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {recipe}: {message}", err
    assert optimizer_bench == {"speed": [], "stability": []} and precision_bench == []  # refused before running


@pytest.mark.parametrize("command", ["optimizer", "precision"])
def test_a_missing_bench_recipe_is_one_line(tmp_path, capsys, optimizer_bench, precision_bench, command):
    recipe = tmp_path / "missing.yaml"
    capsys.readouterr()
    assert run_cli("bench", command, "--recipe", recipe) == 2
    assert capsys.readouterr().err.strip() == f"error: {recipe}: recipe file not found"
    assert optimizer_bench == {"speed": [], "stability": []} and precision_bench == []
