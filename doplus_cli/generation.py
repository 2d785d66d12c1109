"""Greedy answers from the model: targets for `answers_from_model`, the before/after sample table and the answers
the evaluation suites score (below both `engine/` and `evaluation/`, which use it)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence

import torch
from rich.progress import Progress

from doplus_cli.data.formatting import PromptFormatter, left_padded_prompts
from doplus_cli.data.sources import Source
from doplus_cli.decoding import buffered_decoding
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

    Questions are batched in order of prompt length (less padding) and handed back in their own order. Models
    with a plain KV cache and no logits processors in their generation config decode in `decode_dropping`: a
    row leaves the batch (and its cache) as soon as it has stopped, where `generate` keeps computing every row
    until the last one ends. Others take `model.generate`. On CUDA, attention runs without cuDNN's backend
    (`attention_backends`).
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    tokenizer = formatter.tokenizer
    stop = {tokenizer.eos_token_id, tokenizer.pad_token_id} - {None}
    texts: list[str] = [""] * len(questions)
    tokens: list[list[int]] = [[] for _ in questions]
    prompts = [formatter.prompt_ids(q)[-formatter.max_length:] for q in questions]
    order = sorted(range(len(questions)), key=lambda i: len(prompts[i]))
    task = progress.add_task(description, total=len(questions), status="") if progress is not None else None
    try:
        with attention_backends(device):
            for chunk in _chunks(order, batch_size):
                padded = left_padded_prompts(formatter, [questions[i] for i in chunk])
                batch = {k: v.to(device) for k, v in padded.items()}
                count_tokens("prompt", int(batch["attention_mask"].sum()))
                budgets = [max_new_tokens] * len(chunk)
                if max_total_tokens is not None:
                    budgets = [max(0, max_total_tokens - n) for n in batch["attention_mask"].sum(-1).tolist()]
                rows = decode_dropping(model, batch, budgets, _stop_ids(model, stop)) if _drops_rows(model) else None
                if rows is None:
                    output = model.generate(
                        **batch, max_new_tokens=max(1, max(budgets)), do_sample=False,
                        pad_token_id=tokenizer.pad_token_id, temperature=None, top_p=None, top_k=None,
                    )
                    answers = output[:, batch["input_ids"].shape[1]:].tolist()
                    rows = [row[:budget] for row, budget in zip(answers, budgets)]
                for i, row in zip(chunk, rows):
                    cut = next((k for k, t in enumerate(row) if t in stop), len(row))
                    count_tokens("generated", min(cut + 1, len(row)))  # the stop token was computed too
                    tokens[i] = row[:cut]
                    texts[i] = tokenizer.decode(row[:cut], skip_special_tokens=True).strip()
                if task is not None:
                    progress.advance(task, len(chunk))
    finally:
        model.train(was_training)
    return texts, tokens


def attention_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """On CUDA, torch's SDPA without its cuDNN backend for the block (on CPU nothing changes).

    cuDNN's attention builds an execution plan for every new shape: decoding meets a new cache length at every
    step (and a new batch size at every drop), so each of its calls took 1.2 ms of host time against 71 µs on a
    shape seen before. On an H100 (torch 2.11, SmolLM2-135M in bf16, 64 rows) a decoding step on new shapes took
    58 to 86 ms with cuDNN and 24.7 ms without it, as fast as with cuDNN on shapes already planned (24.8 ms)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


# generation-config fields that would make `generate` pick another token than the plain argmax
_PROCESSORS = ("repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "suppress_tokens",
               "begin_suppress_tokens", "min_length", "min_new_tokens", "forced_bos_token_id", "forced_eos_token_id",
               "sequence_bias", "encoder_repetition_penalty", "exponential_decay_length_penalty")
_NEUTRAL = (None, 0, 1.0, [], {})


def _drops_rows(model) -> bool:
    """Whether `decode_dropping` gives what `generate` gives: a plain greedy argmax over a DynamicCache."""
    config = getattr(model, "generation_config", None)
    if config is None or any(getattr(config, name, None) not in _NEUTRAL for name in _PROCESSORS):
        return False
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(text_config, "sliding_window", None) or getattr(text_config, "layer_types", None) and any(
            kind != "full_attention" for kind in text_config.layer_types):
        return False
    return not getattr(model.config, "is_encoder_decoder", False)


def _stop_ids(model, stop: set[int]) -> set[int]:
    """The tokens that end a row: the tokenizer's EOS and pad, and the generation config's EOS ids."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return stop | (set(eos) if isinstance(eos, (list, tuple)) else {eos} - {None})


def cache_argument(model) -> str:
    """The forward's name for the KV cache: `cache` (transformers 5.x, which deprecates the old name), else
    `past_key_values`."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def compacted(keep: list[int]) -> list[int]:
    """The batch's rows after a drop, as indices into the rows before it (`keep`: the kept ones, ascending): each
    slot freed below len(keep) takes a kept row from above it and every other row stays, so that the KV buffers
    move as many rows as stopped, where moving every row after the first stopped one up copied half the cache."""
    order, kept = list(range(len(keep))), set(keep)
    holes = [slot for slot in order if slot not in kept]
    for slot, row in zip(holes, [row for row in keep if row >= len(keep)]):
        order[slot] = row
    return order


def decode_dropping(model, batch: dict[str, torch.Tensor], budgets: list[int], stop: set[int]
                     ) -> list[list[int]] | None:
    """Greedy decoding of left-padded prompts where each row leaves the batch once it produced a stop token or
    reached its budget; each row's tokens up to and including that token. None when the model's cache is not a
    DynamicCache (then `generate` runs instead)."""
    from transformers import DynamicCache

    mask = batch["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    produced: list[list[int]] = [[] for _ in budgets]
    alive = [row for row, budget in enumerate(budgets) if budget > 0]
    if not alive:
        return produced
    inputs = {"input_ids": batch["input_ids"], "attention_mask": mask, "position_ids": positions, "use_cache": True}
    try:
        output = model(**inputs, logits_to_keep=1)
    except TypeError:  # an architecture without logits_to_keep
        output = model(**inputs)
    cache = output.past_key_values
    if type(cache) is not DynamicCache:
        return None
    cache_kwarg = cache_argument(model)  # looked up once, not on every decoding step
    selected = torch.tensor(alive, device=mask.device)
    if len(alive) < len(budgets):
        cache.batch_select_indices(selected)
    mask, next_position = mask[selected], positions[selected, -1] + 1
    token = output.logits[selected, -1].argmax(-1)
    # on CPU: keys and values written in place into buffers sized for the longest budget (decoding.py)
    with buffered_decoding(model, cache, mask.shape[1] + max(budgets)):
        while True:
            keep = []
            for k, (row, value) in enumerate(zip(alive, token.tolist())):
                produced[row].append(value)
                if value not in stop and len(produced[row]) < budgets[row]:
                    keep.append(k)
            if not keep:
                return produced
            if len(keep) < len(alive):
                keep = compacted(keep)
                index = torch.tensor(keep, device=mask.device)
                cache.batch_select_indices(index)
                mask, next_position, token = mask[index], next_position[index], token[index]
                alive = [alive[k] for k in keep]
            mask = torch.cat([mask, mask.new_ones((len(alive), 1))], dim=1)
            output = model(input_ids=token[:, None], attention_mask=mask, position_ids=next_position[:, None],
                           use_cache=True, **{cache_kwarg: cache})
            next_position = next_position + 1
            token = output.logits[:, -1].argmax(-1)


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
