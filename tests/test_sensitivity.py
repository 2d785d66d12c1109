"""`bench schemes --sweep`: each scheme's sensitivity to the swept value and the paired comparison of two schemes'
losses, against values worked out by hand (docs/benchmarks.md states the rule)."""

from __future__ import annotations

import math
import statistics

import pytest

from doplus_cli.bench.sensitivity import render, scheme_sensitivity, sensitivity

T = 4.302652729911275  # Student's t, 0.975 quantile, 2 degrees of freedom
PAIRS = [(1, 0), (1, 1), (2, 0)]
A = {1e-4: [40, 42, 38], 2e-4: [50, 52, 51], 4e-4: [45, 47, 40]}  # sharp: best 2e-4
B = {1e-4: [48, 49, 47], 2e-4: [50, 50, 50], 4e-4: [49, 48, 49]}  # flat: best 2e-4


def grid(schemes: dict[str, dict[float, list[float]]], key: str = "OVR"):
    rows, runs = [], {}
    for scheme, by_lr in schemes.items():
        for lr, values in by_lr.items():
            names = []
            for (task, seed), value in zip(PAIRS, values):
                name = f"{scheme}-{lr}-t{task}-s{seed}"
                runs[name] = {"task_id": task, "seed": seed, "values": {key: value}}
                names.append(name)
            rows.append({"scheme": scheme, "label": scheme.upper(), "sweep_value": lr, "runs": names})
    return rows, runs


def test_best_value_losses_one_step_and_seed_spread_by_hand():
    by_value = {lr: dict(zip(PAIRS, map(float, values))) for lr, values in A.items()}
    s = scheme_sensitivity(by_value, higher_is_better=True)
    assert s["best"] == 2e-4 and s["best_mean"] == pytest.approx(51.0)
    # per pair: the best value minus the mean of the two others
    assert s["losses"] == pytest.approx([50 - (40 + 45) / 2, 52 - (42 + 47) / 2, 51 - (38 + 40) / 2])
    assert s["loss_mean"] == pytest.approx(9.0)
    assert s["step_loss"] == pytest.approx(max(51 - 40, 51 - 44))
    # the seed spread: task 1's two seeds (task 2 has one, which adds nothing)
    assert s["seed_spread"] == pytest.approx([statistics.stdev([40, 42]), statistics.stdev([50, 52]),
                                              statistics.stdev([45, 47])])
    # where lower is better, the best is the lowest mean and a loss is still positive when worse
    flipped = scheme_sensitivity({lr: {p: -v for p, v in values.items()} for lr, values in by_value.items()}, False)
    assert flipped["best"] == 2e-4 and flipped["losses"] == pytest.approx(s["losses"])
    assert scheme_sensitivity({1e-4: by_value[1e-4]}, True) is None  # one value: nothing to compare


def test_the_sharp_scheme_is_called_more_sensitive_than_the_flat_one():
    rows, runs = grid({"a": A, "b": B})
    (entry,) = sensitivity(rows, runs, [("OVR", "OVR", True), ("time", "time", None)], {"a": "A", "b": "B"})
    assert set(entry["schemes"]) == {"A", "B"}
    (comparison,) = entry["comparisons"]
    diffs = [7.5 - 1.5, 7.5 - 1.5, 12.0 - 2.0]
    half = T * statistics.stdev(diffs) / math.sqrt(3)
    assert comparison["differences"] == pytest.approx(diffs)
    assert comparison["low"] == pytest.approx(statistics.mean(diffs) - half)
    assert comparison["low"] > 0 and comparison["reading"].startswith("A is more sensitive than B on OVR")
    # the same losses the other way round: less sensitive
    rows, runs = grid({"b": B, "a": A})
    (entry,) = sensitivity(rows, runs, [("OVR", "OVR", True)], {"a": "A", "b": "B"})
    assert entry["comparisons"][0]["reading"].startswith("B is less sensitive than A on OVR")


def test_an_interval_across_zero_is_no_difference_with_the_detectable_size():
    other = {1e-4: [44, 40, 46], 2e-4: [50, 52, 51], 4e-4: [48, 45, 47]}  # losses 4, 9.5, 5 against A's
    rows, runs = grid({"a": A, "c": other})
    (entry,) = sensitivity(rows, runs, [("OVR", "OVR", True)], {"a": "A", "c": "C"})
    reading = entry["comparisons"][0]["reading"]
    assert reading.startswith("no difference in sensitivity detected between A and C") and "detects" in reading
    lines = render([entry], "lr")
    table = [line for line in lines if line.startswith("| A |")]
    assert table and table[0].startswith("| A | 0.0002 | 51 | 9 | 11 |")
    assert any(line.startswith("- no difference") for line in lines)


def test_seed_spreads_compared_value_by_value():
    from doplus_cli.bench.sensitivity import seed_reading

    values = [1, 2, 3, 4, 5]
    a = {"values": values, "seed_spread": [1.0, 1.0, 3.0, 1.0, 1.0]}
    b = {"values": values, "seed_spread": [2.0, 2.0, 2.0, 2.0, 2.0]}
    assert seed_reading("A", "B", a, b).startswith("A is less seed-sensitive than B (A's seed spread is below "
                                                   "B's at 4 of 5 values, above at 1)")
    assert seed_reading("B", "A", b, a).startswith("B is more seed-sensitive than A")
    c = {"values": values, "seed_spread": [1.0, 3.0, 3.0, 1.0, None]}  # 2 below, 2 above over 4 values
    assert seed_reading("C", "B", c, b).startswith("no difference in seed spread called")
    two = {"values": [1, 2], "seed_spread": [1.0, 1.0]}
    assert seed_reading("D", "B", two, b).startswith("no difference")  # two values: too few to call
