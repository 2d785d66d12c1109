"""The update-similarity diagnostic (paper Figure 2): cosines against float64 references written here, and the
two cases the paper's argument rests on: DualOptim with orthogonal gradients gives orthogonal updates, one
shared AdamW state with identical gradients gives parallel ones."""

import json
import math

import numpy as np
import pytest
import torch

from doplus_cli.config import TrainConfig
from doplus_cli.engine.loop import optimizer_settings
from doplus_cli.engine.optimizers import build_optimizer
from doplus_cli.engine.schedule import JOINT
from doplus_cli.engine.similarity import UpdateSimilarity


def _cos(a, b):
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    return float(a @ b / math.sqrt((a @ a) * (b @ b)))


def test_cosines_equal_a_float64_reference_over_several_parameters():
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4, generator=generator)), torch.nn.Parameter(torch.randn(5))]
    tracker = UpdateSimilarity(params, ("forget", "retain"))
    moves, grads = {}, {}
    for name in ("forget", "retain"):
        grads[name] = [torch.randn(p.shape, generator=generator) for p in params]
        moves[name] = [torch.randn(p.shape, generator=generator) for p in params]
        for p, g in zip(params, grads[name]):
            p.grad = g.clone()
        tracker.before_step(name)
        with torch.no_grad():
            for p, m in zip(params, moves[name]):
                p.add_(m)
        record = tracker.after_step(name)
        if name == "forget":  # the retain objective has not stepped yet
            assert record == {"update_cosine": None, "grad_cosine": None}
    flat = {k: np.concatenate([t.numpy().ravel() for t in v]) for k, v in moves.items()}
    flat_g = {k: np.concatenate([t.numpy().ravel() for t in v]) for k, v in grads.items()}
    assert record["update_cosine"] == pytest.approx(_cos(flat["forget"], flat["retain"]), abs=1e-6)
    # products in the weights' dtype (float32), sums in float64: a cosine to about 1e-7
    assert record["grad_cosine"] == pytest.approx(_cos(flat_g["forget"], flat_g["retain"]), abs=1e-6)
    assert tracker.after_step(JOINT) == {"update_cosine": None, "grad_cosine": None}


def test_three_objectives_average_the_three_pairs():
    p = torch.nn.Parameter(torch.zeros(2))
    tracker = UpdateSimilarity([p], ("a", "b", "c"))
    directions = {"a": [1.0, 0.0], "b": [1.0, 1.0], "c": [0.0, 1.0]}
    for name, d in directions.items():
        p.grad = torch.tensor(d)
        tracker.before_step(name)
        with torch.no_grad():
            p.add_(torch.tensor(d))
        record = tracker.after_step(name)
    expected = (1 / math.sqrt(2) + 0.0 + 1 / math.sqrt(2)) / 3  # (a,b), (a,c), (b,c)
    assert record["update_cosine"] == pytest.approx(expected, abs=1e-7)
    assert record["grad_cosine"] == pytest.approx(expected, abs=1e-7)


def _run(scheme, gradient_of, steps=12):
    model = torch.nn.Linear(4, 4, bias=False)
    config = TrainConfig(scheme=scheme, lr=1e-2, weight_decay=0.0)
    optimizer, _ = build_optimizer(model, ("forget", "retain"), {}, optimizer_settings(config))
    tracker = UpdateSimilarity(model.parameters(), ("forget", "retain"))
    records = []
    for step in range(steps):
        name = ("forget", "retain")[step % 2]
        model.weight.grad = gradient_of(name, step)
        tracker.before_step(name)
        optimizer.step(objective=name)
        records.append(tracker.after_step(name))
        optimizer.zero_grad(set_to_none=True)
    return records


def test_dualoptim_with_orthogonal_gradients_gives_orthogonal_updates():
    generator = torch.Generator().manual_seed(1)

    def gradient_of(name, step):  # forget moves the first two rows only, retain the last two
        g = torch.randn(4, 4, generator=generator)
        g[2:] = 0 if name == "forget" else g[2:]
        g[:2] = 0 if name == "retain" else g[:2]
        return g

    records = _run("dualoptim", gradient_of)
    assert records[0]["update_cosine"] is None
    assert all(abs(r["update_cosine"]) < 1e-9 and abs(r["grad_cosine"]) < 1e-12 for r in records[1:])


def test_one_shared_state_with_identical_gradients_gives_parallel_updates():
    g = torch.randn(4, 4, generator=torch.Generator().manual_seed(2))
    records = _run("alternate", lambda name, step: g.clone())
    assert all(r["grad_cosine"] == pytest.approx(1.0, abs=1e-12) for r in records[1:])
    assert all(r["update_cosine"] > 0.999 for r in records[1:])  # Adam's steps on a constant gradient: ~ -lr·sign(g)


def test_a_run_with_log_update_similarity_records_the_cosines(tiny_llama, tofu_dir, tmp_path):
    from tests.helpers import run_cli, write_sets

    sets = write_sets(tofu_dir, tmp_path, 8, 8)
    out = tmp_path / "run"
    assert run_cli("unlearn", "--model", str(tiny_llama), "--forget", str(sets / "forget.jsonl"),
                   "--retain", str(sets / "retain.jsonl"), "--steps", "6", "--forget-freq", "1", "--retain-freq", "2",
                   "--batch-size", "2", "--warmup-steps", "0",
                   "--log-update-similarity", "--out", str(out)) == 0
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["objective"] for r in records] == ["forget", "retain", "retain"] * 2
    assert records[0]["update_cosine"] is None
    assert all(-1 <= r["update_cosine"] <= 1 and -1 <= r["grad_cosine"] <= 1 for r in records[1:])
