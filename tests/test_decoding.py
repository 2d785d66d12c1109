"""The CPU decoder's KV buffers and one-token attention (doplus_cli/decoding.py): the attention against a float64
loop written here, the buffered layer against transformers' DynamicLayer under the same appends, row drops and
growth, and where the decoder keeps transformers' own path."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicCache, DynamicLayer

from doplus_cli import decoding, generation
from doplus_cli.data.formatting import PromptFormatter
from doplus_cli.optim import kernels
from tests.helpers import greedy_by_hand


def _reference(query, key, value, mask, scale):
    """Softmax attention of one query token, element by element in float64: query [B, H_kv, G, D], key/value
    [B, H_kv, L, D], mask [B, 1, 1, L] (True: attend) or None."""
    batch, kv_heads, group, dim = query.shape
    out = torch.zeros(batch, kv_heads, group, value.shape[-1], dtype=torch.float64)
    q, k, v = query.double(), key.double(), value.double()
    for b in range(batch):
        for h in range(kv_heads):
            for g in range(group):
                kept = [j for j in range(k.shape[2]) if mask is None or bool(mask[b, 0, 0, j])]
                scores = [scale * sum(q[b, h, g, d].item() * k[b, h, j, d].item() for d in range(dim)) for j in kept]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                for w, j in zip(weights, kept):
                    out[b, h, g] += (w / total) * v[b, h, j]
    return out


def _inputs(dtype=torch.float32, masked=True):
    """Keys and values as the decoder hands them over: views of the filled part of larger buffers."""
    torch.manual_seed(1)
    keys, values = torch.randn(3, 2, 16, 8).to(dtype), torch.randn(3, 2, 16, 8).to(dtype)
    query = torch.randn(3, 2, 3, 8).to(dtype)  # 6 query heads on 2 key/value heads
    mask = torch.ones(3, 1, 1, 11, dtype=torch.bool)
    if masked:
        mask[0, ..., :4] = False  # left padding of row 0
        mask[2, ..., :1] = False
    return query, keys[:, :, :11], values[:, :, :11], mask


@pytest.mark.parametrize("masked", [True, False])
def test_compiled_decode_attention_equals_a_float64_loop(masked):
    query, key, value, mask = _inputs(masked=masked)
    assert not key.is_contiguous()  # a view of the buffer, as in decoding
    before = decoding.KERNEL.compiled_calls
    out = decoding.KERNEL(query, key, value, mask, 8 ** -0.5)
    assert decoding.KERNEL.compiled_calls == before + 1 and decoding.KERNEL.fallback_reason is None
    assert out.dtype == torch.float32 and out.shape == (3, 2, 3, 8)
    expected = _reference(query, key, value, mask, 8 ** -0.5)
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)
    if masked:  # a masked position changes nothing: row 0 is row 0 of the last 7 positions alone
        alone = _reference(query[:1], key[:1, :, 4:], value[:1, :, 4:], None, 8 ** -0.5)
        torch.testing.assert_close(out[:1].double(), alone, rtol=1e-6, atol=1e-6)


class _Module(torch.nn.Module):
    """What transformers' SDPA path reads from an attention layer."""

    training, is_causal, num_key_value_groups = False, False, 3


@pytest.mark.parametrize("case", ["no mask", "one row", "one position", "prefill"])
def test_the_attention_interface_routes_each_call(case):
    """The interface's calls in transformers' layout ([B, H, q, D], mask [B, 1, q, L] or None): one-token queries of
    two rows or more over two positions or more run the kernel (a missing mask: every position kept); others SDPA.
    Either way the result is the float64 loop's."""
    query, key, value, mask = _inputs(masked=False)
    query = query.reshape(3, 6, 1, 8)
    if case == "one row":
        query, key, value, mask = query[:1], key[:1], value[:1], mask[:1]
    elif case == "one position":
        key, value, mask = key[:, :, :1], value[:, :, :1], mask[..., :1]
    elif case == "prefill":  # two query tokens: transformers' own path
        query = torch.cat([query, query.flip(0)], dim=2)
    before = decoding.KERNEL.compiled_calls
    out, _ = decoding.decode_attention(_Module(), query, key, value, None, scaling=8 ** -0.5)
    assert decoding.KERNEL.compiled_calls == before + (case == "no mask")
    batch, heads, length, dim = query.shape
    assert out.shape == (batch, length, heads, dim)
    grouped = query[:, :, :1].reshape(batch, 2, 3, dim)
    expected = _reference(grouped, key, value, None, 8 ** -0.5).reshape(batch, heads, dim)
    torch.testing.assert_close(out[:, 0].double(), expected, rtol=1e-6, atol=1e-6)


def test_bfloat16_decode_attention_computes_in_float32():
    query, key, value, mask = _inputs(torch.bfloat16)
    out = decoding.KERNEL(query, key, value, mask, 8 ** -0.5)
    assert out.dtype == torch.bfloat16
    expected = _reference(query, key, value, mask, 8 ** -0.5)  # from the same bf16 inputs, in float64
    # one rounding to bf16 at the end (relative spacing 2^-8), not one per product and sum
    torch.testing.assert_close(out.double(), expected, rtol=2 ** -8, atol=1e-3)


def test_the_eager_fallback_is_torch_sdpa_with_the_same_result():
    query, key, value, mask = _inputs()
    out = decoding.attention_sdpa(query, key, value, mask, 8 ** -0.5)
    torch.testing.assert_close(out.double(), _reference(query, key, value, mask, 8 ** -0.5), rtol=1e-6, atol=1e-6)


def test_a_failed_compile_decodes_with_sdpa_and_says_so(monkeypatch):
    monkeypatch.setattr(kernels, "KERNELS", [])  # this kernel's failure stays out of every other test's report
    monkeypatch.delenv(kernels.REQUIRE_COMPILED_ENV)  # a user's run

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch, "compile", lambda fn, **options: no_compiler)  # as inductor fails without g++
    kernel = kernels.CompiledKernel(decoding.attention, "decode attention", eager=decoding.attention_sdpa)
    query, key, value, mask = _inputs()
    out = kernel(query, key, value, mask, 8 ** -0.5)
    assert kernels.fallbacks() == {"decode attention": "RuntimeError: no C++ compiler"}
    torch.testing.assert_close(out.double(), _reference(query, key, value, mask, 8 ** -0.5), rtol=1e-6, atol=1e-6)


def _layer(keys, values):
    layer = DynamicLayer()
    layer.update(keys, values)
    return layer


def test_buffered_layer_holds_what_a_dynamic_layer_holds_through_appends_drops_and_growth():
    torch.manual_seed(2)
    prompt = torch.randn(5, 2, 4, 8), torch.randn(5, 2, 4, 8)
    plain = _layer(*prompt)
    buffered = decoding.buffered_layer_class()(_layer(*prompt), capacity=6)  # room for 2 tokens, then it grows
    rows = 5
    for step, keep in enumerate([None, [0, 2, 3, 4], None, [1, 3], None, None, [0], None]):
        if keep is not None:
            index = torch.tensor(keep)
            plain.batch_select_indices(index)
            buffered.batch_select_indices(index)
            rows = len(keep)
        new = torch.randn(rows, 2, 1, 8), torch.randn(rows, 2, 1, 8)
        expected = plain.update(*new)
        got = buffered.update(*new)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), step
        assert buffered.get_seq_length() == plain.get_seq_length() == 5 + step
    assert buffered.capacity >= 12 and buffered.key_buffer.data_ptr() == buffered.keys.data_ptr()
    buffered.crop(-3)
    plain.crop(-3)
    assert torch.equal(buffered.keys, plain.keys) and buffered.get_seq_length() == 9


def test_a_row_drop_in_order_moves_only_the_rows_after_the_first_dropped_one():
    torch.manual_seed(3)
    keys = torch.randn(4, 1, 3, 2)
    buffered = decoding.buffered_layer_class()(_layer(keys, keys.clone()), capacity=8)
    tail = buffered.key_buffer[:, :, 3:].clone()  # beyond the filled part: never read, never moved
    start = buffered.key_buffer.data_ptr()
    buffered.batch_select_indices(torch.tensor([0, 1, 3]))
    assert buffered.key_buffer.data_ptr() == start  # in place
    assert torch.equal(buffered.keys, keys[[0, 1, 3]])
    assert torch.equal(buffered.key_buffer[:3, :, 3:], tail[:3])


def test_a_drop_fills_each_freed_slot_from_the_end_and_moves_only_those_rows(monkeypatch):
    torch.manual_seed(4)
    keys, values = torch.randn(6, 1, 3, 2), torch.randn(6, 1, 3, 2)
    buffered = decoding.buffered_layer_class()(_layer(keys, values), capacity=8)
    plain = _layer(keys.clone(), values.clone())
    order = generation.compacted([0, 2, 3, 5])  # rows 1 and 4 stopped
    assert order == [0, 5, 2, 3]  # slot 1 takes row 5; slot 4 is past the end
    moved = []
    setitem = torch.Tensor.__setitem__

    def counting(tensor, index, value):
        if isinstance(index, tuple) and isinstance(index[0], torch.Tensor):
            moved.append(len(index[0]))
        return setitem(tensor, index, value)

    monkeypatch.setattr(torch.Tensor, "__setitem__", counting)
    buffered.batch_select_indices(torch.tensor(order))
    monkeypatch.undo()
    plain.batch_select_indices(torch.tensor(order))
    assert moved == [1, 1]  # one row of keys, one of values
    assert torch.equal(buffered.keys, plain.keys) and torch.equal(buffered.values, plain.values)
    assert torch.equal(buffered.keys, keys[order])


@pytest.mark.parametrize("keep", [[0, 1, 2], [1, 2, 3], [0, 3], [3], [0, 2, 4, 5, 6], []])
def test_compacted_keeps_every_kept_row_once_and_moves_the_fewest(keep):
    order = generation.compacted(keep)
    assert sorted(order) == keep  # each kept row once
    stayed = [slot for slot, row in enumerate(order) if slot == row]
    assert len(order) - len(stayed) == sum(row >= len(keep) for row in keep)  # only rows from past the end move


@pytest.fixture(scope="module")
def model_and_formatter(tiny_chat_llama):
    from transformers import AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_chat_llama)
    return model, PromptFormatter(AutoTokenizer.from_pretrained(tiny_chat_llama), max_length=128)


def _prefilled(model):
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    return model(input_ids=ids, use_cache=True).past_key_values


def test_decoding_buffers_the_cache_and_restores_the_attention_implementation(model_and_formatter):
    model, formatter = model_and_formatter
    cache = _prefilled(model)
    assert type(cache) is DynamicCache and model.config._attn_implementation == "sdpa"
    before = decoding.KERNEL.compiled_calls
    with decoding.buffered_decoding(model, cache, 10) as applied:
        assert applied and model.config._attn_implementation == decoding.DECODE_ATTENTION
        assert all(type(layer) is decoding.buffered_layer_class() for layer in cache.layers)
        # the cache under this transformers' own name for it (5.17 has no `cache` argument and would drop it)
        model(input_ids=torch.tensor([[3], [4]]), use_cache=True, **{generation.cache_argument(model): cache})
    assert model.config._attn_implementation == "sdpa"
    assert decoding.KERNEL.compiled_calls == before + model.config.num_hidden_layers  # one call per layer


def test_greedy_answers_run_the_buffered_decoder(model_and_formatter):
    """Two prompts of different lengths (one row left-padded) decode on the buffers and the compiled attention to
    the tokens of a cache-free greedy loop, one layer call per decoding step."""
    model, formatter = model_and_formatter
    questions = ["Who is the author?", "Where was the author born, and in which year did the first book appear?"]
    assert len(formatter.prompt_ids(questions[0])) != len(formatter.prompt_ids(questions[1]))
    before = decoding.KERNEL.compiled_calls
    texts, tokens = generation.greedy_generate(model, formatter, questions, 6, 2)
    expected = [greedy_by_hand(model, formatter, q, 6) for q in questions]
    assert tokens == expected and all(expected)
    assert texts == [formatter.tokenizer.decode(t, skip_special_tokens=True).strip() for t in expected]
    # the first token comes from the prompt's pass (SDPA); each later step, while both rows run, calls the kernel
    # once per layer (a lone row takes SDPA)
    both = min(len(t) for t in expected)
    assert decoding.KERNEL.compiled_calls - before >= (both - 1) * model.config.num_hidden_layers > 0


def test_the_attention_switch_and_its_undoing_are_transformers_set_attn_implementation(model_and_formatter,
                                                                                        monkeypatch):
    """The model's attention goes to the decoder's and back through transformers' public call, also when the block
    ends with an error."""
    model, _ = model_and_formatter
    calls = []
    switch = model.set_attn_implementation
    monkeypatch.setattr(model, "set_attn_implementation", lambda name: (calls.append(name), switch(name))[1])
    with pytest.raises(KeyError):
        with decoding.buffered_decoding(model, _prefilled(model), 10) as applied:
            assert applied and model.config._attn_implementation == decoding.DECODE_ATTENTION
            raise KeyError("a failure inside the block")
    assert calls == [decoding.DECODE_ATTENTION, "sdpa"] and model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("change", ["eager attention", "sub-configs", "not a DynamicLayer", "switched off",
                                    "no set_attn_implementation"])
def test_other_models_decode_as_before(model_and_formatter, monkeypatch, change):
    model, _ = model_and_formatter
    cache = _prefilled(model)
    if change == "eager attention":
        monkeypatch.setattr(model.config, "_attn_implementation_internal", "eager")
    elif change == "no set_attn_implementation":  # a model that is not transformers' PreTrainedModel
        monkeypatch.setattr(model, "set_attn_implementation", None)
    elif change == "sub-configs":
        monkeypatch.setattr(type(model.config), "sub_configs", {"text_config": type(model.config)})
    elif change == "not a DynamicLayer":
        cache.layers[0] = decoding.buffered_layer_class()(cache.layers[0], 8)
    else:
        monkeypatch.setenv(decoding.BUFFERS_VARIABLE, "0")
    layers = list(cache.layers)
    with decoding.buffered_decoding(model, cache, 10) as applied:
        assert not applied
    assert cache.layers == layers
