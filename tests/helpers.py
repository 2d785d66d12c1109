"""Small helpers shared by the end-to-end tests."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from doplus_cli.cli import main
from tests.tiny_model import SHARED

REPO = Path(__file__).resolve().parents[1]
SAFETY_DIR = SHARED / "data" / "safety"
SAFETY = SAFETY_DIR / "safety_instructions.json"  # a JSON array of instruction, input (empty), output
GENERAL = SAFETY_DIR / "alpaca_seed_tasks.jsonl"  # instruction, instances[0].input/output


@contextlib.contextmanager
def cpu_only(patch):
    """Runs made in this process inside the block train on the CPU, also on a GPU machine: CUDA is hidden from
    torch (through `patch`, a pytest MonkeyPatch) and accelerate's per-process state is reset before and after,
    since accelerate keeps one device per process and refuses a CPU run after a CUDA one in the same process
    ("AcceleratorState has already been initialized", seen on an H100)."""
    from accelerate.state import AcceleratorState

    patch.setattr(torch.cuda, "is_available", lambda: False)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a Python process a test starts: this one's, with the project first on PYTHONPATH and
    the caller's PYTHONPATH kept after it (packages carried to a GPU machine live there), plus `extra`."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def run_cli(*args) -> int:
    """Run `doplus ARGS` in this process; return the exit code (0 on success)."""
    try:
        main([str(a) for a in args])
    except SystemExit as done:
        return done.code
    return 0


def write_sets(tofu_dir, folder, forget_rows: int, retain_rows: int):
    """forget.jsonl and retain.jsonl in `folder`: the first rows of TOFU's forget01 and retain90 (read from
    ../shared, never copied into the project); returns the folder."""
    for role, name, n in (("forget", "forget01.json", forget_rows), ("retain", "retain90.json", retain_rows)):
        lines = [line for line in open(tofu_dir / name) if line.strip()][:n]
        (folder / f"{role}.jsonl").write_text("".join(lines))
    return folder


def write_parity_task(folder):
    """A 4-question lm-eval multiple-choice task (tiny_parity) as a local YAML in `folder`; returns the folder."""
    import json

    folder.mkdir()
    docs = [{"question": f"Is {n} even?", "choices": ["yes", "no"], "label": n % 2} for n in range(4)]
    (folder / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "tiny_parity.yaml").write_text(
        "task: tiny_parity\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'docs.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: choices\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\nmetadata:\n  version: 1.0\n"
    )
    return folder


def align_args(model, out, *extra, safety_rows=14, general_rows=26):
    """A tiny `doplus align` run: each set's last 2 rows held out, so 12 safety and 24 general rows are trained."""
    return ["align", "--model", model, "--safety", f"{SAFETY}[0:{safety_rows}]", "--general",
            f"{GENERAL}[0:{general_rows}]", "--held-out", 2, "--batch-size", 2, "--max-length", 48,
            "--max-new-tokens", 4, "--lr", 1e-3, "--out", out, *extra]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------ processes (resume, DDP, FSDP)


def launch(arguments):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "doplus_cli", *map(str, arguments)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_steps(out, n, process, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        path = out / "metrics.jsonl"
        if path.exists() and sum(1 for _ in open(path)) >= n:
            return
        assert process.poll() is None, process.communicate(timeout=60)
        time.sleep(0.01)
    raise AssertionError("the run did not reach the step in time")


def two_processes(arguments):
    import torch

    # the one-process run it is compared with ran in this process: both must be CPU runs (conftest.py)
    assert not torch.cuda.is_available(), "a test that compares processes needs @pytest.mark.cpu_processes"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "doplus_cli", *map(str, arguments), "--num-processes", "2"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def greedy_by_hand(model, formatter, question: str, max_new_tokens: int, penalty: float = 1.0) -> list[int]:
    """Greedy decoding written out, independently of doplus's decoders: the whole unpadded sequence through the
    model at every step (no cache, no padding, transformers' own attention), with a repetition penalty other than
    1 on the last logits of every token already in the sequence, prompt included (CTRL's rule, as transformers
    applies it: a positive logit divided by the penalty, a negative one multiplied); cut before the first stop
    token."""
    tokenizer = formatter.tokenizer
    stop = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    ids = list(formatter.prompt_ids(question))
    answer = []
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
        if penalty != 1.0:
            seen = torch.tensor(sorted(set(ids)))
            logits[seen] = torch.where(logits[seen] > 0, logits[seen] / penalty, logits[seen] * penalty)
        token = int(logits.argmax())
        if token in stop:
            break
        answer.append(token)
        ids.append(token)
    return answer


def resume_from_step_2(make_run, out, whole, before_resume=None):
    """`make_run(out, extra)` to the end with a checkpoint every 2 steps, its final weights moved to `whole`, then
    (after `before_resume(checkpoint)`, if given) resumed from step 2 in `out`: it must end bit-identical to
    `whole`. The run that writes the checkpoint is the uninterrupted one: a second run without --save-every would
    repeat it at the cost of its processes. Returns the step-2 checkpoint."""
    import shutil

    make_run(out, ["--save-every", 2])
    checkpoint = out / "checkpoints" / "step-2"
    shutil.move(out / "final", whole)
    (out / "report.json").unlink()
    if before_resume is not None:
        before_resume(checkpoint)
    make_run(out, ["--save-every", 2, "--resume", checkpoint])
    a, b = load_file(str(whole / "model.safetensors")), weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return checkpoint


def weights(out):
    return load_file(str(out / "final" / "model.safetensors"))


def max_difference(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ------------------------------------------------------------------ optimizer references


def cycle(frequencies: dict[str, int], steps: int) -> list[str]:
    """The objective sequence: F_1 steps of the first objective, then F_2 of the second, ... repeated."""
    order = [name for name, count in frequencies.items() for _ in range(count)]
    return [order[i % len(order)] for i in range(steps)]


class Float64DualOptimPlus:
    """The DualOptim+ AdamW rule, one line per line, on float64 tensors; with `floor`/`bound` the safeguard:
    the denominator's square at least floor·(v̂_B + |v̂_k|), each element's step at most bound·lr."""

    def __init__(self, params, lr, betas, base_betas, eps, weight_decay, lr_multipliers=None, floor=0.0,
                 bound=math.inf):
        self.floor, self.bound = floor, bound
        self.params = [p.detach().double().clone() for p in params]
        self.lr, self.eps, self.wd = lr, eps, weight_decay
        self.b1, self.b2 = betas
        self.bb1, self.bb2 = base_betas
        self.mult = lr_multipliers or {}
        self.t_base = [0] * len(params)
        self.m_base = [torch.zeros_like(p) for p in self.params]
        self.v_base = [torch.zeros_like(p) for p in self.params]
        self.delta: dict[str, list[dict]] = {}

    def step(self, objective, grads, lr=None):
        lr = (self.lr if lr is None else lr) * self.mult.get(objective, 1.0)
        deltas = self.delta.setdefault(
            objective,
            [{"t": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)} for p in self.params],
        )
        for i, g in enumerate(grads):
            g = g.double()
            d = deltas[i]
            self.t_base[i] += 1
            d["t"] += 1
            t_b, t_k = self.t_base[i], d["t"]
            theta = self.params[i] * (1 - lr * self.wd)
            if t_b == 1:
                m_hat_b = torch.zeros_like(g)
                v_hat_b = torch.zeros_like(g)
            else:
                m_hat_b = self.m_base[i] / (1 - self.bb1 ** (t_b - 1))
                v_hat_b = self.v_base[i] / (1 - self.bb2 ** (t_b - 1))
            d["m"] = self.b1 * d["m"] + (1 - self.b1) * (g - m_hat_b)
            d["v"] = self.b2 * d["v"] + (1 - self.b2) * (g * g - v_hat_b)
            m = m_hat_b + d["m"] / (1 - self.b1**t_k)
            v_hat_k = d["v"] / (1 - self.b2**t_k)
            v = v_hat_b + v_hat_k
            square = torch.maximum(v.abs(), self.floor * (v_hat_b + v_hat_k.abs()))
            step = lr * m / (square.sqrt() + self.eps)
            self.params[i] = theta - step.clamp(-lr * self.bound, lr * self.bound)
            self.m_base[i] = self.bb1 * self.m_base[i] + (1 - self.bb1) * g
            self.v_base[i] = self.bb2 * self.v_base[i] + (1 - self.bb2) * g * g


SHAPES = [(7,), (5, 3), (4, 4, 4), (300,)]


def random_grads(generator, shapes, objective_index):
    # objectives pull in different (partly conflicting) directions, like forget and retain gradients
    return [
        torch.randn(shape, generator=generator) * 0.1 + (0.05 if objective_index % 2 == 0 else -0.03)
        for shape in shapes
    ]


def ns5_bf16(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Newton–Schulz quintic iteration (Jordan et al.), in bf16 as torch.optim.Muon runs it."""
    a, b, c = 3.4445, -4.7750, 2.0315
    y = x.bfloat16()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        y = y.T
    y = y / y.norm().clamp(min=1e-7)
    for _ in range(steps):  # y ← a·y + (b·Y + c·Y²)·y with Y = y·yᵀ, as fused multiply-adds like torch
        gram = y @ y.T
        y = torch.addmm(y, torch.addmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
    return (y.T if transposed else y).float()


def check_muon_rule(device: torch.device, atol: float) -> None:
    """DualOptim+'s Muon rule on `device` against the momentum recursions and `ns5_bf16` written here, run on the
    same device (the same bf16 products), over a 1:2 cycle; the weight within `atol` at every step."""
    from doplus_cli.optim import DualOptimPlus

    torch.manual_seed(0)
    weight = torch.nn.Parameter((torch.randn(16, 8) * 0.1).to(device))
    bias = torch.nn.Parameter(torch.zeros(8, device=device))
    lr, beta, wd = 0.02, 0.9, 0.01
    opt = DualOptimPlus([weight, bias], lr=lr, betas=(beta, 0.95), weight_decay=wd, inner="muon", fused=False)
    theta = weight.detach().clone()
    m_base = torch.zeros_like(theta)
    m_delta = {"forget": torch.zeros_like(theta), "retain": torch.zeros_like(theta)}
    generator = torch.Generator().manual_seed(5)
    for objective in cycle({"forget": 1, "retain": 2}, 9):
        g = torch.randn(16, 8, generator=generator).to(device)
        weight.grad, bias.grad = g.clone(), torch.ones(8, device=device)
        opt.step(objective=objective)
        m_delta[objective] = beta * m_delta[objective] + (g - m_base)
        o = ns5_bf16(m_base + m_delta[objective])
        expected = theta * (1 - lr * wd) - lr * math.sqrt(max(1, 16 / 8)) * o
        m_base = beta * m_base + g
        torch.testing.assert_close(weight.detach(), expected, rtol=0, atol=atol)
        torch.testing.assert_close(opt.state[weight]["momentum_buffer"], m_base, rtol=1e-6, atol=1e-6)
        delta = opt.state[weight]["delta"][objective]["momentum_buffer"]
        torch.testing.assert_close(delta, m_delta[objective], rtol=1e-6, atol=1e-6)
        theta = weight.detach().clone()
    assert "momentum_buffer" in opt.state[weight] and "exp_avg" in opt.state[bias]


def fused_and_reference_steps(device: torch.device, dtype: torch.dtype):
    """DualOptim+ with the compiled kernel and with the eager rule, on twin parameters of `dtype` on `device`
    (300 x 257 and 70,000 elements), stepped with the same gradients over ten steps of a 2:3 cycle; returns
    (fused optimizer, reference optimizer, params, twins) for the caller's tolerances."""
    from doplus_cli.optim import DualOptimPlus

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s).to(device, dtype)) for s in [(300, 257), (70000,)]]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), base_betas=(0.8, 0.99), weight_decay=0.1)
    # multi_tensor=False: the per-tensor compiled kernel even on CUDA (test_cuda.py checks the multi-tensor one)
    fused = DualOptimPlus(params, fused=True, multi_tensor=False, **kwargs)
    reference = DualOptimPlus(twins, fused=False, **kwargs)
    generator = torch.Generator().manual_seed(2)
    for objective in cycle({"forget": 2, "retain": 3}, 10):
        for p, q in zip(params, twins):
            p.grad = torch.randn(p.shape, generator=generator).to(device, dtype)
            q.grad = p.grad.clone()
        fused.step(objective=objective)
        reference.step(objective=objective)
    return fused, reference, params, twins


# ------------------------------------------------------------------ bf16 weights near 0.02 (training precision)

LR_PAPER = 1e-5  # the paper's learning rate
BF16_SHAPE = (64, 256)  # 16384 elements: 8-bit states, two 256-blocks per row


def weights_near_002(seed: int = 0) -> torch.Tensor:
    """bf16 weights of magnitude 0.016-0.031 (one binade: bf16 spacing 2^-13 = 1.2e-4 everywhere), random sign."""
    generator = torch.Generator().manual_seed(seed)
    magnitude = 0.016 + 0.015 * torch.rand(BF16_SHAPE, generator=generator)
    sign = torch.where(torch.rand(BF16_SHAPE, generator=generator) < 0.5, -1.0, 1.0)
    return (sign * magnitude).bfloat16()


def gradients(steps: int, seed: int = 1) -> list[torch.Tensor]:
    """Gradients of one sign pattern (so that steps add up) with noise in their size, in bf16."""
    generator = torch.Generator().manual_seed(seed)
    pattern = torch.where(torch.rand(BF16_SHAPE, generator=generator) < 0.5, -1.0, 1.0)
    return [(pattern * (1.0 + 0.5 * torch.rand(BF16_SHAPE, generator=generator))).bfloat16() for _ in range(steps)]


# ------------------------------------------------------------------ independent 8-bit references

SIGNED = {"exp_avg": True, "exp_avg_sq": False}  # the base state's maps; every delta state is signed (v_k < 0)


def bnb_dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_blockwise(codes, absmax=absmax, code=bnbf.create_dynamic_map(signed=signed),
                                     blocksize=256).double()


def float64_rule(theta, g, mb, vb, md, vd, t_base, t_delta, lr, betas, eps, wd, floor=0.02, bound=10.0):
    """The DualOptim+ AdamW rule (with its safeguard) in float64, base and delta betas equal."""
    b1, b2 = betas
    theta = theta * (1 - lr * wd)
    mb_hat = mb / (1 - b1 ** (t_base - 1)) if t_base > 1 else torch.zeros_like(g)
    vb_hat = vb / (1 - b2 ** (t_base - 1)) if t_base > 1 else torch.zeros_like(g)
    md = b1 * md + (1 - b1) * (g - mb_hat)
    vd = b2 * vd + (1 - b2) * (g * g - vb_hat)
    m = mb_hat + md / (1 - b1**t_delta)
    vd_hat = vd / (1 - b2**t_delta)
    square = torch.maximum((vb_hat + vd_hat).abs(), floor * (vb_hat + vd_hat.abs()))
    theta = theta - (lr * m / (square.sqrt() + eps)).clamp(-lr * bound, lr * bound)
    return theta, b1 * mb + (1 - b1) * g, b2 * vb + (1 - b2) * g * g, md, vd


def bnb_quantize(x: torch.Tensor, signed: bool):
    """bitsandbytes' blockwise quantisation with its dynamic map, on x's device (its CUDA kernel for a CUDA
    tensor): (uint8 codes, block absmax)."""
    import bitsandbytes.functional as bnbf

    code = bnbf.create_dynamic_map(signed=signed).to(x.device)
    codes, state = bnbf.quantize_blockwise(x.reshape(-1), code=code, blocksize=256)
    return codes, state.absmax


def check_8bit_step_against_bitsandbytes(device: torch.device, fused: bool, cycles: int) -> None:
    """Each step of 8-bit DualOptim+ on `device` from its own states: bitsandbytes dequantizes them, the float64
    rule updates (on the CPU), bitsandbytes quantizes the result on `device`; the new weights must be those, and
    the codes those or a neighbour (float32 against float64 may cross a decision threshold), at most 20 codes in
    all."""
    from doplus_cli.optim import DualOptimPlus

    torch.manual_seed(0)
    n = 70_000  # 273 whole 256-blocks and a short one
    param = torch.nn.Parameter(torch.randn(n).to(device))
    lr, betas, eps, wd = 1e-2, (0.9, 0.95), 1e-8, 0.01
    opt = DualOptimPlus([param], lr=lr, betas=betas, eps=eps, weight_decay=wd, state_bits=8, fused=fused)
    generator = torch.Generator().manual_seed(3)
    zero = (torch.zeros(n, dtype=torch.float64),) * 2
    mismatched = 0

    def dequantized(container, signed):
        return tuple(bnb_dequantize(container[k].cpu(), container[k + "_absmax"].cpu(), signed[k]) for k in SIGNED)

    for step, objective in enumerate(["forget", "retain", "retain"] * cycles):
        grad = torch.randn(n, generator=generator) * 0.1 + (0.05 if objective == "forget" else -0.05)
        state = opt.state[param]
        base, t_base = (zero, 1) if step == 0 else (dequantized(state, SIGNED), int(state["step"]) + 1)
        delta = state.get("delta", {}).get(objective) if step else None
        t_delta = 1 if delta is None else int(delta["step"]) + 1
        delta_values = zero if delta is None else dequantized(delta, dict.fromkeys(SIGNED, True))
        expected = float64_rule(param.detach().cpu().double(), grad.double(), *base, *delta_values, t_base, t_delta,
                                lr, betas, eps, wd)
        param.grad = grad.to(device)
        opt.step(objective=objective)
        state, delta = opt.state[param], opt.state[param]["delta"][objective]
        assert state["exp_avg"].device == param.device
        torch.testing.assert_close(param.detach().cpu().double(), expected[0], rtol=1e-6, atol=1e-7)
        stored = [(state, "exp_avg", True), (state, "exp_avg_sq", False), (delta, "exp_avg", True),
                  (delta, "exp_avg_sq", True)]
        for (container, key, signed), value in zip(stored, expected[1:]):
            assert container[key].dtype == torch.uint8
            codes, absmax = (t.cpu() for t in bnb_quantize(value.float().to(device), signed))
            torch.testing.assert_close(container[key + "_absmax"].cpu(), absmax, rtol=1e-6, atol=0)
            mine = container[key].cpu()
            differ = mine != codes
            mismatched += int(differ.sum())
            if differ.any():  # then the two codes are neighbours in the map, never further apart
                assert (mine[differ].int() - codes[differ].int()).abs().max() <= 1, (step, key)
    assert mismatched <= 20, mismatched  # measured on a CPU: 2 of the 3.4 million codes of four cycles


def check_dualoptim_8bit_against_adamw8bit(device: torch.device) -> None:
    """DualOptim with 8-bit states on `device` is two bitsandbytes AdamW8bit stepped alternately: the same weights
    after every step and the same states at the end (bitsandbytes' own kernels on that device)."""
    import bitsandbytes as bnb

    from doplus_cli.optim import DualOptim

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s).to(device)) for s in [(70_000,), (64, 80), (100,)]]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    opt = DualOptim(params, objectives=("forget", "retain"), state_bits=8, **kwargs)
    adamw8bit = {name: bnb.optim.AdamW8bit(twins, min_8bit_size=4096, **kwargs) for name in ("forget", "retain")}
    generator = torch.Generator().manual_seed(2)
    for objective in ["forget", "retain", "retain"] * 3:
        for p, q in zip(params, twins):
            p.grad = (torch.randn(p.shape, generator=generator) * 0.1 + (0.05 if objective == "forget" else -0.05)).to(
                device)
            q.grad = p.grad.clone()
        opt.step(objective=objective)
        adamw8bit[objective].step()
        for p, q in zip(params, twins):
            assert torch.equal(p, q)
    for name, reference in adamw8bit.items():
        for p, q in zip(params, twins):
            mine, theirs = opt.state[p][name], reference.state[q]
            assert mine.keys() == theirs.keys()
            for key in mine:
                assert torch.equal(mine[key], theirs[key]) if torch.is_tensor(mine[key]) else mine[key] == theirs[key]
    big = opt.state[params[0]]["forget"]
    assert big["state1"].dtype == torch.uint8 and big["state2"].dtype == torch.uint8  # really 8-bit states
    assert opt.state[params[2]]["forget"]["state1"].dtype == torch.float32  # 100 elements: below 4,096


def recipe_beside_shared_data(name: str, folder) -> Path:
    """Shipped recipe `name` copied into `folder` with `doplus recipes copy`, and the data doplus does not ship
    (data/tofu, data/safety) linked there from ../shared, as a user places it: the copy resolves as in a real
    run. Returns the copied recipe's path."""
    from doplus_cli.recipes import copy_recipe

    folder = Path(folder)
    copied = copy_recipe(name, folder if str(folder).endswith("/") else f"{folder}/").recipe
    data = copied.parent / "data"
    data.mkdir(exist_ok=True)
    for part in ("tofu", "safety"):
        if not (data / part).exists():
            (data / part).symlink_to(SHARED / "data" / part, target_is_directory=True)
    return copied


HELP_ENV = {"COLUMNS": "160", "TERM": "dumb", "NO_COLOR": "1"}


def help_panels(output: str) -> list[tuple[str, list[str]]]:
    """A command's --help as a user scans it: each titled panel (rich's boxes) with the first flag of each of its
    option rows, in the order shown (a help text's wrapped lines start further right, under its column)."""
    import re

    panels: list[tuple[str, list[str]]] = []
    for line in output.splitlines():
        if title := re.match(r"^╭─ (.+?) ─", line):
            panels.append((title.group(1), []))
        elif row := re.match(r"^│ (?:\*  |   )?(--[a-z0-9-]+)", line):  # "*": a required option
            panels[-1][1].append(row.group(1))
    return panels


def help_flags_of(output: str) -> list[str]:
    """Every option row's first flag of a --help, in the order shown (`help_panels`)."""
    return [flag for _, flags in help_panels(output) for flag in flags]


DOCUMENTED_ROOT = Path(__file__).resolve().parents[1]
PAGES = (DOCUMENTED_ROOT / "README.md", *sorted((DOCUMENTED_ROOT / "docs").glob("*.md")))


def documented_commands(page: Path) -> list[tuple[int, str]]:
    """(line, command) of every `doplus ...` command in the page's bash blocks: continuation lines joined, `&&`
    chains split, comments dropped; the line is where the command starts."""
    lines, found, index = page.read_text().splitlines(), [], 0
    while index < len(lines):
        if lines[index].strip() != "```bash":
            index += 1
            continue
        index += 1
        while index < len(lines) and not lines[index].startswith("```"):
            start, text = index, lines[index]
            while text.endswith("\\") and index + 1 < len(lines):
                index += 1
                text = text[:-1] + " " + lines[index]
            for part in text.split("&&"):
                part = part.split(" #", 1)[0].strip()
                if part.startswith("doplus "):
                    found.append((start + 1, part))
            index += 1
    return found


def training(run: Path) -> bool:
    """Whether the run in `run` has logged a step."""
    metrics = run / "metrics.jsonl"
    return metrics.is_file() and metrics.read_text().count("\n") >= 1


def sigterm_when(ready, seconds: float = 240) -> threading.Thread:
    """A started thread that sends SIGTERM to this process once `ready()` holds, as a scheduler would signal a
    command that runs in it; join it after the command returns."""
    def watch() -> None:
        deadline = time.time() + seconds
        while time.time() < deadline:
            if ready():
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    return watcher
