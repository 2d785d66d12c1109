"""Forget losses (GA, NPO, DPO, ME, IDK), retain losses (GD, KL, AP) and the task loss (CE), one function each,
by name.

Every loss takes a `LossContext` (the model, the frozen reference model when it needs one, beta) and a
batch {"answer": tensors, "rejection": tensors} built by `doplus_cli.data.batches`. NLLs are over answer
tokens only (labels != -100); "CE" is the mean token cross-entropy over all answer tokens of the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from doplus_cli.data.formatting import IGNORE_INDEX

Batch = dict[str, dict[str, Tensor]]


def local_token_count(mask: Tensor) -> Tensor:
    return mask.sum().clamp_min(1)


@dataclass
class LossContext:
    """What a loss needs besides its batch.

    `token_count` turns a batch's answer-token mask into the denominator of token-mean losses. On one
    process it is the batch's count; on N processes the loop passes the all-reduced count divided by N, so
    that the gradients DDP averages equal those of one process on the whole global batch.
    """

    model: torch.nn.Module
    reference: torch.nn.Module | None = None
    beta: float = 0.1
    token_count: Callable[[Tensor], Tensor] = local_token_count
    tally: PartTally | None = None  # set by the loop during a step of a mixture objective


class PartTally:
    """The log of a mixture objective's step (`MixtureSource`, `doplus align --scheme joint`): per part (the set a
    row comes from), the summed NLL of its rows' answer tokens, their token count and the row count, over the
    step's micro-batches. The loss itself is one CE over the whole batch; this only splits what it saw."""

    def __init__(self, names: tuple[str, ...], device: torch.device | str = "cpu") -> None:
        self.names = names
        self.sums = torch.zeros(len(names), 3, dtype=torch.float64, device=device)  # NLL, tokens, rows

    def add(self, part: Tensor, row_nll: Tensor, row_tokens: Tensor) -> None:
        values = torch.stack([row_nll.detach().double(), row_tokens.double(), torch.ones_like(row_tokens).double()], -1)
        self.sums.index_add_(0, part.to(self.sums.device), values.to(self.sums.device))

    def terms(self) -> dict[str, float | None]:
        """{part}_loss: the token-mean CE over the rows of that part (None when the step drew none of them);
        {part}_rows: how many rows of the step's batch came from it."""
        terms: dict[str, float | None] = {}
        for name, (nll, tokens, rows) in zip(self.names, self.sums.tolist()):
            terms[f"{name}_loss"] = nll / tokens if tokens > 0 else None
            terms[f"{name}_rows"] = int(rows)
        return terms


@dataclass(frozen=True)
class LossSpec:
    name: str
    fn: Callable[[LossContext, Batch], Tensor]
    needs_reference: bool = False
    needs_rejection: bool = False
    targeted: bool = False  # trains toward a rejection answer (IDK, DPO): the paper's targeted unlearning


FORGET_LOSSES: dict[str, LossSpec] = {}
RETAIN_LOSSES: dict[str, LossSpec] = {}
TASK_LOSSES: dict[str, LossSpec] = {}  # `doplus multitask`


def _register(table: dict[str, LossSpec], name: str, **flags: bool):
    def wrap(fn):
        table[name] = LossSpec(name, fn, **flags)
        return fn

    return wrap


def logits_of(model: torch.nn.Module, tensors: dict[str, Tensor]) -> Tensor:
    return model(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"]).logits


def _upcast(x: Tensor) -> Tensor:
    """bf16/fp16 logits are upcast to float32 before softmax; float32 and float64 stay as they are."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def shifted(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Logits at positions that predict a label, the labels, and the answer-token mask."""
    logits, labels = logits[:, :-1, :], labels[:, 1:]
    mask = labels != IGNORE_INDEX
    return logits, labels, mask


def token_nll(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token NLL [B, T-1] (0 off the answer) and the answer-token mask."""
    logits, labels, mask = shifted(logits, labels)
    nll = F.cross_entropy(
        _upcast(logits).reshape(-1, logits.size(-1)), labels.clamp_min(0).reshape(-1), reduction="none"
    ).view(labels.shape)
    return nll * mask, mask


def sequence_nll(model: torch.nn.Module, tensors: dict[str, Tensor]) -> Tensor:
    """NLL summed over each sample's answer tokens: [B]."""
    nll, _ = token_nll(logits_of(model, tensors), tensors["labels"])
    return nll.sum(-1)


def mean_ce(model: torch.nn.Module, tensors: dict[str, Tensor], token_count=local_token_count) -> Tensor:
    """Mean token cross-entropy over every answer token of the batch."""
    nll, mask = token_nll(logits_of(model, tensors), tensors["labels"])
    return nll.sum() / token_count(mask)


def _on_reference_device(ctx: LossContext, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The batch moved to the reference model's device (it may be kept on CPU: `--ref-offload cpu`)."""
    device = next(ctx.reference.parameters()).device
    return {k: v.to(device) for k, v in tensors.items()}


def _reference_nll(ctx: LossContext, tensors: dict[str, Tensor]) -> Tensor:
    with torch.no_grad():
        return sequence_nll(ctx.reference, _on_reference_device(ctx, tensors)).to(tensors["labels"].device)


@_register(FORGET_LOSSES, "GA")
def gradient_ascent(ctx: LossContext, batch: Batch) -> Tensor:
    """GA: -CE on the forget answers."""
    return -mean_ce(ctx.model, batch["answer"], ctx.token_count)


@_register(FORGET_LOSSES, "NPO", needs_reference=True)
def npo(ctx: LossContext, batch: Batch) -> Tensor:
    """NPO (Zhang et al., 2024): -(2/beta) * mean log sigmoid(beta * (NLL_theta - NLL_ref)), NLL summed
    over answer tokens."""
    nll = sequence_nll(ctx.model, batch["answer"])
    nll_ref = _reference_nll(ctx, batch["answer"])
    return -(2.0 / ctx.beta) * F.logsigmoid(ctx.beta * (nll - nll_ref)).mean()


@_register(FORGET_LOSSES, "DPO", needs_reference=True, needs_rejection=True, targeted=True)
def dpo(ctx: LossContext, batch: Batch) -> Tensor:
    """DPO with the rejection answer preferred over the true answer, as in the TOFU/closer-look code:
    -(2/beta) * mean log sigmoid(beta * ((logp_theta(idk) - logp_ref(idk)) - (logp_theta(ans) - logp_ref(ans)))),
    log-probabilities summed over answer tokens."""
    win = -sequence_nll(ctx.model, batch["rejection"]) + _reference_nll(ctx, batch["rejection"])
    lose = -sequence_nll(ctx.model, batch["answer"]) + _reference_nll(ctx, batch["answer"])
    return -(2.0 / ctx.beta) * F.logsigmoid(ctx.beta * (win - lose)).mean()


@_register(FORGET_LOSSES, "ME")
def maximum_entropy(ctx: LossContext, batch: Batch) -> Tensor:
    """ME: mean over answer tokens of KL(uniform || p_theta) = -log V - (1/V) * sum_v log p_theta(v)."""
    logits, _, mask = shifted(logits_of(ctx.model, batch["answer"]), batch["answer"]["labels"])
    log_probs = F.log_softmax(_upcast(logits), dim=-1)
    vocab = log_probs.size(-1)
    kl = -math.log(vocab) - log_probs.mean(-1)
    return (kl * mask).sum() / ctx.token_count(mask)


@_register(FORGET_LOSSES, "IDK", needs_rejection=True, targeted=True)
def idk(ctx: LossContext, batch: Batch) -> Tensor:
    """IDK: CE of a rejection answer given the forget question."""
    return mean_ce(ctx.model, batch["rejection"], ctx.token_count)


@_register(RETAIN_LOSSES, "GD")
def gradient_descent(ctx: LossContext, batch: Batch) -> Tensor:
    """GD: CE on the retain answers."""
    return mean_ce(ctx.model, batch["answer"], ctx.token_count)


@_register(RETAIN_LOSSES, "KL", needs_reference=True)
def kl_to_reference(ctx: LossContext, batch: Batch) -> Tensor:
    """KL: mean over retain answer tokens of KL(p_ref || p_theta) = sum_v p_ref(v) (log p_ref(v) - log p_theta(v))."""
    tensors = batch["answer"]
    logits, _, mask = shifted(logits_of(ctx.model, tensors), tensors["labels"])
    with torch.no_grad():
        ref_tensors = _on_reference_device(ctx, tensors)
        ref_logits = logits_of(ctx.reference, ref_tensors).to(tensors["labels"].device)
        ref_logits, _, _ = shifted(ref_logits, tensors["labels"])
    log_p = F.log_softmax(_upcast(logits), dim=-1)
    log_ref = F.log_softmax(_upcast(ref_logits), dim=-1)
    kl = (log_ref.exp() * (log_ref - log_p)).sum(-1)
    return (kl * mask).sum() / ctx.token_count(mask)


@_register(RETAIN_LOSSES, "AP", needs_rejection=True)
def answer_preservation(ctx: LossContext, batch: Batch) -> Tensor:
    """AP (Yuan et al., 2024): -(1/beta) * mean log sigmoid(beta * (NLL_theta(idk) - NLL_theta(answer))) on
    retain questions, NLL summed over answer tokens."""
    nll_idk = sequence_nll(ctx.model, batch["rejection"])
    nll_answer = sequence_nll(ctx.model, batch["answer"])
    return -(1.0 / ctx.beta) * F.logsigmoid(ctx.beta * (nll_idk - nll_answer)).mean()


@_register(TASK_LOSSES, "CE")
def supervised_cross_entropy(ctx: LossContext, batch: Batch) -> Tensor:
    """CE: mean token cross-entropy of a task's answers given its prompts (prompt tokens masked). On a mixture's
    batch the per-part NLLs are tallied for the log as well (`PartTally`); the loss is the same."""
    nll, mask = token_nll(logits_of(ctx.model, batch["answer"]), batch["answer"]["labels"])
    if ctx.tally is not None and "part" in batch:
        ctx.tally.add(batch["part"]["index"], nll.sum(-1), mask.sum(-1))
    return nll.sum() / ctx.token_count(mask)
