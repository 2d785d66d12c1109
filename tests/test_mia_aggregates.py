"""GradNorm and the reference attack against plain autograd loops, OpenUnlearning's aggregates against numbers
worked out by hand, the retain model's MIA AUCs read from its logs (and any JSON refused in one line), and the
privacy suite end to end."""

from __future__ import annotations

import copy
import json
import math
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from doplus_cli.data.formatting import IGNORE_INDEX, PromptFormatter
from doplus_cli.errors import UserError
from doplus_cli.evaluation import aggregates as agg
from doplus_cli.evaluation.compute import packed_linears
from doplus_cli.evaluation.privacy import (
    gradnorm_scores,
    load_reference_model,
    privacy_aggregates,
    privacy_metrics,
    read_retain_logs,
    read_retain_mia_aucs,
)
from doplus_cli.evaluation.suite_api import EvalConfig
from doplus_cli.evaluation.suites import load_tofu_sets
from tests.helpers import run_cli
from tests.tiny_model import build_tiny_llama

FORGET = [("Where was Basil born?", "In Kuwait City."), ("Who wrote the book?", "Nobody at all, I think.")]
HOLDOUT = [("Who wrote book 1?", "Author 1 did."), ("What is the capital of France?", "Paris, of course.")]


def small_llama(tokenizer, seed: int = 0, tied: bool = False, dropout: float = 0.0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tied,
        attention_dropout=dropout))


def answer_nll(model, formatter, question: str, answer: str) -> torch.Tensor:
    """Mean NLL of the answer's scored tokens from one forward pass over the whole row, in float64."""
    encoded = formatter.encode(question, answer)
    log_probs = torch.log_softmax(model(input_ids=torch.tensor([encoded.input_ids])).logits[0].double(), -1)
    positions = [t for t in range(1, len(encoded.labels)) if encoded.labels[t] != IGNORE_INDEX]
    return -sum(log_probs[t - 1, encoded.labels[t]] for t in positions) / len(positions)


def hand_gradnorm(model, formatter, question: str, answer: str, p: float = 2) -> float:
    """The mean over parameters of the p-norm of d(mean answer NLL)/dW, one parameter at a time."""
    params = list(model.parameters())
    with torch.enable_grad():
        grads = torch.autograd.grad(answer_nll(model, formatter, question, answer), params, allow_unused=True)
    norms = []
    for grad in grads:
        if grad is not None:
            values = grad.double().flatten()
            norms.append(float(values.abs().sum()) if p == 1 else math.sqrt(float((values * values).sum())))
    return sum(norms) / len(norms)


def pair_auc(forget: list[float], holdout: list[float]) -> float:
    """The share of (forget, holdout) pairs in which the holdout row scores higher, ties counting one half."""
    pairs = [1.0 if h > f else 0.5 if h == f else 0.0 for f in forget for h in holdout]
    return sum(pairs) / len(pairs)


def stored(logs: dict, attack: str, side: str) -> list[float]:
    by_index = logs[attack][side]["value_by_index"]
    return [by_index[str(i)]["score"] for i in range(len(by_index))]


@pytest.fixture(scope="module")
def formatter(tiny_llama):
    return PromptFormatter(AutoTokenizer.from_pretrained(tiny_llama), 512)


def test_gradnorm_by_hand_leaves_the_model_as_it_was(formatter):
    # tied embeddings (one parameter, two uses) and attention dropout, which eval mode turns off
    model = small_llama(formatter.tokenizer, tied=True, dropout=0.5).eval()
    expected = [hand_gradnorm(model, formatter, q, a) for q, a in FORGET]
    expected_l1 = [hand_gradnorm(model, formatter, q, a, p=1) for q, a in FORGET]
    model.train()
    model.model.embed_tokens.weight.requires_grad_(False)  # frozen before: still scored, and frozen after
    sentinel = torch.full_like(model.model.norm.weight, 7.0)
    model.model.norm.weight.grad = sentinel  # a gradient accumulated before: kept as it was
    flags = {name: param.requires_grad for name, param in model.named_parameters()}
    weights = {name: value.clone() for name, value in model.state_dict().items()}

    scores = gradnorm_scores(model, formatter, FORGET)
    assert scores == pytest.approx(expected, rel=1e-5)
    assert gradnorm_scores(model, formatter, FORGET) == scores  # the same on every run, dropout or not
    assert gradnorm_scores(model, formatter, FORGET, p=1) == pytest.approx(expected_l1, rel=1e-5)
    assert model.training
    assert model.model.norm.weight.grad is sentinel and bool((sentinel == 7.0).all())
    assert all(param.grad is None for name, param in model.named_parameters() if name != "model.norm.weight")
    assert {name: param.requires_grad for name, param in model.named_parameters()} == flags
    assert all(torch.equal(weights[name], value) for name, value in model.state_dict().items())


def test_gradnorm_runs_the_layers_own_forward_inside_an_evaluations_packed_linears(formatter):
    model = small_llama(formatter.tokenizer).eval()
    expected = [hand_gradnorm(model, formatter, q, a) for q, a in FORGET]
    with packed_linears(model) as packed:
        assert gradnorm_scores(model, formatter, FORGET) == pytest.approx(expected, rel=1e-5)
        # the packed inference forwards are back for the rest of the evaluation
        assert sum("forward" in vars(module) for module in model.modules()) == packed


def test_reference_and_gradnorm_scores_by_hand_and_their_auc_after_memorising(formatter):
    model = small_llama(formatter.tokenizer)
    reference = copy.deepcopy(model).eval()  # the model before it saw the forget rows, as a retain model
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(40):
        loss = sum(answer_nll(model, formatter, q, a) for q, a in FORGET)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.zero_grad(set_to_none=True)
    model.eval()
    values, logs, _ = privacy_metrics(model, formatter, FORGET, HOLDOUT, 2, None, gradnorm=True,
                                      reference=reference)
    for side, rows in (("forget", FORGET), ("holdout", HOLDOUT)):
        with torch.no_grad():
            differences = [float(answer_nll(model, formatter, q, a) - answer_nll(reference, formatter, q, a))
                           for q, a in rows]
        assert stored(logs, "mia_reference", side) == pytest.approx(differences, abs=1e-5)
        assert stored(logs, "mia_gradnorm", side) == pytest.approx(
            [hand_gradnorm(model, formatter, q, a) for q, a in rows], rel=1e-5)
    for attack in ("mia_gradnorm", "mia_reference"):
        assert values[attack] == pytest.approx(pair_auc(stored(logs, attack, "forget"),
                                                         stored(logs, attack, "holdout")))
        assert logs[attack]["agg_value"] == values[attack]
    # memorised forget rows fit better than under the reference and have smaller gradients than unseen rows:
    # every holdout row scores above every forget row, AUC 1 (OpenUnlearning's orientation, as the other attacks)
    assert values["mia_gradnorm"] == 1.0 and values["mia_reference"] == 1.0 and values["mia_loss"] == 1.0
    assert all(param.grad is None for param in model.parameters())


def test_a_reference_model_with_another_vocabulary_is_refused_in_one_line(tiny_llama, formatter, tmp_path):
    other = build_tiny_llama(tmp_path / "other", vocab_size=500)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with pytest.raises(UserError, match=r"--mia-reference .*vocabulary differs") as error:
        load_reference_model(str(other), model, formatter.tokenizer)
    assert "\n" not in str(error.value)


def hm(values: list[float]) -> float:
    return len(values) / sum(1 / v for v in values)


def test_aggregates_against_hand_computed_numbers():
    memorization = agg.memorization({"extraction_strength": 0.2, "exact_memorization": 0.5,
                                     "forget_Q_A_PARA_Prob": 0.1, "forget_truth_ratio_prob_mean": 0.6})
    assert memorization.value == pytest.approx(4 / (1 / 0.8 + 1 / 0.5 + 1 / 0.9 + 1 / 0.4))
    assert memorization.reason is None and memorization.inputs["exact_memorization"] == 0.5
    # one input at its maximum (ES = 1: every answer extracted) makes the harmonic mean 0
    assert agg.memorization({"extraction_strength": 1.0, "exact_memorization": 0.5, "forget_Q_A_PARA_Prob": 0.1,
                             "forget_truth_ratio_prob_mean": 0.6}).value == 0.0
    missing = agg.memorization({"extraction_strength": 0.2, "exact_memorization": 0.5,
                                "forget_truth_ratio_prob_mean": 0.6})
    assert missing.value is None and missing.inputs["forget_Q_A_PARA_Prob"] is None
    assert "forget_Q_A_PARA_Prob" in missing.reason and "not available" in missing.reason

    # sMIA = 1 - |AUC - AUC_r| / max(AUC_r, 1 - AUC_r)
    assert agg.mia_closeness(0.4, 0.4) == 1.0
    assert agg.mia_closeness(0.9, 0.4) == pytest.approx(1 - 0.5 / 0.6)
    assert agg.mia_closeness(0.0, 0.4) == pytest.approx(1 - 0.4 / 0.6)
    assert agg.mia_closeness(1.0, 0.4) == pytest.approx(0.0)  # the farthest AUC from 0.4
    assert agg.mia_closeness(0.2, 0.7) == pytest.approx(1 - 0.5 / 0.7)
    assert agg.mia_closeness(0.0, 0.5) == 0.0 and agg.mia_closeness(1.0, 0.5) == 0.0

    aucs = {"mia_loss": 0.9, "mia_zlib": 0.8, "mia_min_k": 0.95, "mia_min_k_plus_plus": 0.85}
    retain = {"mia_loss": 0.4, "mia_zlib": 0.45, "mia_min_k": 0.4, "mia_min_k_plus_plus": 0.5}
    s = [1 - 0.5 / 0.6, 1 - 0.35 / 0.55, 1 - 0.55 / 0.6, 1 - 0.35 / 0.5]
    privacy = agg.privacy(aucs, retain)
    assert privacy.value == pytest.approx(hm(s))
    assert privacy.inputs["s mia_zlib"] == pytest.approx(s[1]) and privacy.inputs["retain mia_zlib"] == 0.45
    no_retain = agg.privacy(aucs, {**retain, "mia_min_k": None})
    assert no_retain.value is None and "--retain-logs" in no_retain.reason and "mia_min_k " in no_retain.reason + " "

    utility = agg.utility({"model_utility": 0.6, "forget_fluency": 0.9})
    assert utility.value == pytest.approx(2 / (1 / 0.6 + 1 / 0.9))
    no_fluency = agg.utility({"model_utility": 0.6, "forget_fluency": None})
    assert no_fluency.value is None and "forget_fluency" in no_fluency.reason and "--fluency-model" in no_fluency.reason

    scores = agg.openunlearning_aggregates({"extraction_strength": 0.2, "exact_memorization": 0.5,
                                            "forget_Q_A_PARA_Prob": 0.1, "forget_truth_ratio_prob_mean": 0.6,
                                            "model_utility": 0.6, "forget_fluency": 0.9, **aucs}, retain)
    assert list(scores) == ["agg_memorization", "agg_privacy", "agg_utility", "agg_overall"]
    mem, priv, util = 4 / (1 / 0.8 + 1 / 0.5 + 1 / 0.9 + 1 / 0.4), hm(s), 2 / (1 / 0.6 + 1 / 0.9)
    assert scores["agg_overall"].value == pytest.approx(3 / (1 / mem + 1 / priv + 1 / util))
    partial = agg.openunlearning_aggregates({**aucs, "model_utility": 0.6}, retain)
    assert partial["agg_overall"].value is None
    assert "agg_memorization" in partial["agg_overall"].reason and "agg_utility" in partial["agg_overall"].reason
    lines = agg.aggregate_lines(scores)
    assert lines[3].startswith("agg_overall = ") and "agg_privacy" in lines[3]


def retain_logs(path: Path, **aucs: float) -> Path:
    path.write_text(json.dumps({attack: {"agg_value": auc} for attack, auc in aucs.items()}))
    return path


def test_privacy_suites_aggregates_take_utility_from_this_evaluations_tofu_summary(tmp_path):
    aucs = {"mia_loss": 0.9, "mia_zlib": 0.8, "mia_min_k": 0.95, "mia_min_k_plus_plus": 0.85}
    retain = {"mia_loss": 0.4, "mia_zlib": 0.45, "mia_min_k": 0.4, "mia_min_k_plus_plus": 0.5}
    logs = retain_logs(tmp_path / "retain.json", **retain, mia_gradnorm=0.55)
    values = {**aucs, "extraction_strength": 0.2, "exact_memorization": 0.5, "forget_Q_A_PARA_Prob": 0.1,
              "forget_truth_ratio_prob_mean": 0.6}
    (tmp_path / "TOFU_SUMMARY.json").write_text(json.dumps({"model_utility": 0.6, "forget_fluency": 0.9}))
    config = EvalConfig(suites=("tofu", "privacy"), retain_logs=str(logs))
    scores, retain_aucs, lines = privacy_aggregates(values, config, tmp_path)
    assert retain_aucs == {**retain, "mia_gradnorm": 0.55}
    mem = 4 / (1 / 0.8 + 1 / 0.5 + 1 / 0.9 + 1 / 0.4)
    priv = hm([1 - 0.5 / 0.6, 1 - 0.35 / 0.55, 1 - 0.55 / 0.6, 1 - 0.35 / 0.5])
    assert scores["agg_utility"].value == pytest.approx(2 / (1 / 0.6 + 1 / 0.9))
    assert scores["agg_overall"].value == pytest.approx(3 / (1 / mem + 1 / priv + 1 / scores["agg_utility"].value))
    assert len(lines) == 4
    # privacy listed first: the tofu suite has not run yet when privacy does, and the reason says so
    scores, _, _ = privacy_aggregates(values, EvalConfig(suites=("privacy", "tofu"), retain_logs=str(logs)), tmp_path)
    assert scores["agg_utility"].value is None and "list tofu first" in scores["agg_utility"].reason
    # the tofu suite ran without a gibberish classifier: its reason is passed on
    (tmp_path / "TOFU_SUMMARY.json").write_text(json.dumps({"model_utility": 0.6, "forget_fluency": None,
                                                             "forget_fluency_missing": "not available: offline"}))
    scores, _, _ = privacy_aggregates(values, config, tmp_path)
    assert scores["agg_utility"].value is None and "offline" in scores["agg_utility"].reason
    assert scores["agg_memorization"].value == pytest.approx(mem) and scores["agg_overall"].value is None


def test_retain_logs_with_every_attack(tmp_path):
    aucs = {"mia_loss": 0.41, "mia_zlib": 0.42, "mia_min_k": 0.43, "mia_min_k_plus_plus": 0.44,
            "mia_gradnorm": 0.45, "mia_reference": 0.46}
    path = tmp_path / "TOFU_EVAL.json"
    path.write_text(json.dumps({"forget_truth_ratio": {"value_by_index": {"0": {"score": 0.5}}},
                                **{attack: {"agg_value": auc, "auc": auc} for attack, auc in aucs.items()}}))
    assert read_retain_mia_aucs(str(path)) == aucs
    assert read_retain_logs(str(path)) == ([0.5], 0.43)  # the existing callers' answer, as before
    only = retain_logs(tmp_path / "only.json", mia_gradnorm=0.3)  # no truth ratios, no Min-K%: still a retain log
    assert read_retain_logs(str(only)) == (None, None) and read_retain_mia_aucs(str(only)) == {"mia_gradnorm": 0.3}
    assert read_retain_mia_aucs(str(retain_logs(tmp_path / "none.json"))) == {}
    for bad, message in ((1.5, r"'mia_zlib.agg_value' is an AUC, a number in \[0, 1\]"),
                         (float("nan"), r"'mia_zlib.agg_value' must be a finite number")):
        with pytest.raises(UserError, match=message):
            read_retain_mia_aucs(str(retain_logs(tmp_path / "bad.json", mia_zlib=bad)))
    path.write_text(json.dumps({"sets": {"forget": [{"nll_paraphrased": 1.0, "nll_perturbed": 2.0}]}}))
    with pytest.raises(UserError, match=r"nll_perturbed' must be a non-empty list"):
        read_retain_logs(str(path))
    path.write_text(json.dumps({"sets": {"forget": [{"nll_paraphrased": -800.0, "nll_perturbed": [2.0]}]}}))
    with pytest.raises(UserError, match=r"nll_paraphrased' is a mean NLL, a number >= 0"):
        read_retain_logs(str(path))


JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
                    lambda inner: st.one_of(st.lists(inner, max_size=3),
                                            st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                    max_leaves=12)
# OpenUnlearning's and doplus's keys, each holding anything: the reader's paths are reached, not only its first check
LOGS = st.fixed_dictionaries({}, optional={
    "forget_truth_ratio": st.one_of(JSON, st.fixed_dictionaries({"value_by_index": st.dictionaries(
        st.text(max_size=3), st.one_of(JSON, st.fixed_dictionaries({"score": JSON})), max_size=3)})),
    "sets": st.one_of(JSON, st.fixed_dictionaries({"forget": st.one_of(JSON, st.lists(st.one_of(
        JSON, st.fixed_dictionaries({"nll_paraphrased": JSON, "nll_perturbed": st.one_of(JSON, st.lists(JSON))})),
        max_size=3))})),
    **{attack: st.one_of(JSON, st.fixed_dictionaries({"agg_value": JSON}))
       for attack in ("mia_loss", "mia_min_k", "mia_gradnorm", "mia_reference")},
})


@settings(derandomize=True, database=None, deadline=None, max_examples=150)
@given(st.one_of(LOGS, JSON))
def test_any_json_as_retain_logs_is_read_or_refused_in_one_line(value):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "TOFU_EVAL.json"
        path.write_text(json.dumps(value))
        for reader in (read_retain_logs, read_retain_mia_aucs):
            try:
                result = reader(str(path))
            except UserError as error:
                assert "\n" not in str(error)
                continue
            if reader is read_retain_mia_aucs:
                assert all(0 <= auc <= 1 for auc in result.values())
            else:
                ratios, auc = result
                assert ratios is None or all(math.isfinite(r) for r in ratios)
                assert auc is None or 0 <= auc <= 1


def test_privacy_suite_end_to_end(tiny_llama, tofu_dir, tmp_path):
    reference = build_tiny_llama(tmp_path / "reference", seed=1)  # the same tokenizer, other weights
    holdout = tmp_path / "holdout10.json"
    holdout.write_text("".join(json.dumps({"question": f"Who wrote book {i}?", "answer": f"Author {i} did."}) + "\n"
                               for i in range(3)))
    retain = {"mia_loss": 0.4, "mia_zlib": 0.45, "mia_min_k": 0.35, "mia_min_k_plus_plus": 0.5}
    logs_in = retain_logs(tmp_path / "retain_TOFU_EVAL.json", **retain)
    out = tmp_path / "eval"
    assert run_cli("evaluate", "--model", tiny_llama, "--suite", "privacy", "--data-dir", tofu_dir, "--max-samples",
                   2, "--holdout", holdout, "--retain-logs", logs_in, "--mia-reference", reference, "--out", out) == 0
    summary = json.loads((out / "PRIVACY_SUMMARY.json").read_text())
    logs = json.loads((out / "PRIVACY_EVAL.json").read_text())
    for attack in ("mia_gradnorm", "mia_reference"):
        assert summary[attack] == pytest.approx(pair_auc(stored(logs, attack, "forget"),
                                                         stored(logs, attack, "holdout")))

    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    other = AutoModelForCausalLM.from_pretrained(reference).eval()
    formatter = PromptFormatter(AutoTokenizer.from_pretrained(tiny_llama), 512)  # as evaluate builds it
    samples = load_tofu_sets("forget10", str(tofu_dir), 2)[0].samples
    first = (samples[0].question, samples[0].answer)
    assert stored(logs, "mia_gradnorm", "forget")[0] == pytest.approx(hand_gradnorm(model, formatter, *first), rel=1e-4)
    with torch.no_grad():
        assert stored(logs, "mia_reference", "forget")[0] == pytest.approx(
            float(answer_nll(model, formatter, *first) - answer_nll(other, formatter, *first)), abs=1e-4)
        para = [float(answer_nll(model, formatter, s.question, s.paraphrased)) for s in samples]
        pert = [[float(answer_nll(model, formatter, s.question, p)) for p in s.perturbed] for s in samples]
    assert summary["forget_Q_A_PARA_Prob"] == pytest.approx(sum(math.exp(-n) for n in para) / 2, rel=1e-4)
    shares = [math.exp(-c) / (math.exp(-c) + math.exp(-sum(w) / len(w)) + 1e-10) for c, w in zip(para, pert)]
    assert summary["forget_truth_ratio_prob_mean"] == pytest.approx(sum(shares) / 2, rel=1e-4)

    ones = [1 - summary[k] for k in ("extraction_strength", "exact_memorization", "forget_Q_A_PARA_Prob",
                                     "forget_truth_ratio_prob_mean")]
    assert summary["agg_memorization"] == pytest.approx(0.0 if min(ones) == 0 else hm(ones))
    closeness = [1 - abs(summary[a] - r) / max(r, 1 - r) for a, r in retain.items()]
    assert summary["agg_privacy"] == pytest.approx(0.0 if min(closeness) == 0 else hm(closeness))
    assert summary["agg_utility"] is None and summary["agg_overall"] is None
    report = (out / "report.md").read_text()
    assert "agg_utility not available: model_utility and forget_fluency come from the tofu suite" in report
    assert "mia_reference: answer NLL under this model minus under" in report
    section = json.loads((out / "eval.json").read_text())["sections"][0]
    assert section["aggregates_openunlearning"]["agg_privacy"]["inputs"]["retain mia_min_k"] == 0.35
