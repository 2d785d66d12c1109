"""Training precision (`--precision`, issue #26): which dtype the trained weights are kept in, which the
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

from doplus_cli.config import TrainConfig
from doplus_cli.models import resolve_dtype

WEIGHT_DTYPES = {"fp32": "float32", "bf16-mixed": "float32", "bf16": "bfloat16"}


def resolve(config: TrainConfig) -> None:
    """Turn `auto` into the precision and save dtype this run uses (written to config.yaml and the report)."""
    if config.precision == "auto":
        config.precision = "bf16-mixed" if resolve_dtype(config.dtype) == torch.bfloat16 else "fp32"
    if config.save_dtype == "auto":
        config.save_dtype = "float32" if config.precision == "fp32" else "bfloat16"


def weights_dtype(config: TrainConfig) -> str:
    """The dtype the trained model is loaded in: its weights' dtype (float32 master weights under bf16-mixed;
    with LoRA the frozen base loads at --dtype instead, the adapters being float32 anyway)."""
    if config.precision == "bf16-mixed" and config.lora_rank > 0:
        return config.dtype
    return WEIGHT_DTYPES[config.precision]


def reference_dtype(config: TrainConfig) -> torch.dtype:
    """The frozen reference model's dtype: --dtype under bf16-mixed (bf16 on CUDA: it is never updated),
    else the trained weights' dtype."""
    if config.precision == "bf16-mixed":
        return resolve_dtype(config.dtype)
    return resolve_dtype(WEIGHT_DTYPES[config.precision])


def autocast(config: TrainConfig, device: torch.device) -> AbstractContextManager:
    """The context the forward pass and the losses run in: bf16 autocast under bf16-mixed, else nothing."""
    if config.precision != "bf16-mixed":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def save_dtype(config: TrainConfig) -> torch.dtype:
    return resolve_dtype(config.save_dtype)


def describe(config: TrainConfig) -> dict[str, str]:
    """The report's `precision` entry: what each part of the run was stored and computed in."""
    compute = "float32" if config.precision == "fp32" else "bfloat16"
    return {"mode": config.precision, "weights": WEIGHT_DTYPES[config.precision], "compute": compute,
            "compensation": "bfloat16 per weight" if config.precision == "bf16" else "none",
            "saved": config.save_dtype}
