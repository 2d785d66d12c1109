"""The compute side of an evaluation: the matmul floor of the tokens it pushed through the model, and the CPU
linear layers that run it at the machine's matmul rate.

A decoder's forward pass costs about 2 x parameters floating-point operations per token in its matrix products
(attention's score products and the softmax are left out: small next to them at these lengths). Over the rate
this machine reaches on one large matrix product of the model's dtype, measured in the same run, that is the
least time the evaluation could take; `wall / floor` says how far the evaluation is from it. Absolute times
differ between machines; the ratio travels.

On CPU, torch's `nn.Linear` calls MKL's sgemm on the weight as stored. At a model's evaluation shapes (a decoding
batch of 64 rows times a 576 x 49152 output layer, say) that runs at about half the machine's large-product rate,
where oneDNN's linear on a weight reordered once for it runs near the full rate. `packed_linears` swaps every
plain `nn.Linear` of a CPU model for the packed oneDNN product for the length of an evaluation.

oneDNN's packed product is not available for every dtype on every CPU: its bfloat16 path needs AVX-512 (BW, VL,
DQ) or AVX-NE-CONVERT, which most laptops and many cloud CPUs (AVX2 only) lack. `packing_unsupported` decides
once per process and dtype, by packing and multiplying a small tensor of that dtype, and the layers keep their
own forward where it cannot run; the record and the report say which kernel ran and why.

The floor is over the fastest product kernel measured, since a floor that the evaluation can beat is none (on
CPUs where oneDNN's packed linear runs at twice MKL's rate, a floor over torch's matmul is one the evaluation
beats). The record keeps the ratio over torch's matmul beside it.

`peak_memory_gb` is the process's peak memory as a run's report and an evaluation's record give it; it sits here,
below the engine, so that both the evaluation and the training loop read the same measure.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from doplus_cli.progress import TokenCount

# DOPLUS_ONEDNN=0 keeps torch's own linear layers (MKL) in evaluations on CPU.
ONEDNN_VARIABLE = "DOPLUS_ONEDNN"
ONEDNN_KERNEL = "oneDNN packed linear"
TORCH_LINEAR = "torch nn.Linear"
PACKED_DTYPES = (torch.float32, torch.bfloat16)

log = logging.getLogger(__name__)

# dtype -> None (oneDNN's packed product runs here) or the reason it does not; filled once per process by
# `packing_unsupported`. A test may set an entry to force an answer.
PACKING_VERDICTS: dict[torch.dtype, str | None] = {}


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's packed linear (x86 CPU builds do) and DOPLUS_ONEDNN is not 0."""
    if os.environ.get(ONEDNN_VARIABLE, "1").strip() == "0" or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


def packing_unsupported(dtype: torch.dtype) -> str | None:
    """None where oneDNN's packed linear runs for `dtype` in this process, else why not, in one line.

    Decided once per process and dtype by packing and multiplying a small tensor of that dtype: the build may lack
    the op, and a CPU may lack the instructions a dtype's path needs (bfloat16 needs AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT; torch raises a RuntimeError when it is asked anyway). The answer does not depend on the
    DOPLUS_ONEDNN switch, which `onednn_linear_available` reads."""
    if dtype not in PACKING_VERDICTS:
        PACKING_VERDICTS[dtype] = _probe_packing(dtype)
        if PACKING_VERDICTS[dtype] is not None:
            log.warning("doplus: linear layers in %s run as %s: %s", str(dtype).removeprefix("torch."), TORCH_LINEAR,
                        PACKING_VERDICTS[dtype])
    return PACKING_VERDICTS[dtype]


def _probe_packing(dtype: torch.dtype) -> str | None:
    name = str(dtype).removeprefix("torch.")
    if dtype not in PACKED_DTYPES:
        return f"oneDNN's packed linear takes float32 and bfloat16 weights, not {name}"
    if not torch.backends.mkldnn.is_available() or not all(
            hasattr(torch.ops.mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise")):
        return "this torch build has no oneDNN packed linear"
    try:
        with torch.no_grad():
            weight = torch.ones(8, 16, dtype=dtype)
            out = packed_linear(pack(weight, 4), None, torch.ones(4, 16, dtype=dtype))
    except (RuntimeError, NotImplementedError) as error:
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return f"oneDNN's {name} packed linear cannot run on this CPU ({first_line})"
    if out.shape != (4, 8) or not bool((out == 16).all()):  # 16 products of ones, exact in both dtypes
        return f"oneDNN's {name} packed linear gave a wrong product on this CPU"
    return None


def packing_blocked(dtype: torch.dtype) -> str | None:
    """None where an evaluation's linear layers of `dtype` run packed here, else why not: the DOPLUS_ONEDNN switch
    or a build without oneDNN, one process of several (the packed copies would not follow sharded weights), or
    this CPU (`packing_unsupported`). The one decision `packed_linears`, `matmul_gflops` and the record share."""
    if not onednn_linear_available():
        return f"{ONEDNN_VARIABLE}=0 or no oneDNN in this build"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "one process of several"
    return packing_unsupported(dtype)


def linear_kernel(model: torch.nn.Module | None) -> dict[str, str | None] | None:
    """Which kernel an evaluation's linear layers ran on and why, for the compute record: {"kernel", "dtype",
    "reason"} (reason None where the packed product ran); None for no model or one off the CPU."""
    parameter = next(model.parameters(), None) if model is not None else None
    if parameter is None or parameter.device.type != "cpu":
        return None
    reason = packing_blocked(parameter.dtype)
    return {"kernel": TORCH_LINEAR if reason else ONEDNN_KERNEL, "dtype": str(parameter.dtype).removeprefix("torch."),
            "reason": reason}


def pack(weight: torch.Tensor, rows: int = 64) -> torch.Tensor:
    """The weight reordered once for oneDNN (the row count is a hint; any number of rows runs)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def packed_linear(packed: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packable(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module) is torch.nn.Linear and type(weight) is torch.nn.Parameter and weight.device.type == "cpu"
            and weight.dtype in PACKED_DTYPES and "forward" not in vars(module))


@contextmanager
def packed_linears(model: torch.nn.Module | None) -> Iterator[int]:
    """For the block: every plain `nn.Linear` of a CPU model (float32 or bfloat16) computes with its weight
    packed for oneDNN; yields how many layers were swapped (0: none, e.g. on CUDA, or wherever `packing_blocked`
    gives a reason: DOPLUS_ONEDNN=0, torch.distributed, a CPU that cannot run the packed product for the layers'
    dtype). The packed copies are snapshots, so the block must not change the weights, and they carry no gradient:
    for inference only. Each layer's own forward is back on exit."""
    swapped: list[torch.nn.Module] = []
    if model is not None:
        seen: dict[int, torch.Tensor] = {}  # a weight shared by several layers packs once
        for module in model.modules():
            if not _packable(module) or packing_blocked(module.weight.dtype) is not None:
                continue
            weight = module.weight
            if id(weight) not in seen:
                seen[id(weight)] = pack(weight)
            packed = seen[id(weight)]
            bias = module.bias.detach() if module.bias is not None else None
            module.forward = lambda x, packed=packed, bias=bias: packed_linear(packed, bias, x)
            swapped.append(module)
            _PACKED[module] = module.forward
    try:
        yield len(swapped)
    finally:
        for module in swapped:
            del module.forward
            _PACKED.pop(module, None)


# The layers `packed_linears` has swapped now, with their packed forward (`own_forwards` lends them their own).
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@contextmanager
def own_forwards(model: torch.nn.Module) -> Iterator[int]:
    """Inside a `packed_linears` block, for what needs gradients (GradNorm's backward pass): the layers of `model`
    compute with their own weights again, and their packed forward is back on exit. Yields how many layers."""
    lent = [module for module in model.modules() if module in _PACKED]
    for module in lent:
        del module.forward
    try:
        yield len(lent)
    finally:
        for module in lent:
            module.forward = _PACKED[module]


MATMUL_START = 256  # the first size `matmul_gflops` tries; it doubles from here up to its `size`


def _product_size(dtype: torch.dtype, device, largest: int, seconds: float, sync) -> int:
    """The size `matmul_gflops` times at: doubled from MATMUL_START while torch's product at the next size would
    take at most half of `seconds` (estimated from the size before, which costs an eighth as much), up to
    `largest`. A kernel of tens of GFLOP/s gets `largest` (2048); a slow one (bfloat16 on a CPU without native
    bfloat16 arithmetic, about 1 GFLOP/s a core) gets a size whose product takes a fraction of a second
    instead of one of 17 GFLOP, which would hold every `doplus evaluate` there for over a minute."""
    size = min(MATMUL_START, largest)
    while size < largest:
        a = torch.randn(size, size, device=device).to(dtype)
        a @ a  # warm-up: the first product of a size pays for its kernel's set-up
        sync()
        started = time.perf_counter()
        a @ a
        sync()
        if 8 * (time.perf_counter() - started) > seconds / 2:
            break
        size = min(2 * size, largest)
    return size


@torch.no_grad()
def matmul_gflops(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", size: int = 2048,
                  seconds: float = 1.0) -> dict[str, float]:
    """GFLOP/s of square matrix products in `dtype` on `device` by kernel, each the best of repeated timings
    over about `seconds` (one warm-up product first): "matmul" (torch's, the floor's rate) and on CPU, where the
    evaluation packs its linear layers (`packed_linears`) and this CPU runs the packed product in `dtype`,
    "oneDNN packed linear". The products are `size` x `size` where torch's takes at most half of `seconds`, and
    smaller where it is slower (`_product_size`)."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    size = _product_size(dtype, device, size, seconds, sync)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    kernels = {"matmul": lambda: a @ b}
    if torch.device(device).type == "cpu" and dtype in PACKED_DTYPES and packing_blocked(dtype) is None:
        packed = pack(b.t().contiguous(), size)
        kernels[ONEDNN_KERNEL] = lambda: packed_linear(packed, None, a)
    rates = {}
    for name, product in kernels.items():
        product()
        sync()
        best, spent = float("inf"), 0.0
        while spent < seconds:
            started = time.perf_counter()
            product()
            sync()
            elapsed = time.perf_counter() - started
            best, spent = min(best, elapsed), spent + elapsed
        rates[name] = 2 * size**3 / best / 1e9
    return rates


def peak_memory_gb(device: torch.device) -> tuple[float, str]:
    """(peak memory in GB, what was measured): CUDA peak allocated, or the process's peak RSS on CPU. A run's report
    and an evaluation's compute section both give it."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9, "cuda_max_allocated"
    import resource

    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss_kb * 1024 / 1e9, "process_peak_rss"


def compute_floor(tokens: TokenCount, parameters: int, rates: dict[str, float], wall_s: float, dtype: str,
                  packed_layers: int = 0, decode_calls: int = 0, fallbacks: dict[str, str] | None = None,
                  linear: dict[str, str | None] | None = None) -> dict[str, Any]:
    """The floor's figures for eval.json: tokens by kind, parameters, the measured rates, floor and wall seconds,
    how many linear layers ran packed for oneDNN, how many one-token attention calls ran the compiled decoding
    kernel (`decoding.py`; per layer and step), the compiled kernels that fell back to eager code, and which kernel
    the linear layers ran on and why (`linear_kernel`). `floor_s` and
    `ratio` are over the fastest kernel measured (`floor_kernel`: oneDNN's packed linear where it is faster than
    torch's matmul); `matmul_floor_s` and `matmul_ratio` over torch's matmul."""
    work = 2 * parameters * tokens.total
    kernel = max(rates, key=rates.get)
    floor_s, matmul_floor_s = work / (rates[kernel] * 1e9), work / (rates["matmul"] * 1e9)
    return {"tokens": {"prompt": tokens.prompt, "generated": tokens.generated,
                       "teacher_forced": tokens.teacher_forced, "total": tokens.total},
            "parameters": parameters, "kernel_gflops": dict(rates), "floor_kernel": kernel,
            "matmul_gflops": rates["matmul"], "matmul_dtype": dtype,
            "packed_linear_layers": packed_layers, "decode_attention_calls": decode_calls,
            "eager_fallbacks": dict(fallbacks or {}), "linear_kernel": linear, "floor_s": floor_s, "wall_s": wall_s,
            "ratio": wall_s / floor_s if floor_s > 0 else None, "matmul_floor_s": matmul_floor_s,
            "matmul_ratio": wall_s / matmul_floor_s if matmul_floor_s > 0 else None}


def floor_line(compute: dict[str, Any]) -> str:
    """One line for report.md and the console."""
    tokens = compute["tokens"]
    kernel = compute.get("floor_kernel", "matmul")
    named = f"{compute['matmul_dtype']} {kernel}, " + (
        "the fastest product measured in this run" if kernel != "matmul" else "measured in this run")
    line = (f"Compute floor: {tokens['total']:,} tokens through the model ({tokens['prompt']:,} prompt, "
            f"{tokens['generated']:,} generated, {tokens['teacher_forced']:,} teacher-forced) x 2 x "
            f"{compute['parameters'] / 1e6:.1f}M parameters over {compute['kernel_gflops'][kernel]:.0f} GFLOP/s "
            f"({named}) = {compute['floor_s']:.1f} s; wall {compute['wall_s']:.1f} s, model load included"
            + (f": {compute['ratio']:.2f}x the floor." if compute["ratio"] is not None else "."))
    if kernel != "matmul" and compute.get("matmul_ratio") is not None:
        line += (f" Over torch's matmul ({compute['matmul_gflops']:.0f} GFLOP/s): floor "
                 f"{compute['matmul_floor_s']:.1f} s, {compute['matmul_ratio']:.2f}x.")
    if compute.get("packed_linear_layers"):
        line += f" {compute['packed_linear_layers']} linear layers ran on oneDNN with packed weights."
    linear = compute.get("linear_kernel") or {}
    if linear.get("reason"):
        line += f" The linear layers ran as {linear['kernel']} ({linear['dtype']}): {linear['reason']}."
    if compute.get("decode_attention_calls"):
        line += (f" {compute['decode_attention_calls']:,} one-token attention calls (per layer and decoding step) "
                 "ran the compiled decoding kernel on in-place KV buffers.")
    for name, reason in (compute.get("eager_fallbacks") or {}).items():
        line += f" The {name} kernel ran as eager code: compiling it failed ({reason})."
    if compute.get("peak_memory_gb") is not None:
        what = {"process_peak_rss": "the process's peak RSS",
                "cuda_max_allocated": "torch's maximum allocated"}.get(compute.get("peak_memory_kind"), "")
        line += f" Peak memory {compute['peak_memory_gb']:.2f} GB" + (f" ({what})." if what else ".")
    return line
