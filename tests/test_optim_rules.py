"""DualOptim+ and DualOptim against independent references written here (float64 loops, torch AdamW)."""

from __future__ import annotations

import io

import pytest
import torch

from doplus_cli.optim import DualOptim, DualOptimPlus, muon_param_groups
from tests.helpers import SHAPES, Float64DualOptimPlus, check_muon_rule, cycle, fused_and_reference_steps, random_grads

FREQUENCIES = {
    "1:1 two objectives": {"forget": 1, "retain": 1},
    "1:5 two objectives": {"forget": 1, "retain": 5},
    "2:3 two objectives": {"forget": 2, "retain": 3},
    "one objective": {"task": 1},
    "three objectives 2:1:3": {"a": 2, "b": 1, "c": 3},
}


# float64 parameters make the optimizer's arithmetic float64 too, so both paths must agree with the loop to
# rounding (float32 would not: an element whose v̂_B + v̂_k nearly cancels amplifies float32 rounding).
RULES = {"paper": {}, "safeguarded": {"floor": 0.05, "bound": 10.0}, "safeguarded-tight": {"floor": 0.3, "bound": 0.8}}


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
@pytest.mark.parametrize("schedule", list(FREQUENCIES), ids=list(FREQUENCIES))
def test_adamw_rule_matches_float64_loop(schedule, fused, rule, dtype=torch.float64, tol=1e-10):
    frequencies = FREQUENCIES[schedule]
    objectives = tuple(frequencies)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, dtype=dtype)) for shape in SHAPES]
    lr, betas, base_betas, eps, wd = 1e-2, (0.9, 0.95), (0.8, 0.99), 1e-8, 0.1
    multipliers = {objectives[0]: 2.0}
    safeguard = RULES[rule]
    reference = Float64DualOptimPlus(params, lr, betas, base_betas, eps, wd, multipliers, **safeguard)
    options = {"rule": "paper"} if not safeguard else {"v_floor": safeguard["floor"], "max_update": safeguard["bound"]}
    opt = DualOptimPlus(
        params, lr=lr, betas=betas, base_betas=base_betas, eps=eps, weight_decay=wd,
        objectives=objectives, lr_multipliers=multipliers, fused=fused, **options,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / 40)
    generator = torch.Generator().manual_seed(1)
    for step, objective in enumerate(cycle(frequencies, 30)):
        grads = random_grads(generator, SHAPES, objectives.index(objective))
        for p, g in zip(params, grads):
            p.grad = g.to(dtype)
        reference.step(objective, grads, lr=lr * (1.0 - step / 40))
        opt.step(objective=objective)
        scheduler.step()
    for p, expected in zip(params, reference.params):
        torch.testing.assert_close(p.detach().double(), expected, rtol=tol, atol=tol)
    # the states too: base first moment and every delta's second moment
    for i, p in enumerate(params):
        state = opt.state[p]
        torch.testing.assert_close(state["exp_avg"].double(), reference.m_base[i], rtol=tol, atol=tol)
        assert int(state["step"]) == reference.t_base[i]
        for name in objectives:
            delta = state["delta"][name]
            torch.testing.assert_close(
                delta["exp_avg_sq"].double(), reference.delta[name][i]["v"], rtol=tol, atol=tol
            )
            assert int(delta["step"]) == reference.delta[name][i]["t"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernel_equals_reference_path(dtype):
    """The compiled one-pass kernel gives the eager reference's bits (float32 states, either param dtype)."""
    fused, reference, params, twins = fused_and_reference_steps(torch.device("cpu"), dtype)
    for p, q in zip(params, twins):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(fused.state[p][key], reference.state[q][key], rtol=1e-6, atol=1e-9)


def test_base_read_before_gradient_enters_on_first_steps():
    """Hand-computed: one scalar, g = 1 then g = 3, betas 0.5, no weight decay, lr 1."""
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float32))
    opt = DualOptimPlus([p], lr=1.0, betas=(0.5, 0.5), eps=0.0, objectives=("f", "r"), fused=False)
    p.grad = torch.tensor([1.0])
    opt.step(objective="f")
    # t_B=1: m̂_B=v̂_B=0; m_f=0.5, v_f=0.5; m̂=1, v̂=1 → θ = 0 − 1·1/1 = −1; then m_B=0.5, v_B=0.5
    assert p.item() == pytest.approx(-1.0)
    assert opt.state[p]["exp_avg"].item() == pytest.approx(0.5)
    p.grad = torch.tensor([3.0])
    opt.step(objective="r")
    # t_B=2: m̂_B = 0.5/(1−0.5) = 1, v̂_B = 1; m_r = 0.5·(3−1) = 1, v_r = 0.5·(9−1) = 4
    # t_r=1: m = 1 + 1/0.5 = 3, v = 1 + 4/0.5 = 9 → θ = −1 − 3/3 = −2; m_B = 0.25+1.5 = 1.75
    assert p.item() == pytest.approx(-2.0)
    assert opt.state[p]["delta"]["r"]["exp_avg"].item() == pytest.approx(1.0)
    assert opt.state[p]["exp_avg"].item() == pytest.approx(1.75)
    assert opt.state[p]["exp_avg_sq"].item() == pytest.approx(0.25 + 4.5)


@pytest.mark.parametrize("ff,fr", [(1, 1), (1, 5), (2, 3)])
@pytest.mark.parametrize("case", ["conflicting", "equal", "base-zero"])
def test_theorem_3_1_state_limits(ff, fr, case):
    """Gradients m·G (forget) and n·G (retain) in a fixed F_f:F_r cycle: states at cycle ends → Theorem 3.1."""
    beta = 0.9
    m, n = {"conflicting": (0.7, -0.4), "equal": (0.5, 0.5), "base-zero": (None, 0.6)}[case]
    if case == "base-zero":
        m = -(1 - beta**fr) / (beta**fr * (1 - beta**ff)) * n
    G = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = DualOptimPlus([p], lr=0.0, betas=(beta, 0.95), fused=False)
    for objective in cycle({"forget": ff, "retain": fr}, (ff + fr) * 400):
        p.grad = (m if objective == "forget" else n) * G
        opt.step(objective=objective)
    state = opt.state[p]
    c = ff + fr
    base = (beta**fr * (1 - beta**ff) * m + (1 - beta**fr) * n) / (1 - beta**c) * G
    delta_f = ff * beta ** (ff - 1) * (1 - beta) * (1 - beta**fr) / ((1 - beta**ff) * (1 - beta**c)) * (m - n) * G
    delta_r = fr * beta ** (fr - 1) * (1 - beta) * (1 - beta**ff) / ((1 - beta**fr) * (1 - beta**c)) * (n - m) * G
    torch.testing.assert_close(state["exp_avg"].double(), base, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(state["delta"]["forget"]["exp_avg"].double(), delta_f, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(state["delta"]["retain"]["exp_avg"].double(), delta_r, rtol=1e-4, atol=1e-6)
    if case == "equal":  # DualOptim+ acts like Alternate: no delta left
        assert state["delta"]["forget"]["exp_avg"].abs().max() < 1e-6
    if case == "base-zero":  # base → 0: DualOptim+ acts like DualOptim
        assert state["exp_avg"].abs().max() < 1e-6


@pytest.mark.parametrize("fused", [False, True])
def test_dualoptim_equals_two_adamw_stepped_alternately(fused):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    opt = DualOptim(params, objectives=("forget", "retain"), fused=fused, **kwargs)
    forget_adamw = torch.optim.AdamW(twins, fused=fused or None, **kwargs)
    retain_adamw = torch.optim.AdamW(twins, fused=fused or None, **kwargs)
    generator = torch.Generator().manual_seed(3)
    for objective in cycle({"forget": 1, "retain": 5}, 24):
        grads = random_grads(generator, SHAPES, 0 if objective == "forget" else 1)
        for p, q, g in zip(params, twins, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step(objective=objective)
        (forget_adamw if objective == "forget" else retain_adamw).step()
    for p, q in zip(params, twins):
        assert torch.equal(p, q)


def test_dualoptim_lr_multiplier_scales_only_its_objective():
    p = torch.nn.Parameter(torch.ones(4))
    opt = DualOptim([p], lr=0.1, objectives=("forget", "retain"), lr_multipliers={"forget": 0.0})
    p.grad = torch.ones(4)
    opt.step(objective="forget")
    assert torch.equal(p, torch.ones(4))
    opt.step(objective="retain")
    assert (p < 1).all()


def test_parameters_without_gradients_are_skipped():
    used, unused = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    for opt in (DualOptimPlus([used, unused], lr=0.1), DualOptim([used, unused], lr=0.1)):
        used.grad = torch.ones(3)
        opt.step(objective="forget")
        assert torch.equal(unused, torch.ones(3))
        assert unused not in opt.state or not opt.state[unused]


def test_muon_rule_matches_reference_loop():
    check_muon_rule(torch.device("cpu"), atol=1e-6)


@pytest.mark.parametrize("shape", [(16, 8), (8, 16), (12, 12)], ids=["tall", "wide", "square"])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_newton_schulz_and_the_shape_scaling_are_torch_muons_to_the_bit(shape, adjust_lr_fn):
    """doplus's own NewtonSchulz5 and learning-rate scaling (kernels.newton_schulz, muon_lr_scale) against one
    step of the public torch.optim.Muon from a zero weight without momentum, Nesterov or decay: that step is
    -η'·NS5(g), so the two must agree bit for bit."""
    from doplus_cli.optim.kernels import muon_lr_scale, newton_schulz

    grad = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    weight = torch.nn.Parameter(torch.zeros(shape))
    weight.grad = grad.clone()
    torch.optim.Muon([weight], lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False,
                     adjust_lr_fn=adjust_lr_fn).step()
    ours = torch.zeros(shape).add_(newton_schulz(grad, (3.4445, -4.7750, 2.0315), 5, 1e-7),
                                   alpha=-muon_lr_scale(adjust_lr_fn, torch.Size(shape)))
    assert torch.equal(weight.detach(), ours)


def test_muon_param_groups_keep_embeddings_and_head_on_adamw():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.hidden = torch.nn.Linear(4, 4)
            self.norm = torch.nn.LayerNorm(4)
            self.head = torch.nn.Linear(4, 10, bias=False)

        def get_output_embeddings(self):
            return self.head

    model = Tiny()
    groups = muon_param_groups(model, lr=0.01)
    muon = {id(p) for g in groups if g["use_muon"] for p in g["params"]}
    assert muon == {id(model.hidden.weight)}
    assert all(g["lr"] == 0.01 for g in groups)


def roundtrip(optimizer_state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(optimizer_state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: DualOptimPlus(ps, lr=1e-2, weight_decay=0.01),
        lambda ps: DualOptimPlus(ps, lr=1e-2, state_bits=8),
        lambda ps: DualOptimPlus(ps, lr=1e-2, state_bits=8, fused=True),
        lambda ps: DualOptimPlus(ps, lr=1e-2, inner="muon"),
        lambda ps: DualOptim(ps, lr=1e-2),
        lambda ps: DualOptim(ps, lr=1e-2, state_bits=8),
    ],
    ids=["doplus", "doplus-8bit", "doplus-8bit-fused", "doplus-muon", "dualoptim", "dualoptim-8bit"],
)
def test_state_dict_roundtrip_continues_bit_identically(make):
    torch.manual_seed(0)
    shapes = [(96, 64), (64,), (5000,)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    opt = make(params)
    generator = torch.Generator().manual_seed(9)
    sequence = cycle({"forget": 1, "retain": 2}, 12)

    def run(optimizer, parameters, objectives):
        for objective in objectives:
            for p in parameters:
                p.grad = torch.randn(p.shape, generator=generator)
            optimizer.step(objective=objective)

    run(opt, params, sequence[:5])
    saved = roundtrip(opt.state_dict())
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = make(clones)
    resumed.load_state_dict(saved)
    state_generator = generator.get_state()
    run(opt, params, sequence[5:])
    generator.set_state(state_generator)
    run(resumed, clones, sequence[5:])
    for p, q in zip(params, clones):
        assert torch.equal(p, q)


def test_misuse_raises_clear_value_errors():
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="unknown objective 'retian'"):
        opt = DualOptimPlus([p])
        p.grad = torch.ones(3)
        opt.step(objective="retian")
    with pytest.raises(ValueError, match="unknown objective"):
        DualOptim([p]).step(objective="x")
    with pytest.raises(ValueError, match="state_bits must be 8 or 32"):
        DualOptimPlus([p], state_bits=16)
    with pytest.raises(ValueError, match="state_bits must be 8 or 32"):
        DualOptim([p], state_bits=4)
    with pytest.raises(ValueError, match="unknown inner optimizer 'sgd'"):
        DualOptimPlus([p], inner="sgd")
    with pytest.raises(ValueError, match="at least one objective"):
        DualOptimPlus([p], objectives=())
    with pytest.raises(ValueError, match="unique"):
        DualOptimPlus([p], objectives=("a", "a"))
    with pytest.raises(ValueError, match="lr_multipliers names unknown objective"):
        DualOptimPlus([p], lr_multipliers={"forgt": 2.0})
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    embedding(torch.tensor([1, 2])).sum().backward()
    for opt in (DualOptimPlus(embedding.parameters()), DualOptim(embedding.parameters())):
        with pytest.raises(ValueError, match="sparse gradients"):
            opt.step(objective="forget")


def test_a_cpu_tensor_longer_than_a_chunk_steps_in_chunks_with_the_counts_of_the_unpacked_kernel():
    """On the CPU the compiled AdamW kernel packs its three counts into one sum and runs over chunks of
    `CPU_CHUNK` elements (kernels.py says why). A tensor of two chunks, with elements the safeguard's floor and
    clamp act on: the packed kernel ran once per chunk, and the weights, states and every count are those of the
    unpacked kernel (the CUDA path's, here compiled for the CPU) and, within rounding, of the eager reference."""
    from doplus_cli.optim import kernels

    n = kernels.CPU_CHUNK + 4099
    generator = torch.Generator().manual_seed(0)
    param = torch.randn(n, generator=generator) * 0.02
    grad = torch.randn(n, generator=generator) * 1e-3
    mb, md = torch.randn(n, generator=generator) * 1e-4, torch.randn(n, generator=generator) * 1e-4
    vb, vd = torch.rand(n, generator=generator) * 1e-6, torch.randn(n, generator=generator) * 1e-8
    vd[::7] = -0.97 * vb[::7]  # v̂_B + v̂_k near 0: the floor acts
    md[::13] = 1.0  # a first moment far above sqrt(v): the clamp acts
    s = kernels.AdamWPlusScalars(lr=1e-3, weight_decay=0.01, beta1=0.9, beta2=0.95, base_beta1=0.9,
                                 base_beta2=0.95, eps=1e-8, base_step=5, delta_step=3, v_floor=0.02, max_update=10.0)
    hp = s.packed(torch.device("cpu"))
    tensors = (param, grad, mb, vb, md, vd)
    unpacked, reference = [t.clone() for t in tensors], [t.clone() for t in tensors]
    calls = kernels._adamw_plus_compiled_packed.compiled_calls
    chunked = kernels.adamw_plus_fused(*tensors, hp)
    assert kernels._adamw_plus_compiled_packed.compiled_calls - calls == 2
    whole = kernels._adamw_plus_compiled(*unpacked, hp, None)
    eager = kernels.adamw_plus_reference(*reference, s)
    counts = [int(value) for value in chunked[1:]]
    assert counts == [int(value) for value in whole[1:]] == [int(value) for value in eager[1:]]
    assert min(counts[1:]) > 1000  # the floor and the clamp both acted
    assert torch.equal(chunked[0], whole[0])
    for mine, theirs, near in zip(tensors, unpacked, reference):
        assert torch.equal(mine, theirs)
        torch.testing.assert_close(mine, near, rtol=1e-6, atol=1e-9)
