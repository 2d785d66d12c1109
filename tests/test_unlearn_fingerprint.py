"""`doplus unlearn` ends with the weights of a plain two-objective loop written here, bit for bit, per scheme.

This replaced fingerprints (sums of |final - start|) recorded on one machine: the paper's DualOptim+ rule
amplifies last-bit differences between CPUs' vectorised arithmetic, and the sums also depended on the random
init of transformers and the BPE training of tokenizers, so a dependency release or another CPU could turn CI
red with no change in doplus. Both runs here are made in the same process on the same starting weights, so
they must agree exactly on any machine.

The loop below is the nanoGPT-style loop the engine must equal for `unlearn`'s two objectives: the forget-first
F_f:F_r cycle (forget, retain, retain), each objective's rows in a seeded permutation per epoch
(`seed * 100003 + epoch`, objective i seeded `seed + i`), NPO on the forget batch against a frozen copy of
the starting model, GD (CE) on the retain batch, a joint step summing both, with --grad-accum each step's
micro-batches backward one by one, each loss over their number, gradient clipping at 1.0, linear
warm-up and decay, and each scheme's optimizer built by hand (the weight-decay groups, torch's fused AdamW for
joint and alternate, DualOptim, DualOptim+ with AdamW, 8-bit states or Muon). It borrows from doplus only the
pieces other tests cover on their own: the prompt formatter and padding, the loss functions and the
optimizers' update rules (tests/test_optim_rules.py, tests/test_losses.py).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup

from doplus_cli.data.formatting import PromptFormatter, collate
from doplus_cli.losses import FORGET_LOSSES, RETAIN_LOSSES, LossContext
from doplus_cli.optim import DualOptim, DualOptimPlus
from tests.helpers import cpu_only, run_cli

STEPS, LR, WARMUP, BATCH, MAX_LENGTH, WEIGHT_DECAY, BETA, SEED = 6, 1e-3, 2, 2, 48, 0.01, 0.1, 0
ACCUM = 2  # --grad-accum of the run that accumulates
CYCLE = ["forget", "retain", "retain"]  # --forget-freq 1 --retain-freq 2
RUNS = {  # run -> (--scheme, extra options)
    "joint": ("joint", []),
    "alternate": ("alternate", []),
    "dualoptim": ("dualoptim", []),
    "doplus": ("doplus", []),
    "doplus-paper": ("doplus", ["--doplus-rule", "paper"]),
    "doplus-8bit": ("doplus", ["--state-bits", 8]),
    "doplus-muon": ("doplus", ["--optimizer", "muon"]),
    "doplus-accum": ("doplus", ["--grad-accum", ACCUM]),
}


@pytest.fixture(scope="module")
def data(tofu_dir, tmp_path_factory):
    """8 forget and 12 retain rows of TOFU, question and answer only."""
    folder = tmp_path_factory.mktemp("loop-data")
    rows = {}
    for role, name, n in (("forget", "forget01.json", 8), ("retain", "retain90.json", 12)):
        lines = [json.loads(line) for line in open(tofu_dir / name) if line.strip()][:n]
        rows[role] = [{"question": r["question"], "answer": r["answer"]} for r in lines]
        (folder / f"{role}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[role]))
    return folder, rows


def _order(size: int, seed: int, epoch: int) -> list[int]:
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()


class Rows:
    """An objective's rows drawn BATCH at a time through a new permutation each epoch."""

    def __init__(self, rows: list[dict], seed: int) -> None:
        self.rows, self.seed, self.epoch, self.order = rows, seed, 0, _order(len(rows), seed, 0)

    def next(self) -> list[dict]:
        drawn = []
        for _ in range(BATCH):
            if not self.order:
                self.epoch += 1
                self.order = _order(len(self.rows), self.seed, self.epoch)
            drawn.append(self.rows[self.order.pop(0)])
        return drawn


def _optimizer(run: str, model: torch.nn.Module):
    scheme, extra = RUNS[run]
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": matrices, "weight_decay": WEIGHT_DECAY}, {"params": vectors, "weight_decay": 0.0}]
    common = dict(lr=LR, betas=(0.9, 0.95), weight_decay=WEIGHT_DECAY)
    if scheme in ("joint", "alternate"):
        adamw = torch.optim.AdamW(groups, fused=True, **common)
        return adamw, lambda objective: adamw.step()
    if scheme == "dualoptim":
        optimizer = DualOptim(groups, objectives=("forget", "retain"), **common)
    elif "--optimizer" in extra:  # Muon for the hidden matrices; embeddings, head, norms on AdamW
        outer = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
        hidden = [p for p in matrices if id(p) not in outer]
        rest = [p for p in model.parameters() if id(p) not in {id(q) for q in hidden}]
        optimizer = DualOptimPlus([{"params": hidden, "use_muon": True}, {"params": rest, "use_muon": False}],
                                  objectives=("forget", "retain"), inner="muon", **common)
    else:
        optimizer = DualOptimPlus(groups, objectives=("forget", "retain"), state_bits=8 if "--state-bits" in extra
                                  else 32, rule="paper" if "--doplus-rule" in extra else "safeguarded", **common)
    return optimizer, lambda objective: optimizer.step(objective=objective)


def plain_loop(model_dir, rows: dict[str, list[dict]], run: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    model.train()
    formatter = PromptFormatter(tokenizer, MAX_LENGTH)
    draws = {"forget": Rows(rows["forget"], SEED), "retain": Rows(rows["retain"], SEED + 1)}
    losses = {"forget": FORGET_LOSSES["NPO"].fn, "retain": RETAIN_LOSSES["GD"].fn}
    context = LossContext(model, reference, BETA)
    optimizer, step = _optimizer(run, model)
    scheduler = get_linear_schedule_with_warmup(optimizer, WARMUP, STEPS)

    def loss_of(objective: str) -> torch.Tensor:
        encoded = [formatter.encode(r["question"], r["answer"]) for r in draws[objective].next()]
        return losses[objective](context, {"answer": collate(encoded, tokenizer.pad_token_id)})

    for index in range(STEPS):
        objective = "joint" if RUNS[run][0] == "joint" else CYCLE[index % len(CYCLE)]
        accum = ACCUM if "--grad-accum" in RUNS[run][1] else 1
        for _ in range(accum):  # each micro-batch's loss over their number, its gradients added
            loss = loss_of("forget") + loss_of("retain") if objective == "joint" else loss_of(objective)
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        step(objective)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


@pytest.fixture(scope="module")
def finals(tiny_llama, data, tmp_path_factory):
    """Each run's final weights from `doplus unlearn` and from the plain loop, both on the CPU in float32, also on a
    GPU machine: bit for bit holds on one device and precision (on an H100 the engine trained on CUDA under
    bf16-mixed and every tensor differed); tests/test_cuda.py covers the CUDA update paths."""
    folder, rows = data
    found = {}
    with pytest.MonkeyPatch.context() as patch, cpu_only(patch):
        for run, (scheme, extra) in RUNS.items():
            out = tmp_path_factory.mktemp(run) / "run"
            assert run_cli("unlearn", "--model", tiny_llama, "--forget", folder / "forget.jsonl", "--retain",
                           folder / "retain.jsonl", "--loss", "NPO+GD", "--scheme", scheme, "--steps", STEPS, "--lr",
                           LR, "--warmup-steps", WARMUP, "--weight-decay", WEIGHT_DECAY, "--max-grad-norm", 1.0,
                           "--beta", BETA, "--seed", SEED, "--forget-freq", 1, "--retain-freq", 2, "--batch-size",
                           BATCH, "--max-length", MAX_LENGTH, "--show-samples", 0, "--out", out, *extra) == 0
            found[run] = (load_file(str(out / "final" / "model.safetensors")), plain_loop(tiny_llama, rows, run))
    return found


@pytest.mark.parametrize("run", list(RUNS))
def test_unlearn_equals_a_plain_two_objective_loop(tiny_llama, finals, run):
    engine, plain = finals[run]
    start = load_file(str(tiny_llama / "model.safetensors"))
    assert set(engine) <= set(plain) and set(engine) == set(start)
    different = [name for name in engine if not torch.equal(engine[name], plain[name])]
    assert not different, f"{run}: {len(different)} tensors differ from the plain loop's, e.g. {different[:3]}"
    moved = sum((engine[name] - start[name]).abs().sum().item() for name in engine)
    assert moved > 1.0  # the run moved the weights (lr 1e-3, 6 steps): the comparison is not of two copies


def test_the_schemes_end_apart(finals):
    """Each scheme's weights differ from every other's: the scheme option reaches the optimizer."""
    runs = list(RUNS)
    for i, first in enumerate(runs):
        for second in runs[i + 1:]:
            a, b = finals[first][0], finals[second][0]
            assert any(not torch.equal(a[name], b[name]) for name in a), (first, second)


@pytest.mark.parametrize("warmup,total", [(0, 10), (2, 6), (3, 3), (7, 5), (60, 300)])
def test_the_schedule_gives_transformers_factors_bit_for_bit(warmup, total):
    """doplus's linear warm-up schedule (which spares every run the import of transformers' Trainer utilities)
    against transformers' own, step by step, past the end, and through a state_dict round trip."""
    from doplus_cli.engine.schedule import linear_warmup_schedule

    def optimizer():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)

    ours, theirs = optimizer(), optimizer()
    a, b = linear_warmup_schedule(ours, warmup, total), get_linear_schedule_with_warmup(theirs, warmup, total)
    for _ in range(total + 3):
        assert ours.param_groups[0]["lr"] == theirs.param_groups[0]["lr"]
        ours.step(), theirs.step(), a.step(), b.step()
    resumed = linear_warmup_schedule(optimizer(), warmup, total)
    resumed.load_state_dict(b.state_dict())
    assert resumed.get_last_lr() == b.get_last_lr()
