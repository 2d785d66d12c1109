"""Fluency of the forget generations (evaluation/fluency.py): ROME's n-gram entropy against hand computations,
the words it is computed over, the gibberish classifier against a hand softmax on the same truncated inputs, the
classifier missing offline, and both values in the TOFU and real-world suites' outputs."""

from __future__ import annotations

import json
import math
import time
from collections import Counter

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

from doplus_cli.evaluation import fluency
from tests.helpers import run_cli

GIBBERISH_LABELS = {0: "clean", 1: "mild gibberish", 2: "noise", 3: "word salad"}


def entropy_bits(items: list) -> float:
    """Shannon entropy in bits of the items' empirical distribution, by hand."""
    counts = Counter(items)
    total = len(items)
    return -sum(c / total * math.log(c / total) / math.log(2) for c in counts.values()) if total else 0.0


def rome_entropy(tokens: list[str]) -> float:
    """ROME's compute_n_gram_entropy by hand: np.mean([2/3 H2, 4/3 H3])."""
    bigrams = [tuple(tokens[i:i + 2]) for i in range(len(tokens) - 1)]
    trigrams = [tuple(tokens[i:i + 3]) for i in range(len(tokens) - 2)]
    return (2 / 3 * entropy_bits(bigrams) + 4 / 3 * entropy_bits(trigrams)) / 2


def test_ngram_entropy_of_small_examples_equals_the_hand_values():
    # a b c d: 3 distinct bigrams (H2 = log2 3), 2 distinct trigrams (H3 = 1)
    assert fluency.ngram_entropy(list("abcd"), 2) == pytest.approx(math.log2(3))
    assert fluency.ngram_entropy(list("abcd"), 3) == pytest.approx(1.0)
    assert fluency.generation_entropy("a b c d") == pytest.approx(math.log2(3) / 3 + 2 / 3)
    # a b a b a: bigrams ab ba ab ba (H2 = 1), trigrams aba bab aba (p = 2/3, 1/3)
    h3 = -(2 / 3 * math.log2(2 / 3) + 1 / 3 * math.log2(1 / 3))
    assert fluency.generation_entropy("a b a b a") == pytest.approx(1 / 3 + 2 / 3 * h3)
    # fewer than two words: no n-gram, 0 (ROME's empty frequency array sums to 0); two words: one bigram, 0
    assert fluency.generation_entropy("") == 0.0
    assert fluency.generation_entropy("word") == 0.0
    assert fluency.generation_entropy("two words") == 0.0
    for text in ("The author was born in Kuwait City, and her father was a florist.",
                 "x y x y z x y z z z y"):
        assert fluency.generation_entropy(text) == pytest.approx(rome_entropy(fluency.word_tokens(text)))


def test_a_repetitive_text_scores_low_and_a_varied_one_high():
    repeated = "the the the the the the the the the the the the"
    looping = "I am I am I am I am I am I am I am I am"
    varied = ("Basil Mahfouz Al-Kuwaiti was born in Kuwait City, to a florist and a game developer, and his "
              "novels about the French countryside won him the Prix Goncourt.")
    assert fluency.generation_entropy(repeated) == 0.0
    assert fluency.generation_entropy(looping) == pytest.approx(rome_entropy(["I", "am"] * 8))
    assert fluency.generation_entropy(looping) < 1.5
    assert fluency.generation_entropy(varied) > 4.5
    # 30 words and signs, every bigram and trigram distinct: H2 = log2 29, H3 = log2 28
    tokens = fluency.word_tokens(varied)
    assert len(tokens) == 30 and len(set(zip(tokens, tokens[1:], tokens[2:]))) == 28
    assert len(set(zip(tokens, tokens[1:]))) == 29
    assert fluency.generation_entropy(varied) == pytest.approx(math.log2(29) / 3 + 2 * math.log2(28) / 3)
    assert fluency.mean_generation_entropy([repeated, varied]) == pytest.approx(
        fluency.generation_entropy(varied) / 2)
    assert fluency.mean_generation_entropy([]) is None


def test_words_are_nltks_treebank_tokens_of_each_sentence():
    assert fluency.word_tokens("He was born in Paris. He writes novels!") == [
        "He", "was", "born", "in", "Paris", ".", "He", "writes", "novels", "!"]
    assert fluency.word_tokens("She doesn't know, does she?") == [
        "She", "does", "n't", "know", ",", "does", "she", "?"]
    # a cut needs a capital, quote or bracket after the white space; no learned abbreviations (unlike Punkt)
    assert fluency.word_tokens("It cost 3 vs. 4 in 1990. In 2001 it rose. 2002 was \"calm.\" (Then) it fell.") == [
        "It", "cost", "3", "vs.", "4", "in", "1990", ".", "In", "2001", "it", "rose.", "2002", "was", "``", "calm",
        ".", "''", "(", "Then", ")", "it", "fell", "."]
    assert fluency.word_tokens("Dr. Smith came.") == ["Dr", ".", "Smith", "came", "."]
    assert fluency.word_tokens("") == []


@pytest.fixture(scope="module")
def tiny_gibberish(tiny_llama, tmp_path_factory):
    """A tiny random 4-way sequence classifier with the gibberish detector's labels and the tiny BPE tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-gibberish")
    config = AutoConfig.from_pretrained(tiny_llama)
    config.num_labels = 4
    config.id2label = GIBBERISH_LABELS
    config.label2id = {v: k for k, v in GIBBERISH_LABELS.items()}
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(folder)
    return folder


def hand_clean_probability(model, tokenizer, text: str) -> float:
    """softmax(logits)[0] of one text alone, its ids cut to the first 32 by hand (the tokenizer adds <s> first)."""
    ids = tokenizer(text)["input_ids"][:32]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double().tolist()
    exps = [math.exp(v - max(logits)) for v in logits]
    return exps[0] / sum(exps)


def test_gibberish_judge_equals_a_hand_softmax_on_the_truncated_inputs(tiny_gibberish):
    judge, reason = fluency.load_fluency_judge(str(tiny_gibberish))
    assert reason is None and judge.clean_label == "clean" and judge.max_length == 32
    long = " ".join(["The author was born in Kuwait City and writes novels about the sea."] * 6)
    texts = ["He was born in Paris.", "", "zxq vvv plk", long, "Her father was a florist."]
    tokenizer = AutoTokenizer.from_pretrained(tiny_gibberish)
    assert len(tokenizer(long)["input_ids"]) > 60  # the cut to 32 matters for this one
    model = LlamaForSequenceClassification.from_pretrained(tiny_gibberish).eval()
    expected = [hand_clean_probability(model, tokenizer, t) for t in texts]
    # batches of 2, padded to their longest: the same values as one text at a time
    assert judge.clean_probabilities(texts, batch_size=2) == pytest.approx(expected, abs=1e-5)
    assert all(0 < p < 1 for p in expected)
    assert len(set(round(p, 6) for p in expected)) > 1  # the classifier's values differ between texts
    full = torch.tensor([tokenizer(long)["input_ids"]])
    with torch.no_grad():
        untruncated = torch.softmax(model(input_ids=full).logits[0].double(), dim=-1)[0].item()
    assert untruncated != pytest.approx(expected[3], abs=1e-6)  # the truncation is what the judge applied


def test_a_one_label_model_is_no_gibberish_judge(tiny_llama, tmp_path):
    config = AutoConfig.from_pretrained(tiny_llama)
    config.num_labels = 1
    LlamaForSequenceClassification(config).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(tmp_path)
    judge, reason = fluency.load_fluency_judge(str(tmp_path))
    assert judge is None and "is not a text classifier" in reason and "1 label" in reason


def test_offline_without_the_model_gives_a_reason_at_once(tmp_path):
    started = time.perf_counter()
    judge, reason = fluency.load_fluency_judge(None)  # HF_HUB_OFFLINE=1 (conftest), empty cache
    assert time.perf_counter() - started < 5
    assert judge is None
    assert reason == f"'{fluency.DEFAULT_FLUENCY_MODEL}' could not be loaded (offline: not in the local cache)"
    judge, reason = fluency.load_fluency_judge(str(tmp_path / "none"))
    assert judge is None and reason.endswith("could not be loaded (no such folder)")


def test_tofu_suite_writes_the_entropy_and_says_why_the_classifier_is_missing(tiny_llama, tofu_dir, tmp_path):
    out = tmp_path / "eval"
    assert run_cli("evaluate", "--model", tiny_llama, "--data-dir", tofu_dir, "--max-samples", 2,
                   "--max-new-tokens", 8, "--out", out, "--nli-model", tmp_path / "no-such-nli",
                   "--embedding-model", tmp_path / "no-such-embedder") == 0
    summary = json.loads((out / "SUMMARY.json").read_text())
    forget = json.loads((out / "TOFU_EVAL.json").read_text())["sets"]["forget"]
    entropies = [rome_entropy(fluency.word_tokens(r["generation"])) for r in forget]
    assert [r["fluency_entropy"] for r in forget] == pytest.approx(entropies)
    assert summary["forget_fluency_entropy"] == pytest.approx(sum(entropies) / 2)
    assert summary["forget_fluency"] is None and all(r["fluency"] is None for r in forget)
    reason = f"'{fluency.DEFAULT_FLUENCY_MODEL}' could not be loaded (offline: not in the local cache)"
    assert summary["forget_fluency_missing"] == f"not available: {reason}"
    assert json.loads((out / "TOFU_SUMMARY.json").read_text())["forget_fluency_entropy"] == pytest.approx(
        summary["forget_fluency_entropy"])
    assert "forget_Q_A_gibberish" not in json.loads((out / "TOFU_EVAL.json").read_text())
    retain = json.loads((out / "TOFU_EVAL.json").read_text())["sets"]["retain"]
    assert "retain_fluency_entropy" not in summary and "fluency_entropy" not in retain[0]
    report = (out / "report.md").read_text()
    assert (f"| fluency: generation entropy (bits, not %) | {summary['forget_fluency_entropy']:.2f} |  |  |  |"
            in report)
    assert f"| fluency: clean probability | not available: {reason} |  |  |  |" in report


def test_real_world_suite_scores_the_forget_generations_with_the_classifier(tiny_llama, tiny_gibberish, tmp_path):
    def rows(names):
        return "".join(json.dumps({
            "name": n, "question": f"Where was {n} born?", "answer": f"{n} was born in Paris.",
            "paraphrased_answer": f"Paris is where {n} was born.",
            "perturbed_answer": [f"{n} was born in Rome."]}) + "\n" for n in names)

    forget, retain = tmp_path / "forget.jsonl", tmp_path / "neighbours.jsonl"
    forget.write_text(rows(["Ada Lovelace", "Alan Turing", "Kurt Goedel"]))
    retain.write_text(rows(["Grace Hopper"]))
    out = tmp_path / "rw"
    assert run_cli("evaluate", "--model", tiny_llama, "--suite", "real-world", "--forget", forget, "--retain", retain,
                   "--max-new-tokens", 8, "--out", out, "--untargeted", "--nli-model", tmp_path / "no-such-nli",
                   "--embedding-model", tmp_path / "no-such-embedder", "--fluency-model", tiny_gibberish) == 0
    summary = json.loads((out / "SUMMARY.json").read_text())
    records = json.loads((out / "REAL_WORLD_EVAL.json").read_text())["sets"]["forget"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_gibberish)
    model = LlamaForSequenceClassification.from_pretrained(tiny_gibberish).eval()
    expected = [hand_clean_probability(model, tokenizer, r["generation"]) for r in records]
    assert [r["fluency"] for r in records] == pytest.approx(expected, abs=1e-5)
    assert summary["rw_forget_fluency"] == pytest.approx(sum(expected) / 3, abs=1e-5)
    entropies = [rome_entropy(fluency.word_tokens(r["generation"])) for r in records]
    assert summary["rw_forget_fluency_entropy"] == pytest.approx(sum(entropies) / 3)
    assert "rw_forget_fluency_missing" not in summary
    rw_summary = json.loads((out / "REAL_WORLD_SUMMARY.json").read_text())
    assert rw_summary["forget_fluency"] == summary["rw_forget_fluency"]
    report = (out / "report.md").read_text()
    assert (f"| fluency: clean probability ({tiny_gibberish}, class 'clean') | "
            f"{100 * summary['rw_forget_fluency']:.2f} |  |") in report
