"""The update-similarity diagnostic of the paper's Figure 2 (`log_update_similarity`).

After every step of objective k the loop keeps k's latest update Δθ_k = θ_after − θ_before and its latest
(clipped) gradient g_k. Each record then gains

    update_cosine = mean over pairs (a, b) of <Δθ_a, Δθ_b> / (‖Δθ_a‖ ‖Δθ_b‖)
    grad_cosine   = mean over pairs (a, b) of <g_a, g_b> / (‖g_a‖ ‖g_b‖)

over every trainable parameter (products in the weights' dtype, sums in float64); null until every objective
has stepped once, and for joint steps, which do not separate the objectives. The paper's claim: DualOptim's
updates are nearly orthogonal (each objective has its own moments), Alternate's nearly parallel (one shared state),
DualOptim+ in between.

The cost: one copy of the trainable weights (θ_before) plus, per objective, one update and one gradient, in
the weights' dtype. Under FSDP each process keeps its shards and the sums are added across processes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import torch

from doplus_cli.engine.schedule import JOINT
from doplus_cli.optim.distributed import local_shard


class UpdateSimilarity:
    def __init__(self, parameters, names: Sequence[str],
                 reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.params = [p for p in parameters if p.requires_grad]
        self.names = tuple(names)
        self.reduce_sum = reduce_sum  # adds the sums of every process's shards (FSDP); None: one process holds all
        self.updates: dict[str, list[torch.Tensor]] = {}
        self.grads: dict[str, list[torch.Tensor]] = {}
        self._before: list[torch.Tensor] | None = None

    @torch.no_grad()
    def before_step(self, objective: str) -> None:
        """Call after clipping, before `optimizer.step`."""
        if objective == JOINT:
            return
        self._before = [local_shard(p).detach().clone() for p in self.params]
        self.grads[objective] = [
            local_shard(p.grad).detach().clone() if p.grad is not None else torch.zeros_like(local_shard(p))
            for p in self.params
        ]

    @torch.no_grad()
    def after_step(self, objective: str) -> dict[str, float | None]:
        """Call after `optimizer.step`: the record's `update_cosine` and `grad_cosine`."""
        if objective == JOINT or self._before is None:
            return {"update_cosine": None, "grad_cosine": None}
        self.updates[objective] = [b.neg_().add_(local_shard(p).detach()) for p, b in zip(self.params, self._before)]
        self._before = None
        return {"update_cosine": self._mean_cosine(self.updates), "grad_cosine": self._mean_cosine(self.grads)}

    def _mean_cosine(self, latest: dict[str, list[torch.Tensor]]) -> float | None:
        if len(self.names) < 2 or any(name not in latest for name in self.names):
            return None
        values = []
        for a, b in itertools.combinations(self.names, 2):
            # products in the weights' dtype, sums in float64: no float64 copy of the weights is made
            sums = torch.stack([
                sum(torch.sum(x * y, dtype=torch.float64) for x, y in zip(latest[a], latest[b])),
                sum(torch.sum(x * x, dtype=torch.float64) for x in latest[a]),
                sum(torch.sum(y * y, dtype=torch.float64) for y in latest[b]),
            ])
            if self.reduce_sum is not None:
                sums = self.reduce_sum(sums)
            dot, xx, yy = sums.tolist()
            if xx > 0 and yy > 0:
                values.append(dot / math.sqrt(xx * yy))
        return sum(values) / len(values) if values else None
