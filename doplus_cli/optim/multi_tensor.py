"""The DualOptim+ AdamW rule, and the AdamW step diagnostics, over every tensor of a step in one Triton kernel
launch each (CUDA).

Why: the compiled per-tensor kernel (`kernels.adamw_plus_fused`) is one pass over memory, but each call costs
~0.1–0.2 ms of host time on CUDA (dynamo's guards, the launch, the diagnostics' reductions). Measured on an
H200 with 1B parameters in 218 tensors: 51.5 ms per step against 8.7 ms for torch's fused AdamW, of which the
GPU was busy 18 ms; the step was host-bound. torch's fused AdamW avoids this with a multi-tensor kernel (one
launch for many tensors); this is the same for the DualOptim+ rule.

How: the host writes one int64 table per launch: for each tensor the element offsets of θ, g, m_B, v_B, m_k,
v_k (and the bf16 compensation buffer c) from one aligned base tensor per array (the kernel's comment says why),
its length and its row in a matrix of scalars (one row of
`AdamWPlusScalars.packed()` per distinct learning rate, weight decay, t_B and t_k: param groups and tensors
that skipped steps share a launch). A program of the kernel updates one tile of `TILE` elements of one tensor
(a second, cached table maps program → tensor, first element), so a step makes one launch per weight and
gradient dtype (usually one) and per `FLUSH_NUMEL` elements, plus three small reductions for the diagnostics
each, and no host sync. The diagnostics kernel reads θ, m and v of torch's AdamW the same way
(`diagnostics.adamw_step_stats`).

The arithmetic is `kernels._adamw_plus_math` line for line, in float32 (states are float32), with the same
compensated read and write for bf16 weights (`kernels.py`). On a GPU the compiler contracts a·b + c into fused
multiply-adds (as the compiled per-tensor kernel does), so results differ from the eager reference in the
last bit; under Triton's interpreter (`TRITON_INTERPRET`-style, on CPU tensors: how the tests run this kernel
without a GPU) each operation rounds as in eager PyTorch.

Used when Triton imports and every state of the tensor is float32 (not 8-bit, not float64), the weight is
float32, bf16 or fp16, θ and g are contiguous and every address is 16-byte aligned (so loads vectorize);
anything else takes the per-tensor path unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor

from doplus_cli.optim.kernels import BIG_UPDATE, REQUIRE_COMPILED_ENV

log = logging.getLogger(__name__)

TILE = 4096  # elements per program
# A step launches the kernel each time this many elements are ready, so the GPU works on the first tensors while
# the host prepares the next ones (~10 µs of Python per tensor): on 1B parameters, ~15 launches of ~1 ms each.
FLUSH_NUMEL = 1 << 26
BLOCK = 1024  # elements per loop iteration of a program
NUM_WARPS = 8  # 4 elements of each array per thread and loop iteration: one 16-byte load each
ALIGN = 16  # bytes: every address in the table is a multiple of this
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class Counters:
    """What the multi-tensor path did in this process (tests check that it ran; `doplus bench` reports it)."""

    launches: int = 0
    tensors: int = 0
    by_kernel: dict[str, int] = field(default_factory=dict)  # launches per kernel


COUNTERS = Counters()


@functools.cache
def _triton():
    """(triton, triton.language), or None when Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    return triton, tl


def triton_installed() -> bool:
    return _triton() is not None


def available(device: torch.device) -> bool:
    """Whether the multi-tensor kernel runs on `device` by default: a CUDA device with Triton installed (an
    optimizer's `MultiTensorKernel.available` also asks whether its own launches failed). The tests force it on
    CPU tensors through Triton's interpreter with `multi_tensor=True`."""
    return device.type == "cuda" and triton_installed()


def _aligned(tensors: tuple[Tensor, ...], numel: int, device: torch.device) -> bool:
    """Contiguous, `numel` long, on `device`, and starting on a 16-byte boundary (so loads vectorize)."""
    return all(t.is_contiguous() and t.data_ptr() % ALIGN == 0 and t.numel() == numel and t.device == device
               for t in tensors)


def eligible(param: Tensor, grad: Tensor, states: tuple[Tensor, ...], compensation: Tensor | None) -> bool:
    """Whether one tensor can go through the DualOptim+ kernel (module docstring). Called for every tensor of
    every step: plain checks, no allocation."""
    numel = param.numel()
    if numel == 0 or param.dtype not in WEIGHT_DTYPES or grad.dtype not in WEIGHT_DTYPES:
        return False
    if any(state.dtype != torch.float32 for state in states):
        return False
    if compensation is not None and compensation.dtype != torch.bfloat16:
        return False
    tensors = (param, grad, *states) if compensation is None else (param, grad, *states, compensation)
    return _aligned(tensors, numel, param.device)


@functools.cache
def _kernel(name: str, interpret: bool):
    """A jitted kernel of `_multi_tensor_kernel.py`. On CPU tensors (`interpret`) Triton must run as its
    interpreter, which it decides when it is imported (`TRITON_INTERPRET=1` in the environment, as the tests'
    subprocess sets it)."""
    triton, _ = _triton()
    if interpret and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the multi-tensor kernel runs on CPU tensors only under Triton's interpreter: "
                           "set TRITON_INTERPRET=1 before Python starts")
    from doplus_cli.optim import _multi_tensor_kernel

    return triton.jit(getattr(_multi_tensor_kernel, name))


@functools.lru_cache(maxsize=64)  # a model's flushes have a handful of layouts; 3 MB each at 1B parameters
def _tiles(numels: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor]:
    """(tensor index, first element) of every program, for tensors of these lengths; cached per layout."""
    counts = torch.tensor([-(-n // TILE) for n in numels], dtype=torch.int64)
    tensor_of_tile = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), counts)
    starts = torch.cat([torch.arange(0, n, TILE, dtype=torch.int64) for n in numels])
    return tensor_of_tile.to(device), starts.to(device)


def _launch(name: str, entries: list[tuple], rows: list[int], hp: Tensor, **constants) -> tuple[Tensor, Tensor]:
    """Launch kernel `name` over `entries` (tuples of tensors, one per slot; None for an unused slot) with the
    table it reads: per slot the element offsets from that slot's first tensor, then lengths and scalar rows.
    Returns the diagnostics reduced over all programs (largest |Δθ|/η, NaN if any element's was; the number
    of elements above `BIG_UPDATE`) as 0-d tensors on the device, as the per-tensor kernels return them."""
    first = entries[0]
    device = first[0].device
    n, slots = len(entries), len(first)
    # addresses as element offsets from the first tensor of each slot (the kernel's comment says why)
    bases = [first[slot] if first[slot] is not None else first[0] for slot in range(slots)]
    base_addresses = [base.data_ptr() for base in bases]
    sizes = [base.element_size() for base in bases]
    table = [0] * ((slots + 2) * n)
    for i, entry in enumerate(entries):
        for slot in range(slots):
            tensor = entry[slot]
            if tensor is not None:
                table[slot * n + i] = (tensor.data_ptr() - base_addresses[slot]) // sizes[slot]
    numels = tuple(entry[0].numel() for entry in entries)
    table[slots * n:(slots + 1) * n] = numels
    table[(slots + 1) * n:] = rows
    table_tensor = torch.tensor(table, dtype=torch.int64).to(device, non_blocking=True)
    tile_tensor, tile_start = _tiles(numels, device)
    programs = tile_tensor.numel()
    out_max = torch.empty(programs, dtype=torch.float32, device=device)
    out_big = torch.empty(programs, dtype=torch.int32, device=device)
    out_nan = torch.empty(programs, dtype=torch.int32, device=device)
    # Triton launches on the current CUDA device: make it the tensors' (a model spread over several GPUs)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _kernel(name, device.type != "cuda")[(programs,)](
            table_tensor, tile_tensor, tile_start, hp, out_max, out_big, out_nan, n, *bases,
            WEIGHT_VEC=ALIGN // sizes[0], BIG=BIG_UPDATE, TILE=TILE, BLOCK=BLOCK, num_warps=NUM_WARPS, **constants,
        )
    COUNTERS.launches += 1
    COUNTERS.tensors += n
    COUNTERS.by_kernel[name] = COUNTERS.by_kernel.get(name, 0) + 1
    largest = torch.where(out_nan.sum() > 0, torch.nan, out_max.amax())
    return largest, out_big.sum(dtype=torch.int64)


def launch(entries: list[tuple], rows: list[int], hp: Tensor, compensated: bool) -> tuple[Tensor, Tensor]:
    """The DualOptim+ AdamW rule in one launch over `entries`, each (θ, g, m_B, v_B, m_k, v_k, c or None), all
    on one device with one weight dtype and one gradient dtype; tensor i uses row `rows[i]` of `hp`, a float32
    matrix of `AdamWPlusScalars.packed()` rows on the device. Returns the step's diagnostics."""
    return _launch("adamw_plus_multi_tensor_kernel", entries, rows, hp,
                   GRAD_VEC=ALIGN // entries[0][1].element_size(), COMPENSATED=compensated)


def stats_eligible(param: Tensor, m: Tensor, v: Tensor) -> bool:
    """Whether `adam_stats` can take this AdamW state (float32 moments; not bitsandbytes' 8-bit codes)."""
    if param.numel() == 0 or param.dtype not in WEIGHT_DTYPES or m.dtype != torch.float32 or v.dtype != torch.float32:
        return False
    return _aligned((param, m, v), param.numel(), param.device)


def adam_stats(entries: list[tuple[Tensor, Tensor, Tensor]], rows: list[int], hp: Tensor) -> tuple[Tensor, Tensor]:
    """`diagnostics._adam_ratio_stats` over many (θ, m, v) of one device and weight dtype in one launch; tensor i
    uses row `rows[i]` of `hp` ([1/bc1, 1/bc2, ε, η, λ, 1/(1 − ηλ)] per row, float32 on the device)."""
    return _launch("adam_stats_multi_tensor_kernel", entries, rows, hp)


NAME = "multi-tensor (Triton)"  # in a report's list of fallbacks: the per-tensor kernels ran instead


def fallbacks() -> dict[str, str]:
    """{NAME: reason} when a live optimizer's multi-tensor launch failed in this process (its `MultiTensorKernel`;
    several reasons joined by "; "), as `kernels.fallbacks()` lists the compiled kernels that fell back to eager
    code; empty otherwise. A report of what happened, not a switch: each optimizer decides by its own record."""
    reasons = sorted({kernel.fallback_reason for kernel in list(_LIVE) if kernel.fallback_reason is not None})
    return {NAME: "; ".join(reasons)} if reasons else {}


class MultiTensorKernel:
    """One optimizer's use of the multi-tensor kernels, and its record of a failed launch (no compiler for the
    GPU, an unsupported GPU). Each optimizer holds its own: after a failure that optimizer takes the per-tensor
    path from then on, and another optimizer in the same process tries the kernel again."""

    def __init__(self) -> None:
        self.fallback_reason: str | None = None  # why this optimizer uses the per-tensor path, once it does
        _LIVE.add(self)

    def __setstate__(self, state: dict) -> None:  # a copied optimizer's record is listed as well
        self.__dict__.update(state)
        _LIVE.add(self)

    def available(self, device: torch.device) -> bool:
        """Whether the kernel runs on `device` by default for this optimizer: `available(device)`, and no failed
        launch of its own."""
        return self.fallback_reason is None and available(device)

    def failed(self, error: Exception) -> None:
        """After a failed launch: log once and use the per-tensor path from now on; under
        `$DOPLUS_REQUIRE_COMPILED=1` (the tests) raise instead."""
        if os.environ.get(REQUIRE_COMPILED_ENV) == "1":
            raise error
        first_line = (str(error).strip().splitlines() or [""])[0]
        self.fallback_reason = f"{type(error).__name__}: {first_line}" if first_line else type(error).__name__
        log.warning("doplus: the multi-tensor DualOptim+ kernel failed (%s); using the per-tensor kernels.",
                    self.fallback_reason)


# The records of the optimizers alive in this process, for `fallbacks()` (a run's report): held weakly, so an
# optimizer's failure leaves with it.
_LIVE: weakref.WeakSet[MultiTensorKernel] = weakref.WeakSet()
