"""Every compiled kernel of doplus really compiles and runs compiled, and a failed compile falls back for
users and says so once in the report.

The suite sets DOPLUS_REQUIRE_COMPILED=1 (conftest.py): a kernel whose compile fails raises in every test
that reaches it, instead of silently running the eager code the "fused equals reference" tests compare with.
Here each kernel is driven through its public caller and must (a) have run its compiled code, (b) hold a
dynamo cache entry for its function (what torch.compile produced), and (c) give the eager function's
numbers. The Muon rule has no compiled kernel (Newton–Schulz runs as torch's own eager matrix products); the
list of kernels is checked whole, so a new kernel without a test here fails.
"""

from __future__ import annotations

import importlib
import json
import logging
import pkgutil

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

import doplus_cli.optim
from doplus_cli import decoding
from doplus_cli.engine import outputs
from doplus_cli.optim import DualOptimPlus, diagnostics, kernels, quant

for _module in pkgutil.iter_modules(doplus_cli.optim.__path__):  # every module that may define a kernel
    if _module.name != "_multi_tensor_kernel":  # Triton source, imported only where Triton is installed
        importlib.import_module(f"doplus_cli.optim.{_module.name}")
# outside doplus_cli.optim: the decoding steps' one-token attention (imported above)
NAMES = [kernel.name for kernel in kernels.KERNELS]

SIZE = 2 * quant.MIN_8BIT_SIZE + 300  # above the fused and 8-bit thresholds, with a short last 256-block


def _step_doplus(bits: int) -> None:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(SIZE))
    opt = DualOptimPlus([param], lr=1e-2, state_bits=bits, fused=True, rule="paper")
    for objective in ("forget", "retain", "forget"):
        param.grad = torch.randn(SIZE)
        opt.step(objective=objective)
    if bits == 8:
        state = opt.state[param]
        assert all(s[name].dtype == torch.uint8 for s in (state, *state["delta"].values())
                   for name in ("exp_avg", "exp_avg_sq")), "the 8-bit run created no 8-bit state"


def _step_diagnostics() -> None:
    n = 1 << 16  # the size from which the diagnostics use their compiled kernel
    torch.manual_seed(0)
    theta, m, v = torch.randn(n), torch.randn(n) * 1e-3, torch.rand(n) * 1e-6
    group = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}
    compiled = diagnostics.adam_update_stats(theta, m, v, 3, group, 1e-3)
    hp = torch.tensor([1 / (1 - 0.9**3), 1 / (1 - 0.95**3), 1e-8, 1e-3, 0.01, 1 / (1 - 1e-5)])
    eager = diagnostics._adam_ratio_stats(theta, m, v, hp)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-6, atol=0)
    assert compiled[1] == eager[1]


def _step_adamw() -> None:
    from doplus_cli.optim.adamw import AdamW  # the bf16-compensated AdamW of `--precision bf16`

    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        param = torch.nn.Parameter(torch.randn(SIZE, dtype=dtype))
        opt = AdamW([param], lr=1e-2, fused=True)
        for _ in range(2):
            param.grad = torch.randn(SIZE, dtype=dtype)
            opt.step()


def _decode_attention() -> None:
    torch.manual_seed(0)
    buffer = torch.randn(2, 2, 20, 8)
    query, key, value = torch.randn(2, 2, 3, 8), buffer[:, :, :13], buffer.flip(0)[:, :, :13]
    mask = torch.ones(2, 1, 1, 13, dtype=torch.bool)
    mask[0, ..., :4] = False
    compiled = decoding.KERNEL(query, key, value, mask, 8 ** -0.5)
    torch.testing.assert_close(compiled, decoding.attention(query, key, value, mask, 8 ** -0.5),
                               rtol=1e-5, atol=1e-6)


DRIVERS = {
    "decode attention": _decode_attention,
    "DualOptim+ AdamW": lambda: _step_doplus(32),
    "DualOptim+ AdamW 8-bit": lambda: _step_doplus(8),
    "AdamW step diagnostics": _step_diagnostics,
    "AdamW": _step_adamw,
}


def test_every_compiled_kernel_has_a_test_here():
    assert NAMES and set(NAMES) <= set(DRIVERS), set(NAMES) - set(DRIVERS)
    assert {"DualOptim+ AdamW", "DualOptim+ AdamW 8-bit", "AdamW step diagnostics", "decode attention"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_kernel_really_compiled(name):
    (kernel,) = [k for k in kernels.KERNELS if k.name == name]
    before = kernel.compiled_calls
    DRIVERS[name]()
    assert kernel.fallback_reason is None
    assert kernel.compiled_calls > before, f"the {name} kernel's caller never ran its compiled code"
    assert _debug_get_cache_entry_list(kernel._fn.__code__), f"dynamo holds no compiled code for {name}"


def _breaks_the_graph(x):
    torch._dynamo.graph_break()  # a no-op in eager code; fullgraph=True refuses it
    return x * 2


def test_a_failed_compile_falls_back_once_for_users_and_raises_in_the_suite(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "KERNELS", [])  # this kernel's failure stays out of every other test's report
    kernel = kernels.CompiledKernel(_breaks_the_graph, "stand-in")
    with pytest.raises(Exception, match="graph_break|graph break"):  # the suite's setting
        kernel(torch.ones(3))
    assert kernel.fallback_reason is None and kernels.fallbacks() == {}

    monkeypatch.delenv(kernels.REQUIRE_COMPILED_ENV)  # a user's run
    with caplog.at_level(logging.WARNING, logger="doplus_cli.optim.kernels"):
        for _ in range(3):
            assert torch.equal(kernel(torch.ones(3)), torch.full((3,), 2.0))
    said = [r.getMessage() for r in caplog.records if r.name == "doplus_cli.optim.kernels"]
    assert len(said) == 1 and "stand-in kernel failed" in said[0] and "\n" not in said[0], said
    assert kernel.compiled_calls == 0 and list(kernels.fallbacks()) == ["stand-in"]
    assert "\n" not in kernels.fallbacks()["stand-in"]


def test_the_report_says_once_which_kernel_fell_back(monkeypatch, tmp_path):
    env = outputs.environment(torch.device("cpu"), 1, 2, 0, "float32")
    assert not any("eager code" in line for line in outputs.environment_lines(env))  # nothing fell back
    monkeypatch.setattr(kernels, "KERNELS", [])
    monkeypatch.delenv(kernels.REQUIRE_COMPILED_ENV)
    kernels.CompiledKernel(_breaks_the_graph, "stand-in")(torch.ones(2))
    outputs.write_report(tmp_path, {"environment": env}, render=lambda r: "\n".join(outputs.environment_lines(
        r["environment"])))
    lines = (tmp_path / "report.md").read_text().splitlines()
    said = [line for line in lines if "stand-in kernel failed to compile" in line]
    assert len(said) == 1 and "eager code" in said[0]
    assert list(json.loads((tmp_path / "report.json").read_text())["environment"]["eager_fallbacks"]) == ["stand-in"]


def test_compiling_a_kernel_raises_dynamos_recompile_limit():
    """One kernel compiles once per dtype and compensation combination, more than dynamo's default 8 (past
    which a process silently runs eager code, or fails under $DOPLUS_REQUIRE_COMPILED=1 depending on test order)."""
    import torch._dynamo.config as dynamo_config

    _step_doplus(32)
    assert dynamo_config.recompile_limit >= kernels.RECOMPILE_LIMIT == 32


def test_the_report_says_when_the_multi_tensor_kernel_fell_back(monkeypatch, tmp_path, caplog):
    """On CUDA a failed multi-tensor launch (no compiler for the GPU, say) leaves the per-tensor kernels running:
    logged once, in the report's environment, and raised under $DOPLUS_REQUIRE_COMPILED=1."""
    from doplus_cli.optim import multi_tensor

    with pytest.raises(RuntimeError, match="no ptxas"):
        multi_tensor.disable(RuntimeError("no ptxas"))
    assert multi_tensor.COUNTERS.fallback_reason is None
    monkeypatch.delenv(kernels.REQUIRE_COMPILED_ENV)
    monkeypatch.setattr(multi_tensor, "COUNTERS", multi_tensor.Counters())
    with caplog.at_level(logging.WARNING, logger="doplus_cli.optim.multi_tensor"):
        multi_tensor.disable(RuntimeError("no ptxas\nmore lines"))
    assert not multi_tensor.available(torch.device("cuda"))  # from now on the per-tensor path
    assert multi_tensor.fallbacks() == {multi_tensor.NAME: "RuntimeError: no ptxas"} and kernels.fallbacks() == {}
    env = outputs.environment(torch.device("cpu"), 1, 2, 0, "float32")
    outputs.write_report(tmp_path, {"environment": env}, render=lambda r: "\n".join(outputs.environment_lines(
        r["environment"])))
    said = [line for line in (tmp_path / "report.md").read_text().splitlines() if "multi-tensor" in line]
    assert len(said) == 1 and "the per-tensor kernels ran" in said[0] and "eager" not in said[0]
    assert len([r for r in caplog.records if r.name == "doplus_cli.optim.multi_tensor"]) == 1
