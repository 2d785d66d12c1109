"""The disk plan of `--dry-run`: how many checkpoints a run holds at once (against the save schedule simulated
here), the bytes of one checkpoint and of final/ (against the files a real run writes), and the bench's count of
runs that fit at once (against byte counts worked out here from the model's parameters)."""

from __future__ import annotations

import json

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
            # --save-minutes: a checkpoint may follow any step before the last, however fast the run
            assert checkpoints_held(steps, 0, keep, save_minutes=10) == simulate(steps, 1, keep), (steps, keep)
    assert checkpoints_held(96, 9, 1) == (2, 1)  # 10 saves, 2 at once for a moment


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
    give 2 runs at once, fewer than --parallel 3 asks for; less than the final models give none."""
    import doplus_cli.engine.memory_plan as memory_plan

    recipe = tmp_path / "bench.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": str(tiny_llama), "forget": str(tofu_dir / "forget01.json"), "retain": "tofu-authors",
        "loss": "NPO+GD", "steps": 4, "eval_every": 2, "eval_suite": "tofu", "eval_data_dir": str(tofu_dir),
        "eval_split": "forget01", "precision": "fp32", "dtype": "float32"}))
    n = parameters(tiny_llama)
    finals, training = 4 * 4 * n, 2 * 28 * n
    for free, words in ((finals + 2.5 * training, "2 runs at once fit (--parallel, --run-index workers)\n"
                                                  "--parallel 3 asks for more runs at once than the disk plan takes "
                                                  "(2)"),
                        (finals - 1, "not even one run at a time fits")):
        monkeypatch.setattr(memory_plan, "free_bytes", lambda path, free=free: int(free))
        capsys.readouterr()
        code = run_cli("bench", "schemes", "--recipe", recipe, "--schemes", "alternate,doplus", "--task-ids", "1,2",
                       "--seeds", "0", "--out", tmp_path / "bench", "--dry-run", "--parallel", 3)
        printed = capsys.readouterr().out
        assert code == 0
        assert (f"alternate {size(2 * 12 * n)}, doplus {size(training)}" in printed
                and f"the 4 runs not done keep {size(finals)}" in printed and words in printed), printed


def test_remove_final_frees_the_final_models_and_the_plan_counts_none(tiny_llama, data, tofu_dir, tmp_path, capsys,
                                                                       monkeypatch):
    """Where the final models of a sweep do not fit, the dry run says how many runs at once --remove-final lets
    through, and with it counts no final model. A run of the bench with it removes its final/ once evaluated, says
    how many bytes went, and the same command skips it (done: its evaluation is what the tables read). Only what
    a run's record lists is removed: a final/ that no record names stays."""
    import doplus_cli.engine.memory_plan as memory_plan
    from doplus_cli.bench.schemes.running import remove_output
    from tests.test_bench_schemes import bench_args, write_recipe

    recipe = write_recipe(tmp_path / "recipe", tiny_llama, data, tofu_dir, steps=4, eval_suite="answers",
                          show_samples=2, eval_data_dir=None, eval_max_samples=None, eval_max_new_tokens=None,
                          save_every=2, precision="fp32", dtype="float32")
    n = parameters(tiny_llama)
    finals, training = 3 * 4 * n, 12 * n  # 3 Joint runs of the lr sweep; one checkpoint (step 2) of weights and AdamW
    monkeypatch.setattr(memory_plan, "free_bytes", lambda path: finals - 1 + training)
    out = tmp_path / "bench"
    arguments = bench_args(recipe, out, "--schemes", "joint", "--seeds", "0", "--sweep", "lr=1e-3,2e-3,4e-3")
    for flag, words in (([], "not even one run at a time fits while every final/ is kept; with --remove-final (each "
                               "run's final/ goes once it is evaluated) 1 at once"),
                        (["--remove-final"], "a run removes its final/ once it is evaluated (--remove-final) and "
                                             "removes its checkpoints when it ends")):
        capsys.readouterr()
        assert run_cli(*arguments, *flag, "--dry-run") == 0
        printed = capsys.readouterr().out
        assert words in printed and f"checkpoints take at most: joint {size(training)};" in printed, printed
    assert "the 3 runs not done keep no model once evaluated" in printed and "1 run at a time fits" in printed

    arguments = bench_args(recipe, out, "--schemes", "joint", "--seeds", "0")
    capsys.readouterr()
    assert run_cli(*arguments, "--remove-final") == 0
    err = capsys.readouterr().err
    run = out / "runs" / "joint-s0"
    assert "joint-s0: removed its final model (" in err and not (run / "final").exists()
    assert "final" in json.loads((run / ".doplus-run.json").read_text())["entries"]
    assert run_cli(*arguments) == 0
    assert "joint-s0: skipped: finished and evaluated" in capsys.readouterr().err
    assert json.loads((out / "SCHEMES.json").read_text())["rows"][0]["scheme"] == "joint"

    stranger = tmp_path / "not-a-run"
    (stranger / "final").mkdir(parents=True)
    (stranger / "final" / "weights.bin").write_bytes(b"mine")
    assert remove_output(stranger, "final") is None and (stranger / "final" / "weights.bin").read_bytes() == b"mine"


@pytest.mark.parametrize(("minutes_a_call", "saved"), [(61, ["step-1", "step-2", "step-3"]), (1, [])])
def test_save_minutes_checkpoints_by_the_clock(tiny_llama, data, tmp_path, monkeypatch, minutes_a_call, saved):
    """--save-minutes 1 with a clock that moves 61 s (or 1 s) at each reading: a checkpoint after every step before
    the last (or none), whatever the steps; a run resumed from one continues to the same final weights."""
    import itertools

    import doplus_cli.engine.loop as loop

    ticks = itertools.count(step=minutes_a_call)
    monkeypatch.setattr(loop, "_clock", lambda: float(next(ticks)))
    out = tmp_path / "run"
    arguments = ["unlearn", "--model", tiny_llama, "--forget", data / "forget.jsonl", "--retain",
                 data / "retain.jsonl", "--loss", "GA+GD", "--steps", 4, "--save-minutes", 1, "--max-length", 32,
                 "--batch-size", 2, "--show-samples", 0]
    assert run_cli(*arguments, "--out", out) == 0
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == saved
    if saved:
        assert run_cli(*arguments, "--out", tmp_path / "resumed", "--resume", out / "checkpoints" / "step-2") == 0
        with safe_open(str(out / "final" / "model.safetensors"), "pt") as a, \
                safe_open(str(tmp_path / "resumed" / "final" / "model.safetensors"), "pt") as b:
            assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())


def test_a_bench_checkpoints_by_time_and_continues_runs_made_with_a_step_cadence(tiny_llama, data, tofu_dir,
                                                                                tmp_path):
    """Without save_every in the recipe or --set, a bench's run saves every 10 minutes, the newest kept. A run
    recipe written with another cadence (an older doplus saved every tenth of the run) is the same experiment; one
    with another learning rate is not."""
    from doplus_cli.bench.schemes.planning import check_out, plan_bench, record_runs
    from doplus_cli.errors import UserError

    recipe = tmp_path / "bench.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": str(tiny_llama), "forget": str(data / "forget.jsonl"), "retain": str(data / "retain.jsonl"),
        "loss": "GA+GD", "steps": 20, "eval_every": 10, "eval_suite": "tofu", "eval_data_dir": str(tofu_dir),
        "eval_split": "forget01"}))
    out = tmp_path / "bench"
    bench = plan_bench(str(recipe), "doplus", "0", str(out), [], None, False)
    (run,) = bench.runs
    assert (run.recipe.get("save_every"), run.recipe["save_minutes"], run.recipe["keep_last"]) == (None, 10, 1)
    given = plan_bench(str(recipe), "doplus", "0", str(tmp_path / "other"), ["save_every=2"], None, False)
    assert (given.runs[0].recipe["save_every"], given.runs[0].recipe.get("save_minutes")) == (2, None)

    out.mkdir()
    record_runs(bench, check_out(bench))
    older = {k: v for k, v in run.recipe.items() if k != "save_minutes"} | {"save_every": 2}
    run.recipe_path.write_text(yaml.safe_dump(older, sort_keys=False))
    check_out(bench)  # no refusal
    run.recipe_path.write_text(yaml.safe_dump(older | {"lr": 0.5}, sort_keys=False))
    with pytest.raises(UserError, match="made from another recipe"):
        check_out(bench)


def test_on_several_processes_the_main_processs_clock_decides(monkeypatch):
    """Each process reads its own clock; the decision is the main process's (broadcast), so that every process
    enters the checkpoint's collective writes at the same step. Here this process's clock says not yet, the main
    process's says due."""
    from types import SimpleNamespace

    import accelerate.utils

    import doplus_cli.engine.loop as loop

    sent = []

    def broadcast(values):  # what the main process sent, as accelerate hands it to every process
        sent.append(list(values))
        return [True]

    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", broadcast)
    monkeypatch.setattr(loop, "_clock", lambda: 100.0)
    config = SimpleNamespace(save_every=0, save_minutes=1)
    two = SimpleNamespace(accelerator=SimpleNamespace(num_processes=2))
    one = SimpleNamespace(accelerator=SimpleNamespace(num_processes=1))
    assert loop._save_due(one, config, 5, saved_at=90.0) is False  # 10 s of the 60 on this process's clock
    assert loop._save_due(two, config, 5, saved_at=90.0) is True and sent == [[False]]
    assert loop._save_due(two, SimpleNamespace(save_every=5, save_minutes=1), 5, saved_at=90.0) is True
    assert len(sent) == 1  # a step cadence needs no clock, and no broadcast


def test_the_grid_disk_plan_works_out_the_embedded_model(tofu_dir, tmp_path, capsys):
    """A recipe without `model` trains the embedded SmolLM2-135M-Instruct (no model name: None): its architecture
    is read from the GGUF's metadata, so the disk plan is worked out, at the bench's start as in its dry run. Its
    134,515,008 parameters (the tied table once) in float32 make a final/ of 538,060,032 bytes."""
    from doplus_cli.bench.schemes import list_grid, plan, planned_disk, starting_architecture

    recipe = tmp_path / "bench.yaml"
    recipe.write_text(yaml.safe_dump({
        "forget": str(tofu_dir / "forget01.json"), "retain": "tofu-authors", "loss": "NPO+GD", "steps": 4,
        "eval_every": 2, "eval_suite": "tofu", "eval_data_dir": str(tofu_dir), "eval_split": "forget01",
        "precision": "fp32", "dtype": "float32"}))
    capsys.readouterr()
    assert run_cli("bench", "schemes", "--recipe", recipe, "--schemes", "joint", "--task-ids", "1", "--seeds", "0",
                   "--out", tmp_path / "bench", "--dry-run") == 0
    assert f"the 1 run not done keeps {538_060_032 / 2 ** 20:.2f} MiB" in capsys.readouterr().out
    bench = plan(str(recipe), "joint", "0", str(tmp_path / "bench"), [], None, False, "1")
    model, readable = starting_architecture(bench)
    assert (model, readable) == (None, True)
    words, workers = planned_disk(bench, list_grid(bench), model, readable, False)
    assert "not worked out" not in words and workers is not None and workers >= 0
