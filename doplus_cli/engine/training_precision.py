"""Training precision (`--precision`): which dtype the trained weights are kept in, which the
forward and backward compute in, and which the final model is saved in.

    fp32        float32 weights, states and compute (the CPU default)
    bf16-mixed  float32 master weights and optimizer states; forward and backward under bf16 autocast (under
                FSDP: FSDP2's mixed-precision policy, bf16 all-gathers and compute, float32 gradient
                reduction and shards); the CUDA default
    bf16        bf16 weights, float32 optimizer states, and a bf16 compensation buffer per weight that every
                optimizer's update kernel reads and writes (`optim/kernels.py`), so that steps below bf16's
                spacing accumulate instead of rounding away

`--dtype` stays the dtype a model is *loaded* in where the trained weights do not decide it: the reference
model of NPO, DPO and KL, and LoRA's frozen base under bf16-mixed. `auto` precision follows it: bf16-mixed
where the model would load in bf16 (`--dtype auto` on CUDA, `--dtype bfloat16`), fp32 otherwise.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from doplus_cli.models import resolve_dtype

WEIGHT_DTYPES = {"fp32": "float32", "bf16-mixed": "float32", "bf16": "bfloat16"}


def resolve(precision: str, dtype: str, save_dtype: str) -> tuple[str, str]:
    """(precision, save dtype) with `auto` turned into what this run uses (written to config.yaml and the report)."""
    if precision == "auto":
        precision = "bf16-mixed" if resolve_dtype(dtype) == torch.bfloat16 else "fp32"
    if save_dtype == "auto":
        save_dtype = "float32" if precision == "fp32" else "bfloat16"
    return precision, save_dtype


def weights_dtype(precision: str, dtype: str, lora: bool) -> str:
    """The dtype the trained model is loaded in: its weights' dtype (float32 master weights under bf16-mixed;
    with LoRA the frozen base loads at --dtype instead, the adapters being float32 anyway)."""
    if precision == "bf16-mixed" and lora:
        return dtype
    return WEIGHT_DTYPES[precision]


def reference_dtype(precision: str, dtype: str) -> torch.dtype:
    """The frozen reference model's dtype: --dtype under bf16-mixed (bf16 on CUDA: it is never updated),
    else the trained weights' dtype."""
    if precision == "bf16-mixed":
        return resolve_dtype(dtype)
    return resolve_dtype(WEIGHT_DTYPES[precision])


def autocast(precision: str, device: torch.device) -> AbstractContextManager:
    """The context the forward pass and the losses run in: bf16 autocast under bf16-mixed, else nothing."""
    if precision != "bf16-mixed":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def describe(precision: str, save_dtype: str) -> dict[str, str]:
    """The report's `precision` entry: what each part of the run was stored and computed in."""
    compute = "float32" if precision == "fp32" else "bfloat16"
    return {"mode": precision, "weights": WEIGHT_DTYPES[precision], "compute": compute,
            "compensation": "bfloat16 per weight" if precision == "bf16" else "none",
            "saved": save_dtype}
