"""The TOFU indicators and aggregates against values worked out by hand; the judge loaders offline."""

from __future__ import annotations

import math

import pytest
import torch

from doplus_cli.evaluation import metrics
from doplus_cli.evaluation.judges import NLIJudge, load_embedder, load_nli, normalise_label
from doplus_cli.evaluation.metrics import (
    AGGREGATES,
    INDICATORS,
    Aggregate,
    choice_probability,
    cosine_similarities,
    entailment_score,
    harmonic_mean,
    mean_token_entropy,
    model_utility,
    overall,
    probability,
    rouge_l_recall,
    targeted_forget_efficacy,
    token_entropy,
    truth_ratio_forget,
    truth_ratio_other,
    truth_ratios,
    untargeted_forget_efficacy,
)

# ---------------------------------------------------------------------------------------------- indicators


def test_rouge_l_recall_counts_the_longest_common_subsequence():
    # reference words: the cat was sit(ting) on a mat (7); generation: the cat sat on the mat
    # LCS = the, cat, on, mat = 4 words
    assert rouge_l_recall("the cat sat on the mat", "the cat was sitting on a mat") == pytest.approx(4 / 7)
    # recall, not precision: every reference word is in the (longer) generation
    assert rouge_l_recall("yes the cat sat there", "the cat sat") == pytest.approx(1.0)
    assert rouge_l_recall("dogs bark", "the cat sat") == 0.0


def test_rouge_l_recall_is_stemmed_and_case_insensitive():
    # stems: cats -> cat, sits / sitting -> sit; reference [the, cat, sit] all matched in order
    assert rouge_l_recall("The CATS are sitting.", "the cat sits") == pytest.approx(1.0)
    # order matters: LCS of [mat, the, cat] against [the, cat, mat] is 2
    assert rouge_l_recall("mat the cat", "the cat mat") == pytest.approx(2 / 3)


def test_probability_is_the_mean_of_exp_minus_nll():
    # exp(-0) = 1, exp(-ln 2) = 0.5
    assert probability([0.0, math.log(2)]) == pytest.approx(0.75)
    with pytest.raises(ValueError):
        probability([])


def test_choice_probability_normalises_over_true_and_perturbed():
    # q1: p(true) = 1/2, p(perturbed) = 1/4, 1/4 -> 0.5 / 1.0 = 0.5
    # q2: p(true) = 1, p(perturbed) = 1/3 -> 1 / (4/3) = 0.75
    true_nlls = [math.log(2), 0.0]
    perturbed = [[math.log(4), math.log(4)], [math.log(3)]]
    assert choice_probability(true_nlls, perturbed) == pytest.approx((0.5 + 0.75) / 2)
    # large NLLs do not underflow to 0/0: p(true) = e^-1000, p(perturbed) = e^-1001
    assert choice_probability([1000.0], [[1001.0]]) == pytest.approx(1 / (1 + math.exp(-1)))
    with pytest.raises(ValueError):
        choice_probability([1.0, 2.0], [[1.0]])


def test_truth_ratios_use_the_mean_perturbed_nll():
    ratios = truth_ratios([1.0, 2.0], [[2.0, 3.0], [1.0]])
    # exp(mean(2, 3) - 1) = exp(1.5); exp(1 - 2) = exp(-1)
    assert ratios == pytest.approx([math.exp(1.5), math.exp(-1.0)])


def test_truth_ratio_forget_and_other():
    ratios = [2.0, 0.5, 1.0]
    # min(r, 1/r) = 0.5, 0.5, 1 -> 1 - 2/3
    assert truth_ratio_forget(ratios) == pytest.approx(1 / 3)
    # max(0, 1 - 1/r) = 0.5, 0 (1 - 2 < 0), 0 -> 0.5 / 3
    assert truth_ratio_other(ratios) == pytest.approx(1 / 6)
    with pytest.raises(ValueError):
        truth_ratio_forget([])


def test_token_entropy_by_hand():
    # two tokens twice each: H = ln 2 over ln 4
    assert token_entropy([1, 1, 2, 2]) == pytest.approx(0.5)
    assert token_entropy([1, 2, 3]) == pytest.approx(1.0)
    assert token_entropy([7, 7, 7]) == 0.0
    # frequencies 3/4, 1/4
    expected = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) / math.log(4)
    assert token_entropy([1, 1, 1, 2]) == pytest.approx(expected)
    assert token_entropy([5]) == 0.0 and token_entropy([]) == 0.0


def test_mean_token_entropy():
    assert mean_token_entropy([[1, 1, 2, 2], [1, 2, 3]]) == pytest.approx(0.75)
    with pytest.raises(ValueError):
        mean_token_entropy([])


def test_cosine_similarities_row_wise_and_floored_at_zero():
    a = torch.tensor([[1.0, 0.0], [1.0, 0.0], [3.0, 4.0]])
    b = torch.tensor([[2.0, 0.0], [-1.0, 0.0], [4.0, 3.0]])
    # 1; -1 floored to 0; (12 + 12) / (5 * 5)
    assert cosine_similarities(a, b) == pytest.approx([1.0, 0.0, 24 / 25])
    with pytest.raises(ValueError):
        cosine_similarities(a, b[:2])


def test_entailment_score_with_rouge_cutoff():
    labels = ["entailment", "entailment", "neutral", "entailment"]
    rouge = [0.5, 0.05, 0.9, 0.1]
    # pair 2 is entailed but its ROUGE 0.05 < 0.1; pair 3 is neutral; pair 4 sits on the cut-off (kept)
    assert entailment_score(labels, rouge) == pytest.approx(2 / 4)
    assert entailment_score(labels, rouge, cutoff=0.0) == pytest.approx(3 / 4)
    with pytest.raises(ValueError):
        entailment_score(labels, rouge[:2])


def test_harmonic_mean():
    assert harmonic_mean([0.5, 1.0]) == pytest.approx(2 / 3)
    assert harmonic_mean([0.2, 0.0, 0.9]) == 0.0
    with pytest.raises(ValueError):
        harmonic_mean([])


def test_registries_name_every_function():
    assert INDICATORS["rouge_l_recall"] is rouge_l_recall
    assert INDICATORS["token_entropy"] is token_entropy
    assert INDICATORS["entailment_score"] is entailment_score
    assert set(AGGREGATES) == {"MU", "UFE", "TFE", "OVR"}
    assert AGGREGATES["MU"] is model_utility


# ---------------------------------------------------------------------------------------------- aggregates

SETS = ["retain", "real_authors", "world_facts"]
SIX = ["rouge", "probability", "truth_ratio", "token_entropy", "cosine_similarity", "entailment"]


def _utility_values() -> dict[str, float]:
    """rouge, probability, truth_ratio at 0.5 and the other three at 1.0 in each set: 9 x 0.5, 9 x 1.0."""
    return {f"{s}_{i}": (0.5 if i in ("rouge", "probability", "truth_ratio") else 1.0) for s in SETS for i in SIX}


def _forget_values() -> dict[str, float]:
    return {
        "forget_rouge": 0.4, "forget_probability": 0.2, "forget_truth_ratio": 0.6, "forget_cosine_similarity": 0.8,
        "forget_entailment": 0.0, "forget_token_entropy": 0.5, "forget_idk_entailment": 1.0,
    }


def test_model_utility_over_all_18_values():
    mu = model_utility(_utility_values())
    # 18 / (9 * 2 + 9 * 1)
    assert mu.value == pytest.approx(18 / 27)
    assert mu.name == "MU" and len(mu.used) == 18 and mu.missing == [] and mu.note == ""


def test_model_utility_without_nli_leaves_entailment_out_and_says_why():
    values = _utility_values()
    for s in SETS:
        values[f"{s}_entailment"] = None
    mu = model_utility(values, {"entailment": "no NLI model"})
    # 15 values left: 9 x 0.5 and 6 x 1.0 -> 15 / (18 + 6)
    assert mu.value == pytest.approx(15 / 24)
    assert sorted(mu.missing) == ["real_authors_entailment", "retain_entailment", "world_facts_entailment"]
    assert mu.note == "MU over 15 of 18 values: no NLI model"
    assert "retain_entailment" not in mu.used and len(mu.used) == 15


def test_model_utility_names_an_absent_value_without_a_reason():
    values = _utility_values()
    del values["retain_rouge"]
    mu = model_utility(values)
    # 17 values: 8 x 0.5, 9 x 1.0 -> 17 / (16 + 9)
    assert mu.value == pytest.approx(17 / 25)
    assert mu.missing == ["retain_rouge"]
    assert mu.note.startswith("MU over 17 of 18 values:") and "retain_rouge" in mu.note


def test_model_utility_of_nothing_is_none_not_zero():
    mu = model_utility({})
    assert mu.value is None and len(mu.missing) == 18


def test_untargeted_forget_efficacy():
    ufe = untargeted_forget_efficacy(_forget_values())
    # 1 - mean(0.4, 0.2, 0.6, 0.8, 0.0): a value of 0.0 enters, it is not "missing"
    assert ufe.value == pytest.approx(1 - 2.0 / 5)
    assert ufe.missing == [] and ufe.note == ""
    values = _forget_values()
    values["forget_entailment"] = None
    ufe = untargeted_forget_efficacy(values, {"entailment": "no NLI model"})
    assert ufe.value == pytest.approx(1 - 2.0 / 4)
    assert ufe.missing == ["forget_entailment"]
    assert ufe.note == "UFE over 4 of 5 indicators: no NLI model"


def test_targeted_forget_efficacy():
    tfe = targeted_forget_efficacy(_forget_values())
    # harmonic mean of 0.5 and 1.0
    assert tfe.value == pytest.approx(2 / 3)
    values = _forget_values()
    del values["forget_idk_entailment"]
    tfe = targeted_forget_efficacy(values, {"entailment": "no NLI model"})
    assert tfe.value == pytest.approx(0.5)
    assert tfe.note == "TFE over 1 of 2 indicators: no NLI model"
    assert targeted_forget_efficacy({}).value is None


def test_overall_targeted_and_untargeted():
    values = {**_utility_values(), **_forget_values()}
    tfe, ufe, mu = targeted_forget_efficacy(values), untargeted_forget_efficacy(values), model_utility(values)
    # TFE = 2/3, UFE = 0.6, MU = 2/3
    targeted = overall(tfe, ufe, mu, targeted=True)
    assert targeted.value == pytest.approx(0.25 * (2 / 3 + 0.6) + 0.5 * (2 / 3))
    untargeted = overall(tfe, ufe, mu, targeted=False)
    assert untargeted.value == pytest.approx(0.5 * (0.6 + 2 / 3))
    assert targeted.name == untargeted.name == "OVR" and targeted.note == ""
    assert "forget_idk_entailment" in targeted.used and "forget_idk_entailment" not in untargeted.used


def test_overall_carries_notes_and_is_none_without_a_part():
    values = {**_utility_values(), **_forget_values()}
    for key in [f"{s}_entailment" for s in SETS] + ["forget_entailment", "forget_idk_entailment"]:
        values[key] = None
    reasons = {"entailment": "no NLI model"}
    tfe, ufe = targeted_forget_efficacy(values, reasons), untargeted_forget_efficacy(values, reasons)
    mu = model_utility(values, reasons)
    result = overall(tfe, ufe, mu, targeted=True)
    assert result.value == pytest.approx(0.25 * (0.5 + 0.5) + 0.5 * (15 / 24))
    assert "UFE over 4 of 5 indicators: no NLI model" in result.note
    assert "MU over 15 of 18 values: no NLI model" in result.note
    assert "forget_entailment" in result.missing
    nothing = Aggregate("MU", None, [], ["retain_rouge"], "MU over 0 of 18 values: not evaluated")
    broken = overall(tfe, ufe, nothing, targeted=False)
    assert broken.value is None and "MU" in broken.note and "not evaluated" in broken.note


def test_indicators_equal_their_formulas_on_random_and_extreme_inputs():
    """The formulas the docstrings state, computed here another way (torch float64 softmax, statistics), on
    random NLLs and on NLLs so large that exp(-NLL) underflows to 0 (a plain ratio would be 0/0)."""
    import random
    import statistics

    rng = random.Random(0)
    for scale in (1.0, 800.0):
        true = [scale + rng.uniform(0, 5) for _ in range(6)]
        perturbed = [[scale + rng.uniform(0, 5) for _ in range(4)] for _ in range(6)]
        shares = [torch.softmax(-torch.tensor([t, *p], dtype=torch.float64), 0)[0].item() for t, p in zip(true,
                                                                                                         perturbed)]
        assert choice_probability(true, perturbed) == pytest.approx(statistics.fmean(shares), rel=1e-12)
        assert probability(true) == pytest.approx(statistics.fmean(math.exp(-t) for t in true), rel=1e-12)
        ratios = truth_ratios(true, perturbed)
        assert ratios == pytest.approx([math.exp(statistics.fmean(p) - t) for t, p in zip(true, perturbed)])
    ratios = [rng.uniform(0.1, 1) for _ in range(4)] + [rng.uniform(1, 10) for _ in range(5)]
    assert truth_ratio_forget(ratios) == pytest.approx(truth_ratio_forget([1 / r for r in ratios]))  # symmetric
    assert truth_ratio_forget(ratios) == pytest.approx(1 - statistics.fmean(min(r, 1 / r) for r in ratios))
    assert truth_ratio_other([r for r in ratios if r < 1]) == 0.0  # a paraphrase less likely than the perturbed
    assert truth_ratio_other(ratios) == pytest.approx(statistics.fmean(max(0, 1 - 1 / r) for r in ratios))
    values = [rng.uniform(0.01, 1) for _ in range(7)]
    assert metrics.harmonic_mean(values) == pytest.approx(statistics.harmonic_mean(values), rel=1e-12)


# ---------------------------------------------------------------------------------------------- judges


@pytest.mark.slow
def test_packaged_embedder_works_offline():
    embedder, reason = load_embedder()
    assert reason is None and embedder is not None
    same = "The author was born in Paris in 1952."
    vectors = embedder.encode([same, same, "Photosynthesis converts sunlight into chemical energy."])
    assert vectors.dtype == torch.float32 and vectors.shape[0] == 3
    identical, unrelated = cosine_similarities(vectors[:2], vectors[1:])
    assert identical > 0.99
    assert unrelated < 0.5


def test_missing_nli_model_fails_fast_with_one_line():
    judge, reason = load_nli("nobody-here/no-such-nli-model")
    assert judge is None
    assert reason.startswith("no NLI model: 'nobody-here/no-such-nli-model' could not be loaded (")
    assert "\n" not in reason


def test_missing_embedder_returns_a_reason():
    embedder, reason = load_embedder("nobody-here/no-such-embedder")
    assert embedder is None and "nobody-here/no-such-embedder" in reason and "\n" not in reason


@pytest.mark.parametrize(
    "label, expected",
    [("ENTAILMENT", "entailment"), ("entailment", "entailment"), ("not_entailment", "neutral"),
     ("Neutral", "neutral"), ("CONTRADICTION", "contradiction"), ("non-entailment", "neutral"), ("LABEL_0", None)],
)
def test_normalise_label(label, expected):
    assert normalise_label(label) == expected


def _tiny_classifier(folder, id2label: dict[int, str], winner: int | None = None):
    """A 1-layer random BERT classifier with a hand-written WordPiece vocabulary, saved to `folder`. With
    `winner`, the head always predicts that class (zero weights, a large bias)."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    words = "[PAD] [UNK] [CLS] [SEP] [MASK] the cat sat on mat dog is a i don't know".split()
    (folder / "vocab.txt").write_text("\n".join(words) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(folder / "vocab.txt"))
    config = BertConfig(
        vocab_size=len(words), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=64, num_labels=len(id2label), id2label=id2label,
        label2id={v: k for k, v in id2label.items()},
    )
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    if winner is not None:
        with torch.no_grad():
            model.classifier.weight.zero_()
            model.classifier.bias.zero_()
            model.classifier.bias[winner] = 100.0
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_nli_judge_labels_are_normalised_and_batched(tmp_path):
    folder = _tiny_classifier(tmp_path, {0: "ENTAILMENT", 1: "NEUTRAL", 2: "CONTRADICTION"}, winner=2)
    judge, reason = load_nli(str(folder))
    assert reason is None and isinstance(judge, NLIJudge) and judge.name == str(folder)
    premises = ["the cat sat on the mat"] * 4 + ["i don't know " * 100]  # the last one is truncated
    hypotheses = ["the dog sat", "a cat", "the mat is a cat", "dog", "the cat"]
    assert judge.labels(premises, hypotheses, batch_size=2) == ["contradiction"] * 5


def test_nli_judge_random_head_gives_nli_labels(tmp_path):
    judge, reason = load_nli(str(_tiny_classifier(tmp_path, {0: "entailment", 1: "not_entailment"})))
    assert reason is None
    labels = judge.labels(["the cat sat", "a dog"], ["the mat", "the cat is a dog"])
    assert len(labels) == 2 and set(labels) <= {"entailment", "neutral"}


def test_non_nli_classifier_is_refused(tmp_path):
    judge, reason = load_nli(str(_tiny_classifier(tmp_path, {0: "LABEL_0", 1: "LABEL_1"})))
    assert judge is None and "not an NLI classifier" in reason and "\n" not in reason
