"""Model-side work of an evaluation: mean token NLLs of many answers in batched forward passes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from doplus_cli.data.formatting import IGNORE_INDEX, Encoded, PromptFormatter, collate
from doplus_cli.losses import token_nll


@torch.no_grad()
def mean_token_nlls(
    model: torch.nn.Module, formatter: PromptFormatter, pairs: Sequence[tuple[str, str]], batch_size: int = 16
) -> list[float]:
    """For each (question, answer): the mean NLL of the answer tokens given the prompt.

    Pairs are sorted by length so each batch pads little, then put back in their order. Rows are padded on
    the left (with positions counted from each row's first token), so every answer ends the row and only
    the last `longest answer + 1` positions need logits: with a 50k-token vocabulary the output layer and
    the softmax are a large part of the cost, and the prompt's logits are never used.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    encoded = [formatter.encode(q, a) for q, a in pairs]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].input_ids))
    result = [0.0] * len(encoded)
    try:
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            batch = {k: v.to(device) for k, v in left_padded([encoded[i] for i in chunk],
                                                             formatter.tokenizer.pad_token_id).items()}
            keep = 1 + max(sum(1 for label in encoded[i].labels if label != IGNORE_INDEX) for i in chunk)
            logits = _answer_logits(model, batch, keep)
            nll, mask = token_nll(logits, batch["labels"][:, -logits.shape[1]:])
            means = (nll.sum(-1) / mask.sum(-1).clamp_min(1)).tolist()
            for i, value in zip(chunk, means):
                result[i] = value
    finally:
        model.train(was_training)
    return result


def left_padded(examples: list[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    """Like `collate`, padded on the left, with position ids that start at 0 on each row's first token."""
    batch = collate(examples, pad_id)
    width = batch["input_ids"].shape[1]
    for row, example in enumerate(examples):
        shift = width - len(example.input_ids)
        for key in ("input_ids", "attention_mask", "labels"):
            batch[key][row] = torch.roll(batch[key][row], shift)
    batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp_min(0)
    return batch


def _answer_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor], keep: int) -> torch.Tensor:
    """Logits of the last `keep` positions (all positions for models without `logits_to_keep`)."""
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
              "position_ids": batch["position_ids"]}
    try:
        return model(**inputs, logits_to_keep=keep).logits
    except TypeError:  # an architecture without logits_to_keep
        return model(**inputs).logits


def grouped_nlls(
    model: torch.nn.Module, formatter: PromptFormatter, questions: Sequence[str], answers: Sequence[Sequence[str]],
    batch_size: int = 16,
) -> list[list[float]]:
    """Mean token NLLs of several answers per question (perturbed answers), in one batched pass."""
    flat = [(q, a) for q, group in zip(questions, answers) for a in group]
    values = mean_token_nlls(model, formatter, flat, batch_size)
    grouped, position = [], 0
    for group in answers:
        grouped.append(values[position:position + len(group)])
        position += len(group)
    return grouped
