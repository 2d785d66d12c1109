"""docs/results.md's generated tables: each is what docs/data/tables.py renders from the runs files in
docs/data/records, byte for byte; the runs files are the conversion of the bench and tune outputs beside them; the
runs-file reader takes a well-formed file and rejects anything else with a one-line UserError naming file and
line; and small runs files written here render to tables worked out by hand."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from doplus_cli.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data"


def _load_tables():
    """docs/data/tables.py, a script outside the package, as a module (registered first: its dataclasses look
    their module up by name)."""
    spec = importlib.util.spec_from_file_location("doplus_docs_tables", DATA / "tables.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


tables = _load_tables()


def record(run: str, scheme: str, seed: int | None, metrics: dict[str, Any], step: int = 10,
           resources: dict[str, Any] | None = None, state: str = "complete", error: str | None = None,
           evaluations: list[dict[str, Any]] | None = None, study: dict[str, Any] | None = None) -> dict[str, Any]:
    """A run in the layout of docs/data/README.md, written out field by field."""
    return {"run": run, "source": None, "scheme": scheme, "task": None, "seed": seed, "settings": {"steps": step},
            "version": None, "commit": None, "state": state, "error": error,
            "evaluations": evaluations if evaluations is not None else [{"step": step, "metrics": metrics}],
            "resources": resources or {}, "diagnostics": {}, "notes": {}, "attacks": None, "study": study}


def trial(study: str, number: int, scheme: str, lr: float, state: str, scores: dict[str, float] | None,
          feasible: bool, objective: str = "retain_rouge", pruner: str = "none", constraints: tuple[str, ...] = (
          "forget_rouge<=0.05",), steps: dict[int, float] | None = None, seconds: float | None = None,
          error: str | None = None, pruned_step: int | None = None) -> dict[str, Any]:
    evaluations = [{"step": s, "metrics": {objective: v}} for s, v in (steps or {}).items()]
    if scores is not None:
        evaluations.append({"step": 36, "metrics": scores})
    value = scores[objective] if scores is not None and state == "complete" else None
    return record(f"{study}/{number:04d}", scheme, 0, {}, state=state, error=error, evaluations=evaluations,
                  resources={"seconds": seconds},
                  study={"name": study, "trial": number, "params": {"lr": lr}, "objective": objective,
                         "direction": "maximize", "constraints": list(constraints), "pruner": pruner,
                         "sampler_seed": 0, "value": value, "feasible": feasible, "violations": None,
                         "pruned_step": pruned_step, "retry_of": None})


def write_lines(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


# ---- the page and the committed data ---------------------------------------------------------------------------


def test_every_generated_table_of_results_md_is_what_the_runs_files_give():
    page = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    names = [name for name, _, _ in tables.regions(page)]
    assert sorted(names) == sorted(tables.TABLES)  # every table of TABLES is on the page, once
    assert tables.regenerate(page) == page
    assert tables.differing(page) == []


def test_a_figure_edited_by_hand_in_a_generated_table_is_caught():
    page = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    _, start, end = next(r for r in tables.regions(page) if r[0] == "muse_mini")
    edited = page[:start] + page[start:end].replace("| 0.321 ± 0.066 |", "| 0.320 ± 0.066 |", 1) + page[end:]
    assert edited != page
    assert tables.differing(edited) == ["muse_mini"]
    assert tables.regenerate(edited) == page


def test_the_runs_files_are_the_conversion_of_the_bench_and_tune_outputs(tmp_path):
    written = tables.convert(DATA, tmp_path)
    assert sorted(p.name for p in written) == sorted(p.name for p in (DATA / "records").glob("*.jsonl"))
    for path in written:
        assert path.read_bytes() == (DATA / "records" / path.name).read_bytes(), path.name
        assert tables.read_runs(path)


def test_the_conversion_copies_a_schemes_run_and_places_its_curve():
    """A SCHEMES.json run with a three-point curve and an attack column: the starting model at step 0, the
    evaluation during training at an unrecorded step (null), the final one at the run's steps with every score;
    the resources, the update cosine and the attacked copy's value apart; no version or commit invented."""
    summary = {
        "kind": "unlearn", "recipe": "r.yaml", "set": {},
        "columns": [{"key": "UFE", "role": "score"}, {"key": "MU", "role": "score"},
                    {"key": "UFE after relearn", "role": "attack"}, {"key": "UFE worst attack", "role": "attack"},
                    {"key": "train_time_s", "role": "resource"}, {"key": "update_cosine", "role": "similarity"}],
        "tradeoff": {"curves": {"doplus-t2-s0": [[10.0, 40.0], [30.0, 35.0], [50.0, 30.0]]}},
        "runs": {"doplus-t2-s0": {
            "scheme": "doplus", "seed": 0, "sweep_value": None, "task_id": 2, "model": "m", "steps": 8,
            "device": "CPU", "world_size": 1, "peak_memory_kind": "process_peak_rss", "evaluation": "e",
            "wall_time_s": 5.0, "evaluated_during_training": True,
            "values": {"UFE": 50.0, "MU": 30.0, "UFE after relearn": 41.0, "UFE worst attack": 41.0,
                       "train_time_s": 3.0, "peak_memory_gb": 1.5, "optimizer_state_bytes": 24,
                       "update_cosine": 0.25},
            "notes": {"UFE": "UFE over 3 of 5 indicators"}}},
    }
    (run,) = tables.records_from_schemes(summary, "S.json")
    assert run["evaluations"] == [{"step": 0, "metrics": {"UFE": 10.0, "MU": 40.0}},
                                  {"step": None, "metrics": {"UFE": 30.0, "MU": 35.0}},
                                  {"step": 8, "metrics": {"UFE": 50.0, "MU": 30.0}}]
    assert run["attacks"] == {"relearn": {"UFE": 41.0}, "worst attack": {"UFE": 41.0}}
    assert run["resources"] == {"train_time_s": 3.0, "peak_memory_gb": 1.5, "optimizer_state_bytes": 24,
                                "peak_memory_kind": "process_peak_rss", "wall_time_s": 5.0}
    assert run["diagnostics"] == {"update_cosine": 0.25}
    assert (run["task"], run["seed"], run["version"], run["commit"]) == (2, 0, None, None)
    assert run["source"] == "S.json#/runs/doplus-t2-s0" and run["notes"] == {"UFE": "UFE over 3 of 5 indicators"}
    tables.check_record(run)
    summary["tradeoff"]["curves"]["doplus-t2-s0"][-1] = [49.0, 30.0]  # a curve that does not end at the scores
    with pytest.raises(UserError, match="cannot place its evaluations"):
        tables.records_from_schemes(summary, "S.json")


def test_the_conversion_copies_a_tune_trial_with_the_studys_settings_applied():
    summary = {
        "settings": {"kind": "unlearn", "recipe": {"scheme": "doplus", "lr": 1e-4, "steps": 36, "seed": 0},
                     "set": {"scheme": "alternate"}, "objective": "OVR", "direction": "maximize",
                     "constraints": [], "pruner": "median", "seed": 3},
        "trials": [
            {"number": 0, "state": "complete", "params": {"lr": 2e-4}, "value": 52.0, "feasible": True,
             "scores": {"OVR": 52.0, "MU": 20.0}, "violations": [], "intermediate": {"18": 48.0, "36": 52.0},
             "pruned_step": None, "seconds": 290.0, "error": None, "retry_of": None,
             "folder": "/x/tune/mt/trials/0000"},
            {"number": 1, "state": "pruned", "params": {"lr": 7e-4}, "value": None, "feasible": False,
             "scores": None, "violations": [], "intermediate": {"18": 40.0}, "pruned_step": 18, "seconds": None,
             "error": None, "retry_of": None, "folder": "/x/tune/mt/trials/0001"},
        ],
    }
    done, pruned = tables.records_from_tune(summary, "T.json")
    assert done["run"] == "mt/0000" and done["scheme"] == "alternate" and done["settings"]["lr"] == 2e-4
    assert done["evaluations"] == [{"step": 18, "metrics": {"OVR": 48.0}},
                                   {"step": 36, "metrics": {"OVR": 52.0, "MU": 20.0}}]
    assert pruned["evaluations"] == [{"step": 18, "metrics": {"OVR": 40.0}}]
    assert (pruned["state"], pruned["study"]["pruned_step"], pruned["study"]["sampler_seed"]) == ("pruned", 18, 3)
    for run in (done, pruned):
        tables.check_record(run)


# ---- the reader ------------------------------------------------------------------------------------------------

GOOD = record("a-s0", "doplus", 0, {"UFE": 1.5, "MU": None}, resources={"peak_memory_kind": "rss"})


def test_the_reader_reads_a_file_and_skips_blank_lines(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text("\n" + json.dumps(GOOD) + "\n\n" + json.dumps({**GOOD, "run": "a-s1"}) + "\n")
    assert [r["run"] for r in tables.read_runs(path)] == ["a-s0", "a-s1"]


@pytest.mark.parametrize("line, says", [
    ("{", "malformed JSON"),
    ("[]", "the line must be a JSON object"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "seed"}), "missing field seed"),
    (json.dumps({**GOOD, "seeds": 0}), "unknown field 'seeds'"),
    (json.dumps({**GOOD, "seed": True}), "seed must be an integer or null"),
    (json.dumps({**GOOD, "state": "done"}), "state must be complete or pruned or failed"),
    (json.dumps({**GOOD, "evaluations": [{"step": 1, "metrics": {"UFE": "high"}}]}),
     "evaluations[0].metrics.UFE must be a finite number or null"),
    (json.dumps({**GOOD, "evaluations": [{"step": 1, "metrics": {"UFE": float("nan")}}]}), "finite numbers"),
    (json.dumps({**GOOD, "study": {"name": "s"}}), "study: missing fields"),
])
def test_the_reader_names_the_file_the_line_and_the_field(tmp_path, line, says):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + line + "\n")
    with pytest.raises(UserError) as caught:
        tables.read_runs(path)
    message = str(caught.value)
    assert message.startswith(f"{path}:2: ") and says in message and "\n" not in message


def test_the_reader_rejects_a_repeated_run(tmp_path):
    path = write_lines(tmp_path / "r.jsonl", [GOOD, GOOD])
    with pytest.raises(UserError, match=r"r\.jsonl:2: run 'a-s0' repeats line 1"):
        tables.read_runs(path)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10)


@st.composite
def lines(draw) -> bytes:
    """A line of a runs file: raw bytes, arbitrary JSON, or a good record with one field (or a field of its
    study or of an evaluation) replaced by arbitrary JSON or dropped."""
    kind = draw(st.sampled_from(["bytes", "json", "field", "study", "evaluation"]))
    if kind == "bytes":
        return draw(st.binary(max_size=40)).replace(b"\n", b" ")
    if kind == "json":
        return json.dumps(draw(JSON)).encode()
    base = json.loads(json.dumps(GOOD))
    base["study"] = trial("s", 0, "doplus", 1e-4, "complete", {"retain_rouge": 0.5}, True)["study"]
    target = {"field": base, "study": base["study"], "evaluation": base["evaluations"][0]}[kind]
    key = draw(st.sampled_from(sorted(target)))
    if draw(st.booleans()):
        del target[key]
    else:
        target[key] = draw(JSON)
    return json.dumps(base).encode()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(lines(), min_size=1, max_size=3))
def test_any_runs_file_is_read_or_refused_with_a_user_error(tmp_path, drawn):
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\n".join(drawn))
    try:
        read = tables.read_runs(path)
    except UserError as error:
        message = str(error)
        assert message.startswith(f"{path}:") and "\n" not in message
        number = int(message[len(str(path)) + 1:].split(":", 1)[0])
        assert 1 <= number <= len(drawn)
    else:
        assert len(read) == sum(1 for line in drawn if line.strip())


# ---- tables worked out by hand ---------------------------------------------------------------------------------


def test_a_tiny_runs_file_renders_to_its_table_in_the_page(tmp_path):
    """Two schemes, two seeds each: the mean and the sample std (n − 1) of each column, worked out here. DO+:
    (0.1, 0.3) -> 0.200 ± sqrt(2 · 0.1² / 1) = 0.141; states 2e9 both -> 2.00, no spread. Alternate: (−1.25,
    −0.75) -> −1.000 ± sqrt(2 · 0.25² / 1) = 0.354 with U+2212 for the sign; states (1e9, 3e9) -> 2.00 ± 1.41."""
    assert math.isclose(statistics.stdev([0.1, 0.3]), math.sqrt(2 * 0.1 ** 2))
    runs = tmp_path / "runs"
    runs.mkdir()
    write_lines(runs / "tiny.jsonl", [
        record("doplus-s0", "doplus", 0, {"M": 0.1}, resources={"optimizer_state_bytes": 2e9}),
        record("alternate-s0", "alternate", 0, {"M": -1.25}, resources={"optimizer_state_bytes": 1e9}),
        record("doplus-s1", "doplus", 1, {"M": 0.3}, resources={"optimizer_state_bytes": 2e9}),
        record("alternate-s1", "alternate", 1, {"M": -0.75}, resources={"optimizer_state_bytes": 3e9}),
    ])
    columns = (tables.Column("M", "M ↓", ".3f"),
               tables.Column("optimizer_state_bytes", "states (GB)", ".2f", resource=True, scale=1e9, spread=False))
    mine = {"tiny": tables.Table("tiny", lambda records: tables.mean_std_table(records, columns))}
    page = ("# Page\n\nText above.\n\n<!-- table: tiny (generated by hand) -->\n\n| old |\n\n<!-- /table -->\n\n"
            "Text below.\n")
    expected = ("# Page\n\nText above.\n\n"
                "<!-- table: tiny (generated by python docs/data/tables.py from data/records/tiny.jsonl) -->\n\n"
                "| Method | M ↓ | states (GB) |\n"
                "| --- | ---: | ---: |\n"
                "| DO+ | 0.200 ± 0.141 | 2.00 |\n"
                "| Alternate | −1.000 ± 0.354 | 2.00 ± 1.41 |\n\n"
                "<!-- /table -->\n\nText below.\n")
    assert tables.regenerate(page, runs, mine) == expected
    assert tables.regenerate(expected, runs, mine) == expected
    with pytest.raises(UserError, match="no table named 'other'"):
        tables.regenerate(page.replace("table: tiny", "table: other"), runs, mine)
    with pytest.raises(UserError, match="has no closing line"):
        tables.regenerate(page.replace("<!-- /table -->", ""), runs, mine)


def test_a_tuning_table_by_hand():
    """One study of four trials shown, the best feasible among trials 0-2 in bold: trial 1 has the highest
    retain ROUGE but breaks the constraint, trial 2 failed for a full disk, trial 3 is better than trial 0 but
    outside the trials the best is chosen among, so trial 0 is bold."""
    disk = "trial 0002 failed (exit code 2): error: cannot write (No space left on device)"
    records = [
        trial("rw", 0, "doplus", 1.2345e-4, "complete", {"forget_rouge": 0.0204, "retain_rouge": 0.5}, True),
        trial("rw", 1, "doplus", 1.1e-5, "complete", {"forget_rouge": 0.4646, "retain_rouge": 0.9}, False),
        trial("rw", 2, "doplus", 8.6e-4, "failed", None, False, error=disk),
        trial("rw", 3, "doplus", 9.999e-3, "complete", {"forget_rouge": 0.0125, "retain_rouge": 0.6}, True),
    ]
    rendered = tables.tune_trials_table(records, ("doplus",), "lr", tables.ROUGES, range(0, 4), range(0, 3),
                                        trial_column=True)
    assert rendered == [
        "| scheme | trial | lr | forget ROUGE-L ↓ | retain ROUGE-L ↑ | forgets (≤ 0.05) |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
        "| DO+ | 0 | **1.23e-4** | 0.020 | **0.500** | yes |",
        "| DO+ | 1 | 1.10e-5 | 0.465 | 0.900 | no |",
        "| DO+ | 2 | 8.60e-4 | — | — | failed (disk full) |",
        "| DO+ | 3 | 1.00e-2 | 0.013 | 0.600 | yes |",
    ]


def test_a_pruner_table_by_hand():
    """Two studies proposing the same two learning rates; the median study prunes trial 1 at step 18, so its
    cells say so and its seconds are blank; trial 0 is the best of both (bold objective and lr)."""
    records = []
    for pruner in ("none", "median"):
        records.append(trial(f"mt-{pruner}", 0, "doplus", 2.694e-4, "complete", {"OVR": 52.684}, True,
                             objective="OVR", pruner=pruner, constraints=(), steps={18: 48.791},
                             seconds=293.5 if pruner == "none" else 287.4))
        pruned = pruner == "median"
        records.append(trial(f"mt-{pruner}", 1, "doplus", 7.82e-4, "pruned" if pruned else "complete",
                             None if pruned else {"OVR": 45.556}, not pruned, objective="OVR", pruner=pruner,
                             constraints=(), steps={18: 46.1906}, seconds=None if pruned else 271.5,
                             pruned_step=18 if pruned else None))
    assert tables.pruner_table(records, "lr", ("none", "median")) == [
        "| trial | lr | step-18 OVR | OVR, `none` | `median` | s, `none` | s, `median` |",
        "| ---: | ---: | ---: | ---: | --- | ---: | ---: |",
        "| 0 | **2.69e-4** | 48.79 | **52.68** | **52.68** | 294 | 287 |",
        "| 1 | 7.82e-4 | 46.19 | 45.56 | pruned at 18 | 272 | |",
    ]


@pytest.mark.parametrize("key, expected", [
    ("UFE after relearn-k50", ("relearn-k50", "UFE")),
    ("UFE worst attack", ("worst attack", "UFE")),
    ("UFE taken back by prune", ("prune", "UFE taken back")),
    ("UFE taken back by the worst attack", ("worst attack", "UFE taken back")),
    ("logit-lens probability unattacked", ("logit-lens", "probability unattacked")),
    ("linear-probe probe_accuracy on embeddings alone", ("linear-probe", "probe_accuracy on embeddings alone")),
    ("probe_accuracy taken back by linear-probe", ("linear-probe", "probe_accuracy taken back")),
    ("held-out rouge after relearn-k50", ("relearn-k50", "held-out rouge")),
    ("held-out rouge unattacked", ("unattacked", "held-out rouge")),
])
def test_a_column_under_attack_goes_to_its_attack(key, expected):
    assert tables.split_key(key) == expected


def _attacked(scheme: str, task: int, ufe: float, worst: float, lens: tuple[float, float], probe: float,
              taught_probe: float) -> dict[str, Any]:
    run = record(f"{scheme}-t{task}", scheme, 0, {"UFE": ufe, "MU": 30.0 + task})
    run["task"] = task
    run["attacks"] = {
        "relearn-k50": {"UFE": worst, "UFE taken back": ufe - worst, "held-out rouge": 0.4},
        "prune": {"UFE": ufe - 1.0, "UFE taken back": 1.0},
        "worst attack": {"UFE": worst, "UFE taken back": ufe - worst},
        "unattacked": {"held-out rouge": 0.1},
        "logit-lens": {"probability unattacked": lens[0], "probability": lens[1],
                       "probability taken back": lens[1] - lens[0]},
        "linear-probe": {"probe_accuracy": probe, "probe_accuracy on the starting model": taught_probe,
                         "probe_accuracy minus the starting model's": probe - taught_probe},
    }
    tables.check_record(run)
    return run


def test_the_white_box_tables_from_runs_worked_out_by_hand():
    runs = [_attacked("doplus", 1, 60.0, 30.0, (0.20, 0.50), 0.80, 0.95),
            _attacked("doplus", 2, 58.0, 27.0, (0.30, 0.40), 0.85, 0.90),
            _attacked("doplus", 3, 62.0, 29.0, (0.10, 0.30), 0.70, 0.95),
            _attacked("alternate", 1, 59.0, 36.0, (0.20, 0.30), 0.75, 0.95),
            _attacked("alternate", 2, 57.0, 35.0, (0.30, 0.35), 0.80, 0.90),
            _attacked("alternate", 3, 60.0, 37.0, (0.10, 0.20), 0.60, 0.95)]
    ufe = tables.WHITEBOX_TABLES["tofu_protocol_whitebox"].render(runs)
    assert ufe[0].startswith("| Method | MU | UFE unattacked | relearn (K = 50) |")
    doplus = ufe[2].split(" | ")
    assert doplus[2] == f"60.00 ± {statistics.stdev([60, 58, 62]):.2f}"  # UFE unattacked
    assert doplus[3] == f"{statistics.mean([30, 27, 29]):.2f} ± {statistics.stdev([30, 27, 29]):.2f}"  # relearn
    assert doplus[4] == "n/a"  # NF4: not in these runs
    assert doplus[8] == f"59.00 ± {statistics.stdev([59, 57, 61]):.2f}"  # prune: UFE - 1
    reading = tables.WHITEBOX_TABLES["tofu_protocol_whitebox_reading"].render(runs)
    lens = reading[2].split(" | ")[1]
    assert lens == (f"{statistics.mean([.2, .3, .1]):.3f} ± {statistics.stdev([.2, .3, .1]):.3f} → "
                    f"{statistics.mean([.5, .4, .3]):.3f} ± {statistics.stdev([.5, .4, .3]):.3f}")
    assert reading[2].split(" | ")[5].startswith("0.100 ± 0.000 → 0.400 ± 0.000")  # relearn's held-out ROUGE-L
    paired = tables.WHITEBOX_TABLES["tofu_protocol_whitebox_paired"].render(runs)
    assert paired[0] == "| What is taken back | DO+ − Alternate | DO+ − DO |"  # the bench's labels
    worst = next(line for line in paired if line.startswith("| UFE, the worst attack |")).split(" | ")
    # UFE taken back by the worst attack: DO+ 30, 31, 33 against Alternate 23, 22, 23: differences 7, 9, 10
    diffs = [7.0, 9.0, 10.0]
    half = 4.302652729911275 * statistics.stdev(diffs) / math.sqrt(3)  # t(0.975, 2 degrees of freedom)
    mean = statistics.mean(diffs)
    assert worst[1] == f"{mean:.2f} [{tables.minus(f'{mean - half:.2f}')}, {mean + half:.2f}], 3/3 agree"
    assert worst[2].rstrip(" |") == "n/a"  # no DualOptim runs
    probe = next(line for line in paired if line.startswith("| probe accuracy minus")).split(" | ")
    # DO+ −0.15, −0.05, −0.25 against Alternate −0.20, −0.10, −0.35: differences 0.05, 0.05, 0.10
    d = [0.05, 0.05, 0.10]
    h = 4.302652729911275 * statistics.stdev(d) / math.sqrt(3)
    m = statistics.mean(d)
    assert probe[1] == f"{m:.3f} [{tables.minus(f'{m - h:.3f}')}, {m + h:.3f}], 3/3 agree"


def test_the_white_box_words_by_the_committed_rules_worked_out_by_hand():
    """The protocol's rules, applied: "less robust" needs every task to agree and the interval to exclude 0; a
    white-box attack recovers knowledge from a scheme when its mean take-back exceeds the spread over tasks of the
    figure it moves; the probe only when it beats both references by more than their spreads."""
    def run(scheme, task, ufe, worst, lens, probe, alone, choice):
        made = _attacked(scheme, task, ufe, worst, lens, probe, 0.9)
        made["attacks"]["linear-probe"].update({"probe_accuracy on embeddings alone": alone,
                                                "probe_accuracy unattacked": choice})
        return made

    runs = [run("doplus", 1, 60.0, 30.0, (0.20, 0.50), 0.95, 0.60, 0.70),
            run("doplus", 2, 58.0, 27.0, (0.30, 0.40), 0.90, 0.65, 0.75),
            run("doplus", 3, 62.0, 29.0, (0.10, 0.30), 1.00, 0.70, 0.65),
            run("alternate", 1, 59.0, 36.0, (0.20, 0.30), 0.75, 0.70, 0.80),
            run("alternate", 2, 57.0, 35.0, (0.30, 0.35), 0.80, 0.75, 0.80),
            run("alternate", 3, 60.0, 37.0, (0.10, 0.20), 0.70, 0.80, 0.85)]
    words = tables.whitebox_words(runs)
    assert words[0] == (f"- Unattacked UFE (mean ± std over the forget tasks): DO+ 60.00 ± "
                        f"{statistics.stdev([60, 58, 62]):.2f}; Alternate 58.67 ± "
                        f"{statistics.stdev([59, 57, 60]):.2f}.")
    # relearn (and so the worst attack) takes back 30, 31, 33 from DO+ and 23, 22, 23 from Alternate: differences
    # 7, 9, 10, every one positive, and the interval above 0: less robust
    half = 4.302652729911275 * statistics.stdev([7, 9, 10]) / math.sqrt(3)
    mean = statistics.mean([7, 9, 10])
    relearn = f"UFE, relearn (+{mean:.2f} [+{mean - half:.2f}, +{mean + half:.2f}])"
    assert words[1].startswith(f"- DO+ against Alternate: DO+'s forgetting is less robust to {relearn}; UFE, the "
                               "worst attack")
    # prune takes back 1 from both (differences 0: no sign agrees); the lens 0.3, 0.1, 0.2 against 0.1, 0.05, 0.1:
    # differences 0.2, 0.05, 0.1 agree in sign, but the interval holds 0
    assert words[2].startswith("- DO+ against Alternate: 3 tasks detect no difference for UFE, prune (+0.00 [+0.00, "
                               "+0.00]); Probability, logit lens (+0.117 [−0.073, +0.306])")
    assert not any("against DO:" in line for line in words)  # no DualOptim runs
    # recovery: prune's mean take-back 1.0 is below the UFE spreads (2.00, 1.53); the lens takes back 0.200 from
    # DO+ against the spread 0.100 of its output Probability, 0.083 from Alternate against 0.100
    assert "- Prune recovers forgotten knowledge from no scheme; not from DO+ (1.00 against a spread of 2.00); " \
           f"Alternate (1.00 against a spread of {statistics.stdev([59, 57, 60]):.2f})." in words
    assert ("- The logit lens recovers forgotten knowledge from DO+ (0.200 against a spread of 0.100); not from "
            "Alternate (0.083 against a spread of 0.100).") in words
    # the probe: DO+ 0.950 beats 0.650 + 0.050 and 0.700 + 0.050; Alternate 0.750 is below 0.750 + 0.050
    assert words[-1] == ("- The linear probe recovers the answer from DO+ (0.950 against 0.650 ± 0.050 on embeddings "
                         "alone and 0.700 ± 0.050 for the model's own choice); not from Alternate (0.750 against "
                         "0.750 ± 0.050 on embeddings alone and 0.817 ± 0.029 for the model's own choice).")


def _curved(scheme: str, task: int, points: list[tuple[float, float]], ovr: float) -> dict[str, Any]:
    """A run whose record holds its (UFE, MU) curve: the starting model, one evaluation during training, the last."""
    (u0, m0), (u1, m1), (u2, m2) = points
    made = record(f"{scheme}-t{task}", scheme, 0, {}, evaluations=[
        {"step": 0, "metrics": {"UFE": u0, "MU": m0}}, {"step": None, "metrics": {"UFE": u1, "MU": m1}},
        {"step": 96, "metrics": {"UFE": u2, "MU": m2, "OVR": ovr, "TFE": 98.0, "forget_Q_A_ROUGE": 0.05}}])
    made["task"] = task
    tables.check_record(made)
    return made


def _rectangles(points: list[tuple[float, float]], x_ref: float) -> float:
    """The area these rising-UFE, falling-MU points dominate above (x_ref, 0), rectangle by rectangle."""
    area, left = 0.0, x_ref
    for x, y in points:
        if x > left:
            area, left = area + (x - left) * y, x
    return area


def test_the_federated_learning_and_ablation_sections_worked_out_by_hand():
    """The re-run's sections: the paired OVR difference in the bench's words, the envelope's area and dominance
    over the runs of one forget task, and the ablations read at the FL runs' own levels, by the bench's rule."""
    doplus = [_curved("doplus", 1, [(20, 45), (40, 40), (60, 30)], 50.0),
              _curved("doplus", 2, [(20, 45), (38, 43), (58, 36)], 52.0),
              _curved("doplus", 3, [(20, 45), (42, 39), (62, 28)], 48.0)]
    scaffold = [_curved("scaffold", 1, [(20, 45), (35, 42), (55, 35)], 53.0),
                _curved("scaffold", 2, [(20, 45), (36, 41), (57, 33)], 54.0),
                _curved("scaffold", 3, [(20, 45), (34, 42), (56, 34)], 52.0)]
    ablation = _curved("doplus-after-delta", 1, [(20, 45), (30, 44), (50, 40)], 51.0)
    records = [*scaffold, ablation, *doplus]  # any order: the sections put DO+ first
    label = tables.scheme_label("scaffold")
    # OVR: DO+ − SCAFFOLD = −3, −2, −4: mean −3, sd 1, the interval −3 ± t(0.975, 2)/√3 excludes 0
    half = 4.302652729911275 / math.sqrt(3)
    words = tables.FL_TABLES["tofu_protocol_fl_paired"].render(records)
    assert words[0].startswith(f"- {label} is better than DO+ on OVR (mean -3, 95% CI [{-3 - half:+.3g}, "
                               f"{-3 + half:+.3g}], 3 of 3 pairs agree")
    # the envelope's area over the mean start (20, 0), task by task
    areas_doplus = [_rectangles(c, 20) for c in ([(40, 40), (60, 30)], [(38, 43), (58, 36)], [(42, 39), (62, 28)])]
    areas_scaffold = [_rectangles(c, 20) for c in ([(35, 42), (55, 35)], [(36, 41), (57, 33)], [(34, 42), (56, 34)])]
    assert areas_doplus == [1400.0, 1494.0, 1418.0] and areas_scaffold == [1330.0, 1349.0, 1336.0]
    differences = [a - b for a, b in zip(areas_doplus, areas_scaffold)]  # 70, 145, 82
    mean, sd = statistics.mean(differences), statistics.stdev(differences)
    low = mean - 4.302652729911275 * sd / math.sqrt(3)
    detectable = (4.302652729911275 + 1.0606601717798212) * sd / math.sqrt(3)  # t(0.975, 2) + t(0.80, 2)
    area_words = next(line for line in words if "envelope's area" in line)
    # every task favours DO+, but the interval holds 0: no difference is called
    assert low < 0 and area_words == (
        f"- no difference detected between DO+ and {label} on the envelope's area (mean {mean:+.3g}, 95% CI "
        f"[{low:+.3g}, {mean + (mean - low):+.3g}], 3 of 3 pairs agree); the grid detects a mean difference of "
        f"about {detectable:.3g} or more.")
    # task 2: DO+'s points (38, 43) and (58, 36) beat SCAFFOLD's (36, 41) and (57, 33); tasks 1 and 3 cross
    tradeoff = tables.FL_TABLES["tofu_protocol_fl_tradeoff"].render(records)
    assert (f"- DO+ against {label}, over 3 forget tasks: DO+'s envelope dominates in 1, {label}'s in 0, they "
            "coincide in 0 and cross in 2.") in tradeoff
    area_row = f"| DO+ | {statistics.mean(areas_doplus):.1f} ± {statistics.stdev(areas_doplus):.1f} (3 runs) |"
    assert area_row in tradeoff
    # the ablation at the FL runs' levels: 1/4, 1/2, 3/4 of the way from the mean start 20 to the median final
    # UFE 57.5 (of 60, 58, 62, 55, 57, 56): 29.4, 38.8, 48.1; its curve crosses them between (20, 45), (30, 44)
    # and between (30, 44), (50, 40)
    levels = [round(20 + f * 37.5, 1) for f in (0.25, 0.5, 0.75)]
    assert levels == [29.4, 38.8, 48.1]
    mu = [45 - (levels[0] - 20) / 10, 44 - 4 * (levels[1] - 30) / 20, 44 - 4 * (levels[2] - 30) / 20]
    table = tables.FL_TABLES["tofu_protocol_ablations"].render(records)
    assert table[0] == ("| DualOptim+, forget task 1 | UFE ↑ | TFE ↑ | MU ↑ | OVR ↑ | forget ROUGE-L ↓ | MU at UFE = "
                        "29.4 | MU at UFE = 38.8 | MU at UFE = 48.1 | envelope area |")
    assert table[2].startswith("| DO+ | 60.00 | 98.00 | 30.00 | 50.00 | 0.050 |")
    assert table[3] == (f"| {tables.scheme_label('doplus-after-delta')} | 50.00 | 98.00 | 40.00 | 51.00 | 0.050 | "
                        f"{mu[0]:.2f} | {mu[1]:.2f} | {mu[2]:.2f} | {_rectangles([(30, 44), (50, 40)], 20):.1f} |")
    assert len(table) == 4  # only task 1's runs: DO+'s and the ablation's


def test_the_stability_bench_output_converts_to_one_record_per_rule_and_scale():
    """`doplus bench optimizer --stability --json` kept with its provenance: each row becomes a run whose figures
    are its diagnostics, its rule the scheme, its retain scale and floor the settings."""
    output = {"command": "doplus bench optimizer --stability --json", "seed": 0, "version": "0.2.0",
              "commit": "abc1234", "machine": "2 cores",
              "output": [{"rule": "doplus safeguarded", "v_floor": 0.02, "retain_scale": 0.01,
                          "max_update_float64": 4.6, "max_update_float32": 4.6, "big_updates_float32": 0,
                          "float32_vs_float64": 1e-7, "8bit_all_vs_32bit": 0.197, "seconds": 12.5},
                         {"rule": "dualoptim", "retain_scale": 1.0, "float32_vs_float64": 0.0,
                          "8bit_all_vs_32bit": 0.014}]}
    first, second = tables.records_from_stability(output, "optimizer_stability.json")
    for converted in (first, second):
        tables.check_record(converted)
    assert first["run"] == "doplus safeguarded, v_floor 0.02, retain scale 0.01"
    assert first["source"] == "optimizer_stability.json#/output/0" and first["scheme"] == "doplus safeguarded"
    assert first["settings"] == {"command": "doplus bench optimizer --stability --json", "retain_scale": 0.01,
                                 "v_floor": 0.02}
    assert (first["version"], first["commit"], first["seed"]) == ("0.2.0", "abc1234", 0)
    assert first["resources"] == {"seconds": 12.5, "machine": "2 cores"}
    assert first["diagnostics"] == {"max_update_float64": 4.6, "max_update_float32": 4.6, "big_updates_float32": 0,
                                    "float32_vs_float64": 1e-7, "8bit_all_vs_32bit": 0.197}
    assert second["run"] == "dualoptim, retain scale 1" and second["settings"]["v_floor"] is None
    assert second["resources"] == {"seconds": None, "machine": "2 cores"}


def test_the_speed_bench_output_converts_to_one_record_per_optimizer_and_its_table_by_hand():
    """`doplus bench optimizer --json` kept with its provenance: each row becomes a run named by the optimizer, the
    bench's size and machine its settings, its times, ratio, state bytes and bandwidth its resources; the table
    prints times in ms below a second and in s above, ratios and bytes to two decimals, DualOptim+'s rows bold."""
    def bench_row(name, median, first, ratio, state, gbps):
        return {"name": name, "median_step_s": median, "first_step_s": first, "ratio_to_adamw": ratio,
                "state_bytes_per_param": state, "gbps": gbps, "fraction_of_copy_bandwidth": gbps / 40,
                "multi_tensor_launches": 0, "step_times_s": [median] * 3, "description": name}

    output = {"command": "doplus bench optimizer --params 50M --json", "seed": 0, "version": "0.2.0",
              "commit": "abc1234", "machine": "2 cores",
              "output": {"device": "cpu", "device_name": "AMD EPYC", "torch": "2.13.0+cpu", "threads": 2,
                         "params": 50_000_000, "dtype": "float32", "steps": 7, "warmup": 2, "seed": 0,
                         "synthetic": {}, "copy_gbps": 40.0,
                         "rows": [bench_row("adamw", 0.0987, 0.1624, 1.0, 8.00000648, 14.18),
                                  bench_row("doplus", 0.1383, 3.6512, 1.4003, 24.0000194, 15.93),
                                  bench_row("doplus-muon", 1.19984, 1.2109, 12.1509, 12.0, 1.16)]}}
    records = tables.records_from_speed(output, "speed.json")
    for converted in records:
        tables.check_record(converted)
    adamw = records[0]
    assert [r["run"] for r in records] == [r["scheme"] for r in records] == ["adamw", "doplus", "doplus-muon"]
    assert adamw["source"] == "speed.json#/output/rows/0" and adamw["task"] is None
    assert adamw["settings"]["params"] == 50_000_000 and adamw["settings"]["copy_gbps"] == 40.0
    assert adamw["settings"]["command"] == "doplus bench optimizer --params 50M --json"
    assert adamw["resources"]["median_step_s"] == 0.0987 and adamw["resources"]["machine"] == "2 cores"
    assert "step_times_s" not in adamw["resources"]  # the source keeps every timed step
    assert tables.speed_table(records) == [
        "| optimizer | median step | × AdamW | first step | state B/param | GB/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        "| adamw (torch default) | 98.7 ms | 1.00× | 162.4 ms | 8.00 | 14.2 |",
        "| **doplus** | 138.3 ms | 1.40× | 3.65 s | 24.00 | 15.9 |",
        "| doplus-muon | 1.20 s | 12.15× | 1.21 s | 12.00 | 1.2 |",
    ]


def test_a_stability_table_by_hand():
    """Steps in learning rates (two decimals under 10, thousands separated, millions as M), counts with
    separators, distances to three digits (0 as is, 2e-7 below a thousandth, whole numbers above a thousand)."""
    def run(rule, scale, floor, values):
        return {**record(f"{rule} {scale}", rule, 0, {}), "settings": {"retain_scale": scale, "v_floor": floor},
                "evaluations": [], "diagnostics": values}

    records = [run("doplus paper", 1.0, None, {"max_update_float64": 1765.2, "max_update_float32": 43_712_345.0,
                                               "big_updates_float32": 11900, "float32_vs_float64": 1195.4,
                                               "8bit_all_vs_32bit": 1.1, "8bit_base_vs_32bit": 1.0,
                                               "8bit_delta_vs_32bit": 0.99951}),
               run("doplus safeguarded", 0.01, 0.02, {"max_update_float64": 4.6051, "max_update_float32": 4.6049,
                                                      "big_updates_float32": 0, "float32_vs_float64": 1.49e-7,
                                                      "8bit_all_vs_32bit": 0.19712, "8bit_base_vs_32bit": 0.0391,
                                                      "8bit_delta_vs_32bit": 0.1934}),
               run("dualoptim", 1.0, None, {"float32_vs_float64": 0.0, "8bit_all_vs_32bit": 0.01362})]
    assert tables.stability_table(records) == [
        "| rule | retain scale s | largest step, fp64 | largest step, fp32 | element-steps > 10η, fp32 | fp32 vs fp64 "
        "| 8-bit all | 8-bit base | 8-bit delta |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        "| DualOptim+, paper rule | 1 | 1,765η | 43.7Mη | 11,900 | 1,195 | 1.1 | 1 | 1 |",
        "| DualOptim+, safeguarded (ρ = 0.02) | 0.01 | 4.61η | 4.60η | 0 | 1e-7 | 0.197 | 0.0391 | 0.193 |",
        "| DualOptim | 1 | | | | 0 | 0.0136 | | |",
    ]


def _precision_output() -> dict[str, Any]:
    def mode(name, changed, distance, error, weights, compensation, states, step):
        return {"mode": name, "changed": changed, "distance_vs_fp32": distance, "error_vs_fp32": error,
                "bytes_per_parameter": {"weights": weights, "compensation": compensation, "gradients": weights,
                                        "optimizer_states": states,
                                        "total": 2 * weights + compensation + states},
                "step_s": step, "first_step_s": 2 * step}

    return {"command": "doplus bench precision", "seed": 0, "version": "0.2.0", "commit": "abc1234",
            "machine": "2 cores", "output": {"model": "tiny", "steps": 20, "lr": 1e-5, "threads": 2, "rows": [
                mode("fp32", 1.0, 1.0, 0.0, 4, 0, 16.0, 1.6412),
                mode("bf16-uncompensated", 0.01849, 0.15649, 0.99551, 2, 0, 16.0, 1.0851)]}}


def test_the_precision_bench_output_converts_to_one_record_per_mode():
    first, second = tables.records_from_precision(_precision_output(), "precision.json")
    for converted in (first, second):
        tables.check_record(converted)
    assert (first["run"], first["source"], first["scheme"]) == ("fp32", "precision.json#/output/rows/0", "doplus")
    assert first["settings"] == {"command": "doplus bench precision", "mode": "fp32", "model": "tiny", "steps": 20,
                                 "lr": 1e-5, "threads": 2}
    assert second["resources"] == {"step_s": 1.0851, "first_step_s": 2.1702, "machine": "2 cores"}
    assert second["diagnostics"] == {"changed": 0.01849, "distance_vs_fp32": 0.15649, "error_vs_fp32": 0.99551,
                                     "bytes_per_parameter_weights": 2, "bytes_per_parameter_compensation": 0,
                                     "bytes_per_parameter_gradients": 2, "bytes_per_parameter_optimizer_states": 16.0,
                                     "bytes_per_parameter_total": 20.0}


def test_a_precision_table_by_hand():
    records = tables.records_from_precision(_precision_output(), "precision.json")
    assert tables.precision_table(records) == [
        "| mode | weight elements changed | distance travelled vs fp32 | displacement error vs fp32 | bytes per "
        "parameter (weights + compensation + gradients + states) |",
        "| --- | ---: | ---: | ---: | ---: |",
        "| `fp32` | 100.0% | 1.000 | 0.000 | 24.0 (4 + 0 + 4 + 16.0) |",
        "| bf16 without compensation | 1.8% | 0.156 | 0.996 | 20.0 (2 + 0 + 2 + 16.0) |",
    ]


def _timed_evaluation(protocol: str, peak: float | None) -> dict[str, Any]:
    def one_set(name, n, generation, scoring):
        return {"name": name, "n": n, "seconds": {"generation": generation, "scoring": scoring, "judges": 0.01}}

    compute = {"tokens": {"prompt": 100, "generated": 50, "teacher_forced": 250, "total": 400}, "parameters": 10,
               "kernel_gflops": {"matmul": 400.0, "onednn_packed_linear": 500.0},
               "floor_kernel": "onednn_packed_linear", "matmul_gflops": 400.0, "matmul_dtype": "float32",
               "floor_s": 174.84, "wall_s": 313.21, "ratio": 313.21 / 174.84}
    if peak is not None:
        compute.update(peak_memory_gb=peak, peak_memory_kind="process_peak_rss")
    return {"command": f"doplus evaluate --split forget10 --protocol {protocol}", "seed": 0, "version": "0.2.0",
            "commit": "abc1234", "machine": "2 cores", "output": {
                "model": "SmolLM2", "config": {"split": "forget10", "task_id": 1, "protocol": protocol,
                                               "batch_size": 64},
                "compute": compute, "seconds": {"tofu": 300.0}, "sections": [{"suite": "tofu", "sets": [
                    one_set("forget", 400, 40.25, 90.5), one_set("retain", 400, 41.0, 80.0),
                    one_set("real_authors", 100, 10.0, 7.0), one_set("world_facts", 117, 13.4, 6.0)],
                    "summary": {"MU": 34.954, "UFE": 66.466, "TFE": None, "forget_fluency": None,
                                "forget_fluency_missing": "not available"}}]}}


def test_a_timed_evaluation_converts_to_one_record_and_its_table_by_hand():
    """An eval.json of `doplus evaluate` kept with its provenance: the protocol names the run, the questions per
    set are settings, generation and scoring are summed over the sets, and the table gives the floor over its
    kernel's rate; a peak memory the record lacks (an older eval.json) reads n/a, as does a missing aggregate."""
    first = tables.records_from_eval_compute(_timed_evaluation("doplus", 3.94), "eval_speed_doplus.json")[0]
    second = tables.records_from_eval_compute(_timed_evaluation("paper", None), "eval_speed_paper.json")[0]
    for converted in (first, second):
        tables.check_record(converted)
    assert (first["run"], first["scheme"], first["task"]) == ("doplus", "evaluation", 1)
    assert first["settings"]["questions"] == {"forget": 400, "retain": 400, "real_authors": 100, "world_facts": 117}
    assert first["resources"]["generation_s"] == 40.25 + 41.0 + 10.0 + 13.4
    assert first["resources"]["scoring_s"] == 90.5 + 80.0 + 7.0 + 6.0
    assert first["evaluations"] == [{"step": 0, "metrics": {"MU": 34.954, "UFE": 66.466}}]
    assert first["diagnostics"]["tokens_total"] == 400
    assert tables.eval_speed_table([first, second]) == [
        "| protocol | questions (forget + retain + real authors + world facts) | wall, model load included | "
        "generation | scoring | floor (product rate) | wall / floor | peak memory | MU | UFE | TFE |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        "| doplus | 400 + 400 + 100 + 117 | 313.2 s | 104.7 s | 183.5 s | 174.8 s (500 GFLOP/s) | 1.79 | 3.9 GB | "
        "34.95 | 66.47 | n/a |",
        "| paper | 400 + 400 + 100 + 117 | 313.2 s | 104.7 s | 183.5 s | 174.8 s (500 GFLOP/s) | 1.79 | n/a | "
        "34.95 | 66.47 | n/a |",
    ]
    untimed = _timed_evaluation("doplus", 1.0)
    del untimed["output"]["compute"]["floor_s"]
    with pytest.raises(UserError, match="eval_speed_doplus.json: not a timed evaluation"):
        tables.records_from_eval_compute(untimed, "eval_speed_doplus.json")


def test_a_bench_output_without_its_provenance_is_refused_by_name():
    output = _precision_output()
    del output["commit"]
    with pytest.raises(UserError, match=r"precision.json: no 'commit'"):
        tables.records_from_precision(output, "precision.json")
    rowless = _precision_output()
    del rowless["output"]  # refused too, not read as a bench with no rows
    with pytest.raises(UserError, match=r"precision.json: no 'output'"):
        tables.records_from_precision(rowless, "precision.json")


PROVENANCE = {"command": "doplus bench schemes --recipe r.yaml --seeds 0", "seed": 0, "version": "0.2.0",
              "commit": "abc1234", "machine": "2 cores"}


def _multitask_summary() -> dict[str, Any]:
    def run(scheme: str, steps: int, scores: dict[str, float], state_bytes: int) -> dict[str, Any]:
        return {"scheme": scheme, "seed": 0, "sweep_value": None, "task_id": None, "model": "m", "steps": steps,
                "device": "CPU", "world_size": 1, "peak_memory_kind": "process_peak_rss", "evaluation": "e",
                "wall_time_s": 9.0, "evaluated_during_training": False,
                "before": {"math": 0.0, "code": 27.875, "average": 13.9375},
                "update_sizes": {"steps": steps, "max_update": 5.5, "steps_over_10lr": 0},
                "values": {**scores, "train_time_s": 3.0, "peak_memory_gb": 2.0,
                           "optimizer_state_bytes": state_bytes, "update_cosine": None}, "notes": {}}

    return {"kind": "multitask", "recipe": "demo.yaml", "set": {"steps": 180},
            "columns": [{"key": "math", "role": "score"}, {"key": "code", "role": "score"},
                        {"key": "average", "role": "score"}],
            "runs": {"joint-s0": run("joint", 60, {"math": 62.5, "code": 44.0, "average": 53.25}, 1_080_000_000),
                     "doplus-s0": run("doplus", 180, {"math": 58.0, "code": -1.0, "average": 28.5},
                                      4_300_000_000)}}


def test_a_kept_schemes_file_converts_with_its_provenance_and_the_scores_before_training():
    output = {**PROVENANCE, "output": _multitask_summary()}
    joint, doplus = tables.records_from_kept_schemes(output, "M_SCHEMES.json")
    for run in (joint, doplus):
        tables.check_record(run)
        assert (run["version"], run["commit"], run["resources"]["machine"]) == ("0.2.0", "abc1234", "2 cores")
        assert run["settings"]["command"] == PROVENANCE["command"]
        assert run["evaluations"][0] == {"step": 0, "metrics": {"math": 0.0, "code": 27.875, "average": 13.9375}}
    assert joint["source"] == "M_SCHEMES.json#/output/runs/joint-s0" and joint["run"] == "M/joint-s0"
    assert joint["diagnostics"] == {"update_cosine": None, "steps": 60, "max_update": 5.5, "steps_over_10lr": 0}
    assert doplus["evaluations"][1] == {"step": 180, "metrics": {"math": 58.0, "code": -1.0, "average": 28.5}}
    with pytest.raises(UserError, match=r"M_SCHEMES.json: no 'machine'"):
        tables.records_from_kept_schemes({k: v for k, v in output.items() if k != "machine"}, "M_SCHEMES.json")


def test_a_per_run_table_by_hand():
    columns = (tables.Column("math", "math", ".2f"), tables.Column("code", "code", ".2f"),
               tables.Column("optimizer_state_bytes", "states (GB)", ".2f", resource=True, scale=1e9))
    records = tables.records_from_kept_schemes({**PROVENANCE, "output": _multitask_summary()}, "M_SCHEMES.json")
    assert tables.per_run_table(records, columns) == [
        "| scheme | math | code | states (GB) |",
        "| --- | ---: | ---: | ---: |",
        "| before training | 0.00 | 27.88 | |",
        "| Joint, 60 steps | 62.50 | 44.00 | 1.08 |",
        "| DO+, 180 steps | 58.00 | −1.00 | 4.30 |",
    ]
    records[1]["evaluations"][0]["metrics"]["math"] = 1.0  # runs that started from other scores: no shared row
    assert "| before training |" not in "\n".join(tables.per_run_table(records, columns))


def test_an_evaluation_converts_to_the_starting_models_row_with_rates_in_percent():
    summary = {"safety_rate_avg": 0.07, "xstest_over_refusal": 0.028, "xstest_unsafe_refusal": 0.095,
               "safety_judge": "offline refusal judge", "n": 16, "missing": None}
    (start,) = tables.records_from_evaluation({**PROVENANCE, "output": summary}, "E.json")
    tables.check_record(start)
    assert start["scheme"] == "before training" and start["source"] == "E.json#/output"
    # the rates in percent, every other number as it is, text and nulls left out
    assert start["evaluations"] == [{"step": 0, "metrics": {"safety_rate_avg": 100 * 0.07,
                                                            "xstest_over_refusal": 100 * 0.028,
                                                            "xstest_unsafe_refusal": 100 * 0.095, "n": 16}}]

    def run(name: str, scheme: str, steps: int, avg: float, seconds: float) -> dict[str, Any]:
        done = record(name, scheme, 0, {"safety_rate_avg": avg, "xstest_over_refusal": 80.0,
                                        "xstest_unsafe_refusal": 98.0}, step=steps,
                      resources={"train_time_s": seconds, "optimizer_state_bytes": 1_080_000_000,
                                 "peak_memory_gb": 3.5})
        return done

    runs = [start, run("joint-s0", "joint", 80, 93.0, 250.0), run("joint-s1", "joint", 80, 95.0, 260.0),
            run("doplus-s0", "doplus", 60, 85.0, 190.0)]
    assert tables.safety_demo_table(runs) == [
        "| scheme (steps) | safety AVG (%) ↑ | XSTest over-refusal (%) ↓ | XSTest unsafe refused (%) ↑ | optimizer "
        "states (GB) | peak memory (GB) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        "| before training | 7.00 | 2.80 | 9.50 | | |",
        "| Joint (80) | 94.00 ± 1.41 | 80.00 ± 0.00 | 98.00 ± 0.00 | 1.08 | 3.50 ± 0.00 |",
        "| DO+ (60) | 85.00 | 80.00 | 98.00 | 1.08 | 3.50 |",
    ]


def test_a_rules_table_by_hand():
    def run(name: str, scheme: str, forget: float, largest: float, steps: int, elements: int) -> dict[str, Any]:
        done = record(name, scheme, 0, {"forget_rouge": forget, "retain_rouge": 1.0}, step=72)
        done["diagnostics"] = {"update_cosine": None, "steps": 72, "max_update": largest, "steps_over_10lr": steps,
                               "updates_over_10lr": elements}
        return done

    runs = [run("paper-s0", "doplus-paper", 0.016, 5688.2, 70, 2082131),
            run("paper-s1", "doplus-paper", 0.018, 4000.0, 69, 2137805),
            run("safe-s0", "doplus", 0.02, 5.8, 0, 0), run("safe-s1", "doplus", 0.02, 5.7, 0, 0)]
    assert tables.rules_table(runs)[2:] == [
        "| paper | 0.017 ± 0.001 | 1.000 ± 0.000 | 5,688 lr | 70 and 69 of 72 | 2,082,131 and 2,137,805 |",
        "| safeguarded | 0.020 ± 0.000 | 1.000 ± 0.000 | 5.8 lr | 0 and 0 of 72 | 0 and 0 |",
    ]


def _relearned(scheme: str, task: int, taken: float, rouge: float, steps: int, stop_when: str | None = None
               ) -> dict[str, Any]:
    run = record(f"{'matched' if stop_when else 'grid'}/{scheme}-t{task}", scheme, 0,
                 {"UFE": 60.0 + task, "MU": 20.0 + task, "forget_Q_A_ROUGE": rouge}, step=steps)
    run["task"] = task
    run["settings"]["set"] = {"stop_when": stop_when} if stop_when else {}
    run["attacks"] = {"relearn-k50": {"UFE": 60.0 + task - taken, "UFE taken back": taken}}
    tables.check_record(run)
    return run


def test_the_matched_forgetting_table_and_its_words_by_the_rule():
    """Three tasks: DO+ stopped at its bound takes back 25, 27, 26 UFE points against Alternate's 23, 24, 22 (d =
    2, 3, 4: every task positive and the interval above 0, so "shallower"); unmatched DO+ takes back 30, 22, 26
    (d = 7, -2, 4: the signs disagree, so no difference). Task 3's run that never met its bound is named and
    left out of the matched difference, and then the two tasks left decide."""
    def runs(third_rouge: float) -> list[dict[str, Any]]:
        return [_relearned("doplus", 1, 25.0, 0.0096, 120, "forget_Q_A_ROUGE<=0.0214"),
                _relearned("doplus", 2, 27.0, 0.0150, 84, "forget_Q_A_ROUGE<=0.0200"),
                _relearned("doplus", 3, 26.0, third_rouge, 192, "forget_Q_A_ROUGE<=0.0300"),
                *(_relearned("alternate", t, back, 0.02, 96) for t, back in ((1, 23.0), (2, 24.0), (3, 22.0))),
                *(_relearned("doplus", t, back, 0.1, 96) for t, back in ((1, 30.0), (2, 22.0), (3, 26.0)))]

    lines = tables.matched_table(runs(0.0250))
    assert lines[2] == ("| 1 | 0.0214 | 120 | 0.0096 | 61.00 / 61.00 | 21.00 / 21.00 | 25.00 / 23.00 | +2.00 | "
                        "30.00 | +7.00 |")
    d = [2.0, 3.0, 4.0]
    half = 4.302652729911275 * statistics.stdev(d) / math.sqrt(3)
    assert lines[6] == (f"At matched forgetting: DualOptim+'s forgetting is shallower than Alternate's (mean +3.00 "
                        f"UFE points, 95% t interval [+{3 - half:.2f}, +{3 + half:.2f}], 3 of 3 tasks agree in "
                        "sign).")
    u = [7.0, -2.0, 4.0]
    u_half = 4.302652729911275 * statistics.stdev(u) / math.sqrt(3)
    detectable = (4.302652729911275 + 1.0606601717798212) * statistics.stdev(u) / math.sqrt(3)  # t(0.80, 2)
    assert lines[8] == (f"Unmatched, at step 96: 3 tasks detect no difference (mean +3.00 UFE points, 95% t "
                        f"interval [{tables.minus(f'{3 - u_half:+.2f}')}, +{3 + u_half:.2f}], 2 of 3 tasks agree in "
                        f"sign; the smallest difference they detect at their spread is {detectable:.2f}).")

    lines = tables.matched_table(runs(0.0400))  # task 3 never reached 0.0300 in 192 steps
    assert lines[4].startswith("| 3 | 0.0300 | 192 (not matched) | 0.0400 |") and "| | 26.00 | +4.00 |" in lines[4]
    assert lines[6].startswith("At matched forgetting: 2 tasks detect no difference (mean +2.50 UFE points")
    assert lines[-1] == "Not matched within the schedule: forget task 3."
    with pytest.raises(UserError, match="forget task 1 has no grid run of alternate"):
        tables.matched_table([r for r in runs(0.02) if r["run"] != "grid/alternate-t1"])


def test_the_matched_control_kept_in_docs_data_converts_to_what_the_table_reads():
    """The committed control on forget task 1: its run, named after its folder, carries its bound, the steps it
    trained and the UFE relearning took back, as its SCHEMES.json holds them."""
    summary = json.loads((DATA / "tofu_matched_t1" / "SCHEMES.json").read_text())
    (run,) = tables.records_from_bench_folder(summary, "tofu_matched_t1/SCHEMES.json")
    tables.check_record(run)
    values = summary["runs"]["doplus-t1-s0"]
    assert run["run"] == "tofu_matched_t1/doplus-t1-s0" and run["task"] == 1
    assert tables._bound(run) == 0.0214 and run["settings"]["steps"] == values["steps"]
    assert tables._taken_back(run) == values["values"]["UFE taken back by relearn-k50"]
    assert tables.final_metrics(run)["forget_Q_A_ROUGE"] == values["values"]["forget_Q_A_ROUGE"] <= 0.0214
    provenance = json.loads((DATA / "tofu_matched_t1" / "PROVENANCE.json").read_text())
    assert (run["version"], run["commit"]) == (provenance["version"], provenance["commit"]) == ("0.2.0", "752652e")
    assert run["settings"]["command"] == provenance["command"] and "--out bench/tofu_matched_t1" in run["settings"]["command"]
    assert run["resources"]["machine"] == provenance["machine"]


def test_a_bench_folder_without_its_provenance_is_one_line_naming_the_file(tmp_path):
    """A bench folder's records carry the version and commit that ran it, so a folder whose PROVENANCE.json is
    missing, not JSON, or lacks a field stops the conversion with one line naming the file (and the field)."""
    summary = json.loads((DATA / "tofu_matched_t1" / "SCHEMES.json").read_text())
    folder = tmp_path / "tofu_matched_t1"
    folder.mkdir()
    with pytest.raises(UserError, match=r"tofu_matched_t1/PROVENANCE.json: a bench folder's provenance is not"):
        tables.records_from_bench_folder(summary, "tofu_matched_t1/SCHEMES.json", tmp_path)
    (folder / "PROVENANCE.json").write_text("{not json")
    with pytest.raises(UserError, match=r"PROVENANCE.json: a bench folder's provenance is not readable JSON"):
        tables.records_from_bench_folder(summary, "tofu_matched_t1/SCHEMES.json", tmp_path)
    whole = {"command": "doplus bench schemes ...", "seed": "0", "version": "9.9.9", "commit": "abc1234",
             "machine": "a test"}
    (folder / "PROVENANCE.json").write_text(json.dumps({k: v for k, v in whole.items() if k != "commit"}))
    with pytest.raises(UserError, match=r"PROVENANCE.json: no 'commit': a bench folder's PROVENANCE.json holds"):
        tables.records_from_bench_folder(summary, "tofu_matched_t1/SCHEMES.json", tmp_path)
    (folder / "PROVENANCE.json").write_text(json.dumps(whole))
    (run,) = tables.records_from_bench_folder(summary, "tofu_matched_t1/SCHEMES.json", tmp_path)
    assert (run["version"], run["commit"], run["resources"]["machine"]) == ("9.9.9", "abc1234", "a test")


def _swept(scheme: str, lr: float, task: int, seed: int, ovr: float) -> dict[str, Any]:
    run = record(f"{scheme}-lr={lr:g}-t{task}-s{seed}", scheme, seed, {"OVR": ovr, "UFE": ovr + 10, "MU": ovr - 10})
    run["task"] = task
    run["settings"]["sweep_value"] = lr
    tables.check_record(run)
    return run


def test_the_learning_rate_grid_tables_by_hand():
    """Alternate at 40, 50, 30 and DO+ at 45, 48, 44 over three learning rates, each pair (task, seed) offset by
    e alike at every rate, DO+ at its best rate by d more (d sums to 0): both are best at 2e-4; Alternate loses 15
    there against the mean of the others in every pair and DO+ 3.5 + d, so DO+ − Alternate = −11.5 + d, an
    interval below 0 (DO+ less sensitive); at the best rates DO+ − Alternate = −2 + d on OVR."""
    e, d = [0.0, 1.0, -1.0, 0.5, -0.5, 2.0], [0.0, 1.0, -1.0, 0.5, -0.5, 0.0]
    pairs = [(task, seed) for task in (1, 2) for seed in (0, 1, 2)]
    runs = []
    for scheme, means in (("alternate", (40.0, 50.0, 30.0)), ("doplus", (45.0, 48.0, 44.0))):
        for lr, mean in zip((1e-4, 2e-4, 4e-4), means):
            for i, (task, seed) in enumerate(pairs):
                extra = d[i] if scheme == "doplus" and lr == 2e-4 else 0.0
                runs.append(_swept(scheme, lr, task, seed, mean + e[i] + extra))
    t975, t80 = 2.5705818366147395, 0.9195443263600424  # Student's t, 5 degrees of freedom
    sd, n = statistics.stdev(d), math.sqrt(6)

    section = tables.STABILITY_TABLES["tofu_stability_sensitivity"].render(runs)
    assert section[0].startswith("**Sensitivity to lr, by OVR**")
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in section if line.startswith("| ")}
    assert rows["Alternate"][1:5] == ["0.0002", f"{50 + statistics.mean(e):.3g}", "15", "20"]
    assert rows["DO+"][1:5] == ["0.0002", f"{48 + statistics.mean(e):.3g}", "3.5", "4"]
    words = next(line for line in section if line.startswith("- "))  # DO+ first, as the protocol states it
    assert words.startswith(f"- DO+ is less sensitive than Alternate on OVR (loss difference -11.5, 95% CI "
                            f"[{-11.5 - t975 * sd / n:+.3g}, {-11.5 + t975 * sd / n:+.3g}], 6 of 6 pairs agree)")

    best = tables.STABILITY_TABLES["tofu_stability_best"].render(runs)
    assert best[0] == "| Method | OVR | UFE | MU |"
    doplus = [line for line in best if line.startswith("| DO+ (lr 0.0002) |")][0].split(" | ")
    values = [48 + x + y for x, y in zip(e, d)]
    assert doplus[1] == f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"
    line = next(line for line in best if line.startswith("- OVR, DO+ − Alternate at their best lr: "))
    assert line == (f"- OVR, DO+ − Alternate at their best lr: −2.00 [{tables.minus(f'{-2 - t975 * sd / n:+.2f}')}, "
                    f"{tables.minus(f'{-2 + t975 * sd / n:+.2f}')}], 6 of 6 pairs agree; the pairs detect "
                    f"{(t975 + t80) * sd / n:.2f} or more.")
    assert "- OVR, DO+ − DO at their best lr: 0 pairs, too few for an interval." in best


def test_the_main_learning_rate_section_pairs_the_grid_with_scaffolds_own_bench_by_hand():
    """At 2e-4 (the main protocol's rate, written 0.0002 by one bench and 2e-4 by another): the grid's runs there
    and SCAFFOLD's, benched without the sweep; the other rates stay out. SCAFFOLD − DO+ on OVR = 1 + f per pair
    (f sums to 0), an interval above 0: SCAFFOLD better; DO+ − Alternate = f, an interval around 0: none."""
    pairs = [(task, seed) for task in (1, 2) for seed in (0, 1, 2)]
    f = [0.5, -0.5, 0.8, -0.8, 0.25, -0.25]
    runs = []
    for i, (task, seed) in enumerate(pairs):
        runs += [_swept("alternate", 0.0002, task, seed, 50.0 + i), _swept("doplus", 2e-4, task, seed, 50.0 + i + f[i]),
                 _swept("alternate", 6.3e-4, task, seed, 10.0), _swept("doplus", 6.3e-4, task, seed, 90.0)]
        scaffold = _swept("scaffold", 2e-4, task, seed, 51.0 + i + 2 * f[i])
        scaffold["settings"]["sweep_value"] = None  # its own bench, at the recipe's lr
        runs.append(scaffold)
    section = tables.STABILITY_TABLES["tofu_stability_main_lr"].render(runs)
    assert section[0] == "| Method | OVR | UFE | MU |"
    ovr = [50.0 + i for i in range(6)]
    assert section[2] == (f"| Alternate | {statistics.mean(ovr):.2f} ± {statistics.stdev(ovr):.2f} | "
                          f"{statistics.mean(ovr) + 10:.2f} ± {statistics.stdev(ovr):.2f} | "
                          f"{statistics.mean(ovr) - 10:.2f} ± {statistics.stdev(ovr):.2f} |")  # 6.3e-4 left out
    t975, n = 2.5705818366147395, math.sqrt(6)
    half = t975 * statistics.stdev(f) / n
    label = tables.scheme_label("scaffold")
    assert (f"- {label} is better than DO+ on OVR (mean +1, 95% CI [{1 - half:+.3g}, {1 + half:+.3g}], 6 of 6 "
            "pairs agree).") in section
    difference = next(line for line in section if line.startswith("- no difference detected between DO+ and "
                                                                   "Alternate on OVR"))
    assert f"95% CI [{-half:+.3g}, {half:+.3g}]" in difference
    assert not any("DO+ (paper rule)" in line for line in section)  # no runs of it: no comparison


def test_the_main_protocol_tables_read_the_white_box_grid_in_the_pages_order():
    """The TOFU-protocol benchmark's tables from the white-box grid's runs: the schemes in the page's order
    whatever the records' order, DO+'s envelope against each other scheme, and DO+ − Alternate in the bench's
    words (OVR −3, −2, −4 as in the FL case: Alternate better)."""
    doplus = [_curved("doplus", t, [(20, 45), (40, 40), (60, 30)], ovr) for t, ovr in ((1, 50.0), (2, 52.0), (3, 48.0))]
    alternate = [_curved("alternate", t, [(20, 45), (35, 42), (55, 35)], ovr)
                 for t, ovr in ((1, 53.0), (2, 54.0), (3, 52.0))]
    records = [*doplus, *alternate]
    table = tables.MAIN_TABLES["tofu_protocol_main"].render(records)
    assert [line.split(" | ")[0] for line in table[2:]] == ["| Alternate", "| DO+"]
    tradeoff = tables.MAIN_TABLES["tofu_protocol_main_tradeoff"].render(records)
    assert ("- DO+ against Alternate, over 3 forget tasks: DO+'s envelope dominates in 0, Alternate's in 0, they "
            "coincide in 0 and cross in 3.") in tradeoff
    paired = tables.MAIN_TABLES["tofu_protocol_main_paired"].render(records)
    assert paired[0].startswith("- Alternate is better than DO+ on OVR (mean -3, ")
    assert len(paired) == 4  # OVR, MU, UFE and the area, for the one comparison both schemes ran


def test_the_mini_benchmarks_tables_by_hand():
    """A loss sweep: one row per (loss, scheme) in the order the losses come, and the paired words per loss; the
    real-world bench: a lower forget ROUGE-L is the better one; the update similarity comes from diagnostics."""
    runs = []
    for loss, shift in (("SimNPO+GD", 0.0), ("RMU+EMBED", -20.0)):
        for seed, e in ((0, 0.0), (1, 1.0), (2, -1.0)):
            for scheme, ovr in (("doplus", 40.0), ("alternate", 44.0)):
                made = record(f"{scheme}-{loss}-s{seed}", scheme, seed, {
                    "OVR": ovr + shift + e + (seed if scheme == "doplus" else 0), "MU": 20.0, "UFE": 50.0,
                    "forget_Q_A_ROUGE": 0.4})
                made["settings"]["sweep_value"] = loss
                runs.append(made)
    table = tables.MINI_TABLES["mini_tofu_losses"].render(runs)
    assert table[0] == "| scheme | loss | forget ROUGE-L ↓ | MU ↑ | UFE ↑ | OVR ↑ |"
    assert [tuple(line.split(" | ")[:2]) for line in table[2:]] == [
        ("| Alternate", "SimNPO+GD"), ("| DO+", "SimNPO+GD"), ("| Alternate", "RMU+EMBED"), ("| DO+", "RMU+EMBED")]
    assert table[3].endswith(f"| {statistics.mean([40, 42, 41]):.2f} ± {statistics.stdev([40, 42, 41]):.2f} |")
    words = tables.MINI_TABLES["mini_tofu_losses_paired"].render(runs)
    # DO+ − Alternate on OVR: −4, −3, −2 at either loss: mean −3, sd 1
    half = 4.302652729911275 / math.sqrt(3)
    for loss in ("SimNPO+GD", "RMU+EMBED"):
        assert (f"- loss = {loss}: Alternate is better than DO+ on OVR (mean -3, 95% CI [{-3 - half:+.3g}, "
                f"{-3 + half:+.3g}], 3 of 3 pairs agree).") in words
    assert not any("envelope" in line for line in words)  # no curves: no area

    world = []
    for seed, forget in ((0, 0.02), (1, 0.03), (2, 0.01)):
        for scheme, offset in (("doplus", 0.0), ("alternate", 0.05)):
            made = record(f"{scheme}-s{seed}", scheme, seed, {"forget_rouge": forget + offset, "retain_rouge": 0.5})
            made["diagnostics"]["update_cosine"] = 0.2
            world.append(made)
    paired = tables.MINI_TABLES["real_world_mini_paired"].render(world)
    assert paired[0].startswith("- DO+ is better than Alternate on forget ROUGE-L (mean -0.05, ")
    cosine = tables.Column("update_cosine", "", ".3f", diagnostic=True)
    assert [cosine.value(r) for r in world] == [0.2] * 6


def test_a_safety_evaluation_read_by_hand_converts_per_set_and_its_table_by_hand():
    """Each prompt set: the judge's refusal rate (full and partial refusals), the reading's and their agreement;
    the harmful sets' mean; each disagreement named with the start of its response on one line."""
    def entry(name, index, judge, read, response="Sure.\nHere"):
        return {"set": name, "index": index, "prompt": "p", "response": response, "judge": judge, "read": read}

    output = {"command": "doplus evaluate --suite safety,xstest", "seed": 0, "version": "0.2.0", "commit": "abc1234",
              "machine": "2 cores", "reading": "by hand",
              "output": {"summary": {}, "rows": [
                  entry("I-Mali", 0, "full_refusal", "refusal"), entry("I-Mali", 1, "compliance", "compliance"),
                  entry("Q-Harm", 0, "partial_refusal", "refusal"),
                  entry("Q-Harm", 1, "compliance", "refusal", "I can't, but\\n here:"),
                  entry("Q-Harm", 2, "compliance", "compliance"), entry("Q-Harm", 3, "full_refusal", "compliance"),
                  entry("xstest_safe", 0, "compliance", "compliance")]}}
    records = tables.records_from_safety_reading(output, "safety_suites.json")
    for converted in records:
        tables.check_record(converted)
    assert [r["run"] for r in records] == ["I-Mali", "Q-Harm", "xstest_safe"]
    table = tables.safety_reading_table(records)
    assert table[2] == "| I-Mali | 2 | 50.00 | 50.00 | 2 of 2 |"
    assert table[3] == "| Q-Harm | 4 | 50.00 | 50.00 | 2 of 4 |"  # judge: 0 and 3; reading: 0 and 1
    assert table[5] == "| the four harmful sets' mean (safety AVG) | | 50.00 | 50.00 | |"
    assert table[7] == '- Q-Harm 1: judge: compliance; read: refusal; response: "I can\'t, but\\n here:…"'
    assert table[8].startswith("- Q-Harm 3: judge: full_refusal; read: compliance;")
    output["output"]["rows"][0]["read"] = "refused"
    with pytest.raises(UserError, match="I-Mali 0: 'read' is 'refused', not refusal or compliance"):
        tables.records_from_safety_reading(output, "safety_suites.json")
    del output["reading"]
    with pytest.raises(UserError, match="safety_suites.json: no 'reading'"):
        tables.records_from_safety_reading(output, "safety_suites.json")


def test_the_same_bench_run_two_ways_converts_and_its_table_by_hand():
    """One record per way and run, named WAY/RUN; the table gives each way's command wall time and each run's wall
    time and peak memory, and counts the runs whose every score is the same in both ways."""
    def schemes(wall, knowmem):
        def one(scheme, value):
            return {"scheme": scheme, "seed": 0, "sweep_value": None, "task_id": None, "model": "m", "steps": 16,
                    "device": "CPU", "world_size": 1, "peak_memory_kind": "process_peak_rss", "evaluation": "e",
                    "wall_time_s": wall, "evaluated_during_training": False,
                    "values": {"knowmem": value, "train_time_s": wall / 2, "peak_memory_gb": 3.0,
                               "optimizer_state_bytes": 8}, "notes": {}}

        return {"kind": "unlearn", "recipe": "r.yaml", "set": {},
                "columns": [{"key": "knowmem", "role": "score"}, {"key": "train_time_s", "role": "resource"}],
                "runs": {"joint-s0": one("joint", 0.5), "doplus-s0": one("doplus", knowmem)}}

    output = {"command": "doplus bench schemes ...", "seed": 0, "version": "0.2.0", "commit": "abc1234",
              "machine": "2 cores", "output": {
                  "sequential": {"command": "doplus bench schemes A", "wall_s": 508.4, "schemes": schemes(250.0, 0.25)},
                  "parallel": {"command": "doplus bench schemes A --parallel 2", "wall_s": 401.0,
                               "schemes": schemes(390.0, 0.25)}}}
    records = tables.records_from_parallel(output, "parallel.json")
    for converted in records:
        tables.check_record(converted)
    assert [r["run"] for r in records] == ["sequential/joint-s0", "sequential/doplus-s0", "parallel/joint-s0",
                                           "parallel/doplus-s0"]
    assert records[2]["settings"]["way_wall_s"] == 401.0 and records[2]["commit"] == "abc1234"
    table = tables.parallel_table(records)
    assert table[0] == "| bench | command's wall time | joint-s0: wall, peak memory | doplus-s0: wall, peak memory |"
    assert table[2] == "| `doplus bench schemes A` | 508 s | 250 s, 3.00 GB | 250 s, 3.00 GB |"
    assert table[3] == "| `doplus bench schemes A --parallel 2` | 401 s | 390 s, 3.00 GB | 390 s, 3.00 GB |"
    assert table[-1] == "Scores the same run for run in every way: 2 of 2 runs."
    output["output"]["parallel"]["schemes"]["runs"]["doplus-s0"]["values"]["knowmem"] = 0.26
    assert tables.parallel_table(tables.records_from_parallel(output, "parallel.json"))[-1] == (
        "Scores the same run for run in every way: 1 of 2 runs.")


def test_the_taught_models_evaluation_heads_the_mini_muse_table_with_its_cost_by_hand():
    """A kept evaluation with its cost beside it converts to a `before training` record whose resources are that
    cost; the MUSE table puts its scores first (no spread, no state size), the per-seed line lists each scheme's
    VerbMem in seed order, and the cost line prints the kept figures with the file's provenance."""
    summary = {"forget_verbmem_ROUGE": 0.4669, "forget_knowmem_ROUGE": 0.6111, "retain_knowmem_ROUGE": 0.5556,
               "muse_privleak": -18.506, "muse_note": "text is left out"}
    kept = {**PROVENANCE, "output": summary,
            "compute": {"wall_s": 16.07, "suite_s": 8.98, "peak_memory_gb": 2.092,
                        "peak_memory_kind": "process_peak_rss"}}
    (start,) = tables.records_from_evaluation(kept, "T.json")
    tables.check_record(start)
    assert start["resources"] == {"wall_s": 16.07, "suite_s": 8.98, "peak_memory_gb": 2.092,
                                  "peak_memory_kind": "process_peak_rss", "machine": "2 cores"}
    (plain,) = tables.records_from_evaluation({**PROVENANCE, "output": summary}, "T.json")
    assert plain["resources"] == {"machine": "2 cores"}  # no cost kept: none made up

    def run(scheme: str, seed: int, verbmem: float) -> dict[str, Any]:
        return record(f"{scheme}-s{seed}", scheme, seed, {"forget_verbmem_ROUGE": verbmem, "forget_knowmem_ROUGE": 0.5,
                                                          "retain_knowmem_ROUGE": 0.5, "muse_privleak": 10.0},
                      resources={"optimizer_state_bytes": 1_080_000_000})

    runs = [start, run("doplus", 1, 0.424), run("doplus", 0, 0.437), run("joint", 0, 0.368), run("joint", 1, 0.274)]
    table = tables.TABLES["muse_mini"].render(runs)
    assert table[2] == "| taught model | 0.467 | 0.611 | 0.556 | −18.5 | |"
    verbmem = [0.424, 0.437]
    assert table[3].startswith(f"| DO+ | {statistics.mean(verbmem):.3f} ± {statistics.stdev(verbmem):.3f} |")
    assert tables.TABLES["muse_mini_per_seed"].render(runs) == [
        "Per seed (0, 1), VerbMem forget: DO+ 0.437, 0.424; Joint 0.368, 0.274."]
    assert tables.TABLES["muse_mini_cost"].render(runs) == [
        "16.1 s wall with the model's load (9.0 s in the suite), 2.09 GB peak resident memory; doplus 0.2.0 at "
        "commit abc1234, 2 cores."]


def test_the_taught_models_line_reads_each_tasks_curve_start_by_hand():
    """Each run's step-0 evaluation is its task's taught model: one UFE per task, one MU for all; runs of a task
    that disagree show both values rather than one picked."""
    runs = [_curved(scheme, task, [(ufe, 45.66), (30, 42), (40, 40)], 50.0)
            for scheme in ("doplus", "alternate") for task, ufe in ((1, 17.52), (2, 14.09), (3, 14.58))]
    assert tables.MAIN_TABLES["tofu_protocol_start"].render(runs) == [
        "The taught model: MU 45.7; UFE 17.5, 14.1, 14.6 on forget tasks 1, 2, 3."]
    runs[0]["evaluations"][0]["metrics"]["UFE"] = 18.0
    assert tables.start_line(runs)[0].endswith("UFE 17.5 or 18.0, 14.1, 14.6 on forget tasks 1, 2, 3.")


def _nine_points(scheme: str, task: int, points: list[tuple[float, float]]) -> dict[str, Any]:
    """A run evaluated every 12 of 96 steps: the starting model, seven evaluations during training, the last."""
    made = record(f"{scheme}-t{task}", scheme, 0, {}, evaluations=[
        {"step": 0, "metrics": {"UFE": points[0][0], "MU": points[0][1]}},
        *({"step": None, "metrics": {"UFE": u, "MU": m}} for u, m in points[1:-1]),
        {"step": 96, "metrics": {"UFE": points[-1][0], "MU": points[-1][1], "OVR": 50.0}}])
    made["task"] = task
    tables.check_record(made)
    return made


def test_the_whole_curve_bench_and_its_three_point_reading_worked_out_by_hand():
    """Alternate's curve is a straight line from (20, 45) to (60, 30 + 0.3k) on task k; DO+ bulges early, to
    (35, 44) and (50, 42), then dips at step 48 to (40, 30) before ending at (64, 30.5 + 0.5k). Read at every point,
    DO+'s envelope covers Alternate's on every task and its area is larger on every task, by more than the
    interval; read at the start, step 48 and the end only (the main protocol's three points), DO+'s dip hides its
    bulge: the envelopes cross and the areas differ by −8, +8, +24, which no interval separates."""
    alternate, doplus = [], []
    for k, task in enumerate((1, 2, 3)):
        line = [(20.0 + 5 * i, 45 - 15 * (5 * i) / 40) for i in range(8)] + [(60.0, 30 + 0.3 * k)]
        bulge = [(20.0, 45.0), (35.0, 44.0), (50.0, 42.0), (55.0, 38.0), (40.0, 30.0), (50.0, 35.0), (58.0, 33.0),
                 (60.0, 32.0), (64.0, 30.5 + 0.5 * k)]
        alternate.append(_nine_points("alternate", task, line))
        doplus.append(_nine_points("doplus", task, bulge))
    records = [*alternate, *doplus]
    # the envelopes by hand: Alternate's line is its own envelope; DO+'s drops its dip (40, 30) and (50, 35)
    full_doplus = [_rectangles([(35, 44), (50, 42), (55, 38), (58, 33), (60, 32), (64, 30.5 + 0.5 * k)], 20)
                   for k in range(3)]
    full_alternate = [_rectangles([(20 + 5 * i, 45 - 15 * (5 * i) / 40) for i in range(1, 8)] + [(60, 30 + 0.3 * k)],
                                  20) for k in range(3)]
    assert full_doplus == [1765.0, 1767.0, 1769.0] and full_alternate == [1462.5, 1464.0, 1465.5]
    # the three-point reading: (20, 45), the step-48 evaluation (the 4th during training), the end; DO+'s (40, 30)
    # lies under its end (64, 30.5 + 0.5k), so its envelope is the start and the end
    chord_doplus = [_rectangles([(64, 30.5 + 0.5 * k)], 20) for k in range(3)]
    chord_alternate = [_rectangles([(40, 37.5), (60, 30 + 0.3 * k)], 20) for k in range(3)]
    assert [a - b for a, b in zip(chord_doplus, chord_alternate)] == [-8.0, 8.0, 24.0]
    t975 = 4.302652729911275

    full = tables.CURVES_TABLES["tofu_curves_tradeoff"].render(records)
    assert (f"| DO+ | {statistics.mean(full_doplus):.1f} ± {statistics.stdev(full_doplus):.1f} (3 runs) |") in full
    assert ("- DO+ against Alternate, over 3 forget tasks: DO+'s envelope dominates in 3, Alternate's in 0, they "
            "coincide in 0 and cross in 0.") in full
    differences = [a - b for a, b in zip(full_doplus, full_alternate)]  # 302.5, 303, 303.5
    half = t975 * statistics.stdev(differences) / math.sqrt(3)
    (paired_full,) = tables.CURVES_TABLES["tofu_curves_paired"].render(records)
    assert paired_full == (f"- DO+ is better than Alternate on the envelope's area (mean +303, 95% CI "
                           f"[{303 - half:+.3g}, {303 + half:+.3g}], 3 of 3 pairs agree).")

    chord = tables.CURVES_TABLES["tofu_curves_chord"].render(records)
    assert (f"| DO+ | {statistics.mean(chord_doplus):.1f} ± {statistics.stdev(chord_doplus):.1f} (3 runs) |") in chord
    assert ("- DO+ against Alternate, over 3 forget tasks: DO+'s envelope dominates in 0, Alternate's in 0, they "
            "coincide in 0 and cross in 3.") in chord
    (paired_chord,) = tables.CURVES_TABLES["tofu_curves_chord_paired"].render(records)
    half = t975 * 16 / math.sqrt(3)  # the differences −8, 8, 24: mean 8, sd 16
    assert paired_chord.startswith(f"- no difference detected between DO+ and Alternate on the envelope's area "
                                   f"(mean +8, 95% CI [{8 - half:+.3g}, {8 + half:+.3g}], 2 of 3 pairs agree)")
    # a run without the step-48 evaluation (a shorter curve) is read as it is
    short = _curved("doplus", 4, [(20, 45), (30, 40), (50, 35)], 50.0)
    assert tables.thinned([short], 12, 48) == [short]


def test_the_same_runs_trained_twice_side_by_side_by_hand():
    """Task 3's runs of the first benchmark beside the grid's runs of the same scheme and task (named
    tofu_protocol_whitebox/RUN): each score as first / second and the largest absolute difference; a scheme or task
    the other has not run is left out, and the rows follow the page's scheme order."""
    def run(name: str, scheme: str, task: int, ufe: float, rouge: float) -> dict[str, Any]:
        made = record(name, scheme, 0, {"UFE": ufe, "MU": 35.8556, "OVR": 57.3594, "forget_Q_A_ROUGE": rouge})
        made["task"] = task
        return made

    records = [run("alternate-t3-s0", "alternate", 3, 59.0256, 0.0175),
               run("doplus-t3-s0", "doplus", 3, 53.6100, 0.1300),
               run("tofu_protocol_whitebox/doplus-t3-s0", "doplus", 3, 53.6100, 0.1322),
               run("tofu_protocol_whitebox/alternate-t3-s0", "alternate", 3, 59.0256, 0.0175),
               run("tofu_protocol_whitebox/alternate-t1-s0", "alternate", 1, 58.0, 0.02)]
    lines = tables.MAIN_TABLES["tofu_protocol_reproduced"].render(records)
    assert lines[0] == ("| scheme, forget task | UFE: 0.1.0 / 0.2.0 | MU: 0.1.0 / 0.2.0 | OVR: 0.1.0 / 0.2.0 | "
                        "forget ROUGE-L: 0.1.0 / 0.2.0 | largest difference |")
    assert lines[2:] == [
        "| Alternate, 3 | 59.03 / 59.03 | 35.86 / 35.86 | 57.36 / 57.36 | 0.0175 / 0.0175 | 0 |",
        "| DO+, 3 | 53.61 / 53.61 | 35.86 / 35.86 | 57.36 / 57.36 | 0.1300 / 0.1322 | 0.0022 |"]
