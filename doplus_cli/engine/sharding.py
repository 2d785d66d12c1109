"""FSDP (full shard) for `doplus unlearn --fsdp` on several processes, with PyTorch's FSDP2 (`fully_shard`).

Each decoder block (the classes a Hugging Face model lists in `_no_split_modules`) and then the whole model
become FSDP units: parameters, gradients and, because DualOptim+'s states are created like their parameters,
every optimizer state are DTensors of which each process holds one shard. The optimizer's elementwise rule
runs on those shards as it is; the full weights exist only inside a forward or backward pass, and once more
at the end, gathered to write final/.
"""

from __future__ import annotations

import torch

from doplus_cli.errors import UserError


def shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """Apply `fully_shard` to every decoder block, then to the model; return the model (changed in place)."""
    from torch.distributed.fsdp import fully_shard

    block_names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise UserError(f"--fsdp: {type(model).__name__} names no decoder block class (_no_split_modules) to shard")
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the (sharded) gradients to `max_norm` in total and return the total norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)
    full = getattr(norm, "full_tensor", None)
    return float(full() if callable(full) else norm)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full weights on the CPU (a collective: every process must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
