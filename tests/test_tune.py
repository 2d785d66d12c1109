"""`doplus tune`: the search space, the objective and its constraints, the study (a known optimum found, the pruner,
two workers on one journal, a killed or stopped worker), one real study on the tiny model whose best.yaml
reproduces its best trial bit for bit, and bad input in one line."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import doplus_cli.tune as tune_module
from doplus_cli.commands.unlearn import UnlearnConfig
from doplus_cli.errors import UserError
from doplus_cli.tune import plan, run_tune
from doplus_cli.tune.goal import Constraint, parse_constraints, parse_objective
from doplus_cli.tune.report import best_row
from doplus_cli.tune.space import Param, parse_space
from doplus_cli.tune.trials import Outcome, Pruned, watch
from tests.helpers import run_cli, write_sets

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "tune_worker.py"
METRICS = {"OVR": True, "MU": True, "forget_Q_A_ROUGE": False, "muse_privleak": None}


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def recipe(tiny_llama, tofu_dir, tmp_path_factory):
    """A tiny IDK+GD recipe evaluated by the TOFU suite during training (steps 6, eval_every 3)."""
    folder = write_sets(tofu_dir, tmp_path_factory.mktemp("tune-recipe"), 6, 8)
    values = {"model": str(tiny_llama), "forget": "forget.jsonl", "retain": "retain.jsonl", "loss": "IDK+GD",
              "forget_freq": 1, "retain_freq": 2, "steps": 6, "lr": 1e-3, "batch_size": 2, "max_length": 48,
              "show_samples": 0, "eval_suite": "tofu", "eval_data_dir": str(tofu_dir), "eval_max_samples": 2,
              "eval_max_new_tokens": 4, "eval_nli_model": str(folder / "no-such-nli"), "eval_every": 3}
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return path


# ---- the space --------------------------------------------------------------------------------------------------


def test_space_specs_parse_to_their_ranges(tmp_path):
    params = parse_space(["lr=log:1e-6:1e-3", "beta=0.05:0.5", "retain_freq=int:1:9:2", "loss=IDK+GD|NPO+GD"],
                         UnlearnConfig)
    assert params == [Param("lr", "log", 1e-6, 1e-3), Param("beta", "float", 0.05, 0.5),
                      Param("retain_freq", "int", 1, 9, 2), Param("loss", "choice", choices=("IDK+GD", "NPO+GD"))]
    space = tmp_path / "space.yaml"
    space.write_text("lr: {low: 1.0e-6, high: 1.0e-3, log: true}\nretain-freq: {low: 1, high: 5, type: int}\n"
                     "loss: {choices: [IDK+GD, ME+GD]}\nbeta: 0.05:0.5\n")
    assert parse_space([str(space)], UnlearnConfig) == [
        Param("lr", "log", 1e-6, 1e-3), Param("retain_freq", "int", 1, 5), Param("loss", "choice",
                                                                                   choices=("IDK+GD", "ME+GD")),
        Param("beta", "float", 0.05, 0.5)]


@pytest.mark.parametrize("item, words", [
    ("warmup_step=int:1:3", "unknown option 'warmup_step' (did you mean 'warmup_steps'?)"),
    ("lr=log:0:1e-3", "a log range needs bounds above 0"),
    ("lr=1e-3:1e-6", "must be below the high bound"),
    ("lr=log:1e-6", "is not a range"),
    ("lr=float:a:1", "is not a number"),
    ("lr=nan:1", "bounds are finite numbers"),
    ("retain_freq=int:1:6:2", "must be >= 1 and divide high - low"),
    ("retain_freq=int:a:3", "is not a whole number"),
    ("lr=fast|slow", "lr"),  # each choice is read as the option's own value
    ("loss=IDK+GD|IDK+GD", "given twice"),
    ("out=a|b", "doplus tune sets out itself"),
    ("no-equals-sign", "write KEY=SPEC"),
])
def test_a_bad_space_is_one_line(item, words):
    with pytest.raises(UserError) as raised:
        parse_space([item], UnlearnConfig)
    assert words in str(raised.value) and "\n" not in str(raised.value)


def test_an_option_in_the_space_and_in_set_or_twice_is_refused():
    with pytest.raises(UserError, match="also given by --set"):
        parse_space(["lr=1e-4:1e-3"], UnlearnConfig, fixed={"lr"})
    with pytest.raises(UserError, match="in the space twice"):
        parse_space(["lr=1e-4:1e-3", "lr=log:1e-4:1e-3"], UnlearnConfig)


@settings(derandomize=True, max_examples=150, deadline=None, database=None)
@given(st.text(max_size=40))
def test_any_space_text_parses_or_is_one_line(text):
    try:
        params = parse_space([f"lr={text}"], UnlearnConfig)
    except UserError as error:
        assert "\n" not in str(error) and len(str(error)) < 400
    else:
        assert params[0].key == "lr"


# ---- the goal ---------------------------------------------------------------------------------------------------


def test_objective_direction_is_the_metrics_or_the_one_given():
    assert parse_objective("OVR", METRICS, "tofu").maximize is True
    assert parse_objective("forget_Q_A_ROUGE", METRICS, "tofu").maximize is False
    assert parse_objective("OVR:min", METRICS, "tofu").maximize is False
    with pytest.raises(UserError, match="marks no better side of muse_privleak; write muse_privleak:max"):
        parse_objective("muse_privleak", METRICS, "muse")
    with pytest.raises(UserError, match="gives no metric 'ovr'; it gives OVR, MU"):
        parse_objective("ovr", METRICS, "tofu")


def test_constraint_violations_against_values_worked_by_hand():
    above, below, relative = parse_constraints(["MU>=20", "forget_Q_A_ROUGE <= 0.3", "MU>=0.9*start"], METRICS,
                                               "tofu")
    assert above == Constraint("MU", ">=", 20.0, False) and relative.relative
    scores, start = {"MU": 25.0, "forget_Q_A_ROUGE": 0.5}, {"MU": 30.0}
    assert above.violation(scores, start) == 20.0 - 25.0  # holds: -5
    assert below.violation(scores, start) == pytest.approx(0.5 - 0.3)  # broken by 0.2
    assert relative.violation(scores, start) == pytest.approx(0.9 * 30.0 - 25.0)  # 27 - 25: broken by 2
    assert above.violation({"MU": None}, start) == math.inf
    for bad in ("MU>20", "MU>=x", "nothing>=1", "MU>=2*begin"):
        with pytest.raises(UserError):
            parse_constraints([bad], METRICS, "tofu")


def test_the_best_trial_is_the_best_feasible_one():
    class Study:
        class objective:
            maximize = True
        constraints = [1]

    rows = [{"number": 0, "value": 50.0, "feasible": True}, {"number": 1, "value": 60.0, "feasible": False},
            {"number": 2, "value": 55.0, "feasible": True}, {"number": 3, "value": 55.0, "feasible": True},
            {"number": 4, "value": None, "feasible": False}]
    assert best_row(Study, rows)["number"] == 2  # 60 breaks a constraint; 2 and 3 tie, the first stands
    Study.objective.maximize = False
    assert best_row(Study, rows)["number"] == 0
    assert best_row(Study, [rows[1], rows[4]]) is None


# ---- the study, with a stub trial ------------------------------------------------------------------------------


def stub_study(recipe, out, trials, space=("lr=log:1e-6:1e-1",), pruner="none", constraints=()):
    return plan(str(recipe), list(space), "OVR", list(constraints), trials, str(out), [], pruner, None, 0)


def test_a_study_finds_a_known_optimum(recipe, tmp_path, monkeypatch):
    """The objective -(log10 lr + 3)^2 is best at lr = 1e-3; 30 TPE trials over six decades come within 0.3 of a
    decade of it, and best.yaml holds the best trial's lr."""
    def trial(tune, trial, values, signals, log):
        return Outcome({"OVR": -((math.log10(values["lr"]) + 3) ** 2), "MU": 1.0}, 0.0, tune.steps, {})

    monkeypatch.setattr(tune_module, "run_trial", trial)
    study = stub_study(recipe, tmp_path / "study", 30)
    summary = run_tune(study, say=lambda line: None)
    best = summary["best"]
    assert abs(math.log10(best["params"]["lr"]) + 3) < 0.3
    assert summary["counts"]["complete"] == 30 and len(summary["trials"]) == 30
    assert best["value"] == max(row["value"] for row in summary["trials"])
    assert yaml.safe_load((tmp_path / "study" / "best.yaml").read_text())["lr"] == best["params"]["lr"]
    assert (tmp_path / "study" / "objective.png").read_bytes()[:4] == b"\x89PNG"
    assert "## Best trial: " in (tmp_path / "study" / "TUNE.md").read_text()
    # the same command again: the study holds its 30 trials, so nothing runs and the outputs are the same
    monkeypatch.setattr(tune_module, "run_trial", None)
    assert run_tune(stub_study(recipe, tmp_path / "study", 30), say=lambda line: None)["best"] == best
    # a larger budget extends the study by as many trials
    monkeypatch.setattr(tune_module, "run_trial", trial)
    more = run_tune(stub_study(recipe, tmp_path / "study", 32), say=lambda line: None)
    assert more["counts"]["complete"] == 32 and more["trials"][:30] == summary["trials"]


def reporting_trials(values):
    """A stub trial runner: trial N reports values[N] at steps 3 and 6 and stops where the pruner says so."""
    def trial(tune, trial, chosen, signals, log):
        value = values[trial.number]
        for step in (3, 6):
            trial.report(value, step)
            if step < tune.steps and trial.should_prune():
                raise Pruned(step)
        return Outcome({"OVR": value, "MU": 1.0}, 0.0, tune.steps, {3: value, 6: value})
    return trial


def test_the_median_pruner_stops_a_trial_that_falls_behind(recipe, tmp_path, monkeypatch):
    """Trials report their value at steps 3 and 6; the third's 0.1 at step 3 is below the median of the first
    two (0.9, 0.8) there, so the pruner stops it; the fourth's 0.95 runs to its end."""
    values = [0.9, 0.8, 0.1, 0.95]

    monkeypatch.setattr(tune_module, "run_trial", reporting_trials(values))
    summary = run_tune(stub_study(recipe, tmp_path / "study", 4, pruner="median"), say=lambda line: None)
    states = [(row["state"], row["pruned_step"]) for row in summary["trials"]]
    assert states == [("complete", None), ("complete", None), ("pruned", 3), ("complete", None)]
    assert summary["best"]["number"] == 3


def test_the_hyperband_pruner_keeps_the_top_third_at_each_rung(recipe, tmp_path, monkeypatch):
    """Steps 6 evaluated every 3: Hyperband (rungs from eval_every, reduction factor 3) is one bracket of successive
    halving with its rung at step 3. The reference, written here: a trial goes on past step 3 only if its value
    there is among the best max(1, n // 3) of the n trials that reached the rung so far, itself included."""
    values = [0.9, 0.8, 0.1, 0.95, 0.85, 0.05, 0.99]

    expected = []
    for number, value in enumerate(values):
        rung = sorted(values[:number + 1], reverse=True)
        expected.append(("complete", None) if value in rung[:max(1, len(rung) // 3)] else ("pruned", 3))
    assert ("pruned", 3) in expected and expected.count(("complete", None)) >= 2  # the case tests both outcomes
    monkeypatch.setattr(tune_module, "run_trial", reporting_trials(values))
    summary = run_tune(stub_study(recipe, tmp_path / "study", len(values), pruner="hyperband"), say=lambda line: None)
    assert [(row["state"], row["pruned_step"]) for row in summary["trials"]] == expected
    assert summary["best"]["number"] == values.index(max(values))


def test_a_trial_writes_no_checkpoints_along_the_way_unless_asked(recipe, tmp_path):
    """A trial never resumes, so its recipe drops the recipe's own save_every and save_minutes (a DualOptim+
    checkpoint of the embedded model is 3.8 GB); --set save_every=N is kept."""
    with_checkpoints = recipe.parent / "with-checkpoints.yaml"  # its data paths read beside it
    with_checkpoints.write_text(recipe.read_text() + "save_every: 2\nsave_minutes: 5\nkeep_last: 1\n")
    values = stub_study(with_checkpoints, tmp_path / "study", 2).trial_values({"lr": 1e-3})
    assert values["save_every"] == 0 and values["save_minutes"] == 0
    assert values["lr"] == 1e-3 and values["steps"] == 6
    asked = plan(str(with_checkpoints), ["lr=log:1e-6:1e-1"], "OVR", [], 2, str(tmp_path / "asked"),
                 ["save_every=3"], "none", None, 0)
    assert asked.trial_values({"lr": 1e-3})["save_every"] == 3


def test_a_trial_that_ended_leaves_no_checkpoints(recipe, tmp_path, monkeypatch):
    """A trial never resumes once it has ended (an interrupted one runs again from its start), so its checkpoints
    go when it ends complete, pruned or failed: a study of N trials does not keep N runs' optimizer states. Each
    trial's run records what it writes (as `doplus unlearn` does): only a recorded checkpoints/ is removed."""
    from doplus_cli import ownership
    from doplus_cli.errors import RunError

    def trial(tune, trial, chosen, signals, log):
        folder = tune.out / "trials" / f"{trial.number:04d}"
        folder.mkdir(parents=True, exist_ok=True)  # the study holds the folder (its lock) while the trial runs
        ownership.begin(folder, "doplus unlearn", ["checkpoints", "final"], overwrite=False)
        step = folder / "checkpoints" / "step-3"
        step.mkdir(parents=True)
        (step / "optimizer.pt").write_bytes(b"0" * 4096)
        (step.parents[1] / "final").mkdir()
        if trial.number == 1:
            raise Pruned(3)
        if trial.number == 2:
            raise RunError("trial 0002 failed (exit code 1)")
        return Outcome({"OVR": 0.5, "MU": 1.0}, 0.0, tune.steps, {})

    said = []
    monkeypatch.setattr(tune_module, "run_trial", trial)
    summary = run_tune(stub_study(recipe, tmp_path / "study", 3, pruner="median"), say=said.append)
    assert [row["state"] for row in summary["trials"]] == ["complete", "pruned", "failed"]
    trials = tmp_path / "study" / "trials"
    for number in range(3):
        names = {p.name for p in (trials / f"{number:04d}").iterdir()}
        assert "final" in names and not {"checkpoints", ".checkpoints.removing"} & names, names
    assert sum("removed its checkpoints" in line for line in said) == 3


def test_watch_stops_a_run_when_the_pruner_says_so(tmp_path):
    """The real polling: a child writes an evaluation at step 2 and would then run for a minute; `look` sees it
    and says prune, so the child gets SIGTERM at once."""
    from doplus_cli.bench.schemes.running import Signals

    evals = tmp_path / "evals" / "step-2"
    child = (f"import json, pathlib, time; p = pathlib.Path({str(evals)!r}); p.mkdir(parents=True); "
             "(p / 'SUMMARY.json').write_text(json.dumps({'OVR': 1.0})); (p / 'eval.json').write_text('{}'); "
             "time.sleep(60)")
    seen = []

    def look():
        if (evals / "eval.json").is_file():
            seen.append(2)
            return 2
        return None

    started = time.monotonic()
    code, step = watch([sys.executable, "-c", child], tmp_path / "child.log", "a child", Signals(), look)
    assert (code, step, seen) == (-signal.SIGTERM, 2, [2])
    assert time.monotonic() - started < 30


def worker(out, marks, seconds, *extra, recipe):
    env = {**os.environ, "TUNE_STUB_MARKS": str(marks), "TUNE_STUB_SECONDS": str(seconds)}
    command = [sys.executable, str(WORKER), "tune", "--recipe", str(recipe), "--space", "lr=log:1e-6:1e-1",
               "--objective", "OVR", "--out", str(out), "--pruner", "none", *extra]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def trial_marks(marks):
    return sorted(path.name for path in marks.iterdir()) if marks.is_dir() else []


def test_two_workers_fill_one_study_and_run_no_trial_twice(recipe, tmp_path):
    out, marks = tmp_path / "study", tmp_path / "marks"
    first = worker(out, marks, 0.5, "--trials", "6", recipe=recipe)
    second = worker(out, marks, 0.5, "--trials", "6", recipe=recipe)
    for process in (first, second):
        _, err = process.communicate(timeout=240)
        assert process.returncode == 0, err
    names = trial_marks(marks)
    numbers = [name.split("-")[0] for name in names]
    assert sorted(numbers) == [f"{n:04d}" for n in range(6)]  # six trials, each run once
    summary = json.loads((out / "TUNE.json").read_text())
    assert summary["counts"]["complete"] == 6 and summary["counts"]["running"] == 0
    seeds = json.loads((out / "TUNE.json").read_text())
    assert seeds["settings"]["trials"] == 6


def wait_for(condition, process, seconds=120):
    deadline = time.time() + seconds
    while not condition():
        assert process.poll() is None, process.communicate(timeout=60)[1]
        assert time.time() < deadline
        time.sleep(0.05)


def test_a_killed_worker_s_trial_runs_again_and_is_not_counted(recipe, tmp_path):
    out, marks = tmp_path / "study", tmp_path / "marks"
    process = worker(out, marks, 60, "--trials", "2", recipe=recipe)
    wait_for(lambda: trial_marks(marks), process)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    first = json.loads((marks / trial_marks(marks)[0]).read_text())
    again = worker(out, marks, 0, "--trials", "2", recipe=recipe)
    _, err = again.communicate(timeout=240)
    assert again.returncode == 0, err
    assert "trial 0000 was left running by a worker that is gone" in err
    summary = json.loads((out / "TUNE.json").read_text())
    rows = {row["number"]: row for row in summary["trials"]}
    assert rows[0]["state"] == "interrupted" and not (out / "trials" / "0000" / "report.json").exists()
    retry = next(row for row in rows.values() if row["retry_of"] == 0)
    assert retry["state"] == "complete" and retry["params"]["lr"] == first["lr"]
    assert summary["counts"]["done"] == 2 and summary["counts"]["complete"] == 2


def test_sigterm_stops_the_worker_in_one_line_and_the_same_command_goes_on(recipe, tmp_path):
    out, marks = tmp_path / "study", tmp_path / "marks"
    process = worker(out, marks, 60, "--trials", "1", recipe=recipe)
    wait_for(lambda: trial_marks(marks), process)
    os.killpg(process.pid, signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert lines == [lines[0]] and "stopped by SIGTERM during trial 0000" in lines[0]
    again = worker(out, marks, 0, "--trials", "1", recipe=recipe)
    _, err = again.communicate(timeout=240)
    assert again.returncode == 0, err
    rows = json.loads((out / "TUNE.json").read_text())["trials"]
    assert [(row["state"], row["retry_of"]) for row in rows] == [("interrupted", None), ("complete", 0)]


# ---- a real study -------------------------------------------------------------------------------------------------


@pytest.mark.processes
def test_a_real_study_and_its_best_yaml_reproduce_the_best_trial(recipe, tmp_path, capsys):
    """Two trials of the tiny model, a constraint relative to the starting model (evaluated once into
    DIR/start/); `doplus unlearn --recipe best.yaml` gives the best trial's final weights bit for bit."""
    from safetensors.torch import load_file

    out = tmp_path / "study"
    code = run_cli("tune", "--recipe", recipe, "--space", "lr=log:1e-4:1e-2", "--objective", "OVR", "--constraint",
                   "MU>=0.5*start", "--trials", "2", "--pruner", "none", "--out", out)
    assert code == 0, capsys.readouterr().err
    summary = json.loads((out / "TUNE.json").read_text())
    assert [row["state"] for row in summary["trials"]] == ["complete", "complete"]
    for row in summary["trials"]:  # each evaluation during training was reported at its step
        assert set(row["intermediate"]) == {"3", "6"}
        assert row["value"] == row["scores"]["OVR"] == row["intermediate"]["6"]
    assert (out / "start" / "eval.json").is_file() and summary["start"]["MU"] is not None
    best = summary["best"]
    assert best["number"] in (0, 1) and (out / "best_model_card.md").is_file()
    again = tmp_path / "again"
    assert run_cli("unlearn", "--recipe", out / "best.yaml", "--out", again) == 0
    trained = load_file(out / "trials" / f"{best['number']:04d}" / "final" / "model.safetensors")
    reproduced = load_file(again / "final" / "model.safetensors")
    assert trained.keys() == reproduced.keys()
    assert all(trained[key].equal(reproduced[key]) for key in trained)


# ---- bad input ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra, words", [
    (["--space", "lr_typo=log:1e-6:1e-3", "--objective", "OVR"], "unknown option 'lr_typo'"),
    (["--space", "lr=log:1e-3", "--objective", "OVR"], "is not a range"),
    (["--space", "lr=log:1e-6:1e-3", "--objective", "accuracy"], "gives no metric 'accuracy'"),
    (["--space", "lr=log:1e-6:1e-3", "--objective", "OVR", "--constraint", "nothing>=1"], "gives no metric"),
    (["--space", "lr=log:1e-6:1e-3", "--objective", "OVR", "--pruner", "fast"], "--pruner fast: choose from"),
    (["--space", "lr=log:1e-6:1e-3", "--objective", "OVR", "--storage", "redis://x"], "--storage redis://x"),
    # a bound, a choice the run itself refuses
    (["--space", "forget_freq=int:0:3", "--objective", "OVR"], "--forget-freq must be at least 1"),
    (["--space", "loss=IDK+GD|NOPE", "--objective", "OVR"], "NOPE"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(recipe, tmp_path, capsys, extra, words):
    out = tmp_path / "study"
    assert run_cli("tune", "--recipe", recipe, "--out", out, *extra) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_a_folder_of_another_study_or_of_something_else_is_refused(recipe, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tune_module, "run_trial", lambda tune, trial, values, signals, log: Outcome(
        {"OVR": 1.0, "MU": 1.0}, 0.0, tune.steps, {}))
    run_tune(stub_study(recipe, tmp_path / "study", 1), say=lambda line: None)
    with pytest.raises(UserError, match="holds a study with other settings"):
        run_tune(stub_study(recipe, tmp_path / "study", 1, space=("lr=log:1e-5:1e-1",)), say=lambda line: None)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty and not a doplus tune folder"):
        run_tune(stub_study(recipe, tmp_path / "mine", 1), say=lambda line: None)
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]


def test_without_optuna_the_command_says_how_to_install_it(recipe, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "optuna", None)
    assert run_cli("tune", "--recipe", recipe, "--space", "lr=log:1e-6:1e-3", "--objective", "OVR", "--out",
                   tmp_path / "study") == 2
    assert "pip install 'doplus-cli[tune]'" in capsys.readouterr().err


def test_a_database_storage_holds_the_study_and_the_folder_the_trials(recipe, tmp_path, monkeypatch):
    """--storage sqlite:///FILE: Optuna's database storage instead of the journal; the same command continues it."""
    monkeypatch.setattr(tune_module, "run_trial", lambda tune, trial, values, signals, log: Outcome(
        {"OVR": -abs(math.log10(values["lr"]) + 3), "MU": 1.0}, 0.0, tune.steps, {}))
    database = tmp_path / "study.db"

    def study(trials):
        return plan(str(recipe), ["lr=log:1e-6:1e-1"], "OVR", [], trials, str(tmp_path / "study"), [], "none",
                    f"sqlite:///{database}", 0)

    assert run_tune(study(3), say=lambda line: None)["counts"]["complete"] == 3
    assert database.stat().st_size > 0 and not (tmp_path / "study" / "study.journal").exists()
    assert run_tune(study(4), say=lambda line: None)["counts"]["complete"] == 4
