"""`--dry-run` makes the checks the command makes before its first heavy step and writes nothing: a missing data
file, a field the loss needs, a bench without its evaluation suite, a file of the user's in the way and a resumption
with nothing to resume are the command's own one line (exit code 2); a command that would run says what it would do
and exits 0. Every case compares the whole working folder before and after."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from tests.helpers import run_cli, write_jsonl, write_sets


@pytest.fixture(scope="module")
def data(tofu_dir, tmp_path_factory):
    return write_sets(tofu_dir, tmp_path_factory.mktemp("dry-run-data"), 6, 8)


def snapshot(folder: Path) -> dict[str, float]:
    return {str(p.relative_to(folder)): p.stat().st_mtime for p in sorted(folder.rglob("*"))}


def dry(capsys, *arguments) -> tuple[int, str, str]:
    capsys.readouterr()
    code = run_cli(*arguments, "--dry-run")
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


def unlearn(model, forget, retain, out, *extra):
    return ["unlearn", "--model", model, "--forget", forget, "--retain", retain, "--loss", "NPO+GD", "--steps", 4,
            "--max-length", 48, "--out", out, *extra]


def test_a_run_that_would_start_says_what_it_would_do_and_writes_nothing(tiny_llama, data, tmp_path, capsys,
                                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    code, out, err = dry(capsys, *unlearn(tiny_llama, data / "forget.jsonl", data / "retain.jsonl", "runs/x"))
    assert code == 0, err
    assert "model: " in out and "a model folder" in out
    assert "forget rows 6; retain rows 8" in out and "steps: 4" in out
    assert "runs/x: a new run" in out and "parameters:" in out  # the memory plan
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("case", ["missing file", "missing field", "user file in the way", "nothing to resume",
                                  "finished run"])
def test_a_dry_run_stops_on_what_the_run_would_stop_on(tiny_llama, data, tmp_path, capsys, case):
    forget, retain, out, extra = data / "forget.jsonl", data / "retain.jsonl", tmp_path / "out", []
    if case == "missing file":
        forget, needle = tmp_path / "nowhere.jsonl", "nowhere.jsonl: file not found"
    elif case == "missing field":
        retain = tmp_path / "no-answer.jsonl"
        write_jsonl(retain, [{"question": "Who?"}] * 3)
        needle = "no-answer.jsonl:1: missing field 'answer'"
    elif case == "user file in the way":
        out.mkdir()
        (out / "report.md").write_text("mine\n")
        needle = "report.md: exists and doplus did not write it"
    elif case == "nothing to resume":
        out.mkdir()
        (out / "notes.txt").write_text("mine\n")
        extra, needle = ["--resume"], "no `doplus unlearn` was started here"
    else:
        assert run_cli(*unlearn(tiny_llama, forget, retain, out, "--steps", 1)) == 0
        extra, needle = ["--resume"], "the run there has finished"
    before = snapshot(tmp_path)
    code, _, err = dry(capsys, *unlearn(tiny_llama, forget, retain, out, *extra))
    assert code == 2 and "\n" not in err and needle in err, (case, err)
    assert snapshot(tmp_path) == before


def test_a_bench_without_its_evaluation_suite_is_its_own_line(tiny_llama, data, tmp_path, capsys):
    recipe = tmp_path / "bench.yaml"
    recipe.write_text(yaml.safe_dump({"model": str(tiny_llama), "forget": str(data / "forget.jsonl"),
                                      "retain": str(data / "retain.jsonl"), "loss": "NPO+GD", "steps": 4}))
    before = snapshot(tmp_path)
    code, _, err = dry(capsys, "bench", "schemes", "--recipe", recipe, "--out", tmp_path / "bench")
    assert code == 2 and "\n" not in err and "no evaluation suite" in err, err
    assert snapshot(tmp_path) == before


def test_a_bench_that_would_run_lists_its_grid_and_checks_each_forget_tasks_data(tiny_llama, tofu_dir, tmp_path,
                                                                                  capsys):
    recipe = tmp_path / "bench.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": str(tiny_llama), "forget": str(tofu_dir / "forget01.json"), "retain": "tofu-authors",
        "loss": "NPO+GD", "steps": 4, "eval_every": 2, "eval_suite": "tofu", "eval_data_dir": str(tofu_dir),
        "eval_split": "forget01"}))
    before = snapshot(tmp_path)
    code, out, err = dry(capsys, "bench", "schemes", "--recipe", recipe, "--schemes", "alternate,doplus",
                         "--task-ids", "1,2", "--seeds", "0", "--out", tmp_path / "bench")
    assert code == 0, err
    assert "4 runs: 0 done, 0 running, 0 failed, 4 pending (2 schemes x 2 forget tasks x 1 seeds)" in out
    assert "data of forget task 1: checked" in out and "data of forget task 2: checked" in out
    assert snapshot(tmp_path) == before
    code, _, err = dry(capsys, "bench", "schemes", "--recipe", recipe, "--task-ids", "1,99", "--out",
                       tmp_path / "bench")
    assert code == 2 and "99" in err and "\n" not in err, err


def test_evaluate_and_bench_precision_dry_runs(tiny_llama, tofu_dir, tmp_path, capsys):
    before = snapshot(tmp_path)
    code, out, err = dry(capsys, "evaluate", "--model", tiny_llama, "--suite", "tofu", "--split", "forget01",
                         "--data-dir", tofu_dir, "--out", tmp_path / "eval")
    assert code == 0 and "suites: tofu" in out and "a new evaluation" in out, err
    code, _, err = dry(capsys, "evaluate", "--model", tiny_llama, "--suite", "tofu", "--split", "forget01",
                       "--data-dir", tmp_path / "no-tofu", "--out", tmp_path / "eval")
    assert code == 2 and "\n" not in err and "no-tofu" in err, err
    code, out, err = dry(capsys, "bench", "precision", "--model", tiny_llama, "--out", tmp_path / "precision")
    assert code == 0 and "fp32, bf16-mixed, bf16, bf16-uncompensated" in out, err
    assert snapshot(tmp_path) == before
    assert not os.path.exists(tmp_path / "eval") and not os.path.exists(tmp_path / "precision")


def test_a_bench_whose_schemes_take_different_steps_says_each(tiny_llama, tmp_path, capsys):
    """align's --epochs: the alternating schemes step through the general rows with a safety step every F_g of
    them, Joint through both sets at once, so their step counts differ and the dry run names each."""
    from tests.helpers import GENERAL, SAFETY

    recipe = tmp_path / "align.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": str(tiny_llama), "safety": f"{SAFETY}[0:14]", "general": f"{GENERAL}[0:26]", "held_out": 2,
        "epochs": 1, "batch_size": 2, "max_length": 48, "max_new_tokens": 4}))
    code, out, err = dry(capsys, "bench", "schemes", "--recipe", recipe, "--schemes", "joint,doplus", "--seeds", "0",
                         "--out", tmp_path / "bench")
    assert code == 0, err
    # 12 safety and 24 general rows left to train on, 2 a batch: DualOptim+ 12 general steps and 2 safety steps
    # (1:10), Joint 18 steps of a batch from both sets
    assert "data: checked (steps a run: joint 18, doplus 14)" in out
