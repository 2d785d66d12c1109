"""Checkpoints and exact resume: SIGKILL at a random step, SIGTERM, a changed configuration, NaN guard."""

from __future__ import annotations

import json
import os
import random
import signal

import pytest
import torch
from safetensors.torch import load_file

from doplus_cli.engine.checkpoint import list_checkpoints
from tests.helpers import launch, run_cli, wait_for_steps, write_sets


@pytest.fixture(scope="module")
def data(tofu_dir, tmp_path_factory):
    return write_sets(tofu_dir, tmp_path_factory.mktemp("resume-data"), 10, 16)


def args(model, data, out, steps, *extra):
    return ["unlearn", "--model", model, "--forget", data / "forget.jsonl", "--retain", data / "retain.jsonl",
            "--loss", "NPO+GD", "--steps", steps, "--lr", 1e-3, "--batch-size", 2, "--max-length", 48,
            "--show-samples", 0, "--out", out, *extra]


def final_weights(out):
    return load_file(str(out / "final" / "model.safetensors"))


def checkpoint_weights(checkpoint):
    return load_file(str(next(checkpoint.glob("model*.safetensors"))))


def largest_change(a, b) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.parametrize("extra", [[], ["--state-bits", "8"]], ids=["doplus-32bit", "doplus-8bit"])
@pytest.mark.processes
def test_sigkill_at_a_random_step_then_resume_is_bit_identical(tiny_llama, data, tmp_path, extra):
    steps = 30
    reference = tmp_path / "uninterrupted"
    assert run_cli(*args(tiny_llama, data, reference, steps, *extra)) == 0
    out = tmp_path / "killed"
    process = launch(args(tiny_llama, data, out, steps, "--save-every", 1, "--keep-last", 3, *extra))
    kill_after = random.Random(os.getpid()).randint(3, steps - 10)
    wait_for_steps(out, kill_after, process)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    # the kill lands at or after step `kill_after` (the run goes on while the test reads metrics.jsonl); to
    # replay a failure, set kill_after to the number in the message
    replay = f"SIGKILL after the run logged {kill_after} steps"
    assert not (out / "final").exists() and not (out / "report.json").exists(), replay
    kept = list_checkpoints(out / "checkpoints")
    assert 1 <= len(kept) <= 3, (replay, kept)  # --keep-last 3
    replay += f"; resumed from {kept[-1].name}"
    at_resume = checkpoint_weights(kept[-1])
    assert run_cli(*args(tiny_llama, data, out, steps, "--save-every", 1, "--keep-last", 3, *extra),
                   "--resume") == 0, replay
    a, b = final_weights(reference), final_weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), replay
    # the steps before and after the resume moved the weights (runs that never stepped would be equal too)
    assert largest_change(at_resume, load_file(str(tiny_llama / "model.safetensors"))) > 1e-4, replay
    assert largest_change(b, at_resume) > 1e-4, replay
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in records] == list(range(1, steps + 1)), replay
    assert json.loads((out / "report.json").read_text())["losses"]["forget"]["steps"] == steps // 6  # 1:5


@pytest.mark.processes
def test_sigterm_writes_a_checkpoint_and_the_resumed_run_ends_as_an_uninterrupted_one(tiny_llama, data, tmp_path):
    steps = 24
    out, whole = tmp_path / "preempted", tmp_path / "whole"
    assert run_cli(*args(tiny_llama, data, whole, steps)) == 0
    process = launch(args(tiny_llama, data, out, steps))
    wait_for_steps(out, 5, process)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM
    assert "stopped by SIGTERM after step" in err and "--resume" in err and "Traceback" not in err
    kept = list_checkpoints(out / "checkpoints")
    assert len(kept) == 1 and not (out / "final").exists()
    stopped_at = int(kept[0].name.removeprefix("step-"))
    assert stopped_at < steps
    at_resume = checkpoint_weights(kept[0])
    assert run_cli(*args(tiny_llama, data, out, steps), "--resume", kept[0]) == 0
    assert len(open(out / "metrics.jsonl").readlines()) == steps
    a, b = final_weights(whole), final_weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"stopped after {kept[0].name}"
    # the steps before and after the resume moved the weights (runs that never stepped would be equal too)
    assert largest_change(at_resume, load_file(str(tiny_llama / "model.safetensors"))) > 1e-4
    assert largest_change(b, at_resume) > 1e-4


def _signal_self_then(function):
    """`function`, after this process sent itself SIGTERM (the handler the run installed only records it)."""
    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return function(*args, **kwargs)
    return signalled


def test_sigterm_during_the_evaluation_after_the_last_step_checkpoints_it_and_resume_ends_the_run(
        tiny_llama, data, tmp_path, capsys, monkeypatch):
    from doplus_cli.commands import unlearn

    steps = 6
    whole, out = tmp_path / "whole", tmp_path / "preempted"
    assert run_cli(*args(tiny_llama, data, whole, steps)) == 0
    handler = signal.getsignal(signal.SIGTERM)
    with monkeypatch.context() as patch:  # the signal lands while the after-training samples are generated
        patch.setattr(unlearn.UnlearnCommand, "after", _signal_self_then(unlearn.UnlearnCommand.after))
        capsys.readouterr()
        assert run_cli(*args(tiny_llama, data, out, steps)) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert f"stopped by SIGTERM after step {steps}" in err and "--resume" in err
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == [f"step-{steps}"]
    assert not (out / "final").exists() and not (out / "report.json").exists()
    assert signal.getsignal(signal.SIGTERM) is handler  # the run's handler is gone with it
    at_resume = checkpoint_weights(out / "checkpoints" / f"step-{steps}")
    assert run_cli(*args(tiny_llama, data, out, steps), "--resume") == 0  # no step left: evaluation and final/
    assert len(open(out / "metrics.jsonl").readlines()) == steps
    assert json.loads((out / "report.json").read_text())["status"] == "completed"
    a, b = final_weights(whole), final_weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the six steps moved the weights, and the resume, with no step left, saved the checkpoint's weights as they are
    assert largest_change(b, load_file(str(tiny_llama / "model.safetensors"))) > 1e-4
    assert all(torch.equal(b[k], at_resume[k]) for k in b)


def test_sigterm_while_the_final_model_is_written_lets_the_run_complete(tiny_llama, data, tmp_path, capsys,
                                                                          monkeypatch):
    from doplus_cli.engine import outputs

    out, handler = tmp_path / "run", signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(outputs, "save_final", _signal_self_then(outputs.save_final))
    capsys.readouterr()
    assert run_cli(*args(tiny_llama, data, out, 4)) == 0
    assert "SIGTERM arrived while the final model and report were written; the run completed" in \
        capsys.readouterr().err
    assert json.loads((out / "report.json").read_text())["status"] == "completed"
    assert (out / "final" / "model.safetensors").exists() and not list_checkpoints(out / "checkpoints")
    assert signal.getsignal(signal.SIGTERM) is handler


def test_resume_with_a_changed_learning_rate_is_refused(tiny_llama, data, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(*args(tiny_llama, data, out, 4, "--save-every", 2)) == 0
    (out / "report.json").unlink()  # stopped after step-2, as far as a resumption can tell
    capsys.readouterr()
    assert run_cli(*args(tiny_llama, data, out, 4)[:-2], "--lr", 5e-4, "--out", out, "--resume") == 2
    err = capsys.readouterr().err.strip()
    assert "cannot resume with a different configuration: lr (0.001 -> 0.0005)" in err and "\n" not in err


def test_a_non_finite_loss_stops_before_the_weights_change(tiny_llama, data, tmp_path, capsys):
    from doplus_cli import losses

    original = losses.FORGET_LOSSES["NPO"]
    calls = {"n": 0}

    def poisoned(ctx, batch):
        calls["n"] += 1
        value = original.fn(ctx, batch)
        return value * float("nan") if calls["n"] == 2 else value

    out = tmp_path / "nan"
    capsys.readouterr()
    with losses.FORGET_LOSSES.replaced("NPO", losses.LossSpec("NPO", poisoned, needs_reference=True)):
        assert run_cli(*args(tiny_llama, data, out, 12, "--save-every", 3)) == 1
    err = capsys.readouterr().err
    assert "step 7: non-finite forget_loss = nan" in err and "checkpoints/step-6" in err
    assert not (out / "final").exists()
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step-3", "step-6"]


class _Killed(BaseException):
    pass


def _complete(checkpoint):
    return all((checkpoint / name).is_file() for name in ("model.safetensors", "optimizer.pt", "state.json"))


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_a_kill_at_any_point_of_a_save_leaves_only_complete_checkpoints_within_keep_last(tmp_path, monkeypatch, keep):
    """A kill can land between any two filesystem operations of a save (the CI run once caught one between
    writing step-42 and pruning step-39). Simulate one at every rename and every delete in turn."""
    import shutil

    import torch

    from doplus_cli.engine import checkpoint as ckpt

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    def save(folder, step):
        ckpt.save_checkpoint(folder, step, model, optimizer, scheduler, {}, {}, [], {}, keep)

    real_replace, real_rmtree = ckpt.os.replace, shutil.rmtree
    operations = 0
    while True:
        folder = tmp_path / f"kill-{operations}"
        for step in range(1, keep + 2):
            save(folder, step)  # keep+1 saves: the folder is full and pruning has started
        budget = {"n": operations}

        def counted(real, budget=budget):
            def wrapper(*a, **k):
                if budget["n"] == 0:
                    raise _Killed
                budget["n"] -= 1
                return real(*a, **k)
            return wrapper

        monkeypatch.setattr(ckpt.os, "replace", counted(real_replace))
        monkeypatch.setattr(ckpt.shutil, "rmtree", counted(real_rmtree))
        try:
            save(folder, keep + 2)
            finished = True
        except _Killed:
            finished = False
        monkeypatch.undo()
        kept = ckpt.list_checkpoints(folder)
        assert 1 <= len(kept) <= max(keep, 2), (operations, [p.name for p in kept])
        assert all(_complete(p) for p in kept), operations
        if keep >= 2:
            assert len(kept) <= keep
        if finished:
            assert [p.name for p in kept] == [f"step-{s}" for s in range(3, keep + 3)]
            assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # nothing left aside
            break
        operations += 1
    assert operations >= 3  # the save made at least a set-aside, the replace and a delete
    save(folder, keep + 3)  # the next save clears whatever the kill left aside
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]
