"""The optimizer contract torch's own optimizer tests check, for DualOptimPlus, DualOptim and doplus's AdamW.

`step(closure=None, *, objective)`: a step without its objective raises, the deprecated positional form warns and
steps as the keyword form, a closure runs under grad mode and its loss comes back. Invalid arguments raise; a
parameter whose gradient is None is skipped while a zero gradient still steps; param groups with their own
hyper-parameters; bf16 and non-contiguous parameters on the compiled path; `state_dict` and `copy.deepcopy`
continue bit for bit; a state saved by release 0.1.0 loads; the functional form `dualoptim_plus` names the
implementation it chose. Every number is checked against float64 loops written here or in tests/helpers.py from
the rules' documentation (`kernels.py`), never against the optimizers' own reference code.
"""

from __future__ import annotations

import copy
import importlib
import io
import math
from pathlib import Path

import pytest
import torch

from doplus_cli.optim import AdamW, DualOptim, DualOptimPlus, Scaffold, dualoptim_plus, kernels
from tests.helpers import SHAPES, Float64DualOptimPlus, random_grads

OPTIMIZERS = {"DualOptimPlus": DualOptimPlus, "DualOptim": DualOptim, "AdamW": AdamW}
MULTI_OBJECTIVE = {"DualOptimPlus": DualOptimPlus, "DualOptim": DualOptim, "Scaffold": Scaffold}
CLASSES = {**OPTIMIZERS, **MULTI_OBJECTIVE}
RELEASE_0_1_0 = Path(__file__).parent / "data" / "release-0.1.0"
FLOOR, BOUND = 0.02, 10.0  # DualOptimPlus's safeguard defaults (v_floor, max_update)


# -- float64 references ----------------------------------------------------------------------------------


class Float64:
    """The update rules in float64, one parameter at a time. `hps[i]`: parameter i's lr, betas, base_betas,
    eps and weight_decay. AdamW: one state; DualOptim: one AdamW state per objective; DualOptimPlus: a base
    state stepped by every objective plus a delta state per objective (the safeguarded rule, kernels.py)."""

    def __init__(self, kind: str, weights: list[torch.Tensor], hps: list[dict]):
        self.kind = kind
        self.theta = [w.detach().double().clone() for w in weights]
        self.hps = hps
        self.states: list[dict] = [{} for _ in weights]

    def step(self, grads: list[torch.Tensor | None], objective: str = "forget") -> None:
        for i, g in enumerate(grads):
            if g is None:
                continue
            g = g.double()
            hp, state = self.hps[i], self.states[i]
            if self.kind == "DualOptimPlus":
                self.theta[i] = self._plus(self.theta[i], g, state, objective, hp)
            else:
                key = objective if self.kind == "DualOptim" else "adamw"
                self.theta[i] = self._adamw(self.theta[i], g, state.setdefault(key, _zero_state(g)), hp)

    @staticmethod
    def _adamw(theta, g, s, hp):
        (b1, b2), lr, wd, eps = hp["betas"], hp["lr"], hp["weight_decay"], hp["eps"]
        s["t"] += 1
        s["m"] = b1 * s["m"] + (1 - b1) * g
        s["v"] = b2 * s["v"] + (1 - b2) * g * g
        update = (s["m"] / (1 - b1 ** s["t"])) / ((s["v"] / (1 - b2 ** s["t"])).sqrt() + eps)
        return theta * (1 - lr * wd) - lr * update

    @staticmethod
    def _plus(theta, g, state, objective, hp):
        (b1, b2), lr, wd, eps = hp["betas"], hp["lr"], hp["weight_decay"], hp["eps"]
        bb1, bb2 = hp["base_betas"] or hp["betas"]
        base = state.setdefault("base", _zero_state(g))
        delta = state.setdefault(objective, _zero_state(g))
        base["t"] += 1
        delta["t"] += 1
        tb, tk = base["t"], delta["t"]
        mb_hat = base["m"] / (1 - bb1 ** (tb - 1)) if tb > 1 else torch.zeros_like(g)
        vb_hat = base["v"] / (1 - bb2 ** (tb - 1)) if tb > 1 else torch.zeros_like(g)
        delta["m"] = b1 * delta["m"] + (1 - b1) * (g - mb_hat)
        delta["v"] = b2 * delta["v"] + (1 - b2) * (g * g - vb_hat)
        m = mb_hat + delta["m"] / (1 - b1**tk)
        vk_hat = delta["v"] / (1 - b2**tk)
        denominator = torch.maximum((vb_hat + vk_hat).abs(), FLOOR * (vb_hat + vk_hat.abs())).sqrt() + eps
        theta = theta * (1 - lr * wd) - (lr * m / denominator).clamp(-BOUND * lr, BOUND * lr)
        base["m"] = bb1 * base["m"] + (1 - bb1) * g
        base["v"] = bb2 * base["v"] + (1 - bb2) * g * g
        return theta


def _zero_state(g):
    return {"t": 0, "m": torch.zeros_like(g), "v": torch.zeros_like(g)}


DEFAULTS = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
OVERRIDE = dict(lr=3e-3, betas=(0.5, 0.8), weight_decay=0.0)  # the second group's own values


def build(name: str, params: list, split: int, base_betas=(0.8, 0.99), override_base=(0.6, 0.9), **options):
    """`name` over two param groups (params[:split] with the defaults, the rest with OVERRIDE) and each
    parameter's hyper-parameters for the reference."""
    defaults, override = dict(DEFAULTS), dict(OVERRIDE)
    if name == "DualOptimPlus":
        defaults["base_betas"], override["base_betas"] = base_betas, override_base
    if name != "AdamW":
        options.setdefault("objectives", ("forget", "retain"))
    groups = [{"params": params[:split]}, {"params": params[split:], **override}]
    opt = CLASSES[name](groups, **defaults, **options)
    hps = [{"base_betas": None, **defaults}] * split + [{"base_betas": None, **defaults, **override}] * (
        len(params) - split)
    return opt, hps


def step(opt, objective: str) -> None:
    opt.step() if isinstance(opt, AdamW) else opt.step(objective=objective)


def grads_for(params, generator, scale=1.0):
    return [scale * torch.randn(p.shape, generator=generator, dtype=torch.float64).to(p.dtype) for p in params]


def clone_tree(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: clone_tree(v) for k, v in value.items()}
    return value


def assert_same_tree(a, b, where=""):
    """Equal bit for bit: tensors (dtype, shape and values), dicts and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, set(a), set(b))
        for key in a:
            assert_same_tree(a[key], b[key], f"{where}/{key}")
    else:
        assert a == b, where


def compiled_kernel(name: str) -> kernels.CompiledKernel:
    (kernel,) = [k for k in kernels.KERNELS if k.name == name]
    return kernel


# -- invalid arguments -----------------------------------------------------------------------------------

COMMON_INVALID = {
    "negative lr": dict(lr=-1e-3),
    "NaN lr": dict(lr=math.nan),
    "beta1 = 1": dict(betas=(1.0, 0.95)),
    "beta2 = 1": dict(betas=(0.9, 1.0)),
    "negative beta": dict(betas=(-0.1, 0.95)),
    "three betas": dict(betas=(0.9, 0.95, 0.99)),
    "negative eps": dict(eps=-1e-8),
    "negative weight decay": dict(weight_decay=-0.1),
}
SPECIFIC_INVALID = {
    "DualOptimPlus": {
        "base beta2 = 1": dict(base_betas=(0.9, 1.0)),
        "no objectives": dict(objectives=()),
        "repeated objective": dict(objectives=("forget", "forget")),
        "unknown inner": dict(inner="sgd"),
        "state bits 16": dict(state_bits=16),
        "unknown rule": dict(rule="clipped"),
        "v_floor = 1": dict(v_floor=1.0),
        "max_update = 0": dict(max_update=0.0),
        "multiplier of unknown objective": dict(lr_multipliers={"other": 2.0}),
        "negative multiplier": dict(lr_multipliers={"forget": -1.0}),
    },
    "DualOptim": {
        "no objectives": dict(objectives=()),
        "state bits 4": dict(state_bits=4),
        "compensated 8-bit": dict(state_bits=8, compensated=True),
        "negative multiplier": dict(lr_multipliers={"retain": -0.5}),
    },
    "AdamW": {},
}
INVALID = [(name, case, kwargs) for name in OPTIMIZERS
           for case, kwargs in {**COMMON_INVALID, **SPECIFIC_INVALID[name]}.items()]


@pytest.mark.parametrize("name,case,kwargs", INVALID, ids=[f"{n}-{c}" for n, c, _ in INVALID])
def test_invalid_arguments_raise(name, case, kwargs):
    with pytest.raises(ValueError):
        OPTIMIZERS[name]([torch.nn.Parameter(torch.zeros(3))], **kwargs)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("case", ["negative lr", "beta2 = 1", "negative eps", "negative weight decay"])
def test_invalid_hyper_parameters_of_a_param_group_raise(name, case):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(3))]},
              {"params": [torch.nn.Parameter(torch.zeros(2))], **COMMON_INVALID[case]}]
    with pytest.raises(ValueError, match="group 1"):
        OPTIMIZERS[name](groups)


def test_valid_edge_values_are_accepted():
    for cls in OPTIMIZERS.values():
        cls([torch.nn.Parameter(torch.zeros(3))], lr=0.0, betas=(0.0, 0.0), eps=0.0, weight_decay=0.0)


# -- the step's call: step(closure=None, *, objective) -----------------------------------------------------


def two_weights(name: str, **options):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(5))]
    opt, _ = build(name, params, split=1, **options)
    return params, opt


@pytest.mark.parametrize("name", MULTI_OBJECTIVE)
def test_a_step_without_its_objective_is_a_type_error_and_changes_nothing(name):
    params, opt = two_weights(name)
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    with pytest.raises(TypeError, match=rf"^{name}\.step\(\) needs objective=\.\.\.: one of \['forget', 'retain'\]"):
        opt.step()
    with pytest.raises(TypeError, match="needs objective"):
        opt.step(lambda: 0.0)
    with pytest.raises(TypeError, match="objective twice"):
        opt.step("forget", objective="retain")
    with pytest.raises(ValueError, match=r"unknown objective 'other'"):
        opt.step(objective="other")
    with pytest.raises(ValueError, match=r"unknown objective 'other'"), pytest.warns(DeprecationWarning):
        opt.step("other")
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert not any(opt.state.values())


@pytest.mark.parametrize("name", MULTI_OBJECTIVE)
def test_the_positional_objective_warns_at_the_callers_line_and_steps_as_the_keyword_form(name):
    params, opt = two_weights(name)
    twins, twin = two_weights(name)
    generator = torch.Generator().manual_seed(6)
    for objective in ("forget", "retain", "retain", "forget"):
        grads = grads_for(params, generator)
        for p, q, g in zip(params, twins, grads):
            p.grad, q.grad = g.clone(), g.clone()
        with pytest.warns(DeprecationWarning, match=rf"write step\(objective='{objective}'\)") as caught:
            opt.step(objective)
        assert [Path(w.filename).name for w in caught] == [Path(__file__).name]  # the line above, not torch's
        twin.step(objective=objective)
    assert_same_optimizers(opt, params, twin, twins)
    assert all(not torch.equal(p, b) for p, b in zip(params, two_weights(name)[0]))


@pytest.mark.parametrize("name", MULTI_OBJECTIVE)
def test_a_closure_runs_under_grad_mode_before_the_update_and_its_loss_is_returned(name):
    """As torch's optimizers: `step` itself runs without grad, the closure (zero_grad, loss, backward) with it;
    the step then equals a backward outside followed by a step, bit for bit."""
    params, opt = two_weights(name)
    twins, twin = two_weights(name)
    x = torch.randn(3, 6)

    def loss_of(weights):
        return (x @ weights[0]).square().mean() + weights[1].sum()

    grad_mode_in_closure = []

    def closure():
        grad_mode_in_closure.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = loss_of(params)
        loss.backward()
        return loss

    for objective in ("forget", "retain", "forget"):
        loss = opt.step(closure, objective=objective)
        assert grad_mode_in_closure.pop() is True and isinstance(loss, torch.Tensor) and loss.ndim == 0
        twin.zero_grad()
        expected = loss_of(twins)
        expected.backward()
        twin.step(objective=objective)
        assert torch.equal(loss, expected)
    assert_same_optimizers(opt, params, twin, twins)
    assert opt.step(objective="retain") is None


# -- zero and None gradients ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_none_gradient_skips_the_parameter_and_a_zero_gradient_steps_it(name):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3, dtype=torch.float64)) for _ in range(3)]
    opt, hps = build(name, params, split=2)
    reference = Float64(name, params, hps)
    generator = torch.Generator().manual_seed(1)
    for objective in ("forget", "retain"):  # every parameter gets a state from both objectives
        grads = grads_for(params, generator)
        for p, g in zip(params, grads):
            p.grad = g
        step(opt, objective)
        reference.step(grads, objective)
    skipped, zeroed, live = params
    before_weight, before_state = skipped.detach().clone(), clone_tree(opt.state[skipped])
    before_zeroed = zeroed.detach().clone()
    for objective in ("forget", "retain", "forget"):
        grads = [None, torch.zeros_like(zeroed), grads_for([live], generator)[0]]
        for p, g in zip(params, grads):
            p.grad = g
        step(opt, objective)
        reference.step(grads, objective)
    assert torch.equal(skipped, before_weight)
    assert_same_tree(opt.state[skipped], before_state, "state of the parameter without a gradient")
    assert not torch.equal(zeroed, before_zeroed)  # weight decay and the decaying moments still move it
    for p, expected in zip(params, reference.theta):
        torch.testing.assert_close(p.detach(), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["DualOptimPlus", "DualOptim"])
def test_an_objective_without_gradient_for_some_parameters_steps_only_the_others(name):
    """The retain loss does not reach `head`: its gradient stays None under that objective, and `head` keeps
    no state of it (DualOptimPlus: no delta, and its base counts only the forget steps)."""
    torch.manual_seed(0)
    body = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
    head = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    params = [body, head]
    opt, hps = build(name, params, split=1)
    reference = Float64(name, params, hps)
    x = torch.randn(6, 4, dtype=torch.float64)
    losses = {"forget": lambda: -((x @ body) @ head).square().mean(), "retain": lambda: (x @ body).square().mean()}
    for objective in ("forget", "retain", "retain", "forget", "retain"):
        opt.zero_grad(set_to_none=True)
        losses[objective]().backward()
        assert (head.grad is None) == (objective == "retain")
        step(opt, objective)
        reference.step([p.grad for p in params], objective)
    if name == "DualOptimPlus":
        assert set(opt.state[head]["delta"]) == {"forget"} and int(opt.state[head]["step"]) == 2
        assert set(opt.state[body]["delta"]) == {"forget", "retain"} and int(opt.state[body]["step"]) == 5
    else:
        assert set(opt.state[head]) == {"forget"} and int(opt.state[head]["forget"]["step"]) == 2
        assert int(opt.state[body]["retain"]["step"]) == 3
    for p, expected in zip(params, reference.theta):
        torch.testing.assert_close(p.detach(), expected, rtol=1e-12, atol=1e-12)


# -- param groups ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_two_param_groups_with_their_own_lr_betas_and_weight_decay_match_float64(name):
    torch.manual_seed(0)
    shapes = [(6, 4), (5,), (3, 2, 2), (7,)]
    params = [torch.nn.Parameter(torch.randn(shape, dtype=torch.float64)) for shape in shapes]
    opt, hps = build(name, params, split=2)
    reference = Float64(name, params, hps)
    one_group = Float64(name, params, [hps[0]] * len(params))  # as if the second group had no values of its own
    generator = torch.Generator().manual_seed(2)
    for objective in ("forget", "retain", "retain", "forget", "retain", "forget", "forget"):
        grads = grads_for(params, generator, scale=1.0 if objective == "forget" else 0.3)
        for p, g in zip(params, grads):
            p.grad = g
        step(opt, objective)
        reference.step(grads, objective)
        one_group.step(grads, objective)
    for p, expected in zip(params, reference.theta):
        torch.testing.assert_close(p.detach(), expected, rtol=1e-12, atol=1e-12)
    for p, elsewhere in zip(params[2:], one_group.theta[2:]):
        assert (p.detach() - elsewhere).abs().max() > 1e-3


# -- DualOptim+: every setting a param group's --------------------------------------------------------------

GROUP_SETTINGS = ("inner", "state_bits", "quantize", "rule", "v_floor", "max_update", "base_update", "base_source",
                  "compensated", "fused", "multi_tensor")


def crossing_steps(params, seed, count):
    """(objective, gradients) pairs: large forget gradients, retain gradients 1e-3 of them (where the floor acts)."""
    generator = torch.Generator().manual_seed(seed)
    for objective in (["forget", "retain", "retain"] * count)[:count]:
        scale = 1.0 if objective == "forget" else 1e-3
        yield objective, [torch.randn(p.shape, generator=generator, dtype=p.dtype) * scale for p in params]


def test_dualoptim_plus_takes_its_rule_floor_and_bound_per_param_group():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, dtype=torch.float64)) for shape in [(40,), (6, 5), (30,), (4, 4)]]
    groups = [{"params": params[:2], "rule": "paper"}, {"params": params[2:], "v_floor": 0.3, "max_update": 2.0}]
    opt = DualOptimPlus(groups, lr=1e-2, fused=False)
    common = (1e-2, (0.9, 0.95), (0.9, 0.95), 1e-8, 0.0)
    paper, guarded = Float64DualOptimPlus(params[:2], *common), Float64DualOptimPlus(params[2:], *common, floor=0.3,
                                                                                         bound=2.0)
    unguarded = Float64DualOptimPlus(params[2:], *common)  # the second group without a safeguard of its own
    for objective, grads in crossing_steps(params, 1, 9):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step(objective=objective)
        paper.step(objective, grads[:2])
        guarded.step(objective, grads[2:])
        unguarded.step(objective, grads[2:])
    for p, expected in zip(params, paper.params + guarded.params):
        # 1e-9: where v̂_B + v_k cancels, the paper's rule magnifies the last bits (docs/optimizers.md)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-9, atol=1e-9)
    assert max((p.detach() - u).abs().max() for p, u in zip(params[2:], unguarded.params)) > 1e-4
    assert [g["rule"] for g in opt.param_groups] == ["paper", "safeguarded"]


def test_a_param_group_keeps_its_own_state_bits():
    big = [torch.nn.Parameter(torch.randn(5000)) for _ in range(2)]
    opt = DualOptimPlus([{"params": big[:1], "state_bits": 8}, {"params": big[1:]}], lr=1e-3)
    for p in big:
        p.grad = torch.randn(5000)
    opt.step(objective="forget")
    assert opt.state[big[0]]["exp_avg"].dtype == torch.uint8
    assert opt.state[big[0]]["delta"]["forget"]["exp_avg_sq"].dtype == torch.uint8
    assert opt.state[big[1]]["exp_avg"].dtype == torch.float32


def test_the_groups_settings_round_trip_through_state_dict_and_older_state_dicts_take_the_defaults():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, dtype=torch.float64)) for shape in [(40,), (30,)]]
    opt = DualOptimPlus([{"params": params[:1], "rule": "paper"}, {"params": params[1:], "v_floor": 0.3,
                                                                    "max_update": 2.0}], lr=1e-2, fused=False)
    for objective, grads in crossing_steps(params, 1, 4):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step(objective=objective)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert all(key in group for group in saved["param_groups"] for key in GROUP_SETTINGS)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = DualOptimPlus([{"params": twins[:1]}, {"params": twins[1:]}], lr=1e-2, fused=False)  # other defaults
    fresh.load_state_dict(saved)
    assert [(g["rule"], g["v_floor"], g["max_update"]) for g in fresh.param_groups] == [
        ("paper", 0.02, 10.0), ("safeguarded", 0.3, 2.0)]
    for objective, grads in crossing_steps(params, 2, 5):
        for p, q, g in zip(params, twins, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step(objective=objective)
        fresh.step(objective=objective)
    assert all(torch.equal(p, q) for p, q in zip(params, twins))
    # a state dict of doplus 0.1.0 or 0.2.0 kept these settings on the optimizer: its groups take the constructor's
    for group in saved["param_groups"]:
        for key in GROUP_SETTINGS:
            del group[key]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    older = DualOptimPlus([{"params": copies[:1]}, {"params": copies[1:]}], lr=1e-2, rule="paper", fused=False)
    older.load_state_dict(saved)
    assert [(g["rule"], g["v_floor"], g["state_bits"]) for g in older.param_groups] == [("paper", 0.02, 32)] * 2


@pytest.mark.parametrize("setting", [{"rule": "exact"}, {"v_floor": 1.0}, {"max_update": 0.0}, {"state_bits": 16},
                                     {"quantize": "half"}, {"base_update": "later"},
                                     {"base_update": "before-delta", "fused": True},
                                     {"base_source": "grad-minus-delta", "use_muon": True}])
def test_a_param_groups_own_bad_setting_is_named_with_its_group(setting):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(3))]},
              {"params": [torch.nn.Parameter(torch.zeros(2, 2))], **setting}]
    with pytest.raises(ValueError, match="^param group 1: "):
        DualOptimPlus(groups)


def test_step_hands_every_group_to_the_functional_form(monkeypatch):
    """One call of `dualoptim_plus_updates` a step with every group's tensors (so the multi-tensor kernel takes
    them in one launch), each with its group's scalars; groups that differ in `fused` take a call each."""
    module = importlib.import_module("doplus_cli.optim.dualoptim_plus")  # the package's name is the function

    calls = []

    def spy(updates, **options):
        calls.append(([u.param.shape for u in updates], sorted({u.scalars.v_floor for u in updates}),
                      options["fused"]))
        return real(updates, **options)

    real = module.dualoptim_plus_updates
    monkeypatch.setattr(module, "dualoptim_plus_updates", spy)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in [(4,), (3, 2), (5,)]]
    for p in params:
        p.grad = torch.randn(p.shape)
    before = [p.detach().clone() for p in params]
    DualOptimPlus([{"params": params[:2], "v_floor": 0.1}, {"params": params[2:]}]).step(objective="forget")
    assert calls == [([(4,), (3, 2), (5,)], [0.02, 0.1], None)]
    assert all(not torch.equal(p, b) for p, b in zip(params, before))
    calls.clear()
    DualOptimPlus([{"params": params[:2], "fused": False}, {"params": params[2:]}]).step(objective="retain")
    assert calls == [([(4,), (3, 2)], [0.02], False), ([(5,)], [0.02], None)]


# -- the compiled path: bf16 and non-contiguous parameters -----------------------------------------------

# the kernels these CPU tensors take: DualOptim+'s CPU kernel packs its counts (kernels.py; on CUDA the unpacked
# "DualOptim+ AdamW", tests/test_cuda.py)
KERNEL_OF = {"DualOptimPlus": "DualOptim+ AdamW (CPU)", "DualOptim": "AdamW", "AdamW": "AdamW"}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_bf16_parameters_and_non_contiguous_gradients_on_the_compiled_path(name):
    """fused=True (DualOptim: its bf16 AdamW takes the compiled kernel from 2^16 elements): a bf16 weight with
    its compensation buffer and a float32 weight go through the compiled kernel; a weight whose gradient is
    transposed cannot (the kernel takes flat contiguous tensors) and must still step by the rule. The bf16
    master value θ_bf16 + c follows the float64 rule to ~2^-16 of the weight; without the buffer it would be
    off by up to half a bf16 spacing (2^-9 of the weight) per step."""
    torch.manual_seed(0)
    dense = torch.nn.Parameter(torch.randn(64, 32))
    with_transposed_grad = torch.nn.Parameter(torch.randn(24, 16))
    bf16 = torch.nn.Parameter(torch.randn(256, 256).to(torch.bfloat16))
    params = [dense, with_transposed_grad, bf16]
    options = {"compensated": True} if name == "DualOptim" else {"compensated": True, "fused": True}
    opt, hps = build(name, params, split=2, **options)
    reference = Float64(name, params, hps)
    kernel = compiled_kernel(KERNEL_OF[name])
    before = kernel.compiled_calls
    generator = torch.Generator().manual_seed(3)
    steps = ("forget", "retain", "forget", "retain")
    for objective in steps:
        grads = grads_for(params, generator)
        grads[1] = grads_for([with_transposed_grad.t()], generator)[0].t()
        assert not grads[1].is_contiguous()
        for p, g in zip(params, grads):
            p.grad = g
        step(opt, objective)
        reference.step(grads, objective)
    assert kernel.fallback_reason is None
    compiled = 1 if name == "DualOptim" else 2  # DualOptim: only the bf16 weight reaches 2^16 elements
    assert kernel.compiled_calls - before >= compiled * len(steps), "the compiled kernel did not run"
    for p, expected in zip(params[:2], reference.theta):
        torch.testing.assert_close(p.detach().double(), expected, rtol=0, atol=2e-6)
    compensation = opt.state[bf16]["compensation"]
    assert compensation.dtype == torch.bfloat16 and compensation.abs().max() > 0
    master = bf16.detach().double() + compensation.double()
    torch.testing.assert_close(master, reference.theta[2], rtol=0, atol=1e-4)
    assert (bf16.detach().double() - reference.theta[2]).abs().max() > 1e-3  # the buffer holds what bf16 drops


NON_CONTIGUOUS = [pytest.param(name, fused, id=f"{name}-{'fused' if fused else 'eager'}")
                  for name in OPTIMIZERS for fused in (True, False)]


@pytest.mark.parametrize("name,fused", NON_CONTIGUOUS)
def test_a_non_contiguous_parameter_steps_by_the_rule_in_its_own_layout(name, fused):
    """A transposed weight (as a tied or permuted one can be) steps by the float64 rule and keeps its strides,
    beside a contiguous one that takes the compiled kernel when fused."""
    torch.manual_seed(0)
    transposed = torch.nn.Parameter(torch.randn(16, 24).t())
    dense = torch.nn.Parameter(torch.randn(64, 32))
    params = [transposed, dense]
    assert not transposed.is_contiguous()
    opt, hps = build(name, params, split=1, fused=fused)
    reference = Float64(name, params, hps)
    generator = torch.Generator().manual_seed(3)
    for objective in ("forget", "retain", "forget"):
        grads = grads_for(params, generator)
        for p, g in zip(params, grads):
            p.grad = torch.empty_like(p).copy_(g)  # in the weight's layout, as autograd makes it
        step(opt, objective)
        reference.step(grads, objective)
    assert transposed.stride() == (1, 24)
    for p, expected in zip(params, reference.theta):
        torch.testing.assert_close(p.detach().double(), expected, rtol=0, atol=2e-6)


def test_dualoptim_steps_a_gradient_laid_out_unlike_its_weight():
    """torch's fused AdamW, which DualOptim uses by default, reads the gradient in the weight's memory order: a
    gradient laid out otherwise (assigned by hand) is copied into the weight's layout first."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(24, 16))
    opt, hps = build("DualOptim", [weight], split=1)
    reference = Float64("DualOptim", [weight], hps)
    generator = torch.Generator().manual_seed(3)
    for objective in ("forget", "retain"):
        grad = grads_for([weight.t()], generator)[0].t()
        weight.grad = grad
        opt.step(objective=objective)
        reference.step([grad], objective)
    torch.testing.assert_close(weight.detach().double(), reference.theta[0], rtol=0, atol=2e-6)


# -- state_dict, deepcopy, an earlier release's state ---------------------------------------------------

CONTINUATION = {
    "DualOptimPlus": ("DualOptimPlus", {"compensated": True}),
    "DualOptimPlus-8bit": ("DualOptimPlus", {"state_bits": 8}),
    "DualOptim": ("DualOptim", {}),
    "DualOptim-bf16": ("DualOptim", {"compensated": True}),
    "AdamW": ("AdamW", {}),
    "Scaffold-bf16": ("Scaffold", {"compensated": True}),  # the FL schemes share PeriodicOptimizer's checkpoints
}


def continuation_problem(case: str):
    name, options = CONTINUATION[case]
    torch.manual_seed(0)
    shapes = [(80, 64), (9,), (3, 5)]  # 5,120 elements: 8-bit states from 4,096
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    if options.get("compensated") or name == "AdamW":
        params[1] = torch.nn.Parameter(params[1].detach().to(torch.bfloat16))
    opt, _ = build(name, params, split=1, **options)
    return name, options, params, opt


def take_steps(opt, params, generator, objectives):
    for objective in objectives:
        for p, g in zip(params, grads_for(params, generator)):
            p.grad = g
        step(opt, objective)


def assert_same_optimizers(a, a_params, b, b_params):
    for p, q in zip(a_params, b_params):
        assert p.dtype == q.dtype and torch.equal(p, q)
        assert_same_tree(clone_tree(a.state[p]), clone_tree(b.state[q]), "state")


@pytest.mark.parametrize("case", CONTINUATION)
def test_state_dict_round_trip_continues_bit_identically(case):
    name, options, params, opt = continuation_problem(case)
    generator = torch.Generator().manual_seed(4)
    take_steps(opt, params, generator, ("forget", "retain", "retain"))
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh, _ = build(name, twins, split=1, **options)
    fresh.load_state_dict(saved)
    assert_same_optimizers(opt, params, fresh, twins)
    moved = [p.detach().clone() for p in params]
    rest = ("forget", "retain", "forget")
    take_steps(opt, params, torch.Generator().manual_seed(5), rest)
    take_steps(fresh, twins, torch.Generator().manual_seed(5), rest)
    assert all(not torch.equal(p, m) for p, m in zip(params, moved))
    assert_same_optimizers(opt, params, fresh, twins)
    assert fresh.param_groups[1]["lr"] == OVERRIDE["lr"]


@pytest.mark.parametrize("case", CONTINUATION)
def test_deepcopy_continues_bit_identically(case):
    name, options, params, opt = continuation_problem(case)
    take_steps(opt, params, torch.Generator().manual_seed(4), ("forget", "retain"))
    twin = copy.deepcopy(opt)
    twins = [p for group in twin.param_groups for p in group["params"]]
    assert all(q is not p for p, q in zip(params, twins))
    rest = ("retain", "forget", "forget")
    take_steps(opt, params, torch.Generator().manual_seed(5), rest)
    before = [q.detach().clone() for q in twins]
    take_steps(twin, twins, torch.Generator().manual_seed(5), rest)
    assert all(not torch.equal(q, b) for q, b in zip(twins, before))
    assert_same_optimizers(opt, params, twin, twins)


def test_dualoptim_state_is_read_and_assigned_as_a_torch_optimizers():
    """`state[p]` holds every objective's AdamW state (the live dicts) and the compensation buffer; assigning a
    mapping of that form replaces them, as assigning `torch.optim.AdamW.state` does: an optimizer given another's
    state (and its weights) continues bit for bit, and `opt.state = opt.state` changes nothing."""
    name, options, params, opt = continuation_problem("DualOptim-bf16")
    take_steps(opt, params, torch.Generator().manual_seed(4), ("forget", "retain", "forget"))
    bf16 = params[1]
    assert set(opt.state[bf16]) == {"forget", "retain", "compensation"}
    assert opt.state[bf16]["forget"] is opt.inner["forget"].state[bf16]
    assert opt.state[bf16]["compensation"] is opt.compensation[bf16]
    assert int(opt.state[bf16]["forget"]["step"]) == 2 and int(opt.state[bf16]["retain"]["step"]) == 1
    assert opt.state[torch.nn.Parameter(torch.zeros(1))] == {}  # a parameter without state reads empty, as torch's

    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    other, _ = build(name, twins, split=1, **options)
    other.state = {q: clone_tree(opt.state[p]) for p, q in zip(params, twins)}
    assert_same_optimizers(opt, params, other, twins)
    assert other.compensation[twins[1]] is other.inner["retain"].shared_compensation[twins[1]]  # still one buffer
    opt.state = opt.state
    rest = ("retain", "forget", "retain")
    take_steps(opt, params, torch.Generator().manual_seed(5), rest)
    take_steps(other, twins, torch.Generator().manual_seed(5), rest)
    assert_same_optimizers(opt, params, other, twins)
    assert int(other.state[twins[0]]["retain"]["step"]) == 3

    with pytest.raises(ValueError, match=r"holds \['exp_avg'\]"):
        other.state = {twins[0]: {"exp_avg": torch.zeros(80, 64)}}  # torch's AdamW layout, not DualOptim's
    other.state = {}
    assert not other.state and not other.compensation and all(not inner.state for inner in other.inner.values())


# -- the functional form ---------------------------------------------------------------------------------

FUNCTIONAL = [(False, "reference", 0), (True, "compiled", len(SHAPES)), (None, "compiled", 0)]


@pytest.mark.parametrize("fused,implementation,compiled_per_step", FUNCTIONAL, ids=["False", "True", "None"])
def test_the_functional_form_names_its_implementation_and_follows_the_float64_loop(fused, implementation,
                                                                                   compiled_per_step):
    """`dualoptim_plus` over states made here: float64 tensors keep float64 states, so it follows the float64
    loop of tests/helpers.py to rounding. The report names the implementation chosen for the call and the
    compiled kernel's counter shows what ran (fused=None: the compiled path, on which tensors below
    FUSED_MIN_NUMEL elements, all of these, take the reference). `DualOptimPlus` with the same `fused` runs
    the same implementation: the same bits."""
    torch.manual_seed(0)
    weights = [torch.randn(shape, dtype=torch.float64) for shape in SHAPES]
    lr, betas, base_betas, eps, wd = 1e-2, (0.9, 0.95), (0.8, 0.99), 1e-8, 0.1
    reference = Float64DualOptimPlus(weights, lr, betas, base_betas, eps, wd, floor=FLOOR, bound=BOUND)
    params = [w.clone() for w in weights]
    twins = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = DualOptimPlus(twins, lr=lr, betas=betas, base_betas=base_betas, eps=eps, weight_decay=wd, fused=fused)

    def zeros(w):
        return {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(w), "exp_avg_sq": torch.zeros_like(w)}

    states = [zeros(w) for w in params]
    deltas = {name: [zeros(w) for w in params] for name in ("forget", "retain")}
    kernel = compiled_kernel(KERNEL_OF["DualOptimPlus"])
    generator = torch.Generator().manual_seed(1)
    objectives = ("forget", "retain", "retain", "forget", "retain", "retain")
    for index, objective in enumerate(objectives):
        grads = [g.double() for g in random_grads(generator, SHAPES, index % 2)]
        before = kernel.compiled_calls
        report = dualoptim_plus(params, grads, states, deltas[objective], lr=lr, betas=betas, base_betas=base_betas,
                                eps=eps, weight_decay=wd, fused=fused)
        assert report.implementation == implementation and len(report.stats) == len(SHAPES)
        assert kernel.compiled_calls - before == compiled_per_step
        reference.step(objective, grads)
        for p, g in zip(twins, grads):
            p.grad = g.clone()
        opt.step(objective=objective)
    for p, twin, expected in zip(params, twins, reference.params):
        torch.testing.assert_close(p, expected, rtol=1e-10, atol=1e-10)
        assert torch.equal(p, twin.detach())
    assert [int(s["step"]) for s in states] == [len(objectives)] * len(SHAPES)
    assert [int(d["step"]) for d in deltas["retain"]] == [4] * len(SHAPES)


def test_the_functional_form_refuses_what_it_cannot_run():
    w = torch.zeros(3)
    state = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
    common = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="one entry per tensor"):
        dualoptim_plus([w], [w, w], [state], [dict(state)], **common)
    with pytest.raises(ValueError, match="eager reference path only"):
        dualoptim_plus([w], [w], [state], [dict(state)], base_update="before-delta", fused=True, **common)
    with pytest.raises(ValueError, match="base_update must be one of"):
        dualoptim_plus([w], [w], [state], [dict(state)], base_update="later", **common)
    assert int(state["step"]) == 0


@pytest.mark.parametrize("name", ["dualoptim_plus", "dualoptim", "adamw"])
def test_a_state_saved_by_release_0_1_0_loads(name):
    """`make_states.py` ran release 0.1.0 (commit d1bcf3d) on a small problem: its state, weights and the
    weights after one more step. The current optimizer continues from that state to the same bits."""
    saved = torch.load(RELEASE_0_1_0 / f"{name}.pt", weights_only=True)
    cls = {"dualoptim_plus": DualOptimPlus, "dualoptim": DualOptim, "adamw": AdamW}[name]
    params = [torch.nn.Parameter(w.clone()) for w in saved["weights"]]
    groups = [{"params": params[:2], **saved["groups"][0]}, {"params": params[2:], **saved["groups"][1]}]
    opt = cls(groups, **saved["kwargs"])
    opt.load_state_dict(saved["state_dict"])
    for p, g in zip(params, saved["next_grads"]):
        p.grad = g.clone()
    step(opt, saved["next_objective"])
    for p, before, after in zip(params, saved["weights"], saved["weights_after"]):
        assert not torch.equal(before, after)
        assert p.dtype == after.dtype and torch.equal(p.detach(), after)
