"""`--v-floor` / recipe key `v_floor`: the safeguarded rule's floor ρ, from the config to DualOptim+, and
`doplus bench optimizer --stability --v-floor`.

The reference is the float64 loop of the rule (`tests.helpers.Float64DualOptimPlus`) at the floor asked for, on a
problem where v̂_B + v̂_k passes through zero, so the floor acts and a wrong floor moves the weights."""

from __future__ import annotations

import inspect

import pytest
import torch

from doplus_cli.bench.stability import doplus_builder, parse_floors
from doplus_cli.commands.unlearn import UnlearnConfig
from doplus_cli.config import TrainConfig, resolve_config
from doplus_cli.engine.loop import optimizer_settings
from doplus_cli.engine.optimizers import build_optimizer
from doplus_cli.errors import UserError
from doplus_cli.optim import DualOptimPlus
from tests.helpers import Float64DualOptimPlus, cycle, run_cli

LR, BETAS = 1e-2, (0.9, 0.95)


def unlearn_config(tofu_dir, **values):
    return resolve_config(None, {"forget": str(tofu_dir / "forget01.json"), "retain": str(tofu_dir / "retain90.json"),
                                 "lr": LR, "betas": BETAS, **values}, UnlearnConfig)


def crossing_gradients(steps):
    """Forget gradients d_f + 0.3ξ, retain gradients 100x smaller: V = v̂_B + v̂_k cancels on retain steps."""
    generator = torch.Generator().manual_seed(1)
    directions = {o: torch.randn(20, 50, generator=generator, dtype=torch.float64) for o in ("forget", "retain")}
    scales = {"forget": 1.0, "retain": 0.01}
    objectives = cycle({"forget": 1, "retain": 5}, steps)
    grads = [scales[o] * (directions[o] + 0.3 * torch.randn(20, 50, generator=generator, dtype=torch.float64))
             for o in objectives]
    return objectives, grads


@pytest.mark.parametrize("v_floor", [None, 0.02, 0.0])
def test_the_floor_reaches_the_optimizer_and_its_steps_equal_a_float64_loop(tofu_dir, v_floor):
    """None: the option left out (the default floor); 0.02; 0: the clamp alone."""
    config = unlearn_config(tofu_dir, **({} if v_floor is None else {"v_floor": v_floor}))
    floor = TrainConfig.v_floor if v_floor is None else v_floor
    assert config.v_floor == floor
    torch.manual_seed(0)
    model = torch.nn.Linear(50, 20, bias=False).double()
    start = model.weight.detach().clone()
    optimizer, _ = build_optimizer(model, ("forget", "retain"), {}, optimizer_settings(config))
    assert isinstance(optimizer, DualOptimPlus)
    settings = {(g["rule"], g["v_floor"], g["max_update"]) for g in optimizer.param_groups}
    assert settings == {("safeguarded", floor, 10.0)}
    objectives, grads = crossing_gradients(60)
    reference = Float64DualOptimPlus([start], LR, BETAS, BETAS, 1e-8, config.weight_decay, floor=floor, bound=10.0)
    other = Float64DualOptimPlus([start], LR, BETAS, BETAS, 1e-8, config.weight_decay, floor=0.05 if floor != 0.05
                                 else 0.02, bound=10.0)
    floored = clamped = 0
    for objective, g in zip(objectives, grads):
        model.weight.grad = g.clone()
        optimizer.step(objective=objective)
        counts = optimizer.safeguard_counts()
        floored, clamped = floored + counts[0], clamped + counts[1]
        reference.step(objective, [g])
        other.step(objective, [g])
    # without a floor, where V has cancelled to nearly nothing, the last bits of the two loops' float64 arithmetic
    # (the same formulas, in another order) are amplified by S/|V|: up to 3.5e-10 here, where the floor keeps
    # them under 1e-12 (what the floor is for)
    atol = 1e-12 if floor > 0 else 1e-8
    torch.testing.assert_close(model.weight.detach(), reference.params[0], rtol=1e-10, atol=atol)
    assert (model.weight.detach() - other.params[0]).abs().max() > 1e-6  # another floor ends elsewhere
    assert (floored > 0) == (floor > 0)  # the floor acted where it is on, and never at ρ = 0


def test_the_default_floor_is_the_optimizers_own_default():
    """One default: the library's `DualOptimPlus(v_floor=...)` and the command's `--v-floor` agree."""
    assert inspect.signature(DualOptimPlus).parameters["v_floor"].default == TrainConfig.v_floor


def test_a_recipe_key_sets_the_floor_and_bad_floors_are_one_line_errors(tofu_dir, tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"forget: {tofu_dir / 'forget01.json'}\nretain: {tofu_dir / 'retain90.json'}\nv_floor: 0.01\n")
    assert resolve_config(str(recipe), {}, UnlearnConfig).v_floor == 0.01
    for bad in (1.0, -0.1):
        with pytest.raises(UserError, match=r"--v-floor must be a number in \[0, 1\)"):
            unlearn_config(tofu_dir, v_floor=bad)
    with pytest.raises(UserError, match=r"--v-floor must be a finite number, got nan"):
        unlearn_config(tofu_dir, v_floor=float("nan"))
    for other in ({"doplus_rule": "paper"}, {"scheme": "dualoptim"}):
        with pytest.raises(UserError, match="--v-floor 0.01 sets the floor of DualOptim\\+'s safeguarded rule"):
            unlearn_config(tofu_dir, v_floor=0.01, **other)
    assert unlearn_config(tofu_dir, doplus_rule="paper").v_floor == TrainConfig.v_floor  # left out: no error
    capsys.readouterr()
    arguments = ["unlearn", "--forget", tofu_dir / "forget01.json", "--retain", tofu_dir / "retain90.json",
                 "--dry-run", "--out", tmp_path / "out"]
    assert run_cli(*arguments, "--v-floor", "1.5") == 2
    assert capsys.readouterr().err.strip() == "error: --v-floor must be a number in [0, 1), got 1.5"
    recipe.write_text(recipe.read_text().replace("0.01", "-0.5"))
    assert run_cli("unlearn", "--recipe", recipe, "--dry-run", "--out", tmp_path / "out") == 2
    assert capsys.readouterr().err.strip() == f"error: {recipe}: option 'v_floor' must be a number in [0, 1), got -0.5"
    assert not (tmp_path / "out").exists()


def test_bench_stability_takes_a_list_of_floors(capsys):
    assert parse_floors(None) == (TrainConfig.v_floor,)
    assert parse_floors("0, 0.01,0.02,0.05,0.02") == (0.0, 0.01, 0.02, 0.05)
    for bad in ("1", "-0.1", "x", "0.01,,0.02"):
        with pytest.raises(UserError, match="is not a number in \\[0, 1\\)"):
            parse_floors(bad)
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert doplus_builder("safeguarded", v_floor=0.02)(params).param_groups[0]["v_floor"] == 0.02
    assert doplus_builder("safeguarded")(params).param_groups[0]["v_floor"] == TrainConfig.v_floor
    capsys.readouterr()
    assert run_cli("bench", "optimizer", "--v-floor", "0.02") == 2
    assert capsys.readouterr().err.strip() == ("error: --v-floor sets the floors of --stability's safeguarded rows: "
                                               "add --stability")


def test_a_run_recorded_without_the_key_ran_at_the_floor_of_0_05():
    """Checkpoints and runs recorded before `v_floor` was a recipe key trained at ρ = 0.05: resuming one under
    another floor is a change the resume check names."""
    from doplus_cli.engine.checkpoint import differing_keys

    now = UnlearnConfig().to_dict()
    before = {k: v for k, v in now.items() if k != "v_floor"}
    assert differing_keys(before, {**now, "v_floor": 0.05}) == []
    assert differing_keys(before, {**now, "v_floor": 0.02}) == ["v_floor"]
