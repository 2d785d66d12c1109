"""A run's life in its folder: one run per output folder (a lock the operating system releases when its holder
dies), and SIGTERM at any stage before training (model load, answers from the model, the evaluation before)
stopping at once with 128 + 15, after which `--resume` ends bit-identical to an uninterrupted run; an interrupted
`doplus evaluate` continuing the suites it had not finished."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from doplus_cli import lifecycle, ownership
from doplus_cli.commands import align, multitask, unlearn
from doplus_cli.engine import loop
from doplus_cli.errors import UserError
from doplus_cli.evaluation import runner
from tests.helpers import align_args, run_cli, sigterm_when, training, write_jsonl, write_sets

HOLD = """
import sys, time
from doplus_cli import lifecycle
with lifecycle.run_guard():
    lifecycle.hold(sys.argv[1], "doplus unlearn")
    time.sleep(120)
"""


@pytest.fixture(scope="module")
def data(tofu_dir, tmp_path_factory):
    return write_sets(tofu_dir, tmp_path_factory.mktemp("lifecycle-data"), 6, 8)


def args(model, data, out, *extra):
    # answers_from_model: the targets are generated before training, a stage a signal can hit
    return ["unlearn", "--model", model, "--forget", data / "forget.jsonl", "--retain", data / "retain.jsonl",
            "--loss", "NPO+GD", "--steps", 4, "--lr", 1e-3, "--batch-size", 2, "--max-length", 48,
            "--answers-from-model", "--max-new-tokens", 4, "--show-samples", 1, "--out", out, *extra]


@pytest.fixture(scope="module")
def uninterrupted(tiny_llama, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("lifecycle") / "uninterrupted"
    assert run_cli(*args(tiny_llama, data, out)) == 0
    return out


def records(out):
    return [{k: v for k, v in json.loads(line).items() if k not in ("seconds", "peak_memory_gb")}
            for line in open(out / "metrics.jsonl")]


def sigterm_first(function):
    """`function`, but SIGTERM to this process first: the signal arrives at that stage of the run."""
    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return function(*args, **kwargs)
    return signalled


@pytest.mark.parametrize("stage,target,attribute", [
    ("loading the model", loop, "load_model_and_tokenizer"),
    ("preparing the data", unlearn, "write_self_answered"),
    ("evaluating before training", unlearn.UnlearnCommand, "before"),
])
def test_sigterm_before_training_stops_at_once_and_resume_is_bit_identical(tiny_llama, data, uninterrupted, tmp_path,
                                                                            monkeypatch, capsys, stage, target,
                                                                            attribute):
    out, handler = tmp_path / "stopped", signal.getsignal(signal.SIGTERM)
    with monkeypatch.context() as patch:
        patch.setattr(target, attribute, sigterm_first(getattr(target, attribute)))
        capsys.readouterr()
        assert run_cli(*args(tiny_llama, data, out)) == 128 + signal.SIGTERM
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]  # no traceback
    assert len(errors) == 1 and errors[0].startswith(f"error: stopped by SIGTERM while {stage}"), errors
    assert errors[0].endswith("--resume")
    assert not (out / "checkpoints").exists() and not (out / "final").exists()
    assert signal.getsignal(signal.SIGTERM) == handler  # the run's handler is gone with the command
    if stage != "loading the model":
        assert (out / "config.yaml").is_file()  # the folder a requeued job finds: it resumes, not refused
    assert run_cli(*args(tiny_llama, data, out, "--resume")) == 0
    assert "no checkpoint was written before the run stopped; starting it again" in capsys.readouterr().err
    a, b = load_file(str(uninterrupted / "final" / "model.safetensors")), load_file(str(out / "final" /
                                                                                        "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert records(out) == records(uninterrupted)
    assert (out / "answers" / "forget.jsonl").read_text() == (uninterrupted / "answers" / "forget.jsonl").read_text()


def test_a_sigterm_names_the_command_line_it_is_given_never_the_process_arguments(monkeypatch):
    """A library caller's stop says no command (this process's own arguments are pytest's); the CLI's names the
    arguments it was invoked with: `--overwrite` dropped, `--resume` and the processes added, a bench's unchanged."""
    monkeypatch.setattr(sys, "argv", ["another-program", "--its-own", "arguments"])
    with pytest.raises(lifecycle.Stopped) as stopped:
        with lifecycle.run_guard():
            lifecycle.stage("loading the model")
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the handler raises here
    error, line = stopped.value, "stopped by SIGTERM while loading the model; nothing was lost"
    assert str(error) == error.continued(None) == line and error.exit_code == 128 + 15
    assert error.continued(["unlearn", "--out", "a b", "--overwrite"]) == (
        f"{line}; continue with: doplus unlearn --out 'a b' --resume")
    assert error.continued(["bench", "schemes", "--out", "b"]) == f"{line}; continue with: doplus bench schemes --out b"
    stop = lifecycle.StopRequest()
    stop.signal_name, stop.signal_number = "SIGINT", 2
    interrupted = loop.RunInterrupted(stop, 3, "out/checkpoints/step-3", processes=2)
    assert str(interrupted) == "stopped by SIGINT after step 3; checkpoint out/checkpoints/step-3"
    assert interrupted.continued(["unlearn", "--out", "out", "--resume"]) == (
        f"{interrupted}; resume with: doplus unlearn --out out --resume --num-processes 2")
    assert interrupted.exit_code == 130


@pytest.mark.parametrize("command", ["align", "multitask"])
def test_align_and_multitask_stopped_before_training_resume_bit_identically(tiny_llama, tmp_path, monkeypatch,
                                                                            capsys, command):
    """The same for the other training commands: SIGTERM while each measures its starting model."""
    rows = [{"prompt": f"What is {a} plus {a}?", "answer": str(2 * a)} for a in range(10)]
    task = write_jsonl(tmp_path / "sums.jsonl", rows)
    plan = {"align": align.AlignCommand, "multitask": multitask.MultitaskCommand}[command]

    def arguments(out, *extra):
        if command == "align":
            return align_args(tiny_llama, out, "--steps", 3, *extra)
        return ["multitask", "--model", tiny_llama, "--task", f"sums={task},metric=exact", "--steps", 3, "--lr",
                1e-3, "--batch-size", 2, "--max-length", 48, "--max-new-tokens", 4, "--eval-rows", 2, "--out", out,
                *extra]

    whole, out = tmp_path / "whole", tmp_path / "stopped"
    assert run_cli(*arguments(whole)) == 0
    with monkeypatch.context() as patch:
        patch.setattr(plan, "before", sigterm_first(plan.before))
        capsys.readouterr()
        assert run_cli(*arguments(out)) == 128 + signal.SIGTERM
    assert "error: stopped by SIGTERM while evaluating before training" in capsys.readouterr().err
    assert run_cli(*arguments(out, "--resume")) == 0
    a, b = (load_file(str(folder / "final" / "model.safetensors")) for folder in (whole, out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert records(out) == records(whole)


def test_resume_without_a_checkpoint_refuses_another_configuration_and_a_finished_run(tiny_llama, data, uninterrupted,
                                                                                      tmp_path, capsys):
    out = tmp_path / "changed"
    out.mkdir()  # a run stopped before its first checkpoint: its record and config.yaml, at another lr
    shutil.copy(uninterrupted / ownership.RECORD_NAME, out)
    (out / "config.yaml").write_text((uninterrupted / "config.yaml").read_text().replace("lr: 0.001", "lr: 0.002"))
    capsys.readouterr()
    assert run_cli(*args(tiny_llama, data, out, "--resume")) == 2
    err = capsys.readouterr().err.strip()
    assert "started with another configuration (lr)" in err and "\n" not in err
    assert run_cli(*args(tiny_llama, data, uninterrupted, "--resume")) == 2  # finished, its checkpoints removed
    assert "the run there has finished" in capsys.readouterr().err
    unrelated = tmp_path / "unrelated"
    unrelated.mkdir()
    (unrelated / "notes.txt").write_text("not a run")
    assert run_cli(*args(tiny_llama, data, unrelated, "--resume")) == 2  # never trains among someone's files
    assert "no `doplus unlearn` was started here" in capsys.readouterr().err
    assert sorted(p.name for p in unrelated.iterdir() if not p.name.startswith(".doplus")) == ["notes.txt"]


@pytest.mark.processes
def test_a_second_start_on_a_held_folder_is_one_line_naming_the_holder_and_a_kill_frees_it(tiny_llama, data,
                                                                                           tmp_path, capsys):
    """Another process holds OUT: `doplus unlearn`, `doplus evaluate` and `doplus bench schemes` on it are one line
    each (host, process id, since when), exit 2, with nothing written; once the holder is killed with SIGKILL the
    operating system has released the lock, and a run takes the folder."""
    out = tmp_path / "held"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while not (out / lifecycle.HOLDER_NAME).is_file():  # written once the lock is held
            assert holder.poll() is None and time.time() < deadline, "the holder did not take the lock"
            time.sleep(0.01)
        capsys.readouterr()
        assert run_cli(*args(tiny_llama, data, out)) == 2
        err = capsys.readouterr().err.strip()
        assert f"another doplus run holds this folder (doplus unlearn on host {socket.gethostname()}, process " \
               f"{holder.pid}, since {time.strftime('%Y-%m-%d')}" in err and "\n" not in err
        assert run_cli(*args(tiny_llama, data, out, "--resume")) == 2
        assert run_cli("evaluate", "--model", tiny_llama, "--out", out, "--suite", "tofu") == 2
        recipe = tmp_path / "bench.yaml"
        recipe.write_text(f"model: {tiny_llama}\nforget: {data / 'forget.jsonl'}\nretain: {data / 'retain.jsonl'}\n"
                          "steps: 2\neval_suite: answers\n")
        assert run_cli("bench", "schemes", "--recipe", recipe, "--schemes", "joint", "--seeds", "0",
                       "--out", out) == 2
        errors = capsys.readouterr().err.strip().splitlines()
        assert len(errors) == 3 and all(f"process {holder.pid}" in line for line in errors), errors
        # nothing written but the holder's lock
        assert sorted(p.name for p in out.iterdir()) == sorted([lifecycle.LOCK_NAME, lifecycle.HOLDER_NAME])
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    assert run_cli(*args(tiny_llama, data, out, "--steps", 1)) == 0
    assert (out / "report.json").is_file() and not (out / lifecycle.HOLDER_NAME).exists()  # released at the end


@pytest.mark.processes
def test_sigterm_to_a_bench_stops_its_run_with_a_checkpoint_and_the_same_command_resumes_it(tiny_llama, data,
                                                                                             tmp_path, capsys):
    """The bench hands the signal to the run it is running, which checkpoints and exits; the bench exits 143 and the
    same command resumes that run from its checkpoint."""
    recipe, out = tmp_path / "bench.yaml", tmp_path / "bench"
    recipe.write_text(f"model: {tiny_llama}\nforget: {data / 'forget.jsonl'}\nretain: {data / 'retain.jsonl'}\n"
                      "steps: 40\nbatch_size: 2\nmax_length: 48\nlr: 0.001\nshow_samples: 1\nmax_new_tokens: 4\n"
                      "eval_suite: answers\n")
    arguments = ("bench", "schemes", "--recipe", recipe, "--schemes", "doplus", "--seeds", "0", "--out", out)
    run = out / "runs" / "doplus-s0"

    watcher = sigterm_when(lambda: training(run))  # to the bench process, once its run trains
    capsys.readouterr()
    assert run_cli(*arguments) == 128 + signal.SIGTERM
    watcher.join(timeout=60)
    err = capsys.readouterr().err
    assert "stopped by SIGTERM during run doplus-s0; run the same command again" in err
    kept = [p.name for p in (run / "checkpoints").iterdir()]
    assert len(kept) == 1 and not (run / "report.json").exists()
    assert "stopped by SIGTERM after step" in (out / "runs" / "doplus-s0.log").read_text()
    assert run_cli(*arguments) == 0
    assert f"[1/1] doplus-s0: resumed from {kept[0]}" in capsys.readouterr().err
    assert [json.loads(line)["step"] for line in open(run / "metrics.jsonl")] == list(range(1, 41))


def test_an_interrupted_evaluation_resumes_the_suites_it_had_not_finished(tiny_llama, tofu_dir, tmp_path, capsys):
    forget, retain = tmp_path / "forget.jsonl", tmp_path / "neighbours.jsonl"
    for path, names in ((forget, ["Ada Lovelace"]), (retain, ["Grace Hopper", "Emmy Noether"])):
        path.write_text("".join(json.dumps({
            "question": f"Where was {n} born?", "answer": f"{n} was born in Paris.",
            "paraphrased_answer": f"Paris is where {n} was born.",
            "perturbed_answer": [f"{n} was born in Rome."]}) + "\n" for n in names))

    def evaluate(out, *extra):
        # privacy (no judges, no generation) and real-world: the cheapest two suites
        return run_cli("evaluate", "--model", tiny_llama, "--suite", "privacy,real-world", "--data-dir", tofu_dir,
                       "--holdout", retain, "--forget", forget, "--retain", retain, "--max-samples", 2,
                       "--max-new-tokens", 4,
                       "--nli-model", tmp_path / "no-such-nli", "--embedding-model", tmp_path / "no-such-embedder",
                       "--out", out, *extra)

    whole, out = tmp_path / "whole", tmp_path / "stopped"
    assert evaluate(whole) == 0
    real_world = runner.SUITE_REGISTRY["real-world"]
    with runner.SUITE_REGISTRY.replaced("real-world", dataclasses.replace(real_world,
                                                                         run=sigterm_first(real_world.run))):
        capsys.readouterr()
        assert evaluate(out) == 128 + signal.SIGTERM
    err = capsys.readouterr().err.strip()
    assert "stopped by SIGTERM while running the real-world suite" in err and "evaluate" in err and "--resume" in err
    assert not (out / "eval.json").exists() and not (out / "SUMMARY.json").exists()
    assert list(json.loads((out / runner.FINISHED_SUITES).read_text())["suites"]) == ["privacy"]
    assert evaluate(out) == 2  # a plain start does not take an interrupted evaluation for a fresh folder
    privacy = runner.SUITE_REGISTRY["privacy"]

    def not_again(context):
        raise AssertionError("a finished suite ran again")
    with runner.SUITE_REGISTRY.replaced("privacy", dataclasses.replace(privacy, run=not_again)):
        assert evaluate(out, "--resume") == 0
    assert json.loads((out / "SUMMARY.json").read_text()) == json.loads((whole / "SUMMARY.json").read_text())
    assert (out / "PRIVACY_EVAL.json").read_text() == (whole / "PRIVACY_EVAL.json").read_text()
    assert (out / "REAL_WORLD_EVAL.json").read_text() == (whole / "REAL_WORLD_EVAL.json").read_text()
    assert not (out / runner.FINISHED_SUITES).exists() and (out / "report.md").is_file()
    assert evaluate(out, "--resume") == 2  # finished: nothing to resume


def test_workers_leave_the_lock_to_their_launcher_and_a_file_system_without_locks_is_one_line(tmp_path,
                                                                                              monkeypatch):
    import errno
    import fcntl

    def held(folder) -> bool:
        return (folder / lifecycle.HOLDER_NAME).is_file()

    launcher, worker = tmp_path / "launched", tmp_path / "worker"
    with monkeypatch.context() as patch:  # a worker of `--num-processes`: its launcher (another process) holds it
        patch.setenv(lifecycle.HELD_VARIABLE, f"{os.path.realpath(launcher)}={os.getppid()}")
        with lifecycle.run_guard():
            lifecycle.hold(launcher, "doplus unlearn")
            assert not held(launcher)
            lifecycle.hold(tmp_path / "other", "doplus unlearn")  # another folder: held by this process
            assert held(tmp_path / "other")
        assert os.environ[lifecycle.HELD_VARIABLE] == f"{os.path.realpath(launcher)}={os.getppid()}"
    with monkeypatch.context() as patch:  # a worker of `accelerate launch` other than the first
        patch.setenv("RANK", "1")
        with lifecycle.run_guard():
            lifecycle.hold(worker, "doplus unlearn")
            assert not held(worker)
    with lifecycle.run_guard():  # the first process
        lifecycle.hold(worker, "doplus unlearn")
        assert json.loads((worker / lifecycle.HOLDER_NAME).read_text())["pid"] == os.getpid()
        assert os.environ[lifecycle.HELD_VARIABLE] == f"{os.path.realpath(worker)}={os.getpid()}"
    assert not held(worker) and lifecycle.HELD_VARIABLE not in os.environ

    def no_flock(fd, operation):  # Lustre mounted without -o flock
        raise OSError(errno.ENOSYS, "Function not implemented")

    with monkeypatch.context() as patch:
        patch.setattr(fcntl, "flock", no_flock)
        with pytest.raises(UserError, match=r"\.doplus\.lock: cannot lock the folder \(Function not "
                                                      r"implemented\); on Lustre mount with -o flock, or set "
                                                      r"DOPLUS_FOLDER_LOCK=off"):
            with lifecycle.run_guard():
                lifecycle.hold(tmp_path / "lustre", "doplus unlearn")
        patch.setenv(lifecycle.LOCK_SWITCH, "off")
        with lifecycle.run_guard():
            lifecycle.hold(tmp_path / "lustre", "doplus unlearn")  # off: no lock taken, none refused
            assert not held(tmp_path / "lustre")
