"""The facts each evaluation suite declares on its `Suite` (forget-side metrics and headline, per-row file, the
attacks it takes, the bench's columns, a QA suite's metric names) agree with each other and with the attack
registry, and a suite registered from outside gets its attacks and bench columns from its declaration alone."""

from __future__ import annotations

import json

import pytest

from doplus_cli.bench.adapters.align import ALIGN_ADAPTER
from doplus_cli.bench.adapters.base import Metric
from doplus_cli.bench.adapters.unlearn import EVALUATED_SUITES, UNLEARN_ADAPTER
from doplus_cli.commands.align import AlignConfig
from doplus_cli.commands.unlearn import UnlearnConfig
from doplus_cli.errors import UserError
from doplus_cli.evaluation.attacks import ATTACKS, forget_suites, parse_attacks
from doplus_cli.evaluation.suite_api import BenchColumn, Suite, SuiteResult
from doplus_cli.evaluation.suite_registry import SUITE_REGISTRY
from doplus_cli.evaluation.suites import INDICATORS

WEIGHT = {"relearn", "relearn-lora", "quant-8bit", "quant-4bit", "quant-fp4", "prune"}
EVERY = WEIGHT | {"probe-prefix", "probe-roleplay", "probe-incontext", "probe-paraphrase", "logit-lens",
                  "linear-probe", "embedding", "orthogonalize"}
# Which suites take which attacks, as docs/attacks.md states it: the QA suites all of them; MUSE and WMDP
# relearning, quantization and pruning; the safety suite those and prefix injection (the prefilling jailbreak).
DOCUMENTED = {"tofu": EVERY, "real-world": EVERY, "muse": WEIGHT, "wmdp": WEIGHT, "safety": WEIGHT | {"probe-prefix"},
              "lm-eval": set(), "privacy": set(), "xstest": set()}


def test_every_registered_suite_states_facts_that_agree():
    assert set(SUITE_REGISTRY) == set(DOCUMENTED)
    for name, suite in SUITE_REGISTRY.items():
        assert suite.name == name
        assert len(set(suite.files)) == len(suite.files), name
        if suite.forget_metrics:
            assert suite.headline in suite.directions, name
            assert set(suite.directions.values()) <= {1, -1}, name
            assert len(suite.directions) == len(suite.forget_metrics), name  # no metric named twice
        else:
            assert suite.headline is None and suite.utility is None, name
        assert suite.utility not in suite.directions, name
        assert suite.forget_rows is None or suite.forget_rows in suite.files, name
        # an attack is measured on forget-side metrics: a suite without them takes none
        assert bool(suite.attacks) == bool(suite.forget_metrics), name
        assert len(set(suite.attacks)) == len(suite.attacks), name
        assert set(suite.attacks) <= set(ATTACKS), name
        assert set(suite.attacks) == DOCUMENTED[name], name
    # the attack registry agrees with the suites, both ways, in --suite's order
    for attack_name, attack in ATTACKS.items():
        assert attack.suites == tuple(n for n in SUITE_REGISTRY if attack_name in DOCUMENTED[n]), attack_name
    assert list(forget_suites()) == [n for n in SUITE_REGISTRY if DOCUMENTED[n]]


def test_bench_columns_are_well_formed_and_cover_what_the_bench_evaluates_with():
    for name, suite in SUITE_REGISTRY.items():
        keys = [column.key for column in suite.bench_columns]
        assert len(set(keys)) == len(keys), name
        for column in suite.bench_columns:
            assert isinstance(column, BenchColumn) and isinstance(column, tuple)
            assert column.higher_is_better in (True, False, None) and column.label, (name, column)
            assert format(0.5, column.spec)  # a format spec the bench can print a mean with
        # a headline the bench shows points the same way as its forget-side direction says (knowing more of
        # the forget set is worse)
        for column in suite.bench_columns:
            if column.key in suite.directions and column.higher_is_better is not None:
                assert column.higher_is_better == (suite.directions[column.key] < 0), (name, column)
    # `answers` is the unlearn run's own before/after answers, no suite of `doplus evaluate`: its columns stay the
    # adapter's; every other suite the unlearn bench evaluates with declares its columns
    assert "answers" not in SUITE_REGISTRY
    for name in EVALUATED_SUITES:
        if name != "answers":
            assert SUITE_REGISTRY[name].bench_columns, name
    assert SUITE_REGISTRY["safety"].bench_columns and SUITE_REGISTRY["xstest"].bench_columns


def test_the_bench_reads_each_suites_columns():
    """The columns, written out here as the bench has shown them."""
    def keys(eval_suite: str) -> list[str]:
        return [m.key for m in UNLEARN_ADAPTER.metric_list(UnlearnConfig(eval_suite=eval_suite))]

    assert keys("tofu") == ["UFE", "TFE", "MU", "OVR", "model_utility", "forget_quality", "forget_Q_A_ROUGE",
                            "retain_Q_A_ROUGE"]
    assert keys("muse") == ["forget_verbmem_ROUGE", "forget_knowmem_ROUGE", "retain_knowmem_ROUGE", "muse_privleak"]
    assert keys("wmdp") == ["wmdp_bio/acc", "wmdp_cyber/acc", "wmdp_chem/acc", "mmlu/acc"]
    assert keys("answers") == ["forget_rouge", "retain_rouge"]
    muse = UNLEARN_ADAPTER.metric_list(UnlearnConfig(eval_suite="muse"))
    assert muse[-1] == Metric("muse_privleak", "PrivLeak (%)", None, ".1f") and muse[-1].header == "PrivLeak (%)"
    assert muse[0].header == "VerbMem forget ↓"
    align = [m.key for m in ALIGN_ADAPTER.metric_list(AlignConfig(eval_suite="xstest,safety", held_out=0))]
    assert align == ["safety_rate_avg", "xstest_over_refusal", "xstest_unsafe_refusal", "safety_loss", "general_loss"]


def test_a_qa_suite_names_its_summary_keys_by_the_papers_names_and_openunlearnings():
    tofu, real_world = SUITE_REGISTRY["tofu"], SUITE_REGISTRY["real-world"]
    expected = {("forget", "rouge"): "forget_Q_A_ROUGE", ("forget", "probability"): "forget_Q_A_Prob",
                ("forget", "truth_ratio"): "forget_Truth_Ratio", ("retain", "token_entropy"): "retain_Token_Entropy",
                ("ra", "probability"): "ra_Q_A_Prob_normalised", ("wf", "entailment"): "wf_Entailment_Score",
                ("forget", "cosine_similarity"): "forget_Cosine_Similarity",
                ("forget", "idk_entailment"): "forget_IDK_Entailment_Score",
                ("neighbour", "rouge"): "neighbour_ROUGE", ("neighbour", "truth_ratio"): "neighbour_Truth_Ratio"}
    for (prefix, indicator), key in expected.items():
        assert tofu.summary_key(prefix, indicator) == key
        assert real_world.summary_key(prefix, indicator) == key
    for indicator in (*INDICATORS, "idk_entailment"):  # every indicator has a name
        assert tofu.summary_key("retain", indicator).startswith("retain_")
    # the forget-side metrics are keys the suite writes: TOFU's forget set's, the real-world suite's with rw_
    for metric in ("rouge", "probability", "truth_ratio"):
        assert tofu.summary_key("forget", metric) in tofu.directions
        assert "rw_" + real_world.summary_key("forget", metric) in real_world.directions
    assert not SUITE_REGISTRY["muse"].paper_names
    with pytest.raises(KeyError):
        SUITE_REGISTRY["muse"].summary_key("forget", "rouge")


def _never_run(context) -> SuiteResult:
    raise AssertionError("the toy suite is only declared")


TOY = Suite("toy", _never_run, files=("TOY_EVAL.json", "TOY_SUMMARY.json"),
            forget_metrics=(("toy_forget", 1), ("toy_leak", -1)), headline="toy_forget",
            forget_rows="TOY_EVAL.json", utility="toy_utility", attacks=("quant-4bit", "probe-prefix"),
            bench_columns=(BenchColumn("toy_forget", "toy forget", False, ".3f"),
                           BenchColumn("toy_utility", "toy utility", True)))


@pytest.fixture
def toy_suite(monkeypatch):
    """TOY registered for the test and removed after it (the registry has no public removal: its table is
    patched, which monkeypatch restores)."""
    assert "toy" not in SUITE_REGISTRY
    monkeypatch.setitem(SUITE_REGISTRY._entries, "toy", TOY)
    yield TOY


def test_a_suite_registered_from_outside_gets_the_attacks_it_declares(toy_suite):
    assert ATTACKS["quant-4bit"].suites == ("tofu", "real-world", "safety", "wmdp", "muse", "toy")
    assert ATTACKS["probe-prefix"].suites == ("tofu", "real-world", "safety", "toy")
    assert "toy" not in ATTACKS["relearn"].suites and "toy" not in ATTACKS["probe-roleplay"].suites
    assert "toy" in forget_suites()
    assert parse_attacks(("probe-prefix", "quant-4bit"), ("toy",)) == ("quant-4bit", "probe-prefix")
    assert parse_attacks(("all",), ("toy",)) == ("quant-4bit", "probe-prefix")
    with pytest.raises(UserError) as error:
        parse_attacks(("probe-roleplay",), ("tofu", "toy"))
    assert str(error.value) == ("--attacks: attack 'probe-roleplay' cannot be applied to suite toy (it applies to "
                                "tofu, real-world)")
    with pytest.raises(UserError) as error:
        parse_attacks(("relearn",), ("toy",))
    assert "cannot be applied to suite toy (it applies to tofu, real-world, safety, wmdp, muse)" in str(error.value)


def test_a_suite_registered_from_outside_gets_the_bench_columns_it_declares(toy_suite, tmp_path):
    assert UNLEARN_ADAPTER.metric_list(UnlearnConfig(eval_suite="toy")) == (
        Metric("toy_forget", "toy forget", False, ".3f"), Metric("toy_utility", "toy utility", True, ".2f"))
    (tmp_path / "SUMMARY.json").write_text(json.dumps({"toy_forget": 0.25, "toy_utility": 0.5, "other": 1.0}))
    (tmp_path / "eval.json").write_text(json.dumps({"sections": [{"suite": "toy"}]}))
    values, notes = UNLEARN_ADAPTER.scores({"config": {"eval_suite": "toy"}}, tmp_path)
    assert values == {"toy_forget": 0.25, "toy_utility": 0.5} and notes == {}
    # align's bench shows a chosen suite's columns, its SUMMARY.json fractions in percent
    align = ALIGN_ADAPTER.metric_list(AlignConfig(eval_suite="safety,toy", held_out=0))
    assert [m.key for m in align][:3] == ["safety_rate_avg", "toy_forget", "toy_utility"]
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "SUMMARY.json").write_text(json.dumps({"toy_forget": 0.25, "safety_rate_avg": 0.75}))
    values, _ = ALIGN_ADAPTER.scores({"config": {"eval_suite": "safety,toy"}, "losses": {}}, tmp_path / "eval")
    assert values == {"safety_rate_avg": 75.0, "toy_forget": 25.0, "toy_utility": None}


def test_the_toy_suite_is_gone_after_its_test():
    assert "toy" not in SUITE_REGISTRY
    assert all("toy" not in attack.suites for attack in ATTACKS.values())
