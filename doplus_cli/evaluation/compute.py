"""The compute floor of an evaluation: the matmul time of the tokens it pushed through the model.

A decoder's forward pass costs about 2 x parameters floating-point operations per token in its matrix products
(attention's score products and the softmax are left out: small next to them at these lengths). Over the rate
this machine reaches on one large matrix product of the model's dtype, measured in the same run, that is the
least time the evaluation could take; `wall / floor` says how far the evaluation is from it. Absolute times
differ between machines (CPUs measured here: 206 to 306 GFLOP/s in float32); the ratio travels.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from doplus_cli.progress import TokenCount


@torch.no_grad()
def matmul_gflops(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", size: int = 2048,
                  seconds: float = 1.0) -> float:
    """GFLOP/s of `size` x `size` matrix products in `dtype` on `device`, the best of repeated timings over about
    `seconds` (one warm-up product first)."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    a @ b
    sync()
    best, spent = float("inf"), 0.0
    while spent < seconds:
        started = time.perf_counter()
        a @ b
        sync()
        elapsed = time.perf_counter() - started
        best, spent = min(best, elapsed), spent + elapsed
    return 2 * size**3 / best / 1e9


def compute_floor(tokens: TokenCount, parameters: int, gflops: float, wall_s: float, dtype: str) -> dict[str, Any]:
    """The floor's figures for eval.json: tokens by kind, parameters, the measured rate, floor and wall seconds."""
    floor_s = 2 * parameters * tokens.total / (gflops * 1e9)
    return {"tokens": {"prompt": tokens.prompt, "generated": tokens.generated,
                       "teacher_forced": tokens.teacher_forced, "total": tokens.total},
            "parameters": parameters, "matmul_gflops": gflops, "matmul_dtype": dtype, "floor_s": floor_s,
            "wall_s": wall_s, "ratio": wall_s / floor_s if floor_s > 0 else None}


def floor_line(compute: dict[str, Any]) -> str:
    """One line for report.md and the console."""
    tokens = compute["tokens"]
    return (f"Compute floor: {tokens['total']:,} tokens through the model ({tokens['prompt']:,} prompt, "
            f"{tokens['generated']:,} generated, {tokens['teacher_forced']:,} teacher-forced) x 2 x "
            f"{compute['parameters'] / 1e6:.1f}M parameters over {compute['matmul_gflops']:.0f} GFLOP/s "
            f"({compute['matmul_dtype']} matmul, measured in this run) = {compute['floor_s']:.1f} s; "
            f"wall {compute['wall_s']:.1f} s, model load included"
            + (f": {compute['ratio']:.2f}x the floor." if compute["ratio"] is not None else "."))
