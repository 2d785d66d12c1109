"""The federated-learning baselines (SCAFFOLD/MIME, FedCM, Local Adam), DualOptim+'s base-update ablations and the
safeguard's floor/clamp counts, each against a float64 loop written here; then the schemes through `doplus unlearn`."""

from __future__ import annotations

import io
import json

import pytest
import torch
from safetensors.torch import load_file

from doplus_cli.optim import DualOptimPlus, FedCM, LocalAdam, Scaffold, dualoptim_plus, kernels
from tests.helpers import (
    SHAPES,
    cycle,
    max_difference,
    random_grads,
    resume_from_step_2,
    run_cli,
    two_processes,
    weights,
    write_sets,
)

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1
SCHEDULES = {"2:3": {"forget": 2, "retain": 3}, "1:5": {"forget": 1, "retain": 5},
             "three objectives 2:1:3": {"a": 2, "b": 1, "c": 3}}


class Float64Periodic:
    """SCAFFOLD/MIME (`residual`), FedCM (`gradient`) or Local Adam (`local-adam`), one line per line of the paper's
    adaptation, on float64 tensors: the base (or the merge) once per period of the cycle `frequencies`."""

    def __init__(self, params, kind, frequencies, multipliers):
        self.params = [p.detach().double().clone() for p in params]
        self.kind, self.frequencies, self.multipliers = kind, frequencies, multipliers
        zeros = [torch.zeros_like(p) for p in self.params]
        self.base_m, self.base_v = [z.clone() for z in zeros], [z.clone() for z in zeros]
        self.delta = {k: [{"m": z.clone(), "v": z.clone(), "t": 0} for z in zeros] for k in frequencies}
        self.count = {k: 0 for k in frequencies}
        self.boundaries = []  # step numbers (1-based) after which a period ended

    def step(self, objective, grads, lr, step_number):
        b1, b2 = BETAS
        lr = lr * self.multipliers.get(objective, 1.0)
        for i, g in enumerate(grads):
            g = g.double()
            d = self.delta[objective][i]
            d["t"] += 1
            if self.kind == "residual":
                d["m"] = b1 * d["m"] + (1 - b1) * (g - self.base_m[i])
                d["v"] = b2 * d["v"] + (1 - b2) * (g * g - self.base_v[i])
            else:
                d["m"] = b1 * d["m"] + (1 - b1) * g
                d["v"] = b2 * d["v"] + (1 - b2) * (g * g)
            m_hat, v_hat = d["m"] / (1 - b1 ** d["t"]), d["v"] / (1 - b2 ** d["t"])
            if self.kind == "local-adam":
                m, v = m_hat, v_hat
            else:
                m, v = self.base_m[i] + m_hat, (self.base_v[i] + v_hat).abs()
            self.params[i] = self.params[i] * (1 - lr * WD) - lr * m / (v.sqrt() + EPS)
        self.count[objective] += 1
        if self.count == self.frequencies:
            self.boundaries.append(step_number)
            self.count = {k: 0 for k in self.frequencies}
            for i in range(len(self.params)):
                deltas = [self.delta[k][i] for k in self.frequencies if self.delta[k][i]["t"] > 0]
                mean_m = sum(d["m"] / (1 - b1 ** d["t"]) for d in deltas) / len(deltas)
                mean_v = sum(d["v"] / (1 - b2 ** d["t"]) for d in deltas) / len(deltas)
                if self.kind == "local-adam":
                    for d in deltas:
                        d["m"], d["v"] = mean_m * (1 - b1 ** d["t"]), mean_v * (1 - b2 ** d["t"])
                else:
                    self.base_m[i] = self.base_m[i] + mean_m
                    self.base_v[i] = self.base_v[i] + mean_v


OPTIMIZERS = {"residual": Scaffold, "gradient": FedCM, "local-adam": LocalAdam}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("kind", list(OPTIMIZERS), ids=["scaffold", "fedcm", "local-adam"])
def test_fl_rule_matches_float64_loop_over_several_periods(kind, schedule, tol=1e-10):
    frequencies = SCHEDULES[schedule]
    objectives = tuple(frequencies)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, dtype=torch.float64)) for shape in SHAPES]
    multipliers = {objectives[0]: 2.0}
    reference = Float64Periodic(params, kind, frequencies, multipliers)
    opt = OPTIMIZERS[kind](params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, objectives=objectives,
                           frequencies=frequencies, lr_multipliers=multipliers)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / 40)
    generator = torch.Generator().manual_seed(1)
    period = sum(frequencies.values())
    steps = 4 * period + 2  # four whole periods, then two steps into the fifth
    base_before = None
    for step, objective in enumerate(cycle(frequencies, steps)):
        grads = random_grads(generator, SHAPES, objectives.index(objective))
        for p, g in zip(params, grads):
            p.grad = g.double()
        reference.step(objective, grads, LR * (1.0 - step / 40), step + 1)
        opt.step(objective=objective)
        scheduler.step()
        if kind != "local-adam":  # the base moves exactly at the period's last step
            base = opt.state[params[0]]["exp_avg"].clone()
            if base_before is not None:
                assert torch.equal(base, base_before) != ((step + 1) % period == 0)
            base_before = base
    assert reference.boundaries == [period * n for n in range(1, 5)]
    assert opt.periods_ended == 4 and opt.period_steps[objectives[0]] == min(2, frequencies[objectives[0]])
    for p, expected in zip(params, reference.params):
        torch.testing.assert_close(p.detach(), expected, rtol=tol, atol=tol)
    for i, p in enumerate(params):
        state = opt.state[p]
        if kind != "local-adam":
            torch.testing.assert_close(state["exp_avg"], reference.base_m[i], rtol=tol, atol=tol)
            torch.testing.assert_close(state["exp_avg_sq"], reference.base_v[i], rtol=tol, atol=tol)
        for name in objectives:
            torch.testing.assert_close(state["delta"][name]["exp_avg"], reference.delta[name][i]["m"], rtol=tol,
                                       atol=tol)
            torch.testing.assert_close(state["delta"][name]["exp_avg_sq"], reference.delta[name][i]["v"], rtol=tol,
                                       atol=tol)
            assert int(state["delta"][name]["step"]) == reference.delta[name][i]["t"]


def test_local_adam_is_each_objectives_own_adamw_within_the_first_period():
    """Before any merge, Local Adam's steps are torch's AdamW with the stepping objective's state."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(7, dtype=torch.float64))
    twins = {k: torch.nn.Parameter(p.detach().clone()) for k in ("forget", "retain")}
    torch_opts = {k: torch.optim.AdamW([twins[k]], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD) for k in twins}
    opt = LocalAdam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, frequencies={"forget": 2, "retain": 3})
    for objective in ("forget", "forget", "retain"):
        g = torch.randn(7, dtype=torch.float64)
        start = p.detach().clone()
        p.grad = g
        opt.step(objective=objective)
        twin = twins[objective]
        with torch.no_grad():
            twin.copy_(start)
        twin.grad = g
        torch_opts[objective].step()
        torch.testing.assert_close(p.detach(), twin.detach(), rtol=1e-12, atol=1e-14)


def test_merge_by_hand_on_a_scalar():
    """Local Adam, betas (0.5, 0.5), one forget step (g = 2) and one retain step (g = 4): after the period both
    states hold the mean of the bias-corrected moments, m̂ = (2 + 4)/2 = 3, v̂ = (4 + 16)/2 = 10, re-biased for t = 1
    (× 0.5). SCAFFOLD on the same steps: Δ̂_f = 2, Δ̂_r = 4 − 0 = 4 (the base is 0 in the first period), so
    B_m = 3, B_v = 10."""
    for cls, expected in ((LocalAdam, {"m": 1.5, "v": 5.0}), (Scaffold, {"base_m": 3.0, "base_v": 10.0})):
        p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        opt = cls([p], lr=0.0, betas=(0.5, 0.5), eps=0.0)
        for objective, g in (("forget", 2.0), ("retain", 4.0)):
            p.grad = torch.tensor([g], dtype=torch.float64)
            opt.step(objective=objective)
        state = opt.state[p]
        if cls is LocalAdam:
            for k in ("forget", "retain"):
                assert state["delta"][k]["exp_avg"].item() == pytest.approx(expected["m"])
                assert state["delta"][k]["exp_avg_sq"].item() == pytest.approx(expected["v"])
        else:
            assert state["exp_avg"].item() == pytest.approx(expected["base_m"])
            assert state["exp_avg_sq"].item() == pytest.approx(expected["base_v"])


@pytest.mark.parametrize("cls", [Scaffold, FedCM, LocalAdam])
def test_state_dict_round_trip_inside_a_period_continues_bit_identically(cls):
    """A state saved two steps into a 2:3 period, loaded into a new optimizer: the period ends at the same step
    and every later step gives the same bits."""
    torch.manual_seed(0)
    frequencies = {"forget": 2, "retain": 3}
    a = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_a = cls(a, lr=LR, weight_decay=WD, frequencies=frequencies)
    schedule = cycle(frequencies, 12)
    generator = torch.Generator().manual_seed(1)
    grads = [random_grads(generator, SHAPES, 0) for _ in schedule]
    for step in range(7):  # one period and two steps
        for p, g in zip(a, grads[step]):
            p.grad = g
        opt_a.step(objective=schedule[step])
    buffer = io.BytesIO()
    torch.save(opt_a.state_dict(), buffer)
    buffer.seek(0)
    with torch.no_grad():
        for p, q in zip(a, b):
            q.copy_(p)
    opt_b = cls(b, lr=LR, weight_decay=WD, frequencies=frequencies)
    opt_b.load_state_dict(torch.load(buffer, weights_only=True))
    assert opt_b.period_steps == {"forget": 2, "retain": 0}
    for step in range(7, 12):
        for params in (a, b):
            for p, g in zip(params, grads[step]):
                p.grad = g
        opt_a.step(objective=schedule[step])
        opt_b.step(objective=schedule[step])
    assert opt_a.periods_ended == 2 and opt_b.periods_ended == 1  # the second period ended after the reload
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def test_period_is_checked():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = Scaffold([p], frequencies={"forget": 1, "retain": 2})
    p.grad = torch.ones(3)
    opt.step(objective="forget")
    with pytest.raises(ValueError, match="stepped more than its frequency 1"):
        opt.step(objective="forget")
    with pytest.raises(ValueError, match="exactly the objectives"):
        Scaffold([p], frequencies={"forget": 1})
    with pytest.raises(ValueError, match="unknown objective"):
        opt.step(objective="other")
    with pytest.raises(ValueError, match="period step counts"):
        Scaffold([p]).load_state_dict({**opt.state_dict(), "period": {"forget": 0}})


# ------------------------------------------------------------------ DualOptim+'s base-update ablations


class Float64Ablation:
    """DualOptim+'s AdamW rule on float64 tensors with the base updated before Δ, after Δ or after θ, by g or by
    g − Δ̂; `floor`/`bound` the safeguard, and the elements where it acted counted."""

    def __init__(self, params, objectives, base_update, base_source, floor=0.0, bound=float("inf")):
        self.params = [p.detach().double().clone() for p in params]
        self.base_update, self.base_source, self.floor, self.bound = base_update, base_source, floor, bound
        zeros = [torch.zeros_like(p) for p in self.params]
        self.mb, self.vb = [z.clone() for z in zeros], [z.clone() for z in zeros]
        self.t_base = 0
        self.delta = {k: [{"m": z.clone(), "v": z.clone(), "t": 0} for z in zeros] for k in objectives}
        self.floored = self.clamped = 0

    def _base(self, i, g, dm_hat, dv_hat):
        b1, b2 = BETAS
        x, y = (g, g * g) if self.base_source == "grad" else (g - dm_hat, g * g - dv_hat)
        self.mb[i] = b1 * self.mb[i] + (1 - b1) * x
        self.vb[i] = b2 * self.vb[i] + (1 - b2) * y

    def step(self, objective, grads, lr):
        b1, b2 = BETAS
        self.t_base += 1
        t = self.t_base
        self.floored = self.clamped = 0
        for i, g in enumerate(grads):
            g = g.double()
            d = self.delta[objective][i]
            d["t"] += 1
            tk = d["t"]
            theta = self.params[i] * (1 - lr * WD)
            if self.base_update == "before-delta":
                prev_m = d["m"] / (1 - b1 ** (tk - 1)) if tk > 1 else torch.zeros_like(g)
                prev_v = d["v"] / (1 - b2 ** (tk - 1)) if tk > 1 else torch.zeros_like(g)
                self._base(i, g, prev_m, prev_v)
                mb_hat, vb_hat = self.mb[i] / (1 - b1**t), self.vb[i] / (1 - b2**t)
            else:
                mb_hat = self.mb[i] / (1 - b1 ** (t - 1)) if t > 1 else torch.zeros_like(g)
                vb_hat = self.vb[i] / (1 - b2 ** (t - 1)) if t > 1 else torch.zeros_like(g)
            d["m"] = b1 * d["m"] + (1 - b1) * (g - mb_hat)
            d["v"] = b2 * d["v"] + (1 - b2) * (g * g - vb_hat)
            dm_hat, dv_hat = d["m"] / (1 - b1**tk), d["v"] / (1 - b2**tk)
            if self.base_update == "after-delta":
                self._base(i, g, dm_hat, dv_hat)
                mb_hat, vb_hat = self.mb[i] / (1 - b1**t), self.vb[i] / (1 - b2**t)
            m, v = mb_hat + dm_hat, vb_hat + dv_hat
            lower = self.floor * (vb_hat + dv_hat.abs())
            self.floored += int((v.abs() < lower).sum())
            u = m / (torch.maximum(v.abs(), lower).sqrt() + EPS)
            self.clamped += int((u.abs() > self.bound).sum())
            self.params[i] = theta - lr * u.clamp(-self.bound, self.bound)
            if self.base_update == "after-param":
                self._base(i, g, dm_hat, dv_hat)


@pytest.mark.parametrize("base_source", ["grad", "grad-minus-delta"])
@pytest.mark.parametrize("base_update", ["before-delta", "after-delta", "after-param"])
def test_base_update_switches_match_float64_loop(base_update, base_source, tol=1e-10):
    frequencies = {"forget": 2, "retain": 3}
    objectives = tuple(frequencies)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, dtype=torch.float64)) for shape in SHAPES]
    reference = Float64Ablation(params, objectives, base_update, base_source, floor=0.3, bound=0.8)
    opt = DualOptimPlus(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, objectives=objectives,
                        v_floor=0.3, max_update=0.8, base_update=base_update, base_source=base_source)
    generator = torch.Generator().manual_seed(1)
    floored = clamped = 0
    for objective in cycle(frequencies, 17):
        grads = random_grads(generator, SHAPES, objectives.index(objective))
        for p, g in zip(params, grads):
            p.grad = g.double()
        reference.step(objective, grads, LR)
        opt.step(objective=objective)
        counts = opt.safeguard_counts()
        assert counts == (reference.floored, reference.clamped, sum(p.numel() for p in params))
        floored, clamped = floored + counts[0], clamped + counts[1]
    assert floored > 0 and clamped > 0  # the counts were put to the test
    for p, expected in zip(params, reference.params):
        torch.testing.assert_close(p.detach(), expected, rtol=tol, atol=tol)
    for i, p in enumerate(params):
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], reference.vb[i], rtol=tol, atol=tol)


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
def test_floor_and_clamp_fractions_match_float64_counts(fused):
    """The compiled kernel counts as the float64 loop does (default switches: the kernel's path)."""
    objectives = ("forget", "retain")
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, dtype=torch.float64)) for shape in SHAPES]
    reference = Float64Ablation(params, objectives, "after-param", "grad", floor=0.3, bound=0.8)
    opt = DualOptimPlus(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, v_floor=0.3, max_update=0.8,
                        fused=fused)
    numel = sum(p.numel() for p in params)
    generator = torch.Generator().manual_seed(1)
    for objective in cycle({"forget": 1, "retain": 3}, 12):
        grads = random_grads(generator, SHAPES, objectives.index(objective))
        for p, g in zip(params, grads):
            p.grad = g.double()
        reference.step(objective, grads, LR)
        opt.step(objective=objective)
        diagnostics = opt.step_diagnostics()
        assert diagnostics["floor_fraction"] == reference.floored / numel
        assert diagnostics["clamp_fraction"] == reference.clamped / numel
    paper = DualOptimPlus(params, rule="paper", fused=fused)
    paper.step(objective="forget")
    assert "floor_fraction" not in paper.step_diagnostics() and paper.safeguard_counts() is None


@pytest.mark.parametrize("fused", [None, False, True], ids=["by-size", "reference", "fused"])
def test_default_switches_are_bit_identical_to_the_rule(fused):
    torch.manual_seed(0)
    shapes = [(300, 300), (7,)]  # one tensor over the compiled kernel's size threshold
    a = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    plain = DualOptimPlus(a, lr=LR, weight_decay=WD, fused=fused)
    explicit = DualOptimPlus(b, lr=LR, weight_decay=WD, fused=fused, base_update="after-param", base_source="grad")
    generator = torch.Generator().manual_seed(1)
    for objective in cycle({"forget": 1, "retain": 2}, 6):
        grads = random_grads(generator, shapes, 0)
        for params in (a, b):
            for p, g in zip(params, grads):
                p.grad = g.clone()
        plain.step(objective=objective)
        explicit.step(objective=objective)
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_switches_on_the_fast_paths_are_refused_and_by_size_takes_the_reference():
    p = torch.nn.Parameter(torch.randn(300, 300))
    for options in ({"fused": True}, {"inner": "muon"}):
        with pytest.raises(ValueError, match="eager reference path only"):
            DualOptimPlus([p], base_update="before-delta", **options)
    with pytest.raises(ValueError, match="unknown base_source"):
        DualOptimPlus([p], base_source="delta")
    p.grad = torch.randn(300, 300)
    opt = DualOptimPlus([p], base_source="grad-minus-delta")  # fused=None: the reference, for every size
    doplus_kernels = [k for k in kernels.KERNELS if k.name.startswith("DualOptim+ AdamW")]
    before = [k.compiled_calls for k in doplus_kernels]
    opt.step(objective="forget")
    assert [k.compiled_calls for k in doplus_kernels] == before
    state = opt.state[p]
    report = dualoptim_plus([p], [p.grad], [state], [state["delta"]["forget"]], lr=LR, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0, base_source="grad-minus-delta")
    assert report.implementation == "reference"


# ------------------------------------------------------------------ through `doplus unlearn`


@pytest.fixture(scope="module")
def data(tofu_dir, tmp_path_factory):
    return write_sets(tofu_dir, tmp_path_factory.mktemp("fl-data"), 8, 12)


def unlearn_args(model, data, out, scheme, *extra):
    return ["unlearn", "--model", model, "--forget", data / "forget.jsonl", "--retain", data / "retain.jsonl",
            "--scheme", scheme, "--steps", 6, "--forget-freq", 1, "--retain-freq", 2, "--lr", 1e-3,
            "--batch-size", 2, "--max-length", 48, "--show-samples", 0, "--out", out, *extra]


@pytest.mark.parametrize("scheme", ["scaffold", "fedcm", "local-adam"])
def test_scheme_resumes_bit_identically_across_a_period_boundary(tiny_llama, data, tmp_path, scheme):
    """Periods of 3 steps: the checkpoint at step 2 is inside the first period; the boundaries at steps 3 and 6
    fall in the resumed part."""
    whole, out = tmp_path / "whole", tmp_path / "run"
    checkpoint = resume_from_step_2(
        lambda folder, more: run_cli(*unlearn_args(tiny_llama, data, folder, scheme, *more)) == 0 or pytest.fail(),
        out, whole)
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert saved["period"] == {"forget": 1, "retain": 1}
    final = weights(out)
    assert max_difference(final, load_file(str(checkpoint / "model.safetensors"))) > 1e-5
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["objective"] for r in records] == ["forget", "retain", "retain"] * 2
    assert all(r["max_update"] > 0 and "floor_fraction" not in r for r in records)
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["scheme"] == scheme and report["update_sizes"]["all"]["steps"] == 6


def test_default_switches_through_unlearn_are_bit_identical_and_record_the_safeguard(tiny_llama, data, tmp_path):
    plain, explicit = tmp_path / "plain", tmp_path / "explicit"
    assert run_cli(*unlearn_args(tiny_llama, data, plain, "doplus")) == 0
    assert run_cli(*unlearn_args(tiny_llama, data, explicit, "doplus", "--base-update", "after-param",
                                 "--base-source", "grad")) == 0
    a, b = weights(plain), weights(explicit)
    assert all(torch.equal(a[k], b[k]) for k in a)
    records = [json.loads(line) for line in open(plain / "metrics.jsonl")]
    assert all(0.0 <= r["floor_fraction"] <= 1.0 and 0.0 <= r["clamp_fraction"] <= 1.0 for r in records)
    report = json.loads((plain / "report.json").read_text())
    assert report["update_sizes"]["all"]["mean_floor_fraction"] == pytest.approx(
        sum(r["floor_fraction"] for r in records) / len(records))
    assert "floor acted" in (plain / "report.md").read_text()


def test_scheme_with_lora_and_an_ablation_switch_run(tiny_llama, data, tmp_path):
    out = tmp_path / "lora"
    assert run_cli(*unlearn_args(tiny_llama, data, out, "local-adam", "--lora-rank", 2, "--steps", 3)) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["lora"]["adapter_norms"]["delta_total"] > 0
    out = tmp_path / "ablation"
    assert run_cli(*unlearn_args(tiny_llama, data, out, "doplus", "--base-update", "before-delta",
                                 "--base-source", "grad-minus-delta", "--steps", 3)) == 0
    assert json.loads((out / "report.json").read_text())["config"]["base_update"] == "before-delta"


@pytest.mark.parametrize("args,message", [
    (["--scheme", "fedavg"], "unknown scheme 'fedavg'"),
    (["--base-update", "sometimes"], "unknown base-update 'sometimes'"),
    (["--base-source", "delta"], "unknown base-source 'delta'"),
    (["--scheme", "scaffold", "--base-update", "before-delta"], "need --scheme doplus"),
    (["--scheme", "fedcm", "--state-bits", "8"], "keeps 32-bit states"),
])
def test_bad_scheme_or_switch_is_one_line_exit_2(tiny_llama, data, tmp_path, capsys, args, message):
    base = ["unlearn", "--model", tiny_llama, "--forget", data / "forget.jsonl", "--retain", data / "retain.jsonl",
            "--out", tmp_path / "bad"]
    assert run_cli(*base, *args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


@pytest.mark.processes
@pytest.mark.cpu_processes
def test_scaffold_on_two_processes_equals_one_process_at_twice_the_batch(tiny_llama, data, tmp_path):
    """DDP (two gloo processes, batch 1 each) against one process at batch 2, across two period boundaries. One
    scheme: each launch of two processes costs ~10 s, and the three schemes share the engine's path (the
    objective's gradient, averaged over processes, then `step(objective=...)`)."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert run_cli(*unlearn_args(tiny_llama, data, one, "scaffold")) == 0
    args = unlearn_args(tiny_llama, data, two, "scaffold")
    args[args.index("--batch-size") + 1] = 1
    two_processes(args)
    assert json.loads((two / "report.json").read_text())["environment"]["world_size"] == 2
    start = load_file(str(tiny_llama / "model.safetensors"))
    assert max_difference(weights(one), start) > 1e-3
    assert max_difference(weights(one), weights(two)) < 1e-5


def test_bench_scheme_names_fix_the_scheme_and_the_switches():
    from doplus_cli.bench.schemes.planning import scheme_values
    from doplus_cli.config import TrainConfig, validate_training

    expected = {"scaffold": ("scaffold", "after-param", "grad"), "fedcm": ("fedcm", "after-param", "grad"),
                "local-adam": ("local-adam", "after-param", "grad"),
                "doplus-before-delta": ("doplus", "before-delta", "grad"),
                "doplus-after-delta": ("doplus", "after-delta", "grad"),
                "doplus-grad-minus-delta": ("doplus", "after-param", "grad-minus-delta"),
                "doplus": ("doplus", "after-param", "grad")}
    for name, (scheme, base_update, base_source) in expected.items():
        values = scheme_values(name)
        assert (values["scheme"], values["base_update"], values["base_source"]) == (scheme, base_update, base_source)
        validate_training(TrainConfig(**values))


def test_fedcm_steps_grow_with_the_periods_as_the_rule_says():
    """A constant gradient g = 1, lr 1, ε 0, a 1:5 cycle: after n periods FedCM's base is n (both moments), so its
    step is (n + 1)/sqrt(n + 1) = sqrt(n + 1); SCAFFOLD's base tracks the mean momentum and its steps stay near 1."""
    for cls in (FedCM, Scaffold):
        p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        opt = cls([p], lr=1.0, eps=0.0, frequencies={"forget": 1, "retain": 5})
        steps = []
        for objective in cycle({"forget": 1, "retain": 5}, 60):
            before = p.item()
            p.grad = torch.ones(1, dtype=torch.float64)
            opt.step(objective=objective)
            steps.append(before - p.item())
        if cls is FedCM:
            for n in range(10):
                assert steps[6 * n: 6 * n + 6] == pytest.approx([(n + 1) ** 0.5] * 6, rel=1e-12)
        else:
            assert max(steps) < 1.5
