"""DualOptim+ keeps every setting in its param groups, as torch's optimizers do.

Two groups with different settings step as two optimizers built with those settings would, each on its own
parameters, bit for bit; `state_dict` carries every group's settings and a loaded optimizer continues bit for bit;
a state dict in the form doplus 0.1.0 and 0.2.0 saved (the rule's settings on the optimizer, not in its groups,
written out here by hand) loads, each group taking the settings it lacks from the group as built, and its next
step is the rule computed here in float64 from the hand-written states; `step` updates the AdamW rule's tensors
through the functional form, and the public `dualoptim_plus` given a group's settings steps as `step` does.
"""

from __future__ import annotations

import importlib
import io
import math
from types import SimpleNamespace

import pytest
import torch

from doplus_cli.engine import loop
from doplus_cli.optim import AdamW, DualOptimPlus, dualoptim_plus
from tests.helpers import Float64DualOptimPlus, cycle

MODULE = importlib.import_module("doplus_cli.optim.dualoptim_plus")  # the package's name is the function
LR, MULTIPLIERS = 1e-2, {"forget": 2.0}
SCHEDULE = cycle({"forget": 1, "retain": 2}, 9)

# Three groups, each with settings of its own and every path of the eager rule: the paper's rule with 8-bit delta
# states (the 5000-element tensor), the safeguard with a high floor, a low bound and the base ablations, Muon.
GROUPS = [
    {"shapes": [(5000,), (6, 5)],
     "settings": dict(rule="paper", betas=(0.8, 0.9), base_betas=(0.85, 0.99), weight_decay=0.1, state_bits=8,
                      quantize="delta")},
    {"shapes": [(40,), (4, 4)],
     "settings": dict(v_floor=0.3, max_update=2.0, eps=1e-6, base_update="after-delta",
                      base_source="grad-minus-delta")},
    {"shapes": [(8, 6)], "settings": dict(inner="muon", ns_steps=3, weight_decay=0.01)},
]


def make_params(seed: int) -> list[list[torch.nn.Parameter]]:
    generator = torch.Generator().manual_seed(seed)
    return [[torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in group["shapes"]]
            for group in GROUPS]


def crossing_grads(params: list[torch.nn.Parameter], generator: torch.Generator, objective: str):
    """Large forget gradients, retain gradients 1e-3 of them: v̂_B + v̂_k cancels, where the floor acts."""
    scale = 1.0 if objective == "forget" else 1e-3
    return [torch.randn(p.shape, generator=generator) * scale for p in params]


def run(optimizers_and_params, seed: int, schedule) -> None:
    """Each optimizer steps its parameters, the gradients drawn from `seed` in the order of all of them: two calls
    with the same seed over parameters of the same shapes give the same gradients."""
    generator = torch.Generator().manual_seed(seed)
    everything = [p for _, params in optimizers_and_params for p in params]
    for objective in schedule:
        grads = dict(zip(map(id, everything), crossing_grads(everything, generator, objective)))
        for opt, params in optimizers_and_params:
            for p in params:
                p.grad = grads[id(p)].clone()
            opt.step(objective=objective)


def settings_of(group: dict) -> dict:
    return {key: value for key, value in group.items() if key != "params"}


def test_two_groups_step_as_two_optimizers_each_on_its_own_parameters():
    grouped, separate, plain = make_params(0), make_params(0), make_params(0)
    opt = DualOptimPlus([{"params": params, **group["settings"]} for params, group in zip(grouped, GROUPS)],
                        lr=LR, lr_multipliers=MULTIPLIERS)
    alone = [DualOptimPlus(params, lr=LR, lr_multipliers=MULTIPLIERS, **group["settings"])
             for params, group in zip(separate, GROUPS)]
    default = DualOptimPlus([p for params in plain for p in params], lr=LR, lr_multipliers=MULTIPLIERS)
    run([(opt, [p for params in grouped for p in params])], 1, SCHEDULE)
    run([(o, params) for o, params in zip(alone, separate)], 1, SCHEDULE)
    run([(default, [p for params in plain for p in params])], 1, SCHEDULE)
    for params, twins, o in zip(grouped, separate, alone):
        for p, q in zip(params, twins):
            assert torch.equal(p, q)
            for key, value in o.state[q].items():
                if torch.is_tensor(value):
                    assert torch.equal(opt.state[p][key], value)
            for objective, delta in o.state[q]["delta"].items():
                assert all(torch.equal(opt.state[p]["delta"][objective][k], v) for k, v in delta.items())
    # each group's settings act: the constructor's defaults alone move every group elsewhere
    for params, others in zip(grouped, plain):
        assert all(not torch.equal(p, q) for p, q in zip(params, others))
    # the 8-bit delta states of the first group's large tensor; the base stays float32 (quantize="delta")
    assert opt.state[grouped[0][0]]["delta"]["retain"]["exp_avg"].dtype == torch.uint8
    assert opt.state[grouped[0][0]]["exp_avg"].dtype == torch.float32
    assert "momentum_buffer" in opt.state[grouped[2][0]]
    # floor and clamp counts are the safeguarded group's alone: the paper's group and Muon have none
    assert alone[0].safeguard_counts() is None and alone[2].safeguard_counts() is None
    counts = alone[1].safeguard_counts()
    assert counts[0] > 0 and counts[2] == 40 + 16
    assert opt.safeguard_counts() == counts


def test_state_dict_carries_every_groups_settings_and_a_loaded_optimizer_continues_bit_for_bit():
    params, twins = make_params(0), make_params(0)
    opt = DualOptimPlus([{"params": ps, **group["settings"]} for ps, group in zip(params, GROUPS)], lr=LR,
                        lr_multipliers=MULTIPLIERS)
    run([(opt, [p for ps in params for p in ps])], 1, SCHEDULE[:4])
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    for group, built in zip(saved["param_groups"], opt.param_groups):
        assert set(opt.defaults) <= set(group)
        assert settings_of(group) == settings_of(built)
    # the settings are the saved ones, not the constructor's (other lr, rule, floor, bits): the groups' values win
    fresh = DualOptimPlus([{"params": ps} for ps in twins], lr=0.5, rule="paper", v_floor=0.1, state_bits=32,
                          lr_multipliers=MULTIPLIERS)
    with torch.no_grad():
        for p, q in zip([p for ps in params for p in ps], [q for qs in twins for q in qs]):
            q.copy_(p)
    fresh.load_state_dict(saved)
    assert [settings_of(g) for g in fresh.param_groups] == [settings_of(g) for g in opt.param_groups]
    run([(opt, [p for ps in params for p in ps])], 2, SCHEDULE)
    run([(fresh, [q for qs in twins for q in qs])], 2, SCHEDULE)  # the same gradients
    assert all(torch.equal(p, q) for ps, qs in zip(params, twins) for p, q in zip(ps, qs))


def test_a_state_dict_with_a_bad_group_setting_is_refused_before_anything_loads():
    p = torch.nn.Parameter(torch.ones(3))
    q = torch.nn.Parameter(torch.ones(2))
    opt = DualOptimPlus([{"params": [p]}, {"params": [q]}])
    saved = opt.state_dict()
    saved["param_groups"][1]["rule"] = "exact"
    with pytest.raises(ValueError, match="^state_dict param group 1: unknown rule 'exact'"):
        opt.load_state_dict(saved)
    assert [g["rule"] for g in opt.param_groups] == ["safeguarded", "safeguarded"]


# -- state dicts of doplus 0.1.0 and 0.2.0 -----------------------------------------------------------------------


def old_moments(generator: torch.Generator, shape) -> dict[str, torch.Tensor]:
    """m, v of an AdamW-rule state: v of the base positive, v of a delta signed (it may be negative)."""
    return {"exp_avg": torch.randn(shape, generator=generator, dtype=torch.float64) * 0.1,
            "exp_avg_sq": torch.rand(shape, generator=generator, dtype=torch.float64) * 0.01}


def old_dualoptim_plus_state_dict(shapes, steps):
    """`DualOptimPlus.state_dict()` as doplus 0.1.0 and 0.2.0 wrote it: the groups hold lr, betas, base_betas, eps,
    weight_decay, use_muon and Muon's settings, the rule's settings (rule, v_floor, max_update, state_bits, quantize,
    inner, compensated, fused, multi_tensor) were the optimizer's; per parameter a float32 step counter, the base's
    exp_avg, exp_avg_sq and one delta state per objective stepped so far."""
    generator = torch.Generator().manual_seed(3)
    state = {}
    for index, shape in enumerate(shapes):
        deltas = {}
        for objective, t in steps["delta"].items():
            delta = old_moments(generator, shape)
            delta["exp_avg_sq"] = delta["exp_avg_sq"] - 0.004  # a signed second moment
            deltas[objective] = {"step": torch.tensor(float(t)), **delta}
        state[index] = {"step": torch.tensor(float(steps["base"])), **old_moments(generator, shape), "delta": deltas}
    muon = {"use_muon": None, "ns_coefficients": (3.4445, -4.775, 2.0315), "ns_steps": 5, "ns_eps": 1e-07,
            "adjust_lr_fn": None}
    groups = [
        {"lr": 5e-3, "betas": (0.9, 0.95), "base_betas": (0.85, 0.99), "eps": 1e-8, "weight_decay": 0.1, **muon,
         "params": [0, 1]},
        {"lr": 2e-2, "betas": (0.8, 0.9), "base_betas": None, "eps": 1e-8, "weight_decay": 0.0, **muon,
         "params": [2]},
    ]
    return {"state": state, "param_groups": groups}


def test_a_state_dict_of_release_0_2_0_loads_its_groups_take_the_settings_as_built_and_step_by_the_rule():
    shapes = [(6,), (2, 3), (5,)]
    steps = {"base": 3, "delta": {"forget": 1, "retain": 2}}
    saved = old_dualoptim_plus_state_dict(shapes, steps)
    params = [torch.nn.Parameter(torch.randn(shape, dtype=torch.float64)) for shape in shapes]
    start = [p.detach().clone() for p in params]
    # the first group built with a rule of its own; the second takes the constructor's floor and bound
    opt = DualOptimPlus([{"params": params[:2], "rule": "paper"}, {"params": params[2:]}], lr=1.0, betas=(0.5, 0.5),
                        v_floor=0.3, max_update=2.0, fused=False, lr_multipliers={"retain": 0.5})
    opt.load_state_dict(saved)
    kept = [(g["lr"], g["betas"], g["base_betas"], g["weight_decay"]) for g in opt.param_groups]
    assert kept == [(5e-3, (0.9, 0.95), (0.85, 0.99), 0.1), (2e-2, (0.8, 0.9), None, 0.0)]  # the saved values
    built = [(g["rule"], g["v_floor"], g["max_update"], g["state_bits"], g["base_update"], g["fused"])
             for g in opt.param_groups]
    assert built == [("paper", 0.3, 2.0, 32, "after-param", False), ("safeguarded", 0.3, 2.0, 32, "after-param", False)]

    # the same state in the float64 loop of the rule: the paper's (no floor, no bound) and the safeguarded one
    references = []
    for indices, group, floor, bound in [([0, 1], saved["param_groups"][0], 0.0, math.inf),
                                         ([2], saved["param_groups"][1], 0.3, 2.0)]:
        reference = Float64DualOptimPlus([start[i] for i in indices], group["lr"], group["betas"],
                                         group["base_betas"] or group["betas"], group["eps"], group["weight_decay"],
                                         lr_multipliers={"retain": 0.5}, floor=floor, bound=bound)
        reference.t_base = [steps["base"]] * len(indices)
        reference.m_base = [saved["state"][i]["exp_avg"].clone() for i in indices]
        reference.v_base = [saved["state"][i]["exp_avg_sq"].clone() for i in indices]
        reference.delta = {name: [{"t": t, "m": saved["state"][i]["delta"][name]["exp_avg"].clone(),
                                   "v": saved["state"][i]["delta"][name]["exp_avg_sq"].clone()} for i in indices]
                           for name, t in steps["delta"].items()}
        references.append((indices, reference))
    generator = torch.Generator().manual_seed(4)
    for objective in ["retain", "forget"]:
        grads = [torch.randn(shape, generator=generator, dtype=torch.float64) * 0.1 for shape in shapes]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step(objective=objective)
        for indices, reference in references:
            reference.step(objective, [grads[i] for i in indices])
    for indices, reference in references:
        for i, expected in zip(indices, reference.params):
            assert not torch.equal(params[i].detach(), start[i])
            torch.testing.assert_close(params[i].detach(), expected, rtol=1e-10, atol=1e-12)
    assert [int(opt.state[p]["step"]) for p in params] == [5] * 3
    assert [int(opt.state[p]["delta"]["retain"]["step"]) for p in params] == [3] * 3
    # the second group took the constructor's floor and bound, and they acted in its last step (the first group's
    # paper rule counts nothing)
    floored, clamped, elements = opt.safeguard_counts()
    assert elements == 5 and floored + clamped > 0


def test_an_adamw_state_dict_of_release_0_2_0_takes_compensated_and_fused_from_the_groups_as_built():
    """doplus's AdamW kept `compensated` and `fused` on the optimizer; its groups held lr, betas, eps, weight_decay."""
    generator = torch.Generator().manual_seed(5)
    weights = [torch.randn(6, generator=generator), torch.randn(4, generator=generator)]
    saved = {
        "state": {i: {"step": torch.tensor(2.0), "exp_avg": torch.randn(w.shape, generator=generator) * 0.1,
                      "exp_avg_sq": torch.rand(w.shape, generator=generator) * 0.01} for i, w in enumerate(weights)},
        "param_groups": [{"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "params": [0]},
                         {"lr": 5e-3, "betas": (0.8, 0.9), "eps": 1e-8, "weight_decay": 0.0, "params": [1]}],
    }
    params = [torch.nn.Parameter(weights[0].to(torch.bfloat16)), torch.nn.Parameter(weights[1].clone())]
    opt = AdamW([{"params": params[:1]}, {"params": params[1:], "compensated": False}], lr=1.0, compensated=True,
                fused=False)
    opt.load_state_dict(saved)
    assert [(g["lr"], g["compensated"], g["fused"]) for g in opt.param_groups] == [(1e-2, True, False),
                                                                                   (5e-3, False, False)]
    grads = [torch.randn(w.shape, generator=generator) for w in weights]
    params[0].grad, params[1].grad = grads[0].to(torch.bfloat16), grads[1].clone()
    opt.step()
    assert "compensation" in opt.state[params[0]]  # the bf16 weight of the compensated group keeps one
    # the float32 group: AdamW at step 3 from the saved moments, in float64
    group, state = saved["param_groups"][1], saved["state"][1]
    (beta1, beta2), lr, g = group["betas"], group["lr"], grads[1].double()
    m = beta1 * state["exp_avg"].double() + (1 - beta1) * g
    v = beta2 * state["exp_avg_sq"].double() + (1 - beta2) * g * g
    expected = weights[1].double() - lr * (m / (1 - beta1**3)) / ((v / (1 - beta2**3)).sqrt() + group["eps"])
    torch.testing.assert_close(params[1].detach().double(), expected, rtol=1e-6, atol=1e-7)
    assert not torch.equal(params[1].detach(), weights[1])


# -- the functional form ------------------------------------------------------------------------------------------


def test_step_hands_each_groups_adamw_tensors_to_the_functional_form_with_the_groups_scalars(monkeypatch):
    calls = []
    real = MODULE.dualoptim_plus_updates

    def spy(updates, **options):
        calls.append([(tuple(u.param.shape), u.scalars) for u in updates])
        return real(updates, **options)

    monkeypatch.setattr(MODULE, "dualoptim_plus_updates", spy)
    params = make_params(0)
    opt = DualOptimPlus([{"params": ps, **group["settings"]} for ps, group in zip(params, GROUPS)], lr=LR,
                        lr_multipliers=MULTIPLIERS)
    run([(opt, [p for ps in params for p in ps])], 1, ["forget"])
    assert len(calls) == 1  # one call a step: the AdamW rule's groups together, Muon's tensor not among them
    expected = []
    for ps, group in zip(params, opt.param_groups[:2]):
        scalars = MODULE.adamw_plus_scalars(lr=LR * 2.0, **{k: group[k] for k in MODULE.ADAMW_RULE_SETTINGS})
        expected += [(tuple(p.shape), scalars) for p in ps]
    got = [(shape, scalars) for shape, scalars in calls[0]]
    assert got == expected
    assert got[0][1].v_floor == 0.0 and got[0][1].max_update == math.inf  # the paper's rule: no safeguard
    assert got[2][1].v_floor == 0.3 and got[2][1].base_update == "after-delta"


def new_states(param: torch.Tensor) -> dict:
    """A zero AdamW-rule state in the layout `DualOptimPlus` documents: step, exp_avg, exp_avg_sq."""
    zeros = torch.zeros_like(param, memory_format=torch.contiguous_format)
    return {"step": torch.tensor(0.0), "exp_avg": zeros.clone(), "exp_avg_sq": zeros.clone()}


def test_dualoptim_plus_given_a_groups_settings_steps_as_the_optimizer_does():
    """The public functional form, called per group with the group's settings (its own states, made here), ends
    where `DualOptimPlus.step` does, bit for bit."""
    params, twins = make_params(0)[:2], make_params(0)[:2]
    opt = DualOptimPlus([{"params": ps, **group["settings"], "state_bits": 32}
                         for ps, group in zip(params, GROUPS[:2])], lr=LR, lr_multipliers=MULTIPLIERS)
    bases = [[new_states(q) for q in qs] for qs in twins]
    deltas = {name: [[new_states(q) for q in qs] for qs in twins] for name in ("forget", "retain")}
    generator = torch.Generator().manual_seed(1)
    for objective in SCHEDULE:
        everything = [p for ps in params for p in ps]
        grads = crossing_grads(everything, generator, objective)
        for p, g in zip(everything, grads):
            p.grad = g.clone()
        opt.step(objective=objective)
        offset, implementations = 0, []
        for i, (qs, group) in enumerate(zip(twins, opt.param_groups)):
            settings = {key: group[key] for key in MODULE.ADAMW_RULE_SETTINGS}
            report = dualoptim_plus(qs, grads[offset:offset + len(qs)], bases[i], deltas[objective][i],
                                    lr=group["lr"] * MULTIPLIERS.get(objective, 1.0), fused=group["fused"],
                                    foreach=group["multi_tensor"], **settings)
            implementations.append(report.implementation)
            offset += len(qs)
        # the first group's tensors are below the compiled kernel's size (the reference steps them on that path);
        # the second group's ablations have the reference only
        assert implementations == ["compiled", "reference"]
    for ps, qs in zip(params, twins):
        assert all(torch.equal(p, q) for p, q in zip(ps, qs))
    assert dualoptim_plus is MODULE.dualoptim_plus


def test_the_paper_rule_of_the_functional_form_ignores_the_floor_and_the_bound():
    torch.manual_seed(0)
    start, grads = torch.randn(50, dtype=torch.float64), torch.randn(4, 50, dtype=torch.float64)
    grads[1::2] *= 1e-4
    ends = []
    for settings in ({"rule": "paper", "v_floor": 0.5, "max_update": 0.1}, {"v_floor": 0.0, "max_update": math.inf},
                     {"v_floor": 0.5, "max_update": 0.1}):
        w, base = start.clone(), new_states(start)
        deltas = {"forget": new_states(start), "retain": new_states(start)}
        for g, objective in zip(grads, ["forget", "retain"] * 2):
            dualoptim_plus([w], [g], [base], [deltas[objective]], lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                           weight_decay=0.0, fused=False, **settings)
        ends.append(w)
    assert torch.equal(ends[0], ends[1]) and not torch.equal(ends[0], ends[2])
    with pytest.raises(ValueError, match="unknown rule 'exact'"):
        dualoptim_plus([start], [grads[0]], [new_states(start)], [new_states(start)], lr=1e-2, betas=(0.9, 0.95),
                       eps=1e-8, weight_decay=0.0, rule="exact")


# -- callers read the settings from the groups --------------------------------------------------------------------


def test_a_sharded_runs_diagnostics_read_the_rule_from_the_param_groups(monkeypatch):
    """Under FSDP the loop adds the floor and clamp fractions when a group takes the safeguarded rule."""
    reduced = []
    # as the real one, the gathered diagnostics hold the largest step and the count only
    monkeypatch.setattr(loop.sharding, "gather_step_diagnostics",
                        lambda update, device: {key: update[key] for key in ("max_update", "big_updates")})
    monkeypatch.setattr(loop, "safeguard_fractions",
                        lambda counts, device: reduced.append(counts) or {"floor_fraction": counts[0] / counts[2]})
    for rules, expected in [(["paper", "safeguarded"], True), (["paper", "paper"], False)]:
        params = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))]
        opt = DualOptimPlus([{"params": params[:1], "rule": rules[0]}, {"params": params[1:], "rule": rules[1]}],
                            fused=False)
        for p in params:
            p.grad = torch.full_like(p, 0.5)
        opt.step(objective="forget")
        fake = SimpleNamespace(optimizer=opt, similarity=None, sharded=True,
                               accelerator=SimpleNamespace(device=torch.device("cpu")))
        reduced.clear()
        update = loop._step_diagnostics(fake, "forget")
        assert ("floor_fraction" in update) is expected
        assert reduced == ([(0, 0, 3)] if expected else [])
