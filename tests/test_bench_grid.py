"""`doplus bench schemes` as a job array: `--list-runs` and each run's state, two `--run-index` processes at once into
one folder (one of them failing), re-running the failed one, the tables against a sequential bench's, and
`--summarize`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from doplus_cli.bench.schemes import array_syntax
from tests.helpers import run_cli, write_sets
from tests.test_bench_schemes import bench_args, write_recipe

pytestmark = pytest.mark.processes  # the runs are doplus processes
RESOURCES = ("train_time_s", "peak_memory_gb")  # measured, so different in every run of the same grid


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_array_syntax_by_hand():
    assert array_syntax([]) == ""
    assert array_syntax([3]) == "3"
    assert array_syntax([0, 1, 2, 3, 5, 7, 8]) == "0-3,5,7-8"
    assert array_syntax([9, 2, 1, 4]) == "1-2,4,9"


def listed(arguments, capsys, *extra):
    capsys.readouterr()
    assert run_cli(*arguments, "--list-runs", *extra) == 0
    return capsys.readouterr().out


def without_measurements(summary):
    """SCHEMES.json less what is measured rather than computed (times, memory) and the folder it sits in."""
    summary = json.loads(json.dumps(summary))
    for row in summary["rows"]:
        for key in RESOURCES:
            row["metrics"].pop(key, None)
        row["best"] = [key for key in row.get("best", []) if key not in RESOURCES]  # the columns it is best in
    for run in summary["runs"].values():
        run.pop("wall_time_s", None)
        for key in RESOURCES:
            run["values"].pop(key, None)
    return summary


def test_two_workers_at_once_a_failed_run_listed_and_rerun_and_the_tables_of_a_sequential_bench(
        tiny_llama, tofu_dir, tmp_path, capsys):
    data = write_sets(tofu_dir, tmp_path, 4, 4)
    # each run scored by its own before/after answers: no evaluation process beside the runs (the suite is cheap)
    recipe = write_recipe(tmp_path / "recipe", tiny_llama, data, tofu_dir, steps=4, eval_suite="answers",
                          show_samples=2, eval_data_dir=None, eval_max_samples=None, eval_max_new_tokens=None)
    out = tmp_path / "array"
    arguments = bench_args(recipe, out, "--schemes", "joint,doplus", "--seeds", "0")

    # Before anything ran: the grid, every run pending, and nothing written.
    grid = json.loads(listed(arguments, capsys, "--json"))
    assert [(r["index"], r["name"], r["scheme"], r["seed"], r["state"]) for r in grid] == [
        (0, "joint-s0", "joint", 0, "pending"), (1, "doplus-s0", "doplus", 0, "pending")]
    assert grid[1]["command"] == (f"doplus unlearn --recipe {out}/recipes/doplus-s0.yaml "
                                  f"--out {out}/runs/doplus-s0")
    assert listed(arguments, capsys, "--indexes", "pending,failed") == "0-1\n"
    assert not out.exists()

    # Two workers at once; run 1's training process is killed (as the kernel's OOM killer would) once it started.
    env = dict(os.environ)
    logs = [open(tmp_path / f"worker-{k}.log", "w") for k in (0, 1)]
    workers = [subprocess.Popen([sys.executable, "-m", "doplus_cli", *map(str, arguments), "--run-index", str(k)],
                                stdout=logs[k], stderr=subprocess.STDOUT, env=env) for k in (0, 1)]
    try:
        deadline = time.time() + 240
        while not (out / "runs" / "doplus-s0" / "config.yaml").exists():
            assert workers[1].poll() is None, (tmp_path / "worker-1.log").read_text()
            assert time.time() < deadline, "run 1 did not start in time"
            time.sleep(0.01)
        # while both work, the listing shows run 1 held by its worker
        running = {r["index"]: r for r in json.loads(listed(arguments, capsys, "--json"))}
        assert running[1]["state"] == "running" and f"process {workers[1].pid}" in running[1]["detail"]
        for child in psutil.Process(workers[1].pid).children():
            child.send_signal(signal.SIGKILL)
        codes = [w.wait(timeout=300) for w in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait(timeout=60)
        for log in logs:
            log.close()
    text = [(tmp_path / f"worker-{k}.log").read_text() for k in (0, 1)]
    assert codes == [0, 1], text
    assert "run 1 (doplus-s0)" in text[1] and "failed (killed by SIGKILL)" in text[1]
    assert "the tables wait for 1 run not done (1 doplus-s0: failed)" in text[0] or "1 doplus-s0: running" in text[0]
    assert not (out / "SCHEMES.json").exists()

    grid = {r["index"]: r for r in json.loads(listed(arguments, capsys, "--json"))}
    assert (grid[0]["state"], grid[1]["state"]) == ("done", "failed")
    assert "killed by SIGKILL" in grid[1]["detail"]
    assert listed(arguments, capsys, "--indexes", "failed") == "1\n"
    table = listed(arguments, capsys)
    assert "2 runs: 1 done, 0 running, 1 failed, 0 pending" in table
    assert "re-run the failed: sbatch --array=1 " in table

    # Bad input: an index outside the grid, a mode twice, an unknown state. One line, exit 2.
    for extra, needle in ((["--run-index", "2"], "--run-index 2: the grid has 2 runs, indexes 0 to 1"),
                          (["--run-index", "0", "--summarize"], "--run-index and --summarize: give one of them"),
                          (["--list-runs", "--indexes", "failing"], "--indexes failing: give states from pending,")):
        capsys.readouterr()
        assert run_cli(*arguments, *extra) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and err.count("\n") == 0, err

    # The failed run again: it ends the grid, so its worker writes the tables.
    capsys.readouterr()
    assert run_cli(*arguments, "--run-index", "1") == 0
    err = capsys.readouterr().err
    assert "run 1 (doplus-s0): " in err and "tables: " in err
    assert not (out / "runs" / "doplus-s0.failed.json").exists()
    assert listed(arguments, capsys, "--indexes", "pending,running,failed") == ""
    written = {name: (out / name).read_bytes() for name in ("SCHEMES.json", "SCHEMES.md")}

    # --summarize writes the same bytes again; so does the sequential command, which finds every run done.
    assert run_cli(*arguments, "--summarize") == 0
    assert run_cli(*arguments) == 0
    assert {name: (out / name).read_bytes() for name in written} == written

    # The same grid as one sequential bench: the same scores, run for run.
    sequential = tmp_path / "sequential"
    assert run_cli(*bench_args(recipe, sequential, "--schemes", "joint,doplus", "--seeds", "0")) == 0
    ours, theirs = (json.loads((folder / "SCHEMES.json").read_text()) for folder in (out, sequential))
    assert without_measurements(ours) == without_measurements(theirs)
    assert [row["metrics"]["forget_rouge"]["values"] for row in ours["rows"]] == \
        [row["metrics"]["forget_rouge"]["values"] for row in theirs["rows"]]


def test_summarize_needs_a_run_done(tiny_llama, tofu_dir, tmp_path, capsys):
    data = write_sets(tofu_dir, tmp_path, 4, 4)
    recipe = write_recipe(tmp_path / "recipe", tiny_llama, data, tofu_dir, steps=4, eval_every=4)
    out = tmp_path / "nothing"
    capsys.readouterr()
    assert run_cli(*bench_args(recipe, out, "--summarize")) == 2
    err = capsys.readouterr().err.strip()
    assert "no run of this bench has started here (no bench.json)" in err and err.count("\n") == 0
    assert not out.exists()
