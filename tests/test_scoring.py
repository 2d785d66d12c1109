"""NLLs scored from each question's shared prompt equal the whole-sequence batched NLLs."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from doplus_cli.data.formatting import PromptFormatter
from doplus_cli.evaluation import scoring
from doplus_cli.evaluation.scoring import grouped_nlls, shared_prefix_nlls


def tofu_groups(tofu_dir, n):
    rows = [json.loads(line) for line in open(tofu_dir / "forget10_perturbed.json")][:n]
    rows += [json.loads(line) for line in open(tofu_dir / "real_authors_perturbed.json")][:n]
    questions = [r["question"] for r in rows]
    groups = [[r["answer"], r.get("paraphrased_answer", r["answer"]), *r["perturbed_answer"]] for r in rows]
    return questions, groups


@pytest.mark.parametrize("chat", [False, True])
def test_shared_prefix_nlls_equal_the_batched_nlls(tiny_llama, tiny_chat_llama, tofu_dir, chat):
    folder = tiny_chat_llama if chat else tiny_llama
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    formatter = PromptFormatter(AutoTokenizer.from_pretrained(folder), max_length=512)
    questions, groups = tofu_groups(tofu_dir, 5)
    expected = grouped_nlls(model, formatter, questions, groups, batch_size=7)
    for batch_size in (3, 16):
        got = shared_prefix_nlls(model, formatter, questions, groups, batch_size=batch_size)
        assert [len(g) for g in got] == [len(g) for g in groups]
        for row_got, row_expected in zip(got, expected):
            assert row_got == pytest.approx(row_expected, abs=1e-5)
    assert got[5][1] == got[5][0]  # real authors: the answer stands in for the paraphrase, scored once


def test_pairs_truncated_by_max_length_are_scored_as_whole_sequences(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    formatter = PromptFormatter(AutoTokenizer.from_pretrained(tiny_llama), max_length=24)
    questions = ["What is the full name of the author born in Kuwait City on 08/09/1956?", "Who?"]
    groups = [["Basil Mahfouz Al-Kuwaiti is his full name, as recorded in the register of births.", "Basil."],
              ["Nobody.", "Somebody else entirely, whose name is long enough to be cut at the end."]]
    expected = grouped_nlls(model, formatter, questions, groups)
    got = shared_prefix_nlls(model, formatter, questions, groups)
    for row_got, row_expected in zip(got, expected):
        assert row_got == pytest.approx(row_expected, abs=1e-5)


def test_both_shared_prefix_paths_equal_the_batched_nlls(tiny_chat_llama, tofu_dir):
    """The packed token-tree rows (sdpa/eager models) and the prompt-cache path each agree with whole sequences."""
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_llama).eval()
    formatter = PromptFormatter(AutoTokenizer.from_pretrained(tiny_chat_llama), max_length=512)
    questions, groups = tofu_groups(tofu_dir, 4)
    expected = grouped_nlls(model, formatter, questions, groups, batch_size=5)
    assert scoring._takes_packed_rows(model, formatter)
    for path in (scoring._packed_nlls, scoring._cached_prefix_nlls):
        got = path(model, formatter, questions, groups, 2)
        for row_got, row_expected in zip(got, expected):
            assert row_got == pytest.approx(row_expected, abs=1e-5)


def test_packed_rows_with_eager_attention_take_an_additive_mask(tiny_llama, tofu_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="eager").eval()
    formatter = PromptFormatter(AutoTokenizer.from_pretrained(tiny_llama), max_length=512)
    questions, groups = tofu_groups(tofu_dir, 3)
    expected = grouped_nlls(model, formatter, questions, groups)
    assert scoring._takes_packed_rows(model, formatter)
    for row_got, row_expected in zip(scoring._packed_nlls(model, formatter, questions, groups, 4), expected):
        assert row_got == pytest.approx(row_expected, abs=1e-5)


def test_a_model_without_custom_masks_takes_the_prompt_cache_path(tiny_llama, tofu_dir, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    model.config._attn_implementation = "flash_attention_2"  # not sdpa/eager: never packed (the probe is skipped)
    monkeypatch.setattr(scoring, "_cached_prefix_nlls", lambda *a, **k: "cached")
    formatter = PromptFormatter(AutoTokenizer.from_pretrained(tiny_llama), max_length=512)
    assert not scoring._takes_packed_rows(model, formatter)
    assert shared_prefix_nlls(model, formatter, ["Who?"], [["Me."]]) == "cached"


def test_the_token_tree_runs_each_shared_answer_prefix_once():
    job = scoring._Job(0, [1, 2, 3])
    for position, ids in enumerate([[7, 8, 9, 2], [7, 8, 5, 2], [7, 6, 2], [4, 2]]):
        job.answers.append((position, ids))
    tree = scoring._TokenTree(job)
    # nodes: 7, 8, 9, 2 | 5, 2 | 6, 2 | 4, 2  ->  10 of the 13 answer tokens
    assert tree.tokens == [7, 8, 9, 2, 5, 2, 6, 2, 4, 2]
    assert tree.parents == [-1, 0, 1, 2, 1, 4, 0, 6, -1, 8]
    assert tree.depths == [1, 2, 3, 4, 3, 4, 2, 3, 1, 2]
    assert tree.paths == [[0, 1, 2, 3], [0, 1, 4, 5], [0, 6, 7], [8, 9]]
    assert tree.length == 3 + 10


def test_the_output_layer_in_chunks_gives_each_scored_token_its_nll():
    """`_head_nlls` against a float64 reference written here: positions scored by several targets (a token tree's
    shared prefix), positions scored by none (padding), and chunks that cut through a position's targets."""
    torch.manual_seed(0)
    head = torch.nn.Linear(6, 11, bias=False)
    hidden = torch.randn(2, 5, 6)
    rows = torch.tensor([0, 0, 0, 1, 1, 1, 1, 0])
    columns = torch.tensor([1, 1, 4, 0, 0, 0, 3, 2])
    targets = torch.tensor([3, 7, 0, 10, 2, 2, 5, 9])
    expected = []
    for r, c, t in zip(rows.tolist(), columns.tolist(), targets.tolist()):
        logits = hidden[r, c].double() @ head.weight.double().T
        expected.append(math.log(sum(math.exp(v) for v in logits.tolist())) - logits[t].item())
    calls = []
    original = head.forward
    head.forward = lambda x: calls.append(len(x)) or original(x)
    for chunk in (1, 2, 3, 64):
        calls.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(scoring, "HEAD_POSITIONS_PER_CHUNK", chunk)
            got = scoring._head_nlls(head, hidden, rows, columns, targets)
        assert got.tolist() == pytest.approx(expected, abs=1e-5)
        assert sum(calls) == 5 and max(calls) <= chunk  # the 5 distinct positions once each, never padding


def test_packed_scoring_applies_the_output_layer_only_where_it_scores(tiny_chat_llama, tofu_dir, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_llama).eval()
    formatter = PromptFormatter(AutoTokenizer.from_pretrained(tiny_chat_llama), max_length=512)
    questions, groups = tofu_groups(tofu_dir, 3)
    expected = grouped_nlls(model, formatter, questions, groups, batch_size=5)
    calls = []
    original = scoring._head_nlls
    monkeypatch.setattr(scoring, "_head_nlls", lambda *a: calls.append(len(a[2])) or original(*a))
    got = scoring._packed_nlls(model, formatter, questions, groups, 2)
    assert calls and scoring._split_head(model) is not None  # the fast path ran
    for row_got, row_expected in zip(got, expected):
        assert row_got == pytest.approx(row_expected, abs=1e-5)
    # a model whose logits are not its output layer on the decoder's state (here: scaled) keeps the whole logits
    scaled = AutoModelForCausalLM.from_pretrained(tiny_chat_llama).eval()
    forward = scaled.forward

    def scaled_forward(*args, **kwargs):
        output = forward(*args, **kwargs)
        output.logits = output.logits * 0.5
        return output

    scaled.forward = scaled_forward
    assert scoring._split_head(scaled) is None
    calls.clear()
    halved = scoring._packed_nlls(scaled, formatter, questions[:1], groups[:1], 2)
    plain = grouped_nlls(scaled, formatter, questions[:1], groups[:1])
    assert not calls and halved[0] == pytest.approx(plain[0], abs=1e-5)
