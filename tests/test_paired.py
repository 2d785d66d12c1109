"""The paired evidence of `bench schemes` (bench/paired.py) against values worked out by hand here, with Student's t
quantiles read from a printed table."""

from __future__ import annotations

import math

import pytest

from doplus_cli.bench.paired import comparisons, paired, reading

T_975 = {2: 4.302652729749464, 4: 2.7764451051977987}  # t(0.975, df)
T_80 = {2: 1.0606601717798212, 4: 0.9409645724325433}  # t(0.80, df)


def test_the_interval_and_the_detectable_difference_of_five_pairs():
    a, b = [11.0, 22.0, 33.0, 44.0, 55.0], [10.0, 20.0, 30.0, 40.0, 50.0]  # differences 1, 2, 3, 4, 5
    result = paired(a, b)
    se = math.sqrt(2.5) / math.sqrt(5)  # sd of 1..5 is sqrt(2.5)
    assert result.differences == (1.0, 2.0, 3.0, 4.0, 5.0) and result.n == 5 and result.agree == 5
    assert result.mean == pytest.approx(3.0)
    assert result.low == pytest.approx(3.0 - T_975[4] * se) and result.high == pytest.approx(3.0 + T_975[4] * se)
    assert result.detectable == pytest.approx((T_975[4] + T_80[4]) * se)
    assert reading("DO+", "Alternate", "MU", True, result).startswith("DO+ is better than Alternate on MU (mean +3")


def test_an_interval_across_zero_is_no_difference_and_says_what_the_grid_detects():
    result = paired([0.5, -0.2, 0.1], [0.0, 0.0, 0.0])
    mean = 0.4 / 3
    sd = math.sqrt(((0.5 - mean) ** 2 + (-0.2 - mean) ** 2 + (0.1 - mean) ** 2) / 2)
    assert result.low == pytest.approx(mean - T_975[2] * sd / math.sqrt(3))
    assert result.low < 0 < result.high
    assert result.agree == 2  # -0.2 goes against the mean
    text = reading("DO+", "DO", "OVR", True, result)
    assert text.startswith("no difference detected between DO+ and DO on OVR")
    assert f"{(T_975[2] + T_80[2]) * sd / math.sqrt(3):.3g} or more" in text


def test_the_better_side_follows_the_metric_and_one_pair_gives_no_interval():
    lower = paired([0.30, 0.41, 0.52], [0.10, 0.20, 0.30])  # A's forget ROUGE-L higher: B forgets more
    assert lower.low > 0
    assert reading("Joint", "DO+", "forget ROUGE-L", False, lower).startswith("DO+ is better than Joint")
    one = paired([1.0], [0.0])
    assert (one.n, one.low, one.detectable) == (1, None, None)
    assert "1 pair, too few for an interval" in reading("A", "B", "MU", True, one)
    assert paired([], []).n == 0
    with pytest.raises(ValueError, match="one of each per pair"):
        paired([1.0], [])


def test_runs_are_paired_by_task_and_seed_within_one_sweep_value():
    def run(scheme, task, seed, value, sweep=0.1):
        return f"{scheme}-{task}-{seed}-{sweep}", {"scheme": scheme, "task_id": task, "seed": seed,
                                                   "sweep_value": sweep, "values": {"MU": value}}

    runs = dict([run("a", 1, 0, 5.0), run("a", 2, 0, 7.0), run("a", 1, 1, 6.0), run("a", 3, 0, 100.0),
                 run("b", 2, 0, 4.0), run("b", 1, 1, 5.5), run("b", 1, 0, 4.0),  # another order; no task 3
                 run("b", 1, 0, 1.0, sweep=0.2)])
    rows = [{"label": "A", "sweep_value": 0.1, "runs": [n for n in runs if n.startswith("a-")]},
            {"label": "B", "sweep_value": 0.1, "runs": [n for n in runs if n.startswith("b-") and n.endswith("0.1")]},
            {"label": "B", "sweep_value": 0.2, "runs": ["b-1-0-0.2"]}]
    found = comparisons(rows, runs, [("MU", "MU", True)])
    assert len(found) == 1  # the 0.2 row has no partner at its sweep value
    entry = found[0]
    assert entry["pairs"] == [{"task": 1, "seed": 0}, {"task": 1, "seed": 1}, {"task": 2, "seed": 0}]
    assert entry["differences"] == [1.0, 0.5, 3.0] and entry["n"] == 3
    assert entry["reading"] == reading("A", "B", "MU", True, paired([5.0, 6.0, 7.0], [4.0, 5.5, 4.0]))
