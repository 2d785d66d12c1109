"""Run under `torch.distributed.run --nproc_per_node 2`: after a DualOptim+ step on an FSDP-sharded tiny
Llama, each process holds only its shard of every optimizer state. Prints one JSON line per process."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from doplus_cli.engine.sharding import shard_model
from doplus_cli.optim import DualOptimPlus


def main(model_dir: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = shard_model(AutoModelForCausalLM.from_pretrained(model_dir))
    optimizer = DualOptimPlus(model.parameters(), lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step(objective="forget")
    full, local = 0, 0
    for param in model.parameters():
        state = optimizer.state[param]
        for tensor in (state["exp_avg"], state["exp_avg_sq"], *state["delta"]["forget"].values()):
            if tensor.ndim == 0:
                continue
            full += tensor.numel()
            local += tensor.to_local().numel()
    print(json.dumps({"rank": dist.get_rank(), "full": full, "local": local}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
