"""`bench schemes`' columns under attack: the headline metric per attack, the reading attacks' and the held-out
half's values beside the unattacked model's on the same rows, and what each attack takes back, from an eval.json
written here by hand (the shape `doplus evaluate --attacks` writes, tests/test_attacks.py checks that shape)."""

from __future__ import annotations

import json

import pytest

from doplus_cli.bench.schemes.attacked import attack_columns, attack_values, column_role
from doplus_cli.bench.schemes.summary import render_markdown


def _row(suite, metric, recovered_when, unattacked, attacks):
    cells = {a: {"value": v, "change": None if v is None or unattacked is None else v - unattacked}
             for a, v in attacks.items()}
    sign = 1 if recovered_when == "higher" else -1
    worst = max(attacks, key=lambda a: sign * attacks[a])
    return {"suite": suite, "metric": metric, "recovered_when": recovered_when, "unattacked": unattacked,
            "attacks": cells, "worst": {"attack": worst, "value": attacks[worst],
                                        "change": attacks[worst] - unattacked}}


@pytest.fixture
def evaluation(tmp_path):
    runs = [
        {"id": "relearn-k50", "attack": "relearn", "suites": ["tofu"]},
        {"id": "prune", "attack": "prune", "suites": ["tofu"]},
        {"id": "logit-lens", "attack": "logit-lens", "suites": ["tofu"],
         "reading": {"tofu": {"rows": "forget rows 0 to 39",
                              "details": {"best_layer": 20, "base": {"probability": 0.91, "best_layer": 30}}}}},
        {"id": "linear-probe", "attack": "linear-probe", "suites": ["tofu"],
         "reading": {"tofu": {"rows": "held-out forget rows 20 to 39",
                              "details": {"embedding_probe_accuracy": 0.55,
                                          "base": {"probe_accuracy": 0.95, "output_choice_accuracy": 0.9}}}}},
    ]
    metrics = [
        _row("tofu", "UFE", "lower", 60.0, {"relearn-k50": 35.0, "prune": 58.0}),
        _row("tofu", "forget_Q_A_ROUGE", "higher", 0.1, {"relearn-k50": 0.4, "prune": 0.12}),  # not the headline
        _row("tofu forget rows 0 to 39", "probability", "higher", 0.2, {"logit-lens": 0.5}),
        _row("tofu forget rows 0 to 39", "rouge", "higher", 0.05, {"logit-lens": 0.07}),
        _row("tofu held-out forget rows 20 to 39", "probe_accuracy", "higher", 0.6, {"linear-probe": 0.85}),
        _row("tofu held-out half", "rouge", "higher", 0.09, {"relearn-k50": 0.45}),
    ]
    folder = tmp_path / "evals" / "step-96"
    folder.mkdir(parents=True)
    (folder / "eval.json").write_text(json.dumps({"attacks": {"runs": runs, "metrics": metrics}}))
    return folder


def test_every_attack_value_and_what_it_takes_back(evaluation):
    values = attack_values(evaluation)
    expected = {
        "UFE after relearn-k50": 35.0, "UFE taken back by relearn-k50": 60.0 - 35.0,
        "UFE after prune": 58.0, "UFE taken back by prune": 60.0 - 58.0,
        "UFE worst attack": 35.0, "UFE taken back by the worst attack": 25.0,
        "logit-lens probability unattacked": 0.2, "logit-lens probability": 0.5,
        "probability taken back by logit-lens": 0.5 - 0.2, "logit-lens probability on the starting model": 0.91,
        "logit-lens rouge unattacked": 0.05, "logit-lens rouge": 0.07, "rouge taken back by logit-lens": 0.07 - 0.05,
        "linear-probe probe_accuracy unattacked": 0.6, "linear-probe probe_accuracy": 0.85,
        "probe_accuracy taken back by linear-probe": 0.85 - 0.6,
        "linear-probe probe_accuracy on the starting model": 0.95,
        "linear-probe probe_accuracy on embeddings alone": 0.55,
        "linear-probe probe_accuracy minus the starting model's": 0.85 - 0.95,
        "held-out rouge unattacked": 0.09, "held-out rouge after relearn-k50": 0.45,
        "held-out rouge taken back by relearn-k50": 0.45 - 0.09,
    }
    assert set(values) == set(expected)
    for key, value in expected.items():
        assert values[key] == pytest.approx(value), key
    assert attack_values(evaluation.parent) == {}  # no eval.json: no attack columns


def test_columns_by_role_and_direction(evaluation):
    by_role = attack_columns(list(attack_values(evaluation)))
    assert [c.key for c in by_role["attack"]] == ["UFE after relearn-k50", "UFE after prune", "UFE worst attack"]
    assert all(c.higher_is_better is True for c in by_role["attack"])  # a higher UFE: still forgotten
    reading = {c.key: c.higher_is_better for c in by_role["reading"]}
    assert reading["logit-lens probability"] is False and reading["held-out rouge after relearn-k50"] is False
    assert reading["logit-lens probability unattacked"] is None  # descriptive: no best marked
    assert reading["linear-probe probe_accuracy on embeddings alone"] is None
    taken = [c.key for c in by_role["taken back"]]
    assert taken[-1] == "UFE taken back by the worst attack"
    assert "linear-probe probe_accuracy minus the starting model's" in taken
    assert all(c.higher_is_better is False for c in by_role["taken back"])  # less given back is better
    assert column_role("UFE") is None and column_role("train_time_s") is None


def test_the_markdown_puts_reading_and_taken_back_columns_in_tables_of_their_own():
    stats = {"mean": 1.0, "std": 0.5, "n": 2, "values": [0.5, 1.5]}
    columns = [{"key": "UFE", "label": "UFE", "role": "score", "format": ".2f", "better": "higher"},
               {"key": "UFE after prune", "label": "UFE after prune", "role": "attack", "format": ".2f",
                "better": "higher"},
               {"key": "logit-lens probability", "label": "logit-lens probability", "role": "reading",
                "format": ".3f", "better": "lower"},
               {"key": "UFE taken back by prune", "label": "UFE taken back by prune", "role": "taken back",
                "format": ".2f", "better": "lower"}]
    summary = {"caption": "c", "columns": columns, "sweep": None, "partial": {}, "definitions": [], "paired": [],
               "tradeoff": None, "unfinished": [],
               "rows": [{"label": "DO+", "sweep_value": None, "seeds": [0], "tasks": [1, 2], "best": [],
                         "metrics": {c["key"]: stats for c in columns}}]}
    text = render_markdown(summary, [])
    tables = [block for block in text.split("\n\n") if block.startswith("| Method")]
    assert len(tables) == 3
    assert "UFE after prune" in tables[0] and "logit-lens" not in tables[0] and "taken back" not in tables[0]
    assert "logit-lens probability ↓" in tables[1] and "UFE taken back by prune ↓" in tables[2]
    assert "Reading attacks" in text and "What each attack takes back" in text
