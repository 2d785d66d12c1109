"""`doplus bench schemes --parallel N`: N runs at once on one machine, each in its own process, with its share of the
CPU cores and, with several GPUs, one of them; a run that fails stops the start of new ones, and the runs under way
finish; what does not go with it is refused in one line."""

from __future__ import annotations

import json
import re

import pytest

import doplus_cli.bench.schemes.running as running
import doplus_cli.engine.memory_plan as memory_plan
from tests.helpers import run_cli, sigterm_when, training, write_sets
from tests.test_bench_schemes import bench_args, write_recipe

pytestmark = pytest.mark.processes  # the runs are doplus processes


@pytest.fixture
def recipe(tiny_llama, tofu_dir, tmp_path):
    data = write_sets(tofu_dir, tmp_path, 4, 4)
    # each run scored by its own before/after answers: no evaluation process beside the runs
    return write_recipe(tmp_path / "recipe", tiny_llama, data, tofu_dir, steps=4, eval_suite="answers",
                        show_samples=2, eval_data_dir=None, eval_max_samples=None, eval_max_new_tokens=None)


def events(err: str) -> list[tuple[str, str]]:
    """(run, what) of each line the bench said about a run, in order."""
    return re.findall(r"\[\d+/\d+\] (\S+): (started|finished|evaluated|skipped)", err)


def test_two_runs_at_once_share_the_cores_and_the_tables_follow(recipe, tmp_path, capsys, monkeypatch):
    """2 cores for 2 workers: each run's torch has 1 thread (its report says so; torch alone takes a thread a
    core); both runs start before either finishes; the tables are written once every run is done. The bench says
    so when the disk plan takes fewer runs at once than asked for (here no free space at all), and runs them."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(running, "cpu_cores", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(memory_plan, "free_bytes", lambda path: 0)  # the disk plan then takes no run at once
    out = tmp_path / "bench"
    capsys.readouterr()
    assert run_cli(*bench_args(recipe, out, "--schemes", "joint,doplus", "--seeds", "0", "--parallel", 2)) == 0
    err = capsys.readouterr().err
    assert "warning: --parallel 2 asks for more runs at once than the disk plan takes (0)" in err  # and they ran
    assert "2 runs (2 schemes x 1 seeds) of doplus unlearn into" in err and ", 2 at a time" in err
    said = events(err)
    starts = [said.index((name, "started")) for name in ("joint-s0", "doplus-s0")]
    finishes = [said.index((name, "finished")) for name in ("joint-s0", "doplus-s0")]
    assert max(starts) < min(finishes), said
    for name in ("joint-s0", "doplus-s0"):
        report = json.loads((out / "runs" / name / "report.json").read_text())
        assert report["status"] == "completed" and report["environment"]["device"].endswith(", 1 thread)")
    summary = json.loads((out / "SCHEMES.json").read_text())
    assert [row["scheme"] for row in summary["rows"]] == ["joint", "doplus"]

    # the same command again: every run is done and skipped; with --remove-final the skipped runs' final/ go
    assert all((out / "runs" / name / "final").is_dir() for name in ("joint-s0", "doplus-s0"))
    assert run_cli(*bench_args(recipe, out, "--schemes", "joint,doplus", "--seeds", "0", "--parallel", 2,
                               "--remove-final")) == 0
    err = capsys.readouterr().err
    assert sorted(events(err)) == [("doplus-s0", "skipped"), ("joint-s0", "skipped")]
    assert err.count("removed its final model (") == 2
    assert not any((out / "runs" / name / "final").exists() for name in ("joint-s0", "doplus-s0"))
    assert json.loads((out / "SCHEMES.json").read_text())["rows"] == summary["rows"]  # the tables read no model


def test_a_failed_run_stops_new_ones_and_the_others_finish(recipe, tmp_path, capsys, monkeypatch):
    """4 runs, 2 at a time: joint at lr 1e30 fails within its first steps (a non-finite gradient); joint at 1e-3 was
    started beside it and finishes; the DualOptim+ runs never start. The bench exits 1 with the failed run's line,
    and --list-runs shows 1 done, 1 failed, 2 pending."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "bench"
    arguments = bench_args(recipe, out, "--schemes", "joint,doplus", "--seeds", "0", "--sweep", "lr=1e-3,1e30")
    capsys.readouterr()
    assert run_cli(*arguments, "--parallel", 2) == 1
    err = capsys.readouterr().err
    assert re.search(r"error: run joint-lr=1e\+?30-s0 failed \(exit code 1\): error: step \d+: non-finite", err), err
    states = {r["name"]: r["state"] for r in json.loads(_listed(arguments, capsys))}
    assert sorted(states.values()) == ["done", "failed", "pending", "pending"], states
    assert [name for name, state in states.items() if state == "pending"] == [n for n in states if "doplus" in n]


def _listed(arguments, capsys) -> str:
    capsys.readouterr()
    assert run_cli(*arguments, "--list-runs", "--json") == 0
    return capsys.readouterr().out


def test_each_worker_takes_its_share_of_cores_and_gpus(monkeypatch):
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(running, "cpu_cores", lambda: 16)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    environments = running.worker_environments(4)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in environments] == ["3", "5", "7", "3"]
    assert {e["OMP_NUM_THREADS"] for e in environments} == {"4"} == {e["MKL_NUM_THREADS"] for e in environments}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # one GPU: every run shares it
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's own setting stands
    assert running.worker_environments(3) == [{"MKL_NUM_THREADS": "5"}] * 3


@pytest.mark.parametrize("flag", [["--run-index", 0], ["--summarize"], ["--list-runs"], ["--num-processes", 2]])
def test_what_does_not_go_with_parallel_is_one_line(recipe, tmp_path, capsys, flag):
    capsys.readouterr()
    code = run_cli(*bench_args(recipe, tmp_path / "bench", "--parallel", 2, *flag))
    err = capsys.readouterr().err.strip()
    assert code == 2 and f"{flag[0]} does not go with it" in err and "\n" not in err, err
    assert not (tmp_path / "bench").exists()


def test_sigterm_stops_every_run_under_way_with_a_checkpoint_and_the_same_command_resumes_them(
        tiny_llama, tofu_dir, tmp_path, capsys, monkeypatch):
    """The bench hands SIGTERM to both runs it is running; each checkpoints and exits, the bench exits 143, and the
    same command resumes both from their checkpoints."""
    import signal

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    data = write_sets(tofu_dir, tmp_path, 4, 4)
    recipe = write_recipe(tmp_path / "recipe", tiny_llama, data, tofu_dir, steps=40, eval_suite="answers",
                          show_samples=1, eval_data_dir=None, eval_max_samples=None, eval_max_new_tokens=None)
    out = tmp_path / "bench"
    arguments = bench_args(recipe, out, "--schemes", "joint,doplus", "--seeds", "0", "--parallel", 2)
    runs = [out / "runs" / name for name in ("joint-s0", "doplus-s0")]

    watcher = sigterm_when(lambda: all(training(run) for run in runs))  # to the bench, once both runs train
    capsys.readouterr()
    assert run_cli(*arguments) == 128 + signal.SIGTERM
    watcher.join(timeout=60)
    assert "stopped by SIGTERM" in capsys.readouterr().err
    for run in runs:
        assert len(list((run / "checkpoints").iterdir())) == 1 and not (run / "report.json").exists()
    assert run_cli(*arguments) == 0
    said = events(capsys.readouterr().err)
    assert sorted(name for name, what in said if what == "finished") == ["doplus-s0", "joint-s0"]
    for run in runs:
        assert [json.loads(line)["step"] for line in open(run / "metrics.jsonl")] == list(range(1, 41))


def test_folders_held_from_two_threads_stay_in_what_their_processes_inherit(tmp_path, monkeypatch):
    """A --parallel worker holds its run's folder while it starts the run and then its evaluation; the process it
    starts inherits the hold. Worker A takes folder a, worker B folder b, and A lets go first: b is still in the
    environment B's next process gets, and once both let go nothing is left."""
    import os
    import threading

    from doplus_cli import lifecycle

    monkeypatch.delenv(lifecycle.HELD_VARIABLE, raising=False)
    a_holds, b_holds, a_done = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def worker_a():
        with lifecycle.holding(tmp_path / "a", "worker a"):
            a_holds.set()
            b_holds.wait(30)
        a_done.set()

    def worker_b():
        a_holds.wait(30)
        with lifecycle.holding(tmp_path / "b", "worker b"):
            b_holds.set()
            a_done.wait(30)
            seen["b"] = os.environ.get(lifecycle.HELD_VARIABLE, "")

    with lifecycle.run_guard():
        workers = [threading.Thread(target=worker_a), threading.Thread(target=worker_b)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(60)
    assert seen["b"].split(os.pathsep) == [f"{os.path.realpath(tmp_path / 'b')}={os.getpid()}"]
    assert lifecycle.HELD_VARIABLE not in os.environ
