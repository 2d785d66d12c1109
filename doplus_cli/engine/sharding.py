"""FSDP (full shard) across processes, with PyTorch's FSDP2 as accelerate applies it.

A run is sharded when `doplus unlearn --fsdp` asks for it or when `accelerate launch` was given an FSDP
configuration (`recipes/cluster/accelerate_fsdp.yaml`). accelerate's `fsdp2_prepare_model` wraps the
model as that configuration says (by default: each decoder block, the classes a Hugging Face model lists
in `_no_split_modules`, then the whole model): parameters and gradients become DTensors of which each
process holds one shard. The optimizer is built afterwards and keeps states for its shards only (see
`engine/optimizers.py`); the full weights exist only inside a forward or backward pass, and once more at
the end, gathered to write final/.
"""

from __future__ import annotations

import os

import torch

from doplus_cli.errors import UserError


def launcher_says_fsdp() -> bool:
    """Whether `accelerate launch` was given an FSDP config (it sets ACCELERATE_USE_FSDP for its processes); known
    before any Accelerator exists."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def launched_with_fsdp(accelerator) -> bool:
    """`accelerate launch` was given an FSDP configuration (on CPU, accelerate leaves the process type
    MULTI_CPU and only the launcher's environment says so)."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP or launcher_says_fsdp()


def fsdp_plugin(accelerator):
    """The FSDP settings: the launcher's configuration, or FSDP2 full shard per decoder block for `--fsdp`."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None and launcher_says_fsdp():
        plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables the launcher set
    if plugin is None:
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, reshard_after_forward=True, auto_wrap_policy="transformer_based_wrap"
        )
    if plugin.fsdp_version != 2:
        raise UserError(f"FSDP version {plugin.fsdp_version} in the accelerate configuration: doplus shards with "
                        "FSDP2 (set fsdp_version: 2, as recipes/cluster/accelerate_fsdp.yaml does)")
    return plugin


def shard_model(accelerator, model: torch.nn.Module, mixed_precision: bool = False) -> torch.nn.Module:
    """Shard `model` across the processes with accelerate's FSDP2 preparation; return the sharded model.

    `mixed_precision` (`--precision bf16-mixed`): FSDP2's mixed-precision policy, the shards kept in their
    own dtype (float32 master weights), gathered and computed in bf16, gradients reduced in float32.

    Under LoRA the causal LM inside the peft wrapper becomes the FSDP root: `generate` calls that model's
    forward directly, and only a root's forward gathers the weights outside the decoder blocks."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    if not getattr(model, "_no_split_modules", None):
        raise UserError(f"FSDP: {type(model).__name__} names no decoder block class (_no_split_modules) to shard")
    accelerator.state.fsdp_plugin = fsdp_plugin(accelerator)
    if mixed_precision:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        accelerator.state.fsdp_plugin.mixed_precision_policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    get_base_model = getattr(model, "get_base_model", None)
    if callable(get_base_model):  # a peft model: shard the model it wraps, in place
        fsdp2_prepare_model(accelerator, get_base_model())
        return model
    return fsdp2_prepare_model(accelerator, model)


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the (sharded) gradients to `max_norm` in total and return the total norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)
    full = getattr(norm, "full_tensor", None)
    return float(full() if callable(full) else norm)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full weights on the CPU (a collective: every process must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def gather_step_diagnostics(diagnostics: dict[str, float], device: torch.device) -> dict[str, float]:
    """A sharded step's diagnostics over every process's shard: the largest step, the total count."""
    import torch.distributed as dist

    largest = torch.tensor([diagnostics["max_update"]], dtype=torch.float64, device=device)
    count = torch.tensor([diagnostics["big_updates"]], dtype=torch.int64, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    dist.all_reduce(count, op=dist.ReduceOp.SUM)
    return {"max_update": float(largest), "big_updates": int(count)}
