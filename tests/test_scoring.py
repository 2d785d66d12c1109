"""Issue #13: NLLs scored from each question's shared prompt equal the whole-sequence batched NLLs."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from doplus_cli.data.formatting import PromptFormatter
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
