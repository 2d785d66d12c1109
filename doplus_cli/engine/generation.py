"""Greedy answers from the model: targets for `answers_from_model` and the before/after sample table."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence

import torch
from rich.progress import Progress

from doplus_cli.data.formatting import PromptFormatter, left_padded_prompts
from doplus_cli.data.sources import Source
from doplus_cli.errors import UserError
from doplus_cli.progress import count_tokens

MAX_SELF_ANSWERED_ROWS = 5000


def _chunks(items: Sequence, size: int) -> Iterator[Sequence]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


@torch.no_grad()
def greedy_generate(
    model: torch.nn.Module,
    formatter: PromptFormatter,
    questions: Sequence[str],
    max_new_tokens: int,
    batch_size: int = 16,
    progress: Progress | None = None,
    description: str = "generating",
    max_total_tokens: int | None = None,
) -> tuple[list[str], list[list[int]]]:
    """Greedy completions of each question's prompt, batched with left padding: (texts, token ids).

    The token ids stop before the first EOS/pad token; the texts are decoded without special tokens.
    `max_total_tokens` (instead of `max_new_tokens`): each answer may be as long as that budget less its own
    prompt (the DualOptim+ code's `generate(max_length=200)`, counted per row rather than per padded batch).
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    tokenizer = formatter.tokenizer
    stop = {tokenizer.eos_token_id, tokenizer.pad_token_id} - {None}
    texts: list[str] = []
    tokens: list[list[int]] = []
    task = progress.add_task(description, total=len(questions), status="") if progress is not None else None
    try:
        for chunk in _chunks(list(questions), batch_size):
            batch = {k: v.to(device) for k, v in left_padded_prompts(formatter, list(chunk)).items()}
            count_tokens("prompt", int(batch["attention_mask"].sum()))
            budgets = [max_new_tokens] * len(chunk)
            if max_total_tokens is not None:
                budgets = [max(0, max_total_tokens - n) for n in batch["attention_mask"].sum(-1).tolist()]
            output = model.generate(
                **batch, max_new_tokens=max(1, max(budgets)), do_sample=False, pad_token_id=tokenizer.pad_token_id,
                temperature=None, top_p=None, top_k=None,
            )
            for row, budget in zip(output[:, batch["input_ids"].shape[1]:].tolist(), budgets):
                row = row[:budget]
                cut = next((i for i, t in enumerate(row) if t in stop), len(row))
                count_tokens("generated", min(cut + 1, len(row)))  # the stop token was computed too
                tokens.append(row[:cut])
                texts.append(tokenizer.decode(row[:cut], skip_special_tokens=True).strip())
            if task is not None:
                progress.advance(task, len(chunk))
    finally:
        model.train(was_training)
    return texts, tokens


def write_self_answered(
    model: torch.nn.Module,
    formatter: PromptFormatter,
    source: Source,
    path: str,
    max_new_tokens: int,
    progress: Progress | None = None,
) -> None:
    """Answer every question of `source` with the model itself and write JSON lines {question, answer}
    to `path` (the paper's real-world setting: the model's own answers are the targets)."""
    if len(source) > MAX_SELF_ANSWERED_ROWS:
        raise UserError(
            f"{source.name}: {len(source)} rows is too many to answer with the model first "
            f"(answers_from_model is for sets up to {MAX_SELF_ANSWERED_ROWS}); give answers in the file"
        )
    rows = [source[i] for i in range(len(source))]
    if any(r.is_text for r in rows):
        raise UserError(f"{source.name}: answers_from_model needs question rows, not 'text' rows")
    answers, _ = greedy_generate(
        model, formatter, [r.question for r in rows], max_new_tokens, progress=progress,
        description=f"answering {os.path.basename(source.name)}",
    )
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        for row, answer in zip(rows, answers):
            handle.write(json.dumps({"question": row.question, "answer": answer}) + "\n")
