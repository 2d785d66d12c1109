"""`doplus unlearn` ends with the same weights before and after the engine learned N objectives (issue #10).

The fingerprints below were computed on the two-objective engine (commit 1ce2df8) by this very test, before
the loop was rewritten over a list of objectives; each scheme must keep reproducing them. A fingerprint is
the float64 sum of |final - start| over every weight (how far the run moved them) and the float64 sum of
(final - start) * a fixed pseudo-random sign per element (which direction), so a change in any step of any
scheme shows up.

The runs are short (6 steps, lr 1e-3, forget-first 1:2). Commit 1ce2df8 had only the paper's DualOptim+ rule,
so the DualOptim+ runs here ask for it (`--doplus-rule paper`): even these 6 steps meet a v̂_B + v̂_k that has
cancelled below the safeguard's floor, where the default safeguarded rule (issue #16) rightly differs.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import run_cli, write_sets

# scheme -> (sum |final - start|, sum (final - start) * sign), computed on the two-objective engine
FINGERPRINTS = {
    "joint": (85.95236288043446, -0.6451254573407255),
    "alternate": (57.250809468566274, -0.8219063663690918),
    "dualoptim": (58.12497939726876, -0.6450208639361676),
    "doplus": (79.98197262875095, -0.7500692864304597),
    "doplus-8bit": (80.89316417616698, -0.14279851299198754),
    "doplus-muon": (47.8211389198113, -0.27797385703564004),
}
PAPER = ["--doplus-rule", "paper"]
EXTRA = {"doplus": PAPER, "doplus-8bit": ["--state-bits", 8, *PAPER], "doplus-muon": ["--optimizer", "muon", *PAPER]}


@pytest.fixture(scope="module")
def data(tofu_dir, tmp_path_factory):
    return write_sets(tofu_dir, tmp_path_factory.mktemp("fingerprint-data"), 8, 12)


def fingerprint(start: dict[str, torch.Tensor], final: dict[str, torch.Tensor]) -> tuple[float, float]:
    moved, signed = 0.0, 0.0
    for name in sorted(start):
        delta = final[name].double() - start[name].double()
        signs = torch.randint(0, 2, delta.shape, generator=torch.Generator().manual_seed(len(name))) * 2 - 1
        moved += delta.abs().sum().item()
        signed += (delta * signs).sum().item()
    return moved, signed


@pytest.mark.parametrize("run", list(FINGERPRINTS))
def test_unlearn_weights_are_unchanged_by_the_n_objective_engine(tiny_llama, data, tmp_path, run):
    scheme = run.split("-")[0]
    out = tmp_path / run
    assert run_cli("unlearn", "--model", tiny_llama, "--forget", data / "forget.jsonl", "--retain",
                   data / "retain.jsonl", "--loss", "NPO+GD", "--scheme", scheme, "--steps", 6, "--lr", 1e-3,
                   "--forget-freq", 1, "--retain-freq", 2, "--batch-size", 2, "--max-length", 48,
                   "--show-samples", 0, "--out", out, *EXTRA.get(run, [])) == 0
    found = fingerprint(load_file(str(tiny_llama / "model.safetensors")),
                        load_file(str(out / "final" / "model.safetensors")))
    moved, signed = FINGERPRINTS[run]
    assert found[0] == pytest.approx(moved, rel=1e-7, abs=0)
    assert found[1] == pytest.approx(signed, rel=1e-6, abs=1e-9)
