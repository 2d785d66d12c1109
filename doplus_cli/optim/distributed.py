"""The one distributed detail the optimizers and the engine share: a sharded parameter (a DTensor, as FSDP2 makes
it) is read and updated through this process's local shard."""

from __future__ import annotations

from torch import Tensor


def local_shard(tensor: Tensor) -> Tensor:
    """This process's part of a DTensor (a view: updating it updates the parameter); a tensor unchanged."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor
