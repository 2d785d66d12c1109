"""The multi-tensor DualOptim+ kernel (`doplus_cli/optim/multi_tensor.py`), run on CPU tensors.

The kernel is Triton code for CUDA; Triton's interpreter runs the same kernel on CPU tensors with numpy, one
operation at a time, when `TRITON_INTERPRET=1` is set before Triton is imported. `multi_tensor_worker.py` does
that in a process of its own (this process keeps the compiled Triton of a CUDA machine, if any) and saves
every run; the tests here assert on them:

* against the per-tensor compiled kernel (the path every other test covers) bit for bit, for float32, bf16
  and compensated bf16 weights under both rules: the interpreter rounds each operation as eager PyTorch
  does, so any difference is an error in the kernel's rule, its tiling or its table of addresses;
* against the float64 loop written in tests/helpers.py, independently of both paths;
* that it ran: one launch per step over every tensor (the per-tensor run made none), and that a tensor it
  cannot take (an address not 16-byte aligned) goes to the per-tensor path in the same step.

On CUDA, tests/test_cuda.py compares the compiled kernel with the per-tensor path on the device.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from doplus_cli.optim import DualOptimPlus, multi_tensor
from tests.helpers import Float64DualOptimPlus, child_env

# Triton is a dev dependency on Linux x86_64 (pyproject.toml), where CI runs; it has no wheels elsewhere
pytestmark = [
    pytest.mark.skipif(not multi_tensor.triton_installed(), reason="Triton is not installed (no wheel here)"),
    pytest.mark.processes,  # the Triton interpreter runs in a process of its own
]
WORKER = os.path.join(os.path.dirname(__file__), "multi_tensor_worker.py")
CONFIGS = [f"{dtype}-{kind}-{rule}" for dtype, kind in (("float32", "plain"), ("bfloat16", "compensated"),
                                                       ("bfloat16", "plain")) for rule in ("safeguarded", "paper")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("multi_tensor") / "runs.pt"
    env = child_env(TRITON_INTERPRET="1", DOPLUS_REQUIRE_COMPILED="1")
    done = subprocess.run([sys.executable, WORKER, str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("config", CONFIGS)
def test_one_launch_per_step_bit_identical_to_the_per_tensor_kernel(runs, config):
    multi, single = runs[config][True], runs[config][False]
    steps = len(multi["steps"])
    assert multi["launches"] == steps and multi["tensors"] == 4 * steps  # every tensor, one launch a step
    assert single["launches"] == 0 and single["tensors"] == 0
    for a, b in zip(multi["params"], single["params"], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert any(not torch.equal(a, s) for a, s in zip(multi["params"], multi["start"]))  # the weights moved
    for i, state in multi["states"].items():
        other = single["states"][i]
        assert state.keys() == other.keys()
        for name, value in state.items():
            if isinstance(value, dict):
                assert value["step"] == other[name]["step"]
                assert torch.equal(value["exp_avg"], other[name]["exp_avg"])
                assert torch.equal(value["exp_avg_sq"], other[name]["exp_avg_sq"])
            elif isinstance(value, torch.Tensor):
                assert torch.equal(value, other[name]), name
            else:
                assert value == other[name] == steps
    assert multi["diagnostics"] == step_sizes(single["diagnostics"])
    if "compensated" in config:  # the compensation buffers were written (not all zero)
        assert any(state["compensation"].abs().sum() > 0 for state in multi["states"].values())


def test_float32_run_matches_a_float64_loop(runs):
    """The kernel's float32 weights against the float64 rule of tests/helpers.py (safeguard: floor 0.02,
    bound 10 lr), over 6 steps of a 1:2 cycle with an lr schedule and a forget lr multiplier of 2. (Not the
    paper's rule: on these gradients its denominator cancels to float32 noise in 1% of the elements, where
    float32 and float64 give steps of different sizes on any implementation; the paper rule's kernel is
    checked bit for bit against the per-tensor path above.)"""
    run = runs["float32-plain-safeguarded"][True]
    floor, bound = 0.02, 10.0
    reference = Float64DualOptimPlus(run["start"], 1e-2, (0.9, 0.95), (0.8, 0.99), 1e-8, 0.1, {"forget": 2.0},
                                     floor=floor, bound=bound)
    for objective, lr, grads in run["steps"]:
        reference.step(objective, grads, lr=lr)
    for got, expected, first in zip(run["params"], reference.params, run["start"], strict=True):
        moved = (expected - first.double()).abs().max()
        assert moved > 1e-3
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-6)


def test_param_groups_and_skipped_tensors_share_one_launch(runs):
    """Two param groups (lr factor 0.5 and no weight decay in the second) and a tensor without a gradient on
    two steps: its t_B and t_k fall behind the others'. Still one launch a step, each tensor with its own
    scalars, equal to the per-tensor path bit for bit."""
    multi, single = runs["groups"][True], runs["groups"][False]
    steps = len(multi["steps"])
    assert multi["launches"] == steps and multi["tensors"] == 4 * steps - 2
    for a, b in zip(multi["params"], single["params"], strict=True):
        assert torch.equal(a, b)
    assert multi["states"][3]["step"] == steps - 2 and multi["states"][0]["step"] == steps
    assert multi["diagnostics"] == step_sizes(single["diagnostics"])


def step_sizes(diagnostics: list[dict]) -> list[dict]:
    """The per-tensor path's diagnostics without the safeguard's floor/clamp fractions, which the multi-tensor
    kernel does not count (a step it took records neither)."""
    return [{k: v for k, v in d.items() if k not in ("floor_fraction", "clamp_fraction")} for d in diagnostics]


def test_a_step_launches_again_each_time_enough_elements_are_ready(runs):
    """With `FLUSH_NUMEL` at 6,000 the first two tensors (6,330 elements) are one launch and the other two
    another: two launches a step, the same numbers bit for bit."""
    flushed, once = runs["flush"], runs["float32-plain-safeguarded"][True]
    steps = len(flushed["steps"])
    assert flushed["launches"] == 2 * steps and flushed["tensors"] == 4 * steps
    for a, b in zip(flushed["params"], once["params"], strict=True):
        assert torch.equal(a, b)
    assert flushed["diagnostics"] == once["diagnostics"]


def test_nan_gradient_reaches_the_weight_and_the_diagnostics(runs):
    multi, single = runs["nan"][True], runs["nan"][False]
    weight = multi["params"][1].view(-1)
    assert math.isnan(weight[7]) and not weight[8:].isnan().any()
    assert math.isnan(multi["diagnostics"][-1]["max_update"])
    assert not math.isnan(multi["diagnostics"][-2]["max_update"])  # NaN only from the step that saw it
    for a, b in zip(multi["params"], single["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_a_misaligned_tensor_takes_the_per_tensor_path_in_the_same_step(runs):
    result = runs["misaligned"]
    assert result[True]["odd_address"] != 0
    assert result[True]["tensors"] == 3 and result[False]["tensors"] == 0  # the aligned tensor, 3 steps
    for a, b in zip(result[True]["params"], result[False]["params"], strict=True):
        assert torch.equal(a, b)
    assert runs["fallback_reason"] is None


def test_adamw_step_diagnostics_in_one_launch_equal_the_per_tensor_ones(runs):
    """The diagnostics of torch's AdamW steps (Alternate, Joint, DualOptim) from θ and the moments: the float32
    group through the multi-tensor kernel, one launch a step; the bf16 group, whose moments torch keeps in
    bf16, per tensor. Equal to the per-tensor computation, and the largest |Δθ|/η is the step the weights
    actually took (float32 weights: up to rounding; bf16 weights are rounded after the step, so there the
    recovered step is the one before rounding)."""
    result = runs["adam_stats"]
    assert result["launches"] == [1, 1, 1]
    assert result["multi"] == result["single"]
    for stats, moved in zip(result["multi"], result["moved"], strict=True):
        assert stats["max_update"] >= 0.5  # AdamW's steps are ~lr
        float32_step = max(moved[:2])
        if stats["max_update"] == pytest.approx(float32_step, rel=1e-4):
            continue
        assert stats["max_update"] == pytest.approx(max(moved[2:]), rel=0.02)  # the largest was a bf16 weight's


def test_eligibility():
    param = torch.zeros(64)
    states = tuple(torch.zeros(64) for _ in range(4))
    assert multi_tensor.eligible(param, torch.zeros(64), states, None)
    assert multi_tensor.eligible(param.bfloat16(), torch.zeros(64).bfloat16(), states, torch.zeros(64).bfloat16())
    assert not multi_tensor.eligible(param.double(), torch.zeros(64).double(), states, None)  # float64 states
    assert not multi_tensor.eligible(param, torch.zeros(64, 2)[:, 0], states, None)  # a strided gradient
    assert not multi_tensor.eligible(param, torch.zeros(65)[1:], states, None)  # address 4 bytes past 16
    codes = (states[0], torch.zeros(64, dtype=torch.uint8), states[2], states[3])
    assert not multi_tensor.eligible(param, torch.zeros(64), codes, None)  # 8-bit states
    assert not multi_tensor.available(torch.device("cpu"))  # by default only on CUDA


def test_default_on_the_cpu_is_the_per_tensor_path():
    before = multi_tensor.COUNTERS.launches
    param = torch.nn.Parameter(torch.ones(1 << 16))
    opt = DualOptimPlus([param], lr=1e-3)
    param.grad = torch.ones_like(param)
    opt.step(objective="forget")
    assert multi_tensor.COUNTERS.launches == before
    assert (param < 1).all()


def test_the_functional_form_with_foreach_runs_the_multi_tensor_kernel_and_equals_the_optimizers_step(runs):
    """`dualoptim_plus(..., foreach=True)` names the multi-tensor implementation and launches once per call;
    foreach=False names the compiled one and launches nothing; both end on the bits of `DualOptimPlus` with
    multi_tensor=True on the same problem."""
    functional, stepped = runs["functional"], runs["float32-plain-safeguarded"][True]
    steps = len(stepped["steps"])
    assert functional[True]["implementations"] == ["multi_tensor"] * steps and functional[True]["launches"] == steps
    assert functional[False]["implementations"] == ["compiled"] * steps and functional[False]["launches"] == 0
    for multi, single, expected in zip(functional[True]["params"], functional[False]["params"], stepped["params"],
                                       strict=True):
        assert torch.equal(multi, expected.detach()) and torch.equal(single, expected.detach())
