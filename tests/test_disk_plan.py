"""The disk plan of `--dry-run`: how many checkpoints a run holds at once (against the save schedule simulated
here), the bytes of one checkpoint and of final/ (against the files a real run writes), and the bench's count of
runs that fit at once (against byte counts worked out here from the model's parameters)."""

from __future__ import annotations

import pytest
import torch
import yaml
from safetensors import safe_open

from tests.helpers import run_cli, write_sets


def simulate(steps: int, every: int, keep: int | None) -> tuple[int, int]:
    """(the most checkpoints on disk at once, those left at the end): a save after every `every`-th step before
    the last; --keep-last K >= 2 drops the oldest before a save, K = 1 drops the older one after it."""
    on_disk: list[int] = []
    most = 0
    for step in range(1, steps + 1):
        if every and step % every == 0 and step < steps:
            if keep is not None and keep >= 2:
                while len(on_disk) >= keep:
                    on_disk.pop(0)
            on_disk.append(step)
            most = max(most, len(on_disk))
            if keep == 1:
                del on_disk[:-1]
    return most, len(on_disk)


def test_checkpoints_held_follow_the_save_schedule():
    from doplus_cli.engine.memory_plan import checkpoints_held

    for steps in (1, 2, 5, 9, 10, 11, 96):
        for every in (0, 1, 3, 9, 10):
            for keep in (None, 1, 2, 3):
                assert checkpoints_held(steps, every, keep) == simulate(steps, every, keep), (steps, every, keep)
    assert checkpoints_held(96, 9, 1) == (2, 1)  # the bench's default for 96 steps: 10 saves, 2 at once


@pytest.fixture(scope="module")
def data(tofu_dir, tmp_path_factory):
    return write_sets(tofu_dir, tmp_path_factory.mktemp("disk-plan-data"), 6, 8)


def parameters(model_folder) -> int:
    """The model's parameters, tied tables once, as transformers loads them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_folder)
    return sum(p.numel() for p in model.parameters())


def tensors_bytes(path) -> tuple[int, int]:
    """(elements' bytes, tensors) in a safetensors file or a torch file, read with their own readers."""
    if path.suffix == ".safetensors":
        with safe_open(str(path), "pt") as handle:
            found = [handle.get_tensor(k) for k in handle.keys()]
    else:
        state = torch.load(path, map_location="cpu", weights_only=False)
        found = []

        def walk(value):
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, dict):
                for item in value.values():
                    walk(item)
            elif isinstance(value, (list, tuple)):
                for item in value:
                    walk(item)

        walk(state)
    return sum(t.numel() * t.element_size() for t in found), len(found)


@pytest.mark.parametrize("scheme", ["alternate", "doplus"])
def test_a_runs_checkpoints_and_final_match_its_plan(tiny_llama, data, tmp_path, capsys, scheme):
    """A run of 7 steps saving every 2 keeps 3 checkpoints. Each holds the trained weights (4 bytes a parameter)
    and the optimizer states (AdamW 2, DualOptim+ 6 float32 values a parameter: base and a delta per objective);
    the files hold those bytes and, per tensor, a small header."""
    out = tmp_path / "run"
    arguments = ["unlearn", "--model", tiny_llama, "--forget", data / "forget.jsonl", "--retain",
                 data / "retain.jsonl", "--loss", "GA+GD", "--scheme", scheme, "--steps", 7, "--save-every", 2,
                 "--max-length", 32, "--batch-size", 2, "--show-samples", 0, "--precision", "fp32", "--dtype",
                 "float32"]
    capsys.readouterr()
    assert run_cli(*arguments, "--out", tmp_path / "plan", "--dry-run") == 0
    printed = capsys.readouterr().out
    assert "a checkpoint every 2 steps" in printed and "up to 3 on disk at once" in printed, printed
    assert run_cli(*arguments, "--out", out) == 0
    n = parameters(tiny_llama)
    states = {"alternate": 2, "doplus": 6}[scheme]
    checkpoints = sorted((out / "checkpoints").glob("step-*"))
    assert [c.name for c in checkpoints] == ["step-2", "step-4", "step-6"]
    for checkpoint in checkpoints:
        weights, weight_tensors = tensors_bytes(checkpoint / "model.safetensors")
        optimizer, optimizer_tensors = tensors_bytes(checkpoint / "optimizer.pt")
        assert weights == 4 * n
        # the states, and the step counters: one per AdamW parameter, or per state (scalars of 8 bytes at most)
        assert states * 4 * n <= optimizer <= states * 4 * n + 8 * optimizer_tensors
        on_disk = (checkpoint / "model.safetensors").stat().st_size + (checkpoint / "optimizer.pt").stat().st_size
        assert 4 * n + states * 4 * n <= on_disk <= 4 * n + states * 4 * n + 4096 * (weight_tensors + optimizer_tensors)
    final = (out / "final" / "model.safetensors").stat().st_size
    assert 4 * n <= final <= 4 * n + 4096 * weight_tensors

    from doplus_cli.commands import command_for
    from doplus_cli.commands.unlearn import UnlearnConfig
    from doplus_cli.config import resolve_config
    from doplus_cli.engine.memory_plan import build_plan, disk_plan, model_plan

    config = resolve_config(None, {"model": str(tiny_llama), "forget": str(data / "forget.jsonl"),
                                   "retain": str(data / "retain.jsonl"), "loss": "GA+GD", "scheme": scheme,
                                   "steps": 7, "save_every": 2, "precision": "fp32", "dtype": "float32"},
                            UnlearnConfig)
    run = command_for(config)
    disk = disk_plan(config, build_plan(config, model_plan(config, run), run, cuda=False), 7)
    assert (disk.final, disk.checkpoint, disk.held, disk.kept) == (4 * n, (1 + states) * 4 * n, 3, 3)
    assert disk.peak == 3 * (1 + states) * 4 * n + 4 * n


def size(count: int) -> str:
    """The tiny model's sizes as the plan writes them: KiB below a MiB, MiB below a GiB."""
    assert 2 ** 10 <= count < 2 ** 30, count
    return f"{count / 2 ** 10:.2f} KiB" if count < 2 ** 20 else f"{count / 2 ** 20:.2f} MiB"


def test_the_bench_dry_run_says_how_many_runs_fit_at_once(tiny_llama, tofu_dir, tmp_path, capsys, monkeypatch):
    """4 steps: the bench saves every step with --keep-last 1, so a DualOptim+ run holds 2 checkpoints of 28 bytes
    a parameter at once (weights 4, states 24) and an Alternate run 2 of 12; each keeps final/ (4 bytes a
    parameter). The free space is set: the final models of the 4 runs and room for 2.5 DualOptim+ runs' checkpoints
    give 2 runs at once; less than the final models give none."""
    import doplus_cli.engine.memory_plan as memory_plan

    recipe = tmp_path / "bench.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": str(tiny_llama), "forget": str(tofu_dir / "forget01.json"), "retain": "tofu-authors",
        "loss": "NPO+GD", "steps": 4, "eval_every": 2, "eval_suite": "tofu", "eval_data_dir": str(tofu_dir),
        "eval_split": "forget01", "precision": "fp32", "dtype": "float32"}))
    n = parameters(tiny_llama)
    finals, training = 4 * 4 * n, 2 * 28 * n
    for free, words in ((finals + 2.5 * training, "2 runs at once fit (--run-index workers)"),
                        (finals - 1, "not even one run at a time fits")):
        monkeypatch.setattr(memory_plan, "free_bytes", lambda path, free=free: int(free))
        capsys.readouterr()
        code = run_cli("bench", "schemes", "--recipe", recipe, "--schemes", "alternate,doplus", "--task-ids", "1,2",
                       "--seeds", "0", "--out", tmp_path / "bench", "--dry-run")
        printed = capsys.readouterr().out
        assert code == 0
        assert (f"alternate {size(2 * 12 * n)}, doplus {size(training)}" in printed
                and f"the 4 runs not done keep {size(finals)}" in printed and words in printed), printed
