"""A write that fails (disk full, a place that cannot be written) ends a command with one line naming the path
and exit code 2, leaves nothing half-written that looks finished, and the same command run again goes on.

A full disk is real here where it can be: /dev/full answers every write with ENOSPC. A checkpoint's full disk
is torch.save's own error for it ("PytorchStreamWriter failed writing file ...: file write failed"), raised at
the second checkpoint."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

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


class FullDisk:
    """A disk that fills up at one chosen write point of a run: every file the run opens for writing under `root`
    (through Python's open, as json, yaml, torch.save into a file, matplotlib and the tokenizer's files do) and
    every safetensors file it writes is a write point, named by its path under `root` with step numbers as N.
    At the chosen point the write fails as it does on a full disk: Python's OSError ENOSPC from the file's write
    (torch.save carries it as the context of its own RuntimeError), safetensors' SafetensorError with Rust's
    "os error 28". With no point chosen it only lists the points, in the order the run meets them."""

    def __init__(self, root: Path, fail_at: str | None = None) -> None:
        self.root, self.fail_at, self.points, self.failed = str(root), fail_at, [], False

    def hit(self, path) -> bool:
        path = os.fspath(path)
        if not path.startswith(self.root) or os.path.basename(path).startswith(".doplus"):
            return False  # outside the run's folder, or the folder's lock and record
        point = re.sub(r"\d+", "N", os.path.relpath(path, self.root))
        if point not in self.points:
            self.points.append(point)
        if point == self.fail_at and not self.failed:
            self.failed = True
            return True
        return False

    def install(self, monkeypatch) -> None:
        import builtins
        import io

        from safetensors import SafetensorError
        from transformers import modeling_utils

        real_open, disk = builtins.open, self

        class Full:
            """The open file, whose writes find no space."""

            def __init__(self, handle):
                self._handle = handle

            def write(self, data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            writelines = write

            def __getattr__(self, name):
                return getattr(self._handle, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self._handle.close()

            def __iter__(self):
                return iter(self._handle)

        def open_(file, mode="r", *a, **k):
            handle = real_open(file, mode, *a, **k)
            if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+") and disk.hit(file):
                return Full(handle)
            return handle

        def safetensors_writer(real):
            def save(tensors, filename, *a, **k):
                if disk.hit(filename):
                    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
                return real(tensors, filename, *a, **k)
            return save

        monkeypatch.setattr(builtins, "open", open_)
        monkeypatch.setattr(io, "open", open_)
        monkeypatch.setattr(checkpoint, "save_file", safetensors_writer(checkpoint.save_file))
        monkeypatch.setattr(modeling_utils, "safe_save_file", safetensors_writer(modeling_utils.safe_save_file))


def test_a_full_disk_at_every_write_point_of_a_run_is_one_line_and_leaves_nothing_that_looks_finished(
        tiny_llama, data, tmp_path, capsys, monkeypatch):
    """A run with a checkpoint, an evaluation curve's folder, final/, the model card and the report is first
    listed write point by write point; then, for each point, the same run on a disk that fills up there ends with
    one line naming the file and the full disk (exit code 2, no traceback), with no `.tmp` left, no report.json,
    and every checkpoint on disk intact (its manifest verifies)."""
    run = ["--steps", 3, "--save-every", 2, "--keep-last", 1]
    listing = FullDisk(tmp_path / "listed")
    with monkeypatch.context() as patch:
        listing.install(patch)
        assert run_cli(*args(tiny_llama, data, tmp_path / "listed", *run)) == 0
    points = listing.points
    for expected in ("config.yaml.tmp", "inputs.json.tmp", "metrics.jsonl", "checkpoints/.step-N.tmp/model.safetensors",
                     "checkpoints/.step-N.tmp/optimizer.pt", "checkpoints/.step-N.tmp/manifest.json.tmp",
                     "final.tmp/model.safetensors", "final/README.md.tmp", "report.json.tmp", "report.md.tmp"):
        assert expected in points, points
    for index, point in enumerate(points):
        out = tmp_path / f"full-{index}"
        disk = FullDisk(out, fail_at=point)
        capsys.readouterr()
        with monkeypatch.context() as patch:
            disk.install(patch)
            code = run_cli(*args(tiny_llama, data, out, *run))
        assert disk.failed, point
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, (point, err[-2000:])
        assert "No space left on device" in lines[0] and str(out) in lines[0], (point, lines[0])
        leftovers = [str(p.relative_to(out)) for p in out.rglob("*") if ".tmp" in p.name]
        assert not leftovers, (point, leftovers)
        assert not (out / "report.json").exists(), point
        for step in list_checkpoints(out / "checkpoints"):
            checkpoint.verify_checkpoint(step)
