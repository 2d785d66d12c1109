"""Checkpoints that prove they are intact, a resumption that notices changed inputs, and no non-finite weights
saved: a damaged checkpoint (cut short, a flipped bit, an unreadable manifest) is passed over by `--resume` and
named in one line when asked for; saved states that do not fit are one line; a checkpoint without a manifest
resumes only with --accept-unverified; an edited data file, model file or library version is refused unless
accepted; a NaN after a step stops the run before anything saves it."""

from __future__ import annotations

import hashlib
import json
import shutil
from importlib import metadata

import pytest
import torch
from safetensors.torch import load_file

from doplus_cli import ownership
from doplus_cli.engine import checkpoint as ckpt
from doplus_cli.engine import inputs
from doplus_cli.errors import UserError
from tests.helpers import run_cli, weights, write_jsonl, write_sets


@pytest.fixture(scope="module")
def data(tofu_dir, tmp_path_factory):
    return write_sets(tofu_dir, tmp_path_factory.mktemp("integrity-data"), 10, 16)


def args(model, forget, retain, out, steps, *extra):
    return ["unlearn", "--model", model, "--forget", forget, "--retain", retain, "--loss", "NPO+GD",
            "--steps", steps, "--lr", 1e-3, "--batch-size", 2, "--max-length", 48, "--show-samples", 0,
            "--out", out, *extra]


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def same_weights(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def last_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_the_manifest_lists_every_file_with_its_size_and_sha256(tiny_llama, data, tmp_path):
    out = tmp_path / "run"
    assert run_cli(*args(tiny_llama, data / "forget.jsonl", data / "retain.jsonl", out, 2, "--save-every", 1)) == 0
    step = out / "checkpoints" / "step-1"
    manifest = json.loads((step / "manifest.json").read_text())
    on_disk = {p.name for p in step.iterdir() if p.name != "manifest.json"}
    assert set(manifest["files"]) == on_disk  # nothing left out, nothing listed that is not there
    for name, entry in manifest["files"].items():  # hashlib over the whole file, not the code under test
        assert entry == {"size": (step / name).stat().st_size, "sha256": sha256(step / name)}
    assert manifest["format"] == ckpt.MANIFEST_FORMAT and manifest["step"] == 1
    assert manifest["world_size"] == 1 and manifest["precision"] == "fp32"
    assert manifest["software"]["torch"] == metadata.version("torch")  # the installed distribution's version
    recorded = json.loads((out / "inputs.json").read_text())
    assert manifest["inputs"] == recorded
    assert recorded["data"]["forget"]["sha256"] == sha256(data / "forget.jsonl")
    assert recorded["data"]["forget"]["rows"] == 10 and recorded["data"]["retain"]["rows"] == 16
    assert recorded["model"]["files"]["model.safetensors"]["sha256"] == sha256(tiny_llama / "model.safetensors")


def test_a_damaged_checkpoint_is_named_in_one_line_and_latest_falls_back_to_an_intact_one(
        tiny_llama, data, tmp_path, capsys):
    """One run writes step-2 and step-4 and is the uninterrupted reference; its step-4 then gets a flipped bit, its
    step-2 a truncated file, each resumed by name and as `latest`."""
    out, whole = tmp_path / "run", tmp_path / "whole"
    run = args(tiny_llama, data / "forget.jsonl", data / "retain.jsonl", out, 6, "--save-every", 2)
    assert run_cli(*run) == 0
    shutil.move(out / "final", whole)
    (out / "report.json").unlink()
    step2, step4 = out / "checkpoints" / "step-2", out / "checkpoints" / "step-4"
    saved_step2 = tmp_path / "step-2-intact"
    shutil.copytree(step2, saved_step2)

    flipped = step4 / "model.safetensors"
    raw = bytearray(flipped.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit in the middle of the weights: the size is unchanged
    flipped.write_bytes(bytes(raw))
    capsys.readouterr()
    assert run_cli(*run, "--resume", step4) == 2
    lines = last_lines(capsys)
    assert len(lines) == 1 and str(flipped) in lines[0] and "contents changed" in lines[0], lines

    cut = step2 / "optimizer.pt"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    assert run_cli(*run, "--resume", step2) == 2
    lines = last_lines(capsys)
    assert len(lines) == 1 and str(cut) in lines[0] and "truncated" in lines[0], lines
    assert run_cli(*run, "--resume") == 2  # latest: neither is intact
    lines = last_lines(capsys)
    assert len(lines) == 1 and "no intact checkpoint" in lines[0] and str(flipped) in lines[0], lines

    shutil.rmtree(step2)
    shutil.copytree(saved_step2, step2)
    assert run_cli(*run, "--resume") == 0  # latest: step-4 passed over for step-2, and the run ends as the whole one
    err = capsys.readouterr().err
    passed = [line for line in err.splitlines() if "passed over" in line]
    assert len(passed) == 1 and str(flipped) in passed[0] and str(step2) in passed[0], err
    assert f"resuming from {step2} at step 2" in err
    assert same_weights(load_file(str(whole / "model.safetensors")), weights(out))

    (out / "report.json").unlink()  # unfinished again: a finished run is not resumed
    (step2 / "manifest.json").write_text('{"format": 1, "files": ')  # cut short: unreadable
    assert run_cli(*run, "--resume", step2) == 2
    lines = last_lines(capsys)
    assert len(lines) == 1 and "manifest.json: unreadable manifest" in lines[0], lines


def test_a_checkpoint_without_a_manifest_is_refused_unless_accepted_unverified(tiny_llama, data, tmp_path, capsys):
    """What a doplus that wrote no manifest, no inputs.json and no record of its files left (0.1 and 0.2): resumed
    only with --accept-unverified, which takes the folder on; without it, a byte-flipped file whose manifest was
    deleted would be trained on, so it is refused, by name and as `latest`."""
    out, whole = tmp_path / "run", tmp_path / "whole"
    run = args(tiny_llama, data / "forget.jsonl", data / "retain.jsonl", out, 4, "--save-every", 2)
    assert run_cli(*run) == 0
    shutil.move(out / "final", whole)
    (out / "report.json").unlink()
    step2 = out / "checkpoints" / "step-2"
    (step2 / "manifest.json").unlink()
    (out / "inputs.json").unlink()
    (out / ownership.RECORD_NAME).unlink()
    capsys.readouterr()
    for resume in (step2, "latest"):
        assert run_cli(*run, "--resume", resume) == 2
        lines = last_lines(capsys)
        assert len(lines) == 1 and f"{step2}: has no manifest.json" in lines[0], lines
        assert "--accept-unverified" in lines[0], lines
    assert run_cli(*run, "--resume", step2, "--accept-unverified") == 0
    err = capsys.readouterr().err
    assert "written without a manifest.json, so its files could not be verified" in err
    assert "inputs were not recorded" in err
    assert "a run written before doplus recorded its files" in err
    assert same_weights(load_file(str(whole / "model.safetensors")), weights(out))
    assert (out / "inputs.json").is_file()  # recorded for the checkpoints that follow
    assert "final" in ownership.read(out)["entries"]  # taken on: --overwrite now replaces what the run wrote


def test_saved_weights_or_optimizer_states_that_do_not_fit_are_one_line(tmp_path):
    """Missing and unexpected names and another shape, in the weights and in the optimizer's states."""
    def parts(model):
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.ones(1, model.in_features)).sum().backward()
        optimizer.step()
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    saved = ckpt.save_checkpoint(tmp_path, 1, *parts(torch.nn.Linear(3, 2)), {}, {}, [], {}, 0)

    class Renamed(torch.nn.Module):  # `weight` and `bias` under other names
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(3, 2)
            self.in_features = 3

        def forward(self, x):
            return self.inner(x)

    for model, expected in ((Renamed(), "lacks 2 of this run's parameters (e.g. inner.weight) and holds 2 this run "
                                        "does not train (e.g. bias)"),
                            (torch.nn.Linear(4, 2), "weight has shape (2, 3), this run's has (2, 4)")):
        with pytest.raises(UserError) as error:
            ckpt.load_checkpoint(saved, *parts(model), {})
        assert str(saved / "model.safetensors") in str(error.value) and expected in str(error.value)
        assert "\n" not in str(error.value)

    model, optimizer, scheduler = parts(torch.nn.Linear(3, 2))
    intact = (saved / "optimizer.pt").read_bytes()
    state = torch.load(saved / "optimizer.pt", weights_only=True)
    state["state"][0]["exp_avg"] = torch.zeros(5, 7)  # a moment of another shape
    torch.save(state, saved / "optimizer.pt")
    with pytest.raises(UserError, match=r"optimizer\.pt: the optimizer state 'exp_avg' has shape \(5, 7\) for a "
                                         r"parameter of shape \(2, 3\)"):
        ckpt.load_checkpoint(saved, model, optimizer, scheduler, {})
    state["param_groups"][0]["params"] = [0]  # one parameter where the optimizer has two
    torch.save(state, saved / "optimizer.pt")
    with pytest.raises(UserError, match=r"optimizer\.pt: does not fit this run's optimizer \(ValueError"):
        ckpt.load_checkpoint(saved, model, optimizer, scheduler, {})
    (saved / "optimizer.pt").write_bytes(intact)
    (saved / "state.json").write_text(json.dumps({**json.loads((saved / "state.json").read_text()), "streams": {}}))
    stream = type("Stream", (), {"size": 4, "load_state_dict": lambda self, s: None})()
    with pytest.raises(UserError, match="no data position for the objective 'forget'"):
        ckpt.load_checkpoint(saved, *parts(torch.nn.Linear(3, 2)), {"forget": stream})


def test_changed_data_model_or_software_is_refused_on_resume_and_accepted_with_the_flag(
        tiny_llama, data, tmp_path, capsys, monkeypatch):
    forget, model = tmp_path / "forget.jsonl", tmp_path / "model"
    shutil.copy(data / "forget.jsonl", forget)
    shutil.copytree(tiny_llama, model)
    out = tmp_path / "run"
    run = args(model, forget, data / "retain.jsonl", out, 4, "--save-every", 2)
    assert run_cli(*run) == 0
    step2 = out / "checkpoints" / "step-2"
    shutil.rmtree(out / "final")
    (out / "report.json").unlink()

    rows = [json.loads(line) for line in forget.read_text().splitlines()]
    rows[3]["answer"] = rows[3]["answer"] + " Edited."
    write_jsonl(forget, rows)  # in place, the same 10 rows
    generation = model / "generation_config.json"
    generation.write_text(generation.read_text() + "\n")
    capsys.readouterr()
    assert run_cli(*run, "--resume") == 2
    lines = last_lines(capsys)
    assert len(lines) == 1, lines
    assert f"data: forget {forget} (edited, same 10 rows)" in lines[0]
    assert "model: model generation_config.json" in lines[0] and "--accept-changed data,model" in lines[0]

    real = inputs.software_versions
    monkeypatch.setattr(inputs, "software_versions", lambda: {**real(), "torch": "9.9.9"})
    assert run_cli(*run, "--resume", "--accept-changed", "data") == 2  # model and software are still refused
    lines = last_lines(capsys)
    assert len(lines) == 1 and f"software: torch {metadata.version('torch')} -> 9.9.9" in lines[0], lines
    assert "data:" not in lines[0] and "--accept-changed model,software" in lines[0]
    assert run_cli(*run, "--resume", step2, "--accept-changed", "data,model,software") == 0
    err = capsys.readouterr().err
    assert "resuming on changed inputs, accepted with --accept-changed" in err and "edited, same 10 rows" in err
    # the accepted inputs are the run's from now on: a later checkpoint records them
    assert json.loads((out / "inputs.json").read_text())["data"]["forget"]["sha256"] == sha256(forget)
    # the model card's command reproduces the run from the start, where no change is there to accept
    card = (out / "final" / "README.md").read_text()
    assert "--lr" in card and "--accept-changed" not in card


def test_a_file_edited_with_its_modification_time_set_back_is_hashed_again(tmp_path, monkeypatch):
    """The recorded hash is reused only for a file with the recorded size, inode, mtime and ctime, changed well
    before it was hashed; an edit that keeps the size and sets the mtime back still changes the ctime, which no user
    tool sets back."""
    import os
    import time

    data = tmp_path / "forget.jsonl"
    data.write_text('{"question": "q", "answer": "a"}\n' * 3)
    recorded = inputs.describe_file(data, rows=True)
    assert recorded["sha256"] == sha256(data) and recorded["rows"] == 3
    # changed less than 2 s before it was hashed: hashed again (a later hashing time), the same contents
    again = inputs.describe_file(data, recorded, rows=True)
    assert again["hashed_at_ns"] > recorded["hashed_at_ns"] and again["sha256"] == recorded["sha256"]
    monkeypatch.setattr(inputs, "_RACY_NS", 0)  # as if the file had been hashed long after its last change
    assert inputs.describe_file(data, recorded, rows=True) == recorded  # not written since: its record stands
    before = data.stat()
    time.sleep(0.05)  # a later ctime, even on a file system with a coarse clock
    data.write_text('{"question": "q", "answer": "b"}\n' * 3)  # same size
    os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert data.stat().st_size == before.st_size and data.stat().st_mtime_ns == before.st_mtime_ns
    now = inputs.describe_file(data, recorded, rows=True)
    assert now["sha256"] == sha256(data) != recorded["sha256"]
    assert inputs.changes({"data": {"forget": recorded}}, {"data": {"forget": now}}) == {
        "data": [f"forget {data} (edited, same 3 rows)"]}


def test_accept_changed_is_checked_before_anything_runs(tiny_llama, data, tmp_path, capsys):
    run = args(tiny_llama, data / "forget.jsonl", data / "retain.jsonl", tmp_path / "run", 2)
    for extra, said in ((["--accept-changed", "data"], "--accept-changed applies to a resumed run: add --resume"),
                        (["--resume", "--accept-changed", "data,weights"],
                         "--accept-changed data,weights: unknown kind 'weights' (choose from data, model, software")):
        capsys.readouterr()
        assert run_cli(*run, *extra) == 2
        lines = last_lines(capsys)
        assert len(lines) == 1 and said in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_a_shrunk_multitask_file_is_refused_and_resumes_once_accepted(tiny_llama, tmp_path, capsys):
    rows = [{"prompt": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(16)]
    task = write_jsonl(tmp_path / "sums.jsonl", rows)
    out = tmp_path / "run"
    run = ["multitask", "--model", tiny_llama, "--task", f"sums={task},metric=exact", "--task",
           f"copy={write_jsonl(tmp_path / 'copy.jsonl', rows)},metric=exact", "--steps", 6, "--lr", 1e-3,
           "--batch-size", 4, "--max-length", 32, "--max-new-tokens", 2, "--eval-rows", 2, "--out", out,
           "--save-every", 4]
    assert run_cli(*run) == 0
    shutil.rmtree(out / "final")
    (out / "report.json").unlink()
    write_jsonl(task, rows[:9])  # 16 -> 9 rows: the saved data position is past the new end of the file
    capsys.readouterr()
    assert run_cli(*run, "--resume") == 2
    lines = last_lines(capsys)
    assert len(lines) == 1 and f"data: task sums data {task} (16 -> 9 rows)" in lines[0], lines
    assert run_cli(*run, "--resume", "--accept-changed", "data") == 0
    assert json.loads((out / "report.json").read_text())["status"] == "completed"


def _poison_after(step_to_poison: int, what: str, monkeypatch):
    """The optimizer step, then a NaN written into the first trainable weight or its first moment after step N."""
    from doplus_cli.optim import DualOptimPlus

    real = DualOptimPlus.step
    taken = {"n": 0}

    def step(self, *a, **k):
        result = real(self, *a, **k)
        taken["n"] += 1
        if taken["n"] == step_to_poison:
            param = self.param_groups[0]["params"][0]
            with torch.no_grad():
                if what == "weight":
                    param.view(-1)[3] = float("nan")
                else:
                    next(v for v in self.state[param].values() if torch.is_tensor(v) and v.numel() > 1
                         ).view(-1)[3] = float("inf")
        return result

    monkeypatch.setattr(DualOptimPlus, "step", step)


def test_a_nan_in_the_weights_after_the_last_step_stops_the_run_without_final(
        tiny_llama, data, tmp_path, capsys, monkeypatch):
    """A non-finite update on the last step (a bf16 or 8-bit overflow): once saved as final/ and "completed"."""
    out = tmp_path / "nan"
    _poison_after(4, "weight", monkeypatch)
    capsys.readouterr()
    assert run_cli(*args(tiny_llama, data / "forget.jsonl", data / "retain.jsonl", out, 4, "--save-every", 2)) == 1
    lines = last_lines(capsys)
    assert "step 4: non-finite values after the optimizer step: weight model.embed_tokens.weight holds 1 NaN" in \
        lines[-1] and "checkpoints/step-2" in lines[-1], lines
    assert not (out / "final").exists() and not (out / "report.json").exists()
    assert [p.name for p in ckpt.list_checkpoints(out / "checkpoints")] == ["step-2"]
    kept = load_file(str(out / "checkpoints" / "step-2" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in kept.values())


def test_an_infinite_optimizer_state_is_never_saved_in_a_checkpoint(tiny_llama, data, tmp_path, capsys, monkeypatch):
    out = tmp_path / "inf"
    _poison_after(2, "state", monkeypatch)  # the weights stay finite; the save after step 2 finds the state
    capsys.readouterr()
    assert run_cli(*args(tiny_llama, data / "forget.jsonl", data / "retain.jsonl", out, 6, "--save-every", 1)) == 1
    lines = last_lines(capsys)
    assert "step 2: non-finite values after the optimizer step: optimizer state state.model.embed_tokens.weight." \
        in lines[-1] and "holds 1 infinite" in lines[-1] and "checkpoints/step-1" in lines[-1], lines
    assert [p.name for p in ckpt.list_checkpoints(out / "checkpoints")] == ["step-1"]
    assert not (out / "final").exists() and not (out / "report.json").exists()


def test_the_state_shape_check_reads_through_the_shared_state_wrapper_and_passes_8bit_block_scales(tmp_path):
    """Alternate and Joint hand the loop a wrapper around one torch optimizer; 8-bit states keep one absmax per
    block of 256 elements, so a 1-D weight of 4096 elements has a (16,) absmax beside its (4096,) codes."""
    from doplus_cli.engine.optimizers import SharedState
    from doplus_cli.optim import DualOptimPlus

    weight = torch.nn.Parameter(torch.ones(4096))
    optimizer = DualOptimPlus([weight], lr=0.1, objectives=("forget", "retain"), state_bits=8)
    weight.grad = torch.full_like(weight, 0.5)
    optimizer.step(objective="forget")
    absmax = [key for key, value in optimizer.state[weight].items() if "absmax" in key and value.shape == (16,)]
    assert absmax  # the case the check must pass: block scales of another length than the weight
    ckpt.check_optimizer_shapes(tmp_path / "optimizer.pt", optimizer)

    linear = torch.nn.Linear(3, 2)
    inner = torch.optim.AdamW(linear.parameters(), lr=0.1)
    linear(torch.ones(1, 3)).sum().backward()
    inner.step()
    wrapped = SharedState(inner)
    ckpt.check_optimizer_shapes(tmp_path / "optimizer.pt", wrapped)
    inner.state[linear.weight]["exp_avg"] = torch.zeros(5, 7)
    with pytest.raises(UserError, match=r"the optimizer state 'exp_avg' has shape \(5, 7\)"):
        ckpt.check_optimizer_shapes(tmp_path / "optimizer.pt", wrapped)


def test_the_finite_probe_reduces_each_device_apart_and_finds_a_nan_or_an_infinity():
    """On a GPU an optimizer's state dict holds CUDA moments beside the CPU step counters of torch's AdamW: the probe
    reduces each device's tensors where they are and lands on the accelerator. The meta device stands in for the
    accelerator here (it carries no values, only where the result lands); tests/test_cuda.py checks it with values."""
    cpu = [torch.ones(3), torch.tensor(2.0), torch.arange(4)]  # an integer tensor is left out
    assert ckpt.all_finite(cpu)
    assert not ckpt.all_finite(cpu + [torch.tensor([1.0, float("nan")])])
    assert not ckpt.all_finite([torch.tensor(float("-inf"))] + cpu)
    probe = ckpt.finite_probe([torch.tensor(1.0), torch.empty(4, device="meta"), torch.ones(2)])
    assert probe.device.type == "meta" and probe.dtype == torch.float32
    assert ckpt.finite_probe([torch.arange(3)]).device.type == "cpu"
