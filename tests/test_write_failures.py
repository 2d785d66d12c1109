"""A write that fails (disk full, a place that cannot be written) ends a command with one line naming the path
and exit code 2, leaves nothing half-written that looks finished, and the same command run again goes on.

A full disk is real here where it can be: /dev/full answers every write with ENOSPC. A checkpoint's full disk
is torch.save's own error for it ("PytorchStreamWriter failed writing file ...: file write failed"), raised at
the second checkpoint."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from doplus_cli.engine import checkpoint
from doplus_cli.engine.checkpoint import list_checkpoints
from tests.helpers import run_cli, write_sets


@pytest.fixture(scope="module")
def data(tofu_dir, tmp_path_factory):
    return write_sets(tofu_dir, tmp_path_factory.mktemp("write-data"), 6, 8)


def args(model, data, out, *extra):
    return ["unlearn", "--model", model, "--forget", data / "forget.jsonl", "--retain", data / "retain.jsonl",
            "--loss", "NPO+GD", "--steps", 6, "--lr", 1e-3, "--batch-size", 2, "--max-length", 48,
            "--show-samples", 0, "--out", out, *extra]


def one_line(capsys) -> str:
    """The command's error: one line (the progress lines of a run without a terminal come before it)."""
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err and err.rstrip().endswith(errors[0]), err[-3000:]
    return errors[0]


@pytest.mark.parametrize("where", ["under a file", "in /proc"])
def test_an_out_that_cannot_be_written_is_one_line(tiny_llama, data, tmp_path, capsys, where):
    if where == "under a file":
        (tmp_path / "a-file").write_text("not a folder\n")
        out = tmp_path / "a-file" / "run"
    else:
        out = "/proc/doplus-cannot-write-here/run"
    capsys.readouterr()
    assert run_cli(*args(tiny_llama, data, out)) == 2
    err = one_line(capsys)
    assert err.startswith("error: ") and (str(out) in err or str(os.path.dirname(out)) in err), err


def test_a_full_disk_at_a_checkpoint_then_at_the_metrics_and_the_run_goes_on(tiny_llama, data, tmp_path, capsys,
                                                                             monkeypatch):
    whole, out = tmp_path / "whole", tmp_path / "run"
    assert run_cli(*args(tiny_llama, data, whole)) == 0
    real_save = torch.save

    def full_at_step_4(obj, path, *a, **k):
        if ".step-4.tmp" in str(path):
            raise RuntimeError(f"[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing "
                               f"file data/0: file write failed ({path})")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(checkpoint.torch, "save", full_at_step_4)
    capsys.readouterr()
    assert run_cli(*args(tiny_llama, data, out, "--save-every", 2, "--keep-last", 2)) == 2
    err = one_line(capsys)
    assert f"{out / 'checkpoints' / 'step-4'}: cannot write (" in err and "file write failed" in err
    assert f"newest complete checkpoint is {out / 'checkpoints' / 'step-2'}" in err and "--resume" in err
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step-2"]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-2"]  # the half-written step removed
    assert not (out / "final").exists() and not (out / "report.json").exists()
    monkeypatch.undo()

    # the disk is full when the resumed run starts its metrics: a real ENOSPC, from /dev/full
    (out / "metrics.jsonl").unlink()
    (out / "metrics.jsonl").symlink_to("/dev/full")
    assert run_cli(*args(tiny_llama, data, out, "--save-every", 2, "--keep-last", 2), "--resume") == 2
    err = one_line(capsys)
    assert f"{out / 'metrics.jsonl'}: cannot write (No space left on device)" in err
    assert not (out / "final").exists() and not (out / "report.json").exists()

    (out / "metrics.jsonl").unlink()  # space again: the same command goes on from step-2
    assert run_cli(*args(tiny_llama, data, out, "--save-every", 2, "--keep-last", 2), "--resume") == 0
    a, b = load_file(str(whole / "final" / "model.safetensors")), load_file(str(out / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 6


def test_a_full_disk_at_the_final_weights_leaves_no_final_folder(tiny_llama, data, tmp_path, capsys, monkeypatch):
    from transformers import PreTrainedModel

    def full(self, folder, *a, **k):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "model.safetensors"), "wb") as handle:
            handle.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    out = tmp_path / "run"
    capsys.readouterr()
    assert run_cli(*args(tiny_llama, data, out, "--save-every", 3)) == 2
    err = one_line(capsys)
    assert f"{out / 'final'}: cannot write (No space left on device)" in err and "--resume" in err
    assert not (out / "final").exists() and not (out / "final.tmp").exists() and not (out / "report.json").exists()
    monkeypatch.undo()
    assert run_cli(*args(tiny_llama, data, out, "--save-every", 3), "--resume") == 0
    assert (out / "final" / "model.safetensors").is_file()


def test_an_atomic_write_that_fails_keeps_the_previous_file(tmp_path):
    from doplus_cli.errors import WriteError
    from doplus_cli.files import atomic_write_text

    path = tmp_path / "report.md"
    atomic_write_text(path, "before\n")
    (tmp_path / "report.md.tmp").symlink_to("/dev/full")
    with pytest.raises(WriteError, match=r"report\.md: cannot write \(No space left on device\)"):
        atomic_write_text(path, "after\n")
    assert path.read_text() == "before\n" and not os.path.lexists(tmp_path / "report.md.tmp")
