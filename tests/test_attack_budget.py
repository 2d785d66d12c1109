"""The attacks' worst case under a utility budget (`--utility-budget`, after TamperBench): the rule against values
worked out here, a whole evaluation whose attacked copies carry their utility and whose worst case skips the
copies beyond the budget, and the white-box attacks that need a starting model when none is known."""

from __future__ import annotations

import json

import pytest

from doplus_cli.evaluation import attacks
from tests.helpers import run_cli


def test_the_budget_keeps_a_copy_whose_utility_dropped_by_at_most_its_fraction():
    unattacked = {"MU": 40.0}
    assert attacks.utility_check("MU", unattacked, {"MU": 36.0}, 0.1) == (True, "kept: MU 40 -> 36 (-10.0%)")
    kept, reason = attacks.utility_check("MU", unattacked, {"MU": 35.9}, 0.1)  # a 10.25% drop
    assert not kept and reason.startswith("left out: MU 40 -> 35.9 (-10.3%)")
    assert attacks.utility_check("MU", unattacked, {"MU": 50.0}, 0.0)[0]  # a gain is never over budget
    assert attacks.utility_check("MU", unattacked, {"MU": None}, 0.1) == (True, "kept: MU not measured on both "
                                                                          "models")
    assert attacks.utility_check(None, unattacked, {}, 0.1)[0]


def test_the_worst_case_is_taken_over_the_copies_within_the_budget():
    unattacked = {"forget_Q_A_Prob": 0.10, "UFE": 80.0}
    attacked = {"a": {"forget_Q_A_Prob": 0.50, "UFE": 40.0},  # recovers most, but broke the model
                "b": {"forget_Q_A_Prob": 0.20, "UFE": 70.0},
                "c": {"forget_Q_A_Prob": 0.15, "UFE": 75.0}}
    directions = {"forget_Q_A_Prob": 1, "UFE": -1}
    rows = attacks.metric_rows("tofu", unattacked, attacked, directions, {"a": "left out: over budget"})
    prob, ufe = rows
    assert prob["worst"] == {"attack": "b", "value": 0.20, "change": pytest.approx(0.10)}
    assert ufe["worst"] == {"attack": "b", "value": 70.0, "change": -10.0}
    assert prob["attacks"]["a"]["excluded"] == "left out: over budget" and "excluded" not in prob["attacks"]["b"]
    everything = attacks.metric_rows("tofu", unattacked, attacked, directions)
    assert [row["worst"]["attack"] for row in everything] == ["a", "a"]


def test_an_evaluation_under_a_budget_measures_each_copys_utility(tiny_llama, tofu_dir, tmp_path):
    """The random tiny model's MU is 0 (a harmonic mean with a zero ROUGE), so the TOFU suite is checked by its
    retain Probability here, a utility metric the whole suite computes and the forget side alone does not."""
    from dataclasses import replace

    from doplus_cli.evaluation.suite_registry import SUITE_REGISTRY

    out = tmp_path / "eval"
    with SUITE_REGISTRY.replaced("tofu", replace(SUITE_REGISTRY["tofu"], utility="retain_Q_A_Prob")):
        code = run_cli("evaluate", "--model", tiny_llama, "--data-dir", tofu_dir, "--max-samples", 3,
                       "--max-new-tokens", 4, "--nli-model", tmp_path / "no-nli", "--embedding-model",
                       tmp_path / "no-embedder", "--out", out, "--attacks", "quant-fp4,probe-roleplay,prune",
                       "--utility-budget", 0.01)
    assert code == 0
    record = json.loads((out / "eval.json").read_text())
    section = record["attacks"]
    unattacked = json.loads((out / "SUMMARY.json").read_text())
    utility = {}
    for attack in ("quant-fp4", "probe-roleplay"):
        summary = json.loads((out / "attacks" / attack / "SUMMARY.json").read_text())
        assert summary["retain_Q_A_Prob"] is not None  # the copy's utility, measured for the budget
        utility[attack] = summary["retain_Q_A_Prob"]
    before = unattacked["retain_Q_A_Prob"]
    kept = {a for a, value in utility.items() if (before - value) / before <= 0.01}
    checks = {c["attack"]: c for c in section["utility_budget"]["checks"]}
    assert {a for a, c in checks.items() if c["kept"]} == kept and section["utility_budget"]["budget"] == 0.01
    for row in section["metrics"]:
        candidates = {a: cell["value"] for a, cell in row["attacks"].items() if a in kept}
        sign = 1 if row["recovered_when"] == "higher" else -1
        expected = max(candidates, key=lambda a: sign * candidates[a]) if candidates else None
        assert row["worst"]["attack"] == expected, row["metric"]
    # prune needs the starting model: the tiny model is no run's final/ and --base-model is not given
    prune = next(run for run in section["runs"] if run["id"] == "prune")
    assert prune["suites"] == [] and "needs the starting model" in prune["skipped"][0]
    report = (out / "report.md").read_text()
    assert "Utility budget 1%" in report and "needs the starting model" in report


def test_edit_attacks_on_the_starting_model_itself_change_no_forget_number(tiny_llama, tofu_dir, tmp_path):
    """With --base-model naming the evaluated model, nothing was unlearned: prune resets no neuron and
    orthogonalize finds no direction, so each copy scores the forget rows exactly as the model does."""
    out = tmp_path / "eval"
    assert run_cli("evaluate", "--model", tiny_llama, "--data-dir", tofu_dir, "--max-samples", 3,
                   "--max-new-tokens", 4, "--nli-model", tmp_path / "no-nli", "--embedding-model",
                   tmp_path / "no-embedder", "--out", out, "--attacks", "orthogonalize,prune",
                   "--base-model", tiny_llama) == 0
    record = json.loads((out / "eval.json").read_text())
    runs = {run["id"]: run for run in record["attacks"]["runs"]}
    assert runs["prune"]["edit"]["edited"] == 0 and runs["prune"]["suites"] == ["tofu"]
    assert "no direction" in json.dumps(runs["orthogonalize"]["edit"])
    plain = json.loads((out / "TOFU_EVAL.json").read_text())["sets"]["forget"]
    for attack in ("orthogonalize", "prune"):
        rows = json.loads((out / "attacks" / attack / "TOFU_EVAL.json").read_text())["sets"]["forget"]
        assert [r["nll_answer"] for r in rows] == [r["nll_answer"] for r in plain]
        assert [r["generation"] for r in rows] == [r["generation"] for r in plain]
    for row in record["attacks"]["metrics"]:
        assert all(cell["change"] in (0, None) for cell in row["attacks"].values()), row
    assert record["attacks"]["starting_model"] == str(tiny_llama)


def test_reading_attacks_report_their_rows_beside_the_unattacked_model_on_the_same_rows(tiny_llama, tofu_dir,
                                                                                       tmp_path):
    """The three reading attacks through `doplus evaluate`: each gives a row per metric named by the suite and
    the rows it scored, with the unattacked value it computed on the same rows, and leaves no summary of a copy
    (there is none); the unattacked files are those of a plain evaluation."""
    common = ["evaluate", "--model", tiny_llama, "--data-dir", tofu_dir, "--max-samples", 4, "--max-new-tokens", 4,
              "--nli-model", tmp_path / "no-nli", "--embedding-model", tmp_path / "no-embedder"]
    assert run_cli(*common, "--out", tmp_path / "plain") == 0
    out = tmp_path / "eval"
    assert run_cli(*common, "--out", out, "--attacks", "logit-lens,linear-probe,embedding",
                   "--attack-option", "embedding.steps=3", "--attack-option", "logit-lens.max_new_tokens=2",
                   "--attack-option", "linear-probe.l2=0.5") == 0
    assert (out / "TOFU_EVAL.json").read_bytes() == (tmp_path / "plain" / "TOFU_EVAL.json").read_bytes()
    record = json.loads((out / "eval.json").read_text())
    runs = {run["id"]: run for run in record["attacks"]["runs"]}
    assert set(runs) == {"logit-lens", "linear-probe", "embedding"}
    for attack, run in runs.items():
        reading = json.loads((out / "attacks" / attack / "READING.json").read_text())
        assert reading == run["reading"] and set(reading) == {"tofu"}
        assert json.loads((out / "attacks" / attack / "SUMMARY.json").read_text()) == {}
        rows = [m for m in record["attacks"]["metrics"] if attack in m["attacks"]]
        assert rows and all(m["suite"] == f"tofu {reading['tofu']['rows']}" for m in rows), attack
        for m in rows:
            cell = m["attacks"][attack]
            assert cell["change"] == pytest.approx(cell["value"] - m["unattacked"])
            assert m["worst"]["attack"] == attack  # the only attack on its own rows
    lens = next(m for m in record["attacks"]["metrics"]
                if m["metric"] == "probability" and "logit-lens" in m["attacks"])
    # the lens's last layer is the model's own output, so the best layer is at least as likely
    assert lens["attacks"]["logit-lens"]["value"] >= lens["unattacked"] - 1e-9
    report = (out / "report.md").read_text()
    assert all(f"- {attack} on tofu: scored on" in report for attack in runs)
    # --attack-option reached each attack (the defaults: 100 steps, 32 tokens, l2 0.01)
    details = {attack: run["reading"]["tofu"]["details"] for attack, run in runs.items()}
    assert details["embedding"]["steps_requested"] == 3 and details["embedding"]["steps"] <= 3
    assert details["logit-lens"]["max_new_tokens"] == 2 and details["linear-probe"]["l2"] == 0.5


def test_the_last_evaluation_of_a_run_takes_its_starting_model_for_the_edit_attacks(tiny_llama, tofu_dir, tmp_path):
    """`unlearn --eval-attacks prune`: the starting model is the run's own, and the 1% of MLP neurons that moved
    most (2 of the tiny model's 2 x 64) are reset in the copy."""
    forget = tmp_path / "f.jsonl"
    forget.write_text("".join(list(open(tofu_dir / "forget01.json"))[:6]))
    out = tmp_path / "run"
    assert run_cli("unlearn", "--model", tiny_llama, "--forget", forget, "--loss", "GA", "--steps", 2, "--lr", 1e-2,
                   "--eval-data-dir", tofu_dir, "--eval-max-samples", 2, "--eval-max-new-tokens", 2,
                   "--eval-nli-model", tmp_path / "no-nli", "--eval-embedding-model", tmp_path / "no-embedder",
                   "--show-samples", 0, "--eval-every", 2, "--eval-attacks", "prune", "--out", out) == 0
    section = json.loads((out / "evals" / "step-2" / "eval.json").read_text())["attacks"]
    assert section["starting_model"] == str(tiny_llama)
    (prune,) = section["runs"]
    assert prune["edit"]["k"] == 2 and prune["edit"]["edited"] == 2 and prune["suites"] == ["tofu"]
