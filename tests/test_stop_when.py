"""`--stop-when METRIC<=VALUE`: the first evaluation during training that meets the bound ends the run; final/ is
the model after that step, which is the model a run without the rule has at that step (the schedule stays the one
of --steps); a bound never met trains every step; the last evaluation's attacks run at the step that ends the run;
a bound on a metric the evaluation does not report is one line, exit 2."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import run_cli, write_sets
from tests.test_select_by import CURVE, known_curve, unlearn_args  # noqa: F401  (known_curve: the fixture)


def final_weights(out):
    return load_file(str(out / "final" / "model.safetensors"))


def lrs(out):
    return [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if "lr" in json.loads(line)]


def test_the_first_evaluation_that_meets_the_bound_ends_the_run(tiny_llama, tofu_dir, tmp_path,
                                                                 known_curve):  # noqa: F811
    data = write_sets(tofu_dir, tmp_path, 4, 8)
    full = tmp_path / "full"
    assert run_cli(*unlearn_args(tiny_llama, data, full)) == 0
    every_step = {step: dict(weights) for step, weights in known_curve.items()}
    known_curve.clear()

    # CURVE: UFE 10, 50, 20, 30, 40, 5 at steps 1-6; >= 25 is first met at step 2 (not at step 4, the next one)
    out = tmp_path / "stopped"
    assert run_cli(*unlearn_args(tiny_llama, data, out, "--stop-when", "UFE>=25")) == 0
    assert sorted(known_curve) == [1, 2]  # nothing after step 2 was trained or evaluated
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 2 and [row["step"] for row in report["evals"]] == [1, 2]
    assert report["stopped"] == {"rule": "UFE>=25", "metric": "UFE", "step": 2, "value": CURVE[2],
                                 "planned_steps": 6}
    assert sum(report["steps_per_objective"].values()) == 2
    # final/ is the model after step 2, the same as the full run's after its step 2: the same schedule
    kept = final_weights(out)
    assert all(torch.equal(kept[name], every_step[2][name]) for name in kept)
    assert not torch.equal(kept["lm_head.weight"], final_weights(full)["lm_head.weight"])
    assert lrs(out) == lrs(full)[:2]
    line = "Stop rule UFE>=25: met at step 2 of 6 (UFE 50)"
    assert line in (out / "report.md").read_text() and line in (out / "final" / "README.md").read_text()

    # <=, below the lowest value (5): a bound never met trains every step
    never = tmp_path / "never"
    assert run_cli(*unlearn_args(tiny_llama, data, never, "--stop-when", "UFE<=4.9")) == 0
    report = json.loads((never / "report.json").read_text())
    assert report["steps"] == 6 and report["stopped"]["step"] is None
    assert "Stop rule UFE<=4.9: no evaluation met it; the run trained all 6 steps." in (never / "report.md").read_text()


@pytest.mark.parametrize(("extra", "says"), [
    (["--stop-when", "accuracy<=1", "--eval-every", 1], "unknown metric 'accuracy'"),
    (["--stop-when", "UFE=50", "--eval-every", 1], "write METRIC<=VALUE or METRIC>=VALUE"),
    (["--stop-when", "UFE>=high", "--eval-every", 1], "'high' is not a number"),
    (["--stop-when", "UFE>=inf", "--eval-every", 1], "the bound is a finite number"),
    (["--stop-when", "forget_Q_A_ROUGE<=0.1"], "add --eval-every N"),
])
def test_a_bound_that_cannot_be_read_is_one_line_and_exit_2(tiny_llama, tofu_dir, tmp_path, capsys, extra, says):
    data = write_sets(tofu_dir, tmp_path, 4, 8)
    args = ["unlearn", "--model", tiny_llama, "--forget", data / "forget.jsonl", "--out", tmp_path / "run", *extra]
    assert run_cli(*args) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1 and not (tmp_path / "run").exists()


def test_multitask_bounds_a_task_or_the_average(tiny_llama, tofu_dir, tmp_path, capsys):
    task = f"facts={tofu_dir / 'forget01.json'}"
    args = ["multitask", "--model", tiny_llama, "--task", task, "--prompt-key", "question", "--eval-every", 1,
            "--stop-when", "MU>=1", "--out", tmp_path / "run"]
    assert run_cli(*args) == 2
    assert "unknown metric 'MU': choose one of facts, average" in capsys.readouterr().err
    out = tmp_path / "ran"  # a score is at least 0: met at the first evaluation, step 2 of 4
    args = ["multitask", "--model", tiny_llama, "--task", task, "--prompt-key", "question", "--eval-every", 2,
            "--steps", 4, "--batch-size", 2, "--max-length", 32, "--eval-rows", 2, "--stop-when", "average>=0",
            "--out", out]
    assert run_cli(*args) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 2 and report["stopped"]["step"] == 2 and len(report["evals"]) == 1
    assert "Stop rule average>=0: met at step 2 of 4" in (out / "report.md").read_text()


def test_the_suite_value_ends_the_run_and_its_evaluation_runs_the_attacks(tiny_llama, tofu_dir, tmp_path):
    """A bound on a value of the TOFU suite's summary (forget ROUGE-L) read from the real evaluation: the row
    carries SUMMARY.json's value; the evaluations before the one that ends the run ran no attack, that one did."""
    forget = tmp_path / "f.jsonl"
    forget.write_text("".join(list(open(tofu_dir / "forget01.json"))[:6]))
    base = ["unlearn", "--model", tiny_llama, "--forget", forget, "--loss", "GA", "--steps", 4, "--eval-data-dir",
            tofu_dir, "--eval-max-samples", 2, "--eval-max-new-tokens", 2, "--eval-nli-model", tmp_path / "no-nli",
            "--eval-embedding-model", tmp_path / "no-embedder", "--show-samples", 0, "--eval-every", 2,
            "--eval-attacks", "quant-4bit"]
    never = tmp_path / "never"
    assert run_cli(*base, "--stop-when", "forget_Q_A_ROUGE>=2", "--out", never) == 0
    step2 = json.loads((never / "evals" / "step-2" / "eval.json").read_text())
    assert "attacks" not in step2 and step2["config"]["attacks"] is None
    report = json.loads((never / "report.json").read_text())
    summary = json.loads((never / "evals" / "step-2" / "SUMMARY.json").read_text())
    assert report["evals"][0]["forget_Q_A_ROUGE"] == summary["forget_Q_A_ROUGE"] is not None
    last = json.loads((never / "evals" / "step-4" / "eval.json").read_text())
    assert [run["id"] for run in last["attacks"]["runs"]] == ["quant-4bit"]

    met = tmp_path / "met"  # ROUGE-L is at most 1: met at the first evaluation, which runs the attacks
    assert run_cli(*base, "--stop-when", "forget_Q_A_ROUGE<=1", "--out", met) == 0
    report = json.loads((met / "report.json").read_text())
    assert report["steps"] == 2 and report["stopped"]["step"] == 2
    first = json.loads((met / "evals" / "step-2" / "eval.json").read_text())
    assert [run["id"] for run in first["attacks"]["runs"]] == ["quant-4bit"]
    assert sorted(path.name for path in (met / "evals").iterdir() if path.is_dir()) == ["step-2"]
