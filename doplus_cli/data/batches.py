"""Which rows make each batch, and the tensors a loss needs from them.

`IndexStream` walks a fresh seeded permutation of the set every epoch. Each optimizer micro-step draws
`batch_size x world_size` consecutive positions of it and each process takes its own slice, so N processes
at batch b see exactly the samples one process sees at batch N*b. Its state (epoch, position) is two
integers, which is what a checkpoint needs to continue the same order.
"""

from __future__ import annotations

import torch

from doplus_cli.data.formatting import PromptFormatter, collate
from doplus_cli.data.rejections import rejection_for
from doplus_cli.data.sources import MixtureSource, Source
from doplus_cli.errors import UserError


class IndexStream:
    def __init__(self, size: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1) -> None:
        self.size, self.batch_size, self.seed = size, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(self.size, generator=generator).tolist()

    def next_indices(self) -> list[int]:
        """This process's row indices for the next micro-batch."""
        drawn = []
        for _ in range(self.batch_size * self.world_size):
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            drawn.append(self._order[self.position])
            self.position += 1
        return drawn[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)


def build_batch(
    source: Source, indices: list[int], formatter: PromptFormatter, *, with_rejection: bool, seed: int
) -> dict[str, dict[str, torch.Tensor]]:
    """{"answer": the rows' own answers} and, for IDK/DPO/AP, {"rejection": the same questions answered
    with a rejection phrase from the project's list}; from a `MixtureSource`, {"part": {"index": the part each
    row comes from}} too."""
    rows = [source[i] for i in indices]
    pad_id = formatter.tokenizer.pad_token_id
    encoded = [formatter.encode_text(r.text) if r.is_text else formatter.encode(r.question, r.answer) for r in rows]
    batch = {"answer": collate(encoded, pad_id)}
    if isinstance(source, MixtureSource):
        batch["part"] = {"index": torch.tensor([source.part_of(i) for i in indices], dtype=torch.long)}
    if with_rejection:
        if any(r.is_text for r in rows):
            raise UserError(f"{source.name}: rows with only a 'text' field have no question to answer with a "
                            "rejection; IDK, DPO and AP need question/answer rows")
        rejected = [formatter.encode(r.question, rejection_for(i, seed)) for r, i in zip(rows, indices)]
        batch["rejection"] = collate(rejected, pad_id)
    return batch
