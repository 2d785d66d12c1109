"""Model-side work of an evaluation: mean token NLLs of many answers in batched forward passes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from doplus_cli.data.formatting import PromptFormatter, collate
from doplus_cli.losses import token_nll


@torch.no_grad()
def mean_token_nlls(
    model: torch.nn.Module, formatter: PromptFormatter, pairs: Sequence[tuple[str, str]], batch_size: int = 16
) -> list[float]:
    """For each (question, answer): the mean NLL of the answer tokens given the prompt.

    Pairs are sorted by length so each batch pads little, then put back in their order.
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
            batch = {k: v.to(device) for k, v in collate([encoded[i] for i in chunk],
                                                         formatter.tokenizer.pad_token_id).items()}
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            nll, mask = token_nll(logits, batch["labels"])
            means = (nll.sum(-1) / mask.sum(-1).clamp_min(1)).tolist()
            for i, value in zip(chunk, means):
                result[i] = value
    finally:
        model.train(was_training)
    return result


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
