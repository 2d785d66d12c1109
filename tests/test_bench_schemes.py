"""`doplus bench schemes`: runs x seeds as real CLI runs, statistics, resume after a kill, --set/--sweep, bad input."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time

import pytest
import yaml

from doplus_cli.bench.adapters import ADAPTERS, adapter_of
from doplus_cli.bench.schemes import (
    Result,
    mean_std,
    plan_bench,
    plot_update_similarity,
    render_markdown,
    second_half_mean,
    summarise,
)
from doplus_cli.engine.checkpoint import list_checkpoints
from tests.helpers import run_cli, write_jsonl, write_sets

pytestmark = pytest.mark.processes  # bench runs are doplus processes
PNG = b"\x89PNG"


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """The runs are subprocesses: one torch thread each is the fastest for the tiny model, above all on a busy
    machine (idle OpenMP threads wait for each other)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def data(tofu_dir, tmp_path_factory):
    return write_sets(tofu_dir, tmp_path_factory.mktemp("bench-data"), 6, 8)


def write_recipe(folder, model, data, tofu_dir, **changes):
    """A tiny IDK+GD recipe next to its data (relative paths, as a shipped recipe would have them)."""
    folder.mkdir(exist_ok=True)
    for role in ("forget", "retain"):
        (folder / f"{role}.jsonl").write_text((data / f"{role}.jsonl").read_text())
    recipe = {"model": str(model), "forget": "forget.jsonl", "retain": "retain.jsonl", "loss": "IDK+GD",
              "forget_freq": 1, "retain_freq": 2, "steps": 24, "lr": 1e-3, "batch_size": 2, "max_length": 48,
              "show_samples": 0, "eval_suite": "tofu", "eval_data_dir": str(tofu_dir), "eval_max_samples": 2,
              "eval_max_new_tokens": 4, "eval_nli_model": str(folder / "no-such-nli"), **changes}
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in recipe.items() if v is not None}, sort_keys=False))
    return path


def bench_args(recipe, out, *extra):
    return ["bench", "schemes", "--recipe", recipe, "--out", out, *extra]


def read_metrics(run):
    return [json.loads(line) for line in open(run / "metrics.jsonl")]


def test_killed_bench_resumes_and_reports_mean_and_std_over_seeds(tiny_llama, data, tofu_dir, tmp_path, capsys):
    """2 schemes x 2 seeds, evaluated during training; the bench is SIGKILLed while the second run is halfway,
    then the same command skips the finished run, resumes the interrupted one and finishes the rest."""
    recipe = write_recipe(tmp_path / "recipe", tiny_llama, data, tofu_dir, eval_every=12)
    out = tmp_path / "bench"
    arguments = bench_args(recipe, out, "--schemes", "alternate,doplus", "--seeds", "0,1", "--set", "save_every=2")
    first, second = out / "runs" / "alternate-s0", out / "runs" / "alternate-s1"
    with open(tmp_path / "killed.log", "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "doplus_cli", *map(str, arguments)], stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ))
        deadline = time.time() + 240
        while not ((first / "report.json").exists() and list_checkpoints(second / "checkpoints")
                   and not (second / "report.json").exists()):
            assert process.poll() is None, (tmp_path / "killed.log").read_text()
            assert time.time() < deadline, "the bench did not reach the second run in time"
            time.sleep(0.005)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
    assert not (second / "report.json").exists() and not (out / "SCHEMES.json").exists()

    capsys.readouterr()
    assert run_cli(*arguments) == 0
    err = capsys.readouterr().err
    assert "[1/4] alternate-s0: skipped: finished and evaluated" in err
    # task, seed, then scheme: both schemes on seed 0 first
    assert "[2/4] doplus-s0: skipped: finished and evaluated" in err
    assert "[3/4] alternate-s1: resumed from step-" in err and "[4/4] doplus-s1: finished in" in err
    assert "resuming from" in (out / "runs" / "alternate-s1.log").read_text()
    assert [r["step"] for r in read_metrics(second)] == list(range(1, 25))
    # once evaluated, a run's checkpoints go (the disk stays about one run's checkpoints); final/ stays
    assert "[4/4] doplus-s1: removed its checkpoints (" in err and "--keep-checkpoints keeps them)" in err
    for run in (out / "runs").iterdir():
        if run.is_dir():
            assert sorted(p.name for p in run.iterdir() if "checkpoints" in p.name) == [], run.name
            assert (run / "final" / "model.safetensors").is_file()

    # The run's recipe: relative data paths made absolute, the scheme and seed, checkpoints for resuming.
    run_recipe = yaml.safe_load((out / "recipes" / "doplus-s1.yaml").read_text())
    assert run_recipe["forget"] == str(recipe.parent / "forget.jsonl")
    assert (run_recipe["scheme"], run_recipe["seed"], run_recipe["state_bits"]) == ("doplus", 1, 32)
    assert (run_recipe["save_every"], run_recipe["keep_last"], run_recipe.get("save_minutes")) == (2, 1, None)

    # Mean and sample std per scheme, by hand from each run's own evaluation at its last step.
    summary = json.loads((out / "SCHEMES.json").read_text())
    assert [(row["scheme"], row["seeds"]) for row in summary["rows"]] == [("alternate", [0, 1]), ("doplus", [0, 1])]
    for row in summary["rows"]:
        runs = [out / "runs" / f"{row['scheme']}-s{seed}" for seed in (0, 1)]
        evaluated = [json.loads((run / "evals" / "step-24" / "SUMMARY.json").read_text()) for run in runs]
        for key in ("UFE", "TFE", "MU", "OVR", "model_utility"):
            values = [e[key] for e in evaluated]
            assert row["metrics"][key]["mean"] == pytest.approx(statistics.mean(values))
            assert row["metrics"][key]["std"] == pytest.approx(statistics.stdev(values))
        times = [sum(r["seconds"] for r in read_metrics(run)) for run in runs]
        assert row["metrics"]["train_time_s"]["mean"] == pytest.approx(statistics.mean(times))
        states = [json.loads((run / "report.json").read_text())["optimizer_state_bytes"] / 1e6 for run in runs]
        assert row["metrics"]["optimizer_state_bytes"]["mean"] == pytest.approx(statistics.mean(states))
    alternate, doplus = summary["rows"]
    # DualOptim+ keeps a base and two delta states where Alternate's AdamW keeps one: 3x the state.
    assert doplus["metrics"]["optimizer_state_bytes"]["mean"] == pytest.approx(
        3 * alternate["metrics"]["optimizer_state_bytes"]["mean"], rel=0.01)

    markdown = (out / "SCHEMES.md").read_text()
    assert markdown.startswith("**Table.** Update schemes on tiny.yaml (doplus unlearn, IDK+GD")
    assert "24 steps, seeds 0, 1" in markdown
    lines = markdown.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("| "))
    rows = lines[first:next(i for i in range(first, len(lines) + 1) if i == len(lines) or not lines[i].startswith("|"))]
    table = [[cell.strip() for cell in line.strip("|").split("|")] for line in rows if not line.startswith("| ---")]
    headers, body = table[0], {cells[0]: cells for cells in table[1:]}
    labels = {column["key"]: column["label"] for column in summary["columns"]}
    marked = 0
    for key, spec, pick in (("UFE", ".2f", max), ("TFE", ".2f", max), ("OVR", ".2f", max),
                            ("train_time_s", ".1f", min)):
        index = next(i for i, header in enumerate(headers) if header.rstrip(" ↑↓") == labels[key])
        shown = [body[row["label"]][index] for row in (alternate, doplus)]
        cells = [f"{row['metrics'][key]['mean']:{spec}} ± {row['metrics'][key]['std']:{spec}}"
                 for row in (alternate, doplus)]
        means = [f"{row['metrics'][key]['mean']:{spec}}" for row in (alternate, doplus)]
        if means[0] != means[1]:  # the best mean of the column in bold, the other not
            best = pick((alternate, doplus), key=lambda row: row["metrics"][key]["mean"])
            expected = [f"**{cell}**" if row is best else cell for row, cell in zip((alternate, doplus), cells)]
            marked += 1
        else:  # the same mean as shown (the stds may differ, as 0.2 ± 0.1 and 0.2 ± 0.0 did once): none marked
            expected = cells
        assert shown == expected, (key, shown, expected)
    assert marked > 0
    assert "- MU: MU over 15 of 18 values: no NLI model (4 of 4 runs)" in markdown
    assert (out / "tradeoff.png").read_bytes()[:4] == PNG and (out / "curves.png").read_bytes()[:4] == PNG


def test_sweep_and_set_one_row_per_value_and_finished_runs_are_reused(tiny_llama, data, tofu_dir, tmp_path, capsys):
    """One seed, so every std is n/a. A finished run whose evaluation is missing gets `doplus evaluate` on final/."""
    recipe = write_recipe(tmp_path / "recipe", tiny_llama, data, tofu_dir, steps=6, eval_every=6)
    out = tmp_path / "sweep"
    arguments = bench_args(recipe, out, "--schemes", "doplus", "--seeds", "3", "--set", "lr=5e-4",
                           "--set", "forget-coeff=0.5", "--log-update-similarity")
    assert run_cli(*arguments, "--sweep", "retain_freq=3,1") == 0
    for value in (1, 3):
        config = yaml.safe_load((out / "runs" / f"doplus-retain_freq={value}-s3" / "config.yaml").read_text())
        assert (config["lr"], config["forget_coeff"], config["retain_freq"]) == (5e-4, 0.5, value)
        assert config["log_update_similarity"] is True and config["seed"] == 3
    summary = json.loads((out / "SCHEMES.json").read_text())
    assert [(row["scheme"], row["sweep_value"]) for row in summary["rows"]] == [("doplus", 1), ("doplus", 3)]
    assert all(row["metrics"]["UFE"]["std"] is None for row in summary["rows"])
    markdown = (out / "SCHEMES.md").read_text()
    assert "| Method | retain_freq | UFE ↑ |" in markdown and "update cos (mean over the 2nd half of steps)" in markdown
    assert "lr=0.0005, forget_coeff=0.5" in markdown  # the caption names the --set values
    # the sweep's sensitivity (bench/sensitivity.py): UFE's best retain_freq is the one with the higher mean
    ufe = next(entry for entry in summary["sensitivity"] if entry["metric"] == "UFE")
    means = {row["sweep_value"]: row["metrics"]["UFE"]["mean"] for row in summary["rows"]}
    assert ufe["schemes"]["DO+"]["best"] == max(means, key=means.get)
    assert ufe["schemes"]["DO+"]["losses"] == [pytest.approx(abs(means[1] - means[3]))]
    assert "**Sensitivity to retain_freq, by UFE**" in markdown

    # Another command into the same OUT re-uses the finished run that matches; its evaluation had gone.
    run = out / "runs" / "doplus-retain_freq=3-s3"
    (run / "evals" / "step-6" / "eval.json").unlink()
    capsys.readouterr()
    assert run_cli(*arguments, "--sweep", "retain_freq=3") == 0
    err = capsys.readouterr().err
    assert "[1/1] doplus-retain_freq=3-s3: evaluating" in err and "started" not in err
    evaluated = json.loads((run / "eval" / "SUMMARY.json").read_text())
    summary = json.loads((out / "SCHEMES.json").read_text())
    assert len(summary["rows"]) == 2 and summary["rows"][1]["metrics"]["UFE"]["mean"] == evaluated["UFE"]
    assert f"| DO+ | 3 | {evaluated['UFE']:.2f} ± n/a |" in (out / "SCHEMES.md").read_text()

    assert run_cli(*arguments[:-1], "--sweep", "retain_freq=3") == 2  # not the experiment OUT holds
    err = capsys.readouterr().err.strip()
    assert "holds runs of another experiment (log_update_similarity (True -> False))" in err and "\n" not in err


def test_multitask_recipe_per_task_scores(tiny_llama, tmp_path):
    rows = [{"prompt": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(10)]
    letters = [{"prompt": f"Pick {'ABCD'[i % 4]}: A) a B) b C) c D) d", "answer": "ABCD"[i % 4]} for i in range(10)]
    write_jsonl(tmp_path / "math.jsonl", rows)
    write_jsonl(tmp_path / "sci.jsonl", letters)
    recipe = tmp_path / "mt.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": str(tiny_llama), "steps": 4, "lr": 1e-3, "batch_size": 2, "max_length": 40, "max_new_tokens": 3,
        "eval_rows": 3, "tasks": [{"name": "math", "data": "math.jsonl"},
                                  {"name": "sci", "data": "sci.jsonl", "metric": "choice"}]}))
    out = tmp_path / "mt-bench"
    assert run_cli(*bench_args(recipe, out, "--schemes", "doplus-8bit", "--seeds", "0", "--keep-checkpoints",
                           "--set", "save_every=2")) == 0
    assert list_checkpoints(out / "runs" / "doplus-8bit-s0" / "checkpoints")  # kept, as asked
    summary = json.loads((out / "SCHEMES.json").read_text())
    assert [row["label"] for row in summary["rows"]] == ["DO+ 8bit"]
    for row in summary["rows"]:
        report = json.loads((out / "runs" / f"{row['scheme']}-s0" / "report.json").read_text())
        assert report["config"]["state_bits"] == (8 if row["scheme"] == "doplus-8bit" else 32)
        for task in ("math", "sci", "average"):
            assert row["metrics"][task]["mean"] == pytest.approx(report["scores"]["after"][task])
            assert row["metrics"][task]["std"] is None
        # the scores before training, as the run measured them, kept beside the run's own
        assert summary["runs"][f"{row['scheme']}-s0"]["before"] == report["scores"]["before"]
        # and the run's step diagnostics over every objective (the largest step, the steps above 10 lr)
        sizes = summary["runs"][f"{row['scheme']}-s0"]["update_sizes"]
        assert sizes == report["update_sizes"]["all"] and sizes["steps"] == 4 and sizes["max_update"] > 0
    assert "| Method | math ↑ | sci ↑ | average ↑ |" in (out / "SCHEMES.md").read_text()
    before = report["scores"]["before"]
    assert (f"Before training (the same rows and model for every run): math {before['math']:.2f}, sci "
            f"{before['sci']:.2f}, average {before['average']:.2f}.") in (out / "SCHEMES.md").read_text()
    assert (out / "tradeoff.png").read_bytes()[:4] == PNG


def test_a_failing_run_stops_the_bench_and_names_its_log(tiny_llama, data, tofu_dir, tmp_path, capsys):
    recipe = write_recipe(tmp_path / "recipe", tiny_llama, data, tofu_dir)
    (recipe.parent / "forget.jsonl").write_text('{"question": "q", "answer": "a"}\n{oops\n')
    out = tmp_path / "failing"
    capsys.readouterr()
    assert run_cli(*bench_args(recipe, out, "--schemes", "joint,doplus", "--seeds", "0")) == 1
    err = capsys.readouterr().err
    log = out / "runs" / "joint-s0.log"
    assert "error: run joint-s0 failed (exit code 2): error: " in err and "forget.jsonl:2: malformed JSON" in err
    assert f"see its log {log}" in err and "doplus-s0" not in err
    assert "malformed JSON" in log.read_text()


@pytest.mark.parametrize("case,needle", [
    ("scheme", "unknown scheme 'doplus-4bit' in --schemes (did you mean 'doplus-8bit'?): choose from joint,"),
    ("seeds", "--seeds is empty"),
    ("no_eval", "no evaluation suite"),
    ("multitask_no_eval", "no evaluation suite: eval_rows is 0 and no task has an eval file"),
    ("set_key", "--set lrr: unknown option 'lrr' (did you mean 'lr'?)"),
    ("sweep_key", "--sweep retain_frq: unknown option 'retain_frq' (did you mean 'retain_freq'?)"),
    ("set_scheme_key", "--set state_bits: the scheme names set state_bits"),
    ("set_value", "--set steps: option 'steps' must be int, got 'many'"),
    ("missing", "recipe file not found"),
    ("yaml", "not valid YAML"),
    ("unreadable", "cannot read the recipe"),
    ("not_a_recipe", "not a recipe bench schemes can run: it sets none of forget (unlearn), tasks (multitask), "
                     "safety (align)"),
])
def test_bad_input_is_one_line_with_exit_code_2(tiny_llama, data, tofu_dir, tmp_path, capsys, case, needle):
    recipe = write_recipe(tmp_path / "recipe", tiny_llama, data, tofu_dir)
    extra = []
    if case == "scheme":
        extra = ["--schemes", "joint,doplus-4bit"]
    elif case == "seeds":
        extra = ["--seeds", " , "]
    elif case == "no_eval":
        recipe = write_recipe(tmp_path / "recipe", tiny_llama, data, tofu_dir, eval_suite=None)
    elif case == "multitask_no_eval":
        write_jsonl(tmp_path / "t.jsonl", [{"prompt": "p", "answer": "a"}] * 4)
        recipe.write_text(yaml.safe_dump({"eval_rows": 0, "tasks": [{"name": "t", "data": str(tmp_path / "t.jsonl")}]}))
    elif case == "set_key":
        extra = ["--set", "lrr=0.1"]
    elif case == "sweep_key":
        extra = ["--sweep", "retain_frq=1,2"]
    elif case == "set_scheme_key":
        extra = ["--set", "state_bits=8"]
    elif case == "set_value":
        extra = ["--set", "steps=many"]
    elif case == "missing":
        recipe = tmp_path / "nowhere.yaml"
    elif case == "yaml":
        recipe.write_text("steps: [1,\n")
    elif case == "unreadable":
        recipe.write_bytes(b"steps: \xff\xfe\n")  # not UTF-8 text
    elif case == "not_a_recipe":
        recipe.write_text("steps: 3\nlr: 0.001\n")
    out = tmp_path / "never"
    capsys.readouterr()
    assert run_cli(*bench_args(recipe, out, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and err.count("\n") == 0 and "Traceback" not in err
    assert not out.exists()  # every check comes before anything is written


def test_kinds_statistics_and_update_similarity_window(tmp_path):
    assert adapter_of(tmp_path, {"tasks", "steps"}) is ADAPTERS["multitask"]
    assert adapter_of(tmp_path, {"forget", "steps"}) is ADAPTERS["unlearn"]
    assert adapter_of(tmp_path, {"safety", "general"}) is ADAPTERS["align"]
    assert mean_std([2.0, None, 4.0]) == {"mean": 3.0, "std": pytest.approx(2 ** 0.5), "n": 2}
    assert mean_std([5.0]) == {"mean": 5.0, "std": None, "n": 1}  # one seed: n/a, never 0
    points = [(1, 0.9), (2, 0.8), (3, 0.1), (4, 0.3)]
    assert second_half_mean(points, 4) == pytest.approx(0.2)  # steps 3 and 4 of 4
    assert second_half_mean([], 4) is None


def test_update_cosine_column_and_figure(tiny_llama, data, tofu_dir, tmp_path):
    """The column is the second-half mean per run, then mean ± std over seeds; joint records none (n/a)."""
    recipe = write_recipe(tmp_path / "recipe", tiny_llama, data, tofu_dir, steps=4)
    bench = plan_bench(str(recipe), "joint,alternate,doplus", "0,1", str(tmp_path / "out"), [], None, True)
    cosines = {("alternate", 0): [0.9, 0.8, 0.7, 0.9], ("alternate", 1): [0.95, 0.9, 0.6, 0.8],
               ("doplus", 0): [0.5, 0.4, 0.3, 0.1], ("doplus", 1): [0.2, 0.6, 0.2, 0.4]}
    results = []
    for scheme in ("joint", "alternate", "doplus"):
        for seed in (0, 1):
            points = [(step, value) for step, value in enumerate(cosines.get((scheme, seed), []), start=1)]
            results.append(Result(
                f"{scheme}-s{seed}", scheme, seed, None, {"UFE": 50.0 + seed, "MU": 40.0, "train_time_s": 1.0,
                                                          "update_cosine": second_half_mean(points, 4)},
                {}, [], points, {"model": "m", "steps": 4, "device": "CPU", "world_size": 1,
                                 "peak_memory_kind": "rss", "evaluated_during_training": False}))
    summary = summarise(bench, results, [])
    column = {row["scheme"]: row["metrics"]["update_cosine"] for row in summary["rows"]}
    assert column["joint"]["mean"] is None
    assert column["alternate"]["mean"] == pytest.approx(statistics.mean([0.8, 0.7]))  # (0.7+0.9)/2, (0.6+0.8)/2
    assert column["alternate"]["std"] == pytest.approx(statistics.stdev([0.8, 0.7]))
    assert column["doplus"]["mean"] == pytest.approx(statistics.mean([0.2, 0.3]))
    markdown = render_markdown(summary, [])
    assert "| Joint | 50.50 ± 0.71 |" in markdown and markdown.count("| n/a | 2 |") == 1  # joint's update cos
    assert "| 0.750 ± 0.071 | 2 |" in markdown and "| 0.250 ± 0.071 | 2 |" in markdown  # no best marked: no goal
    assert plot_update_similarity(summary, results, tmp_path) == "update_similarity.png"
    assert (tmp_path / "update_similarity.png").read_bytes()[:4] == PNG


def test_the_answers_suite_scores_each_run_by_its_own_before_and_after_answers(tiny_llama, data, tofu_dir, tmp_path):
    """eval_suite: answers (the real-world setting, no reference answers): the columns are the means over seeds
    of each run's report.json sample_rouge_mean, recomputed here from the per-run reports."""
    recipe = write_recipe(tmp_path / "recipe", tiny_llama, data, tofu_dir, eval_suite="answers", show_samples=3,
                          eval_data_dir=None, eval_max_samples=None, eval_max_new_tokens=None, steps=6)
    out = tmp_path / "bench"
    assert run_cli(*bench_args(recipe, out, "--schemes", "doplus", "--seeds", "0,1")) == 0
    summary = json.loads((out / "SCHEMES.json").read_text())
    reports = [json.loads((out / "runs" / f"doplus-s{s}" / "report.json").read_text()) for s in (0, 1)]
    row = summary["rows"][0]
    for key, part in (("forget_rouge", "forget"), ("retain_rouge", "retain")):
        values = [r["sample_rouge_mean"][part] for r in reports]
        assert row["metrics"][key]["mean"] == pytest.approx(statistics.mean(values), abs=1e-12)
        assert row["metrics"][key]["std"] == pytest.approx(statistics.stdev(values), abs=1e-12)
    assert "forget ROUGE-L ↓" in (out / "SCHEMES.md").read_text()
    assert (out / "tradeoff.png").read_bytes()[:4] == PNG
    assert not (out / "runs" / "doplus-s0" / "eval").exists()  # no doplus evaluate for this suite


def test_the_answers_suite_needs_show_samples(tiny_llama, data, tofu_dir, tmp_path, capsys):
    recipe = write_recipe(tmp_path / "recipe", tiny_llama, data, tofu_dir, eval_suite="answers", show_samples=0)
    assert run_cli(*bench_args(recipe, tmp_path / "bench", "--seeds", "0")) == 2
    assert "show_samples is 0" in capsys.readouterr().err
