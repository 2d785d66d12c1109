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

import gc
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


def _step_doplus_unpacked() -> None:
    """The kernel a CUDA tensor's step takes (its four counts reduced apart), called on CPU tensors here."""
    torch.manual_seed(0)
    tensors = [torch.randn(SIZE) for _ in range(6)]
    tensors[3] = tensors[3].abs()
    s = kernels.AdamWPlusScalars(lr=1e-2, weight_decay=0.0, beta1=0.9, beta2=0.95, base_beta1=0.9,
                                 base_beta2=0.95, eps=1e-8, base_step=2, delta_step=1)
    kernels._adamw_plus_compiled(*tensors, s.packed(torch.device("cpu")), None)


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
    "DualOptim+ AdamW": _step_doplus_unpacked,
    "DualOptim+ AdamW (CPU)": lambda: _step_doplus(32),
    "DualOptim+ AdamW 8-bit": lambda: _step_doplus(8),
    "AdamW step diagnostics": _step_diagnostics,
    "AdamW": _step_adamw,
}


def test_every_compiled_kernel_has_a_test_here():
    assert NAMES and set(NAMES) <= set(DRIVERS), set(NAMES) - set(DRIVERS)
    assert {"DualOptim+ AdamW", "DualOptim+ AdamW (CPU)", "DualOptim+ AdamW 8-bit", "AdamW step diagnostics",
            "decode attention"} <= set(NAMES)


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

    kernel = multi_tensor.MultiTensorKernel()
    with pytest.raises(RuntimeError, match="no ptxas"):
        kernel.failed(RuntimeError("no ptxas"))
    assert kernel.fallback_reason is None and multi_tensor.fallbacks() == {}
    monkeypatch.delenv(kernels.REQUIRE_COMPILED_ENV)
    with caplog.at_level(logging.WARNING, logger="doplus_cli.optim.multi_tensor"):
        kernel.failed(RuntimeError("no ptxas\nmore lines"))
    assert not kernel.available(torch.device("cuda"))  # from now on the per-tensor path
    assert multi_tensor.fallbacks() == {multi_tensor.NAME: "RuntimeError: no ptxas"} and kernels.fallbacks() == {}
    env = outputs.environment(torch.device("cpu"), 1, 2, 0, "float32")
    outputs.write_report(tmp_path, {"environment": env}, render=lambda r: "\n".join(outputs.environment_lines(
        r["environment"])))
    said = [line for line in (tmp_path / "report.md").read_text().splitlines() if "multi-tensor" in line]
    assert len(said) == 1 and "the per-tensor kernels ran" in said[0] and "eager" not in said[0]
    assert len([r for r in caplog.records if r.name == "doplus_cli.optim.multi_tensor"]) == 1
    del kernel
    gc.collect()
    assert multi_tensor.fallbacks() == {}  # a record leaves with its optimizer: the next run's report is clean


def test_two_kernel_objects_keep_separate_failure_records(monkeypatch):
    """One kernel whose compile failed runs its eager code from then on; another kernel of the same function in
    the same process compiles and runs compiled. torch.compile is a stand-in here whose first compile fails (a
    compiler missing for a moment, say), so the test costs no real compile."""
    monkeypatch.setattr(kernels, "KERNELS", [])
    monkeypatch.delenv(kernels.REQUIRE_COMPILED_ENV)
    compiles = []

    def compile_stand_in(fn, **options):
        compiles.append(fn)
        if len(compiles) == 1:
            def broken(*args):
                raise RuntimeError("no C++ compiler")
            return broken
        return fn

    monkeypatch.setattr(torch, "compile", compile_stand_in)
    first, second = (kernels.CompiledKernel(_doubles, name) for name in ("first", "second"))
    for _ in range(2):
        for kernel in (first, second):
            assert torch.equal(kernel(torch.ones(3)), torch.full((3,), 2.0))
    assert compiles == [_doubles, _doubles]  # each kernel compiled once; the failed one never again
    assert (first.fallback_reason, first.compiled_calls) == ("RuntimeError: no C++ compiler", 0)
    assert (second.fallback_reason, second.compiled_calls) == (None, 2)
    assert kernels.fallbacks() == {"first": "RuntimeError: no C++ compiler"}


def _doubles(x):
    return x * 2


def test_two_optimizers_keep_separate_multi_tensor_failure_records(monkeypatch):
    """An optimizer whose multi-tensor launch failed takes the per-tensor path from then on (and its numbers
    are the reference's); another optimizer in the same process tries the kernel again. The launch is a
    stand-in that fails (no GPU here), made available on the CPU."""
    from doplus_cli.optim import dualoptim_plus, multi_tensor

    monkeypatch.delenv(kernels.REQUIRE_COMPILED_ENV)
    monkeypatch.setattr(multi_tensor, "available", lambda device: True)
    launches = []

    def failing_launch(entries, rows, hp, compensated):
        launches.append(len(entries))
        raise RuntimeError(f"launch {len(launches)} failed")

    monkeypatch.setattr(multi_tensor, "launch", failing_launch)

    def problem():
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(64)) for _ in range(2)]

    def step(opt, params, objective):
        for i, param in enumerate(params):
            param.grad = torch.full_like(param, 0.1 * (i + 1)) * (1 if objective == "forget" else -1)
        opt.step(objective=objective)

    first, second, reference = problem(), problem(), problem()
    opt_first, opt_second = DualOptimPlus(first, lr=1e-2), DualOptimPlus(second, lr=1e-2)
    opt_reference = DualOptimPlus(reference, lr=1e-2, fused=False)
    for objective in ("forget", "retain", "forget"):
        step(opt_first, first, objective)
        step(opt_reference, reference, objective)
    assert launches == [2]  # one failed launch over both tensors, then the per-tensor path
    assert opt_first.multi_tensor_kernel.fallback_reason == "RuntimeError: launch 1 failed"
    for a, b in zip(first, reference, strict=True):
        assert torch.equal(a, b)  # small tensors: the per-tensor path is the reference rule
    assert opt_second.multi_tensor_kernel.fallback_reason is None  # untouched by the other optimizer's failure
    step(opt_second, second, "forget")
    assert launches == [2, 2]  # it tried the kernel itself
    assert multi_tensor.fallbacks() == {multi_tensor.NAME: "RuntimeError: launch 1 failed; RuntimeError: launch 2 "
                                                           "failed"}
    state = [{"step": torch.tensor(0.0), "exp_avg": torch.zeros(64), "exp_avg_sq": torch.zeros(64)}]
    delta = [dict(step=torch.tensor(0.0), exp_avg=torch.zeros(64), exp_avg_sq=torch.zeros(64))]
    report = dualoptim_plus([first[0].detach()], [torch.ones(64)], state, delta, lr=1e-2, betas=(0.9, 0.95),
                            eps=1e-8, weight_decay=0.0, multi_tensor_kernel=opt_first.multi_tensor_kernel)
    assert report.implementation == "compiled" and launches == [2, 2]  # its record, kept across calls
    del opt_first, opt_second
    gc.collect()
    assert multi_tensor.fallbacks() == {}  # the records leave with their optimizers
