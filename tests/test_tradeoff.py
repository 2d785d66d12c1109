"""The trade-off at matched levels (bench/tradeoff.py) on hand-made curves, values worked out by hand."""

from __future__ import annotations

import pytest

from doplus_cli.bench.tradeoff import (
    at_level,
    cell,
    dominance,
    dominance_between,
    dominance_counts,
    dominated_area,
    envelope,
    levels,
    render,
    summarise_tradeoff,
)

# (x, y) in step order: x rises 10 -> 30 -> 50 while y falls 50 -> 40 -> 20
RISING = [(10.0, 50.0), (30.0, 40.0), (50.0, 20.0)]


@pytest.mark.parametrize("level, value, status", [
    (20.0, 45.0, "reached"),  # halfway from 10 to 30: halfway from 50 to 40
    (40.0, 30.0, "reached"),  # halfway from 30 to 50: halfway from 40 to 20
    (25.0, 42.5, "reached"),  # 3/4 of the way from 10 to 30: 50 - 0.75 * 10
    (50.0, 20.0, "reached"),  # exactly the last point
    (10.0, 50.0, "reached"),  # exactly the first point
    (60.0, None, "not reached"),  # beyond the curve: never extrapolated
    (5.0, None, "past at the start"),  # the curve starts beyond it
])
def test_a_rising_curve_is_read_at_each_level(level, value, status):
    crossing = at_level(RISING, level, falling=False)
    assert crossing.status == status
    assert crossing.value == (None if value is None else pytest.approx(value))


def test_the_first_crossing_counts_when_the_curve_turns_back():
    # x: 10 -> 35 -> 25 -> 45; level 30 is first passed between the first two points (t = 20/25 = 0.8)
    curve = [(10.0, 50.0), (35.0, 45.0), (25.0, 44.0), (45.0, 30.0)]
    assert at_level(curve, 30.0, falling=False).value == pytest.approx(50.0 - 0.8 * 5.0)
    # a level passed only after the turn: 40 is first crossed from 25 to 45, at t = 15/20 = 0.75
    assert at_level(curve, 40.0, falling=False).value == pytest.approx(44.0 + 0.75 * (30.0 - 44.0))


def test_a_falling_curve_for_ufe_at_matched_mu():
    # (MU, UFE): MU falls 50 -> 45 -> 35 while UFE rises 10 -> 30 -> 50
    curve = [(50.0, 10.0), (45.0, 30.0), (35.0, 50.0)]
    assert at_level(curve, 40.0, falling=True).value == pytest.approx(40.0)  # halfway from 45 to 35
    assert at_level(curve, 48.0, falling=True).value == pytest.approx(10.0 + 0.4 * 20.0)  # 2/5 of 50 -> 45
    assert at_level(curve, 30.0, falling=True).status == "not reached"
    assert at_level(curve, 55.0, falling=True).status == "past at the start"
    assert at_level([], 1.0, falling=True).status == "not reached"


def test_the_levels_rule():
    # mean start 12, median end 60: 1/4, 1/2, 3/4 of the way are 24, 36, 48
    assert levels([10.0, 14.0], [52.0, 60.0, 100.0]) == [24.0, 36.0, 48.0]
    # falling (MU): mean start 50, median end 42: 48, 46, 44
    assert levels([50.0, 50.0], [40.0, 42.0, 44.0]) == [48.0, 46.0, 44.0]
    assert levels([30.0], [30.05]) == [] and levels([], [1.0]) == []


def test_summary_means_stds_and_runs_that_never_reach_a_level():
    start = {"step": 0, "UFE": 10.0, "MU": 50.0}
    runs = {  # evaluations out of step order on purpose: the curve sorts them
        "a1": {"start": start, "evals": [{"step": 20, "UFE": 50.0, "MU": 40.0}, {"step": 10, "UFE": 30.0, "MU": 46.0}]},
        "a2": {"start": start, "evals": [{"step": 10, "UFE": 30.0, "MU": 44.0}, {"step": 20, "UFE": 70.0, "MU": 42.0}]},
        "b1": {"start": start, "evals": [{"step": 10, "UFE": 20.0, "MU": 48.0}, {"step": 20, "UFE": 26.0, "MU": 47.0}]},
        "b2": {"start": None, "evals": [{"step": 10, "UFE": 20.0, "MU": None}]},  # no curve: left out
    }
    summary = summarise_tradeoff(runs, [("A", ["a1", "a2"]), ("B", ["b1", "b2"])])
    # UFE: mean start 10, final UFE 50, 70, 26 -> median 50: levels 20, 30, 40
    assert summary["ufe_levels"] == [20.0, 30.0, 40.0]
    # MU: start 50, lowest MU 40, 42, 47 -> median 42: levels 48, 46, 44
    assert summary["mu_levels"] == [48.0, 46.0, 44.0]
    a, b = summary["rows"]
    assert a["runs"] == ["a1", "a2"] and b["runs"] == ["b1"]
    # MU at UFE 20: a1 halfway 10 -> 30 (MU 50 -> 46) = 48; a2 halfway (50 -> 44) = 47
    at20 = a["mu_at_ufe"][0]
    assert at20["values"] == [pytest.approx(48.0), pytest.approx(47.0)]
    assert at20["mean"] == pytest.approx(47.5) and at20["std"] == pytest.approx(0.5 ** 0.5)
    # MU at UFE 40: a1 halfway 30 -> 50 (46 -> 40) = 43; a2 1/4 of 30 -> 70 (44 -> 42) = 43.5
    assert a["mu_at_ufe"][2]["values"] == [pytest.approx(43.0), pytest.approx(43.5)]
    # B reaches UFE 20 at its first evaluation (MU 48); never 30 or 40
    assert b["mu_at_ufe"][0]["values"] == [pytest.approx(48.0)] and b["mu_at_ufe"][0]["std"] is None
    for entry in b["mu_at_ufe"][1:]:
        assert entry["mean"] is None and entry["reached"] == 0 and entry["status"] == ["not reached"]
    # UFE at MU 46: a1 reaches 46 at its first evaluation (UFE 30); a2 2/3 of 50 -> 44 (10 -> 30) = 23.33
    assert a["ufe_at_mu"][1]["values"] == [pytest.approx(30.0), pytest.approx(10.0 + 40.0 / 3)]
    # B never loses that much utility: not reached at 46 and 44; at 48 its first evaluation (UFE 20)
    assert b["ufe_at_mu"][0]["values"] == [pytest.approx(20.0)]
    assert [e["reached"] for e in b["ufe_at_mu"]] == [1, 0, 0]
    assert cell(b["ufe_at_mu"][2]) == "not reached (0/1)"
    assert cell(at20) == f"47.50 ± {0.5 ** 0.5:.2f} (2/2)"
    text = "\n".join(render(summary, "forget tasks"))
    assert "| A | 47.50 ± 0.71 (2/2) |" in text
    assert "| B | 48.00 (1/1) | not reached (0/1) | not reached (0/1) |" in text


def test_no_curve_no_tradeoff():
    assert summarise_tradeoff({"r": {"start": None, "evals": [{"step": 4, "UFE": 1.0, "MU": 2.0}]}},
                              [("R", ["r"])]) is None


def test_the_envelope_keeps_the_points_no_other_point_beats_on_both():
    # (UFE, MU): (20, 45) is beaten by (30, 46); (40, 30) and (40, 20): only the higher MU stays
    curve = [(10.0, 50.0), (20.0, 45.0), (30.0, 46.0), (40.0, 30.0), (40.0, 20.0), (35.0, 10.0)]
    assert envelope(curve) == [(10.0, 50.0), (30.0, 46.0), (40.0, 30.0)]
    assert envelope([]) == [] and envelope([(5.0, 5.0), (5.0, 5.0)]) == [(5.0, 5.0)]


def test_the_area_an_envelope_dominates_by_hand():
    curve = [(10.0, 50.0), (30.0, 46.0), (40.0, 30.0)]
    # above (10, 0): (10 -> 30) x 46 + (30 -> 40) x 30; the start point adds no width
    assert dominated_area(curve, 10.0) == pytest.approx(20 * 46 + 10 * 30)
    # above (20, 0): the point at 10 is left of the reference, (20 -> 30) x 46 + (30 -> 40) x 30
    assert dominated_area(curve, 20.0) == pytest.approx(10 * 46 + 10 * 30)
    # above (0, 40): the point below MU 40 adds nothing; (0 -> 10) x 10 + (10 -> 30) x 6
    assert dominated_area(curve, 0.0, 40.0) == pytest.approx(10 * 10 + 20 * 6)
    assert dominated_area(curve, 50.0) == 0.0


def test_a_curve_above_another_all_along_dominates_it_and_crossing_curves_do_not():
    low = [(10.0, 50.0), (30.0, 40.0), (50.0, 20.0)]
    high = [(10.0, 52.0), (30.0, 44.0), (50.0, 25.0), (55.0, 5.0)]  # better MU at every UFE, and further
    crossing = [(10.0, 50.0), (30.0, 45.0), (50.0, 10.0)]  # above low in the middle, below it at the end
    assert dominance(high, low) == "a" and dominance(low, high) == "b"
    assert dominance(low, crossing) == "cross"
    assert dominance(low, list(reversed(low))) == "equal"
    assert dominated_area(high, 10.0) > dominated_area(low, 10.0)
    counts = dominance_counts({(1, 0): high, (1, 1): low, (2, 0): low}, {(1, 0): low, (1, 1): crossing, (3, 0): low})
    assert {k: counts[k] for k in ("pairs", "first", "second", "equal", "cross")} == \
        {"pairs": 2, "first": 1, "second": 0, "equal": 0, "cross": 1}


def test_the_summary_gives_each_row_its_runs_areas_and_says_which_envelope_dominates():
    start = {"step": 0, "UFE": 10.0, "MU": 50.0}
    better = [{"step": 10, "UFE": 30.0, "MU": 48.0}, {"step": 20, "UFE": 50.0, "MU": 40.0}]
    worse = [{"step": 10, "UFE": 30.0, "MU": 44.0}, {"step": 20, "UFE": 45.0, "MU": 30.0}]
    runs = {"a0": {"start": start, "evals": better}, "b0": {"start": start, "evals": worse}}
    summary = summarise_tradeoff(runs, [("A", ["a0"]), ("B", ["b0"])])
    # reference UFE 10 (both start there): A (10 -> 30) x 48 + (30 -> 50) x 40; B (10 -> 30) x 44 + (30 -> 45) x 30
    assert summary["areas"] == {"a0": pytest.approx(20 * 48 + 20 * 40), "b0": pytest.approx(20 * 44 + 15 * 30)}
    assert [row["area"]["mean"] for row in summary["rows"]] == [pytest.approx(1760.0), pytest.approx(1330.0)]
    rows = [{"label": "A", "sweep_value": None, "runs": ["a0"]}, {"label": "B", "sweep_value": None, "runs": ["b0"]}]
    facts = {"a0": {"task_id": 1, "seed": 0}, "b0": {"task_id": 1, "seed": 0}}
    summary["dominance"] = dominance_between(rows, facts, summary["curves"])
    assert summary["dominance"][0]["first"] == 1 and summary["dominance"][0]["pairs"] == 1
    text = "\n".join(render(summary, "seeds"))
    assert "| A | 1760.0 (1 run) |" in text and "A's envelope dominates in 1, B's in 0" in text
