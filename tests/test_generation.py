"""Greedy generation: the row-dropping decoder (on CPU with its KV buffers and compiled one-token attention) gives
exactly what `model.generate` gives, in the questions' order."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from doplus_cli import decoding, generation
from doplus_cli.data.formatting import PromptFormatter
from doplus_cli.generation import greedy_generate
from doplus_cli.progress import counting_tokens
from tests.helpers import greedy_by_hand

QUESTIONS = ["Who is the author?", "Where was the author born, and in which year did the author write the first "
             "book?", "Name a book.", "What genre does the author write in most of the time?", "Why?",
             "What awards did the author win?", "Tell me about the author's parents and their jobs."]


def _reference(model, formatter, questions, max_new_tokens, max_total_tokens=None):
    """model.generate one question at a time (no padding at all), cut as greedy_generate cuts."""
    tokenizer = formatter.tokenizer
    stop = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    texts, tokens, computed = [], [], 0
    ends = stop | set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
                      else [model.generation_config.eos_token_id])
    for question in questions:
        ids = torch.tensor([formatter.prompt_ids(question)], device=model.device)
        budget = max_new_tokens if max_total_tokens is None else max(0, max_total_tokens - ids.shape[1])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max(1, budget),
                             do_sample=False, pad_token_id=tokenizer.pad_token_id, temperature=None, top_p=None,
                             top_k=None)[0, ids.shape[1]:].tolist()[:budget]
        cut = next((k for k, t in enumerate(out) if t in stop), len(out))
        tokens.append(out[:cut])
        texts.append(tokenizer.decode(out[:cut], skip_special_tokens=True).strip())
        computed += next((k + 1 for k, t in enumerate(out) if t in ends), len(out))  # up to the row's last token
    return texts, tokens, computed


@pytest.fixture(scope="module")
def loaded(tiny_chat_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_llama)
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_llama)
    return model, PromptFormatter(tokenizer, max_length=128)


def _frequent_token(model, formatter) -> int:
    """A token the random model produces in the middle of some answers but not others: made an EOS token, it ends
    rows at different steps, so rows leave the batch one by one."""
    _, tokens, _ = _reference(model, formatter, QUESTIONS, 12)
    counts: dict[int, int] = {}
    for row in tokens:
        for t in set(row[1:]):
            counts[t] = counts.get(t, 0) + 1
    return max((t for t in counts if counts[t] < len(QUESTIONS)), key=counts.get)


@pytest.mark.parametrize("batch_size,max_total", [(3, None), (7, None), (4, 40)])
def test_row_dropping_decoder_equals_generate_one_question_at_a_time(loaded, monkeypatch, batch_size, max_total):
    model, formatter = loaded
    eos = _frequent_token(model, formatter)
    monkeypatch.setattr(model.generation_config, "eos_token_id", [formatter.tokenizer.eos_token_id, eos])
    expected = _reference(model, formatter, QUESTIONS, 12, max_total)
    assert len({len(t) for t in expected[1]}) > 1  # rows end at different steps

    calls = []
    original = generation.decode_dropping
    monkeypatch.setattr(generation, "decode_dropping", lambda *a: calls.append(1) or original(*a))
    monkeypatch.setattr(model, "generate", lambda *a, **k: pytest.fail("the fast path called generate"))
    compiled = decoding.KERNEL.compiled_calls
    with counting_tokens() as count:
        texts, tokens = greedy_generate(model, formatter, QUESTIONS, 12, batch_size, max_total_tokens=max_total)
    assert calls  # the row-dropping decoder ran, and generate never did
    assert decoding.KERNEL.compiled_calls > compiled  # on the KV buffers and the compiled attention (decoding.py)
    assert tokens == expected[1] and texts == expected[0]
    assert count.generated == expected[2]  # each row's tokens up to the one that ended it, no decoding after


def test_a_repetition_penalty_in_the_generation_config_is_applied(loaded, monkeypatch):
    """A logits processor in the generation config takes `generate` (the row-dropping decoder has none), and the
    answers are the greedy choices with the penalty applied."""
    model, formatter = loaded
    questions, new_tokens = QUESTIONS[:4], 10
    monkeypatch.setattr(model.generation_config, "repetition_penalty", 1.3)
    monkeypatch.setattr(generation, "decode_dropping", lambda *a: pytest.fail("fast path with a processor"))
    texts, tokens = greedy_generate(model, formatter, questions, new_tokens, 2)
    expected = [greedy_by_hand(model, formatter, q, new_tokens, 1.3) for q in questions]
    assert tokens == expected
    assert texts == [formatter.tokenizer.decode(t, skip_special_tokens=True).strip() for t in expected]
    unpenalised = [greedy_by_hand(model, formatter, q, new_tokens, 1.0) for q in questions]
    assert unpenalised != expected  # the penalty changes these answers, so dropping it would fail above


def test_on_cuda_generation_attends_without_cudnn_and_on_the_cpu_as_before():
    """cuDNN's attention plans every new shape, and decoding meets one at every step (58 to 86 ms a step on an H100
    against 24.7 ms without it, docs/results.md); the flags are back on exit; on the CPU nothing changes."""
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with generation.attention_backends(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with generation.attention_backends(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled()
