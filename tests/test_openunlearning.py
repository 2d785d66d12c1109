"""OpenUnlearning's metrics against values worked out by hand, the token statistics against a plain
float64 forward, and a retain model's logs in OpenUnlearning's layout read and used end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from doplus_cli.data.formatting import IGNORE_INDEX, PromptFormatter
from doplus_cli.errors import UserError
from doplus_cli.evaluation import openunlearning as ou
from doplus_cli.evaluation.privacy import read_retain_logs
from doplus_cli.evaluation.scoring import answer_token_stats, per_token_stats
from tests.helpers import run_cli


def test_ks_p_values_by_hand():
    # n = m = 3, fully separated: D = 1, reached by 2 of the C(6, 3) = 20 equally likely orderings
    assert ou.forget_quality([1, 2, 3], [4, 5, 6]) == pytest.approx(2 / 20)
    assert ou.forget_quality([1, 2, 3, 4], [5, 6, 7, 8]) == pytest.approx(2 / 70)
    # n = m = 2 interleaved: D = 1/2, and every one of the 6 orderings has D >= 1/2
    assert ou.forget_quality([1, 3], [2, 4]) == pytest.approx(1.0)


def test_auc_on_fixed_scores():
    # holdout 0.8 beats all 3 forget scores; holdout 0.4 beats 0.1 and 0.35 and ties 0.4 (one half): 5.5 of 6
    assert ou.mia_auc([0.1, 0.4, 0.35], [0.8, 0.4]) == pytest.approx(5.5 / 6)
    assert ou.mia_auc([1.0, 2.0], [3.0, 4.0]) == 1.0 and ou.mia_auc([3.0, 4.0], [1.0, 2.0]) == 0.0


def test_min_k_and_loss_and_zlib_by_hand():
    lp = [-0.1, -2.0, -0.5, -3.0, -0.2]
    assert ou.min_k_score(lp, 0.4) == pytest.approx(2.5)  # int(5 * 0.4) = 2 lowest: -3, -2
    assert ou.min_k_score(lp, 0.1) == pytest.approx(3.0)  # at least one token
    assert ou.loss_score(lp) == pytest.approx(5.8 / 5)
    assert ou.zlib_score(lp, "abc") == pytest.approx(5.8 / 5 / 11)  # zlib.compress(b"abc") is 11 bytes


def test_min_k_plus_plus_on_fixed_log_probabilities():
    # three positions over a 2-token vocabulary: p = (0.5, 0.5) target 0; p = (0.8, 0.2) target 1; target 0
    log_probs = torch.tensor([[0.5, 0.5], [0.8, 0.2], [0.8, 0.2]], dtype=torch.float64).log()
    stats = per_token_stats(log_probs, [0, 1, 0])
    # a two-point distribution: mu = sum p log p, s2 = p q (log p - log q)^2; z = (log p_x - mu) / s
    assert stats["means"] == pytest.approx([math.log(0.5), 0.8 * math.log(0.8) + 0.2 * math.log(0.2),
                                            0.8 * math.log(0.8) + 0.2 * math.log(0.2)])
    assert stats["variances"] == pytest.approx([0.0, 0.16 * math.log(4) ** 2, 0.16 * math.log(4) ** 2], abs=1e-12)
    assert stats["predicted"] == [0, 0, 0]
    # z = 0 (variance floored at 1e-6, numerator 0), z = -0.8 / 0.4 = -2, z = 0.2 / 0.4 = 0.5
    args = (stats["token_log_probs"], stats["means"], stats["variances"])
    assert ou.min_k_plus_plus_score(*args, k=0.4) == pytest.approx(2.0)
    assert ou.min_k_plus_plus_score(*args, k=0.7) == pytest.approx(1.0)


def test_privleak_memorisation_and_utility_by_hand():
    assert ou.privleak(0.9, 0.5) == pytest.approx(-80.0)  # (0.1 - 0.5) / 0.5 * 100
    assert ou.privleak(0.5, 0.5) == pytest.approx(0.0)
    assert ou.privleak(0.3, 0.6) == pytest.approx((0.7 - 0.4) / 0.4 * 100)
    assert ou.exact_memorization([1, 2, 3, 4], [9, 2, 3, 4]) == 0.75
    assert ou.extraction_strength([1, 2, 3, 4], [9, 2, 3, 4]) == 0.75  # suffix from k = 1: 1 - 1/4
    assert ou.extraction_strength([5, 6, 7], [5, 6, 7]) == 1.0
    assert ou.extraction_strength([1, 1], [2, 3]) == 0.5  # no suffix matches: OpenUnlearning's k = n - 1
    values = dict(zip(ou.OU_MODEL_UTILITY_KEYS, [0.5, 0.25, 1.0, 0.5, 0.5, 0.5, 0.25, 1.0, 0.5]))
    assert ou.model_utility_ou(values) == pytest.approx(9 / (2 + 4 + 1 + 2 + 2 + 2 + 4 + 1 + 2))
    assert ou.model_utility_ou({**values, "wf_Truth_Ratio": 0.0}) == 0.0
    assert ou.model_utility_ou({**values, "wf_Truth_Ratio": None}) is None
    # p(wrong) / p(correct): exp(-(2 + 4) / 2) / exp(-1) = exp(-2)
    assert ou.truth_ratio_scores([1.0], [[2.0, 4.0]]) == pytest.approx([math.exp(-2)])


def test_answer_token_stats_equal_a_plain_forward(tiny_chat_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_llama).eval()
    formatter = PromptFormatter(AutoTokenizer.from_pretrained(tiny_chat_llama), 512)
    pairs = [("Where was Basil born?", "In Kuwait City."), ("Who?", "Nobody at all, I think.")]
    for (question, answer), stats in zip(pairs, answer_token_stats(model, formatter, pairs, batch_size=1)):
        encoded = formatter.encode(question, answer)
        with torch.no_grad():
            log_probs = torch.log_softmax(model(input_ids=torch.tensor([encoded.input_ids])).logits[0].double(), -1)
        positions = [t for t in range(1, len(encoded.labels)) if encoded.labels[t] != IGNORE_INDEX]
        assert stats["labels"] == [encoded.labels[t] for t in positions]
        assert stats["token_log_probs"] == pytest.approx([log_probs[t - 1, encoded.labels[t]].item()
                                                          for t in positions], abs=1e-5)
        assert stats["predicted"] == [int(log_probs[t - 1].argmax()) for t in positions]
        assert stats["text"] == answer


def test_retain_logs_in_openunlearning_layout(tmp_path):
    path = tmp_path / "TOFU_EVAL.json"
    path.write_text(json.dumps({"forget_truth_ratio": {"agg_value": 0.6, "value_by_index": {
        "0": {"score": 0.5}, "1": {"score": 2.0}, "2": {"score": None}}}, "mia_min_k": {"agg_value": 0.61}}))
    assert read_retain_logs(str(path)) == ([0.5, 2.0], 0.61)
    path.write_text(json.dumps({"forget_truth_ratio": {"value_by_index": {"0": {"score": "x"}}}}))
    with pytest.raises(UserError, match=r"field 'forget_truth_ratio.value_by_index.0.score' must be a number"):
        read_retain_logs(str(path))
    path.write_text("{\n  oops")
    with pytest.raises(UserError, match=r"TOFU_EVAL.json:2: malformed JSON"):
        read_retain_logs(str(path))


def test_tofu_suite_with_retain_logs_and_holdout(tiny_llama, tofu_dir, tmp_path, capsys):
    logs = tmp_path / "retain_TOFU_EVAL.json"
    retain_scores = [0.2, 0.9, 1.3, 0.05]
    logs.write_text(json.dumps({"forget_truth_ratio": {"value_by_index": {
        str(i): {"score": s} for i, s in enumerate(retain_scores)}}, "mia_min_k": {"agg_value": 0.6}}))
    holdout = tmp_path / "holdout10.json"
    holdout.write_text("".join(json.dumps({"question": f"Who wrote book {i}?", "answer": f"Author {i} did."}) + "\n"
                               for i in range(3)))
    out = tmp_path / "eval"
    assert run_cli("evaluate", "--model", tiny_llama, "--data-dir", tofu_dir, "--max-samples", 3, "--max-new-tokens",
                   2, "--out", out, "--nli-model", tmp_path / "none", "--retain-logs", logs, "--holdout", holdout) == 0
    summary = json.loads((out / "TOFU_SUMMARY.json").read_text())
    evaluation = json.loads((out / "TOFU_EVAL.json").read_text())
    forget = evaluation["sets"]["forget"]
    scores = [evaluation["forget_truth_ratio"]["value_by_index"][str(i)]["score"] for i in range(3)]
    for record, score in zip(forget, scores):  # p(wrong) / p(correct) from the per-sample NLLs, by hand
        wrong = math.exp(-sum(record["nll_perturbed"]) / len(record["nll_perturbed"]))
        assert score == pytest.approx(wrong / math.exp(-record["nll_paraphrased"]))
    # the exact two-sided KS p-value for n = 3, m = 4: count the orderings whose D reaches the observed one
    assert summary["forget_quality"] == pytest.approx(exact_ks(scores, retain_scores))
    assert summary["privleak"] == pytest.approx(((1 - summary["mia_min_k"]) - 0.4) / 0.4 * 100)
    for key in ("mia_loss", "mia_zlib", "mia_min_k_plus_plus", "extraction_strength", "exact_memorization"):
        assert 0.0 <= summary[key] <= 1.0
    mu9 = [summary[k] for k in ou.OU_MODEL_UTILITY_KEYS]
    assert summary["model_utility"] == pytest.approx(0.0 if min(mu9) == 0 else 9 / sum(1 / v for v in mu9))
    assert "forget_quality" in (out / "report.md").read_text()


def exact_ks(a, b):
    """Two-sided exact KS p-value by enumerating every split of the pooled (distinct) values."""
    from itertools import combinations

    pooled = sorted(a + b)
    n, m = len(a), len(b)

    def statistic(first):
        chosen = [pooled[i] for i in first]
        rest = [x for i, x in enumerate(pooled) if i not in first]
        return max(abs(sum(v <= x for v in chosen) / n - sum(v <= x for v in rest) / m) for x in pooled)

    observed = statistic([pooled.index(x) for x in a])
    splits = list(combinations(range(n + m), n))
    return sum(statistic(list(s)) >= observed - 1e-12 for s in splits) / len(splits)


def test_without_retain_logs_forget_quality_is_absent_and_said_why(tiny_llama, tofu_dir, tmp_path):
    out = tmp_path / "eval"
    assert run_cli("evaluate", "--model", tiny_llama, "--data-dir", tofu_dir, "--max-samples", 2, "--max-new-tokens",
                   2, "--out", out, "--nli-model", tmp_path / "none") == 0
    assert json.loads((out / "TOFU_SUMMARY.json").read_text())["forget_quality"] is None
    report = (out / "report.md").read_text()
    assert "forget_quality: absent, no --retain-logs" in report and "no --holdout FILE" in report


def test_privacy_suite_needs_a_holdout_file(tiny_llama, tofu_dir, tmp_path, capsys):
    assert run_cli("evaluate", "--model", tiny_llama, "--suite", "privacy", "--data-dir", tofu_dir,
                   "--out", tmp_path / "e") == 2
    assert "--suite privacy needs --holdout FILE" in capsys.readouterr().err


def test_privacy_suite_alone(tiny_llama, tofu_dir, tmp_path):
    holdout = tmp_path / "holdout10.json"
    holdout.write_text("".join(json.dumps({"question": f"Who wrote book {i}?", "answer": f"Author {i} did."}) + "\n"
                               for i in range(4)))
    out = tmp_path / "eval"
    assert run_cli("evaluate", "--model", tiny_llama, "--suite", "privacy", "--data-dir", tofu_dir, "--max-samples",
                   3, "--holdout", holdout, "--out", out) == 0
    summary = json.loads((out / "PRIVACY_SUMMARY.json").read_text())
    logs = json.loads((out / "PRIVACY_EVAL.json").read_text())
    forget = [s["score"] for s in logs["mia_loss"]["forget"]["value_by_index"].values()]
    held = [s["score"] for s in logs["mia_loss"]["holdout"]["value_by_index"].values()]
    assert (len(forget), len(held)) == (3, 3)  # --max-samples cuts the holdout set too
    # AUC from the stored scores by hand: the share of (forget, holdout) pairs where holdout scores higher
    pairs = [(1.0 if h > f else 0.5 if h == f else 0.0) for f in forget for h in held]
    assert summary["mia_loss"] == pytest.approx(sum(pairs) / len(pairs))
    assert summary["privleak"] == pytest.approx(((1 - summary["mia_min_k"]) - 0.5) / 0.5 * 100)
    assert "reference AUC of 0.5: no --retain-logs" in (out / "report.md").read_text()
