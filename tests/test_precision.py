"""Training precision: bf16 weights lose small updates; compensated summation keeps them; bf16-mixed
keeps float32 master weights and states; resume stays bit-identical; --save-dtype; contradictions refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from doplus_cli.optim import DualOptim, DualOptimPlus
from doplus_cli.optim.adamw import AdamW
from tests.helpers import LR_PAPER as LR
from tests.helpers import gradients, run_cli, weights_near_002, write_sets


def bf16_spacing(x: torch.Tensor) -> torch.Tensor:
    """Distance between consecutive bfloat16 values around x (8 significant bits)."""
    return 2.0 ** (torch.floor(torch.log2(x.abs())) - 7)


def master(param: torch.Tensor, optimizer) -> torch.Tensor:
    """θ_bf16 + c in float64: the weight a compensated optimizer carries."""
    state = optimizer.state[param]
    compensation = state.get("compensation")
    if compensation is None and hasattr(optimizer, "compensation"):
        compensation = optimizer.compensation.get(param)
    return param.detach().double() + (0.0 if compensation is None else compensation.double())


# -- the premise, and compensated summation against float64 loops --------------------------------------------


@pytest.mark.parametrize("make", [
    lambda ps, c: DualOptimPlus(ps, lr=LR, compensated=c),
    lambda ps, c: AdamW(ps, lr=LR, compensated=c),
], ids=["doplus", "adamw"])
def test_a_bf16_step_of_lr_1e5_rounds_away_without_compensation_and_is_kept_with_it(make):
    start = weights_near_002()
    (grad,) = gradients(1)
    plain, kept = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    plain_opt, kept_opt = make([plain], False), make([kept], True)
    for param, opt in ((plain, plain_opt), (kept, kept_opt)):
        param.grad = grad.clone()
        opt.step(**({"objective": "forget"} if isinstance(opt, DualOptimPlus) else {}))
    # The first step of either rule is lr·g/(|g| + ε) = ±1e-5 per element, below half the spacing (6.1e-5).
    assert torch.equal(plain.detach(), start)  # every element rounded back: the update is lost
    assert torch.equal(kept.detach(), start)  # the bf16 weight cannot show it either ...
    moved = master(kept, kept_opt) - start.double()  # ... but the compensation holds it
    expected = -LR * torch.sign(grad.double())
    assert torch.allclose(moved, expected, rtol=0.01, atol=0)


def test_bit_rounding_to_bfloat16_is_torchs_round_to_nearest_even():
    """The kernels round by integer arithmetic on the bits (inductor may drop a cast round trip); torch's own
    cast is the reference, ties included (x.5 ulp: the low 16 bits exactly 0x8000, both parities)."""
    from doplus_cli.optim.kernels import round_to_bfloat16

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(100_000, generator=generator) * 10.0 ** torch.randint(-6, 4, (100_000,), generator=generator)
    ties = ((x.view(torch.int32) & -65536) | 0x8000).view(torch.float32)
    for values in (x, ties, -ties, torch.tensor([0.0, -0.0, 1.0, 3.3895314e38, float("inf"), -float("inf")])):
        assert torch.equal(round_to_bfloat16(values), values.bfloat16().float())
    assert torch.isnan(round_to_bfloat16(torch.tensor([float("nan")]))).all()


def float64_doplus(start: torch.Tensor, grads: list[torch.Tensor], objectives: list[str], lr: float,
                   betas=(0.9, 0.95), eps=1e-8, wd=0.01, floor=0.02, bound=10.0) -> torch.Tensor:
    """DualOptim+'s safeguarded AdamW rule (the paper's Algorithm 1, base updated after θ) in float64."""
    theta = start.double().clone()
    m_base, v_base, t_base = torch.zeros_like(theta), torch.zeros_like(theta), 0
    delta: dict[str, list] = {}
    for g, name in zip(grads, objectives):
        g = g.double()
        m, v, t = delta.setdefault(name, [torch.zeros_like(theta), torch.zeros_like(theta), 0])
        t_base, t = t_base + 1, t + 1
        theta = theta * (1 - lr * wd)
        m_base_hat = m_base / (1 - betas[0] ** (t_base - 1)) if t_base > 1 else torch.zeros_like(theta)
        v_base_hat = v_base / (1 - betas[1] ** (t_base - 1)) if t_base > 1 else torch.zeros_like(theta)
        m = betas[0] * m + (1 - betas[0]) * (g - m_base_hat)
        v = betas[1] * v + (1 - betas[1]) * (g * g - v_base_hat)
        v_delta_hat = v / (1 - betas[1] ** t)
        denominator = torch.maximum((v_base_hat + v_delta_hat).abs(), floor * (v_base_hat + v_delta_hat.abs()))
        step = lr * (m_base_hat + m / (1 - betas[0] ** t)) / (denominator.sqrt() + eps)
        theta = theta - step.clamp(-bound * lr, bound * lr)
        m_base = betas[0] * m_base + (1 - betas[0]) * g
        v_base = betas[1] * v_base + (1 - betas[1]) * g * g
        delta[name] = [m, v, t]
    return theta


def float64_adamw(start: torch.Tensor, grads: list[torch.Tensor], lr: float, betas=(0.9, 0.95), eps=1e-8,
                  wd=0.01) -> torch.Tensor:
    theta = start.double().clone()
    m, v = torch.zeros_like(theta), torch.zeros_like(theta)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        theta = theta * (1 - lr * wd) - lr * (m / (1 - betas[0] ** t)) / ((v / (1 - betas[1] ** t)).sqrt() + eps)
    return theta


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
@pytest.mark.parametrize("rule", ["doplus", "adamw"])
def test_compensated_bf16_weights_match_a_float64_loop_within_one_spacing(rule, fused):
    steps = 20
    start, grads = weights_near_002(), gradients(steps)
    objectives = ["forget", "retain", "retain"] * 7
    if rule == "doplus":
        expected = float64_doplus(start, grads, objectives[:steps], LR)
    else:
        expected = float64_adamw(start, grads, LR)
    results = {}
    for compensated in (False, True):
        param = torch.nn.Parameter(start.clone())
        if rule == "doplus":
            opt = DualOptimPlus([param], lr=LR, weight_decay=0.01, fused=fused, compensated=compensated)
        else:
            opt = AdamW([param], lr=LR, weight_decay=0.01, fused=fused, compensated=compensated)
        for g, name in zip(grads, objectives):
            param.grad = g.clone()
            opt.step(**({"objective": name} if rule == "doplus" else {}))
        results[compensated] = (param.detach().double(), master(param, opt))
    spacing = bf16_spacing(expected)
    assert ((expected - start.double()).abs() > spacing).float().mean() > 0.9  # the loop moved most by > 1 spacing
    weights, carried = results[True]
    assert ((weights - expected).abs() <= spacing).all()  # compensated: the bf16 weights within one spacing
    assert ((carried - expected).abs() <= 0.05 * spacing).all()  # and θ + c within a twentieth of one
    plain, _ = results[False]
    assert torch.equal(plain.bfloat16(), start)  # uncompensated: not one element moved in 20 steps
    assert ((plain - expected).abs() > spacing).float().mean() > 0.9


def float32_twin(make, steps: int = 20) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float32 weights, compensated bf16 weights, their θ + c) after the same steps of the same optimizer."""
    start, grads = weights_near_002(), gradients(steps)
    objectives = ["forget", "retain"] * steps
    out = []
    for weights in (start.float(), start.clone()):
        param = torch.nn.Parameter(weights)
        opt = make([param])
        for g, name in zip(grads, objectives):
            param.grad = g.to(param.dtype)
            opt.step(objective=name)
        out.append((param.detach().double(), master(param, opt)))
    return out[0][0], out[1][0], out[1][1]


@pytest.mark.parametrize("make", [
    lambda ps: DualOptimPlus(ps, lr=LR, state_bits=8, fused=True, compensated=True),
    lambda ps: DualOptimPlus(ps, lr=LR, state_bits=8, fused=False, compensated=True),
    lambda ps: DualOptimPlus(ps, lr=1e-3, inner="muon", compensated=True),
    lambda ps: DualOptim(ps, lr=LR, compensated=True),
], ids=["doplus-8bit-fused", "doplus-8bit-reference", "doplus-muon", "dualoptim"])
def test_compensated_bf16_weights_track_the_same_optimizer_on_float32_weights(make):
    """The states depend on the gradients only, so a float32-weight run of the same optimizer is the weights'
    reference; compensated bf16 weights stay within one bf16 spacing of it (DualOptim: one compensation
    buffer shared by the objectives' AdamW states)."""
    fp32, bf16, carried = float32_twin(make)
    start = weights_near_002().double()
    spacing = bf16_spacing(fp32)
    assert (fp32 - start).abs().mean() > 0.3 * spacing.mean()  # the float32 run moved
    assert ((bf16 - fp32).abs() <= spacing).all()
    assert ((carried - fp32).abs() <= 0.05 * spacing).all()


@pytest.mark.parametrize("make", [
    lambda ps, fused: DualOptimPlus(ps, lr=LR, fused=fused, compensated=True),
    lambda ps, fused: DualOptimPlus(ps, lr=LR, state_bits=8, fused=fused, compensated=True),
    lambda ps, fused: AdamW(ps, lr=LR, fused=fused),
], ids=["doplus", "doplus-8bit", "adamw"])
def test_compensated_fused_kernel_gives_the_reference_bits(make):
    start, grads = weights_near_002(), gradients(6)
    finals = []
    for fused in (True, False):
        param = torch.nn.Parameter(start.clone())
        opt = make([param], fused)
        for step, g in enumerate(grads):
            param.grad = g.clone()
            opt.step(**({"objective": ("forget", "retain")[step % 2]} if not isinstance(opt, AdamW) else {}))
        finals.append((param.detach().clone(), opt.state[param]["compensation"].clone()))
    (fused_w, fused_c), (ref_w, ref_c) = finals
    assert torch.equal(fused_w, ref_w) and torch.equal(fused_c, ref_c) and fused_c.abs().max() > 0


def test_compensated_state_dict_round_trip_keeps_every_dtype():
    param = torch.nn.Parameter(weights_near_002())
    opt = DualOptim([param], lr=LR, compensated=True)
    for step, g in enumerate(gradients(3)):
        param.grad = g
        opt.step(objective=("forget", "retain")[step % 2])
    twin = torch.nn.Parameter(param.detach().clone())
    reloaded = DualOptim([twin], lr=LR, compensated=True)
    reloaded.load_state_dict(opt.state_dict())
    for source, target in ((param, opt), (twin, reloaded)):
        state = target.inner["forget"].state[source]
        assert state["exp_avg"].dtype == torch.float32 and target.compensation[source].dtype == torch.bfloat16
    assert torch.equal(reloaded.compensation[twin], opt.compensation[param])
    for p, o in ((param, opt), (twin, reloaded)):
        p.grad = gradients(1, seed=5)[0]
        o.step(objective="retain")
    assert torch.equal(param, twin) and torch.equal(reloaded.compensation[twin], opt.compensation[param])


# -- the engine: bf16-mixed, bf16, resume, --save-dtype, contradictions --------------------------------------


@pytest.fixture(scope="module")
def data(tofu_dir, tmp_path_factory):
    return write_sets(tofu_dir, tmp_path_factory.mktemp("precision-data"), 10, 16)


def unlearn(model, data, out, steps, *extra):
    return ["unlearn", "--model", model, "--forget", data / "forget.jsonl", "--retain", data / "retain.jsonl",
            "--loss", "IDK+GD", "--steps", steps, "--lr", 1e-3, "--batch-size", 2, "--max-length", 48,
            "--show-samples", 0, "--out", out, *extra]


def test_bf16_mixed_keeps_float32_master_weights_and_states_and_tracks_fp32(tiny_llama, data, tmp_path):
    runs = {}
    for precision in ("fp32", "bf16-mixed"):
        out = tmp_path / precision
        assert run_cli(*unlearn(tiny_llama, data, out, 4, "--precision", precision, "--save-every", 2,
                                "--save-dtype", "float32")) == 0
        runs[precision] = out
    mixed = runs["bf16-mixed"]
    checkpoint = mixed / "checkpoints" / "step-2"
    assert {t.dtype for t in load_file(str(checkpoint / "model.safetensors")).values()} == {torch.float32}
    states = torch.load(checkpoint / "optimizer.pt", weights_only=True)["state"]
    floats = [t for s in states.values() for t in _tensors(s) if t.is_floating_point() and t.ndim > 0]
    assert floats and {t.dtype for t in floats} == {torch.float32}  # moments of base and deltas: float32
    report = json.loads((mixed / "report.json").read_text())
    assert report["precision"] == {"mode": "bf16-mixed", "weights": "float32", "compute": "bfloat16",
                                   "compensation": "none", "saved": "float32"}
    assert "precision: bf16-mixed" in (mixed / "config.yaml").read_text()
    assert "precision bf16-mixed" in (mixed / "report.md").read_text()
    # bf16 autocast changes the forward's rounding, not the update: the displacement from the start agrees
    start = load_file(str(tiny_llama / "model.safetensors"))
    a = load_file(str(runs["fp32"] / "final" / "model.safetensors"))
    b = load_file(str(mixed / "final" / "model.safetensors"))
    moved = torch.cat([(a[k] - start[k]).flatten() for k in start])
    moved_mixed = torch.cat([(b[k] - start[k]).flatten() for k in start])
    assert moved.abs().max() > 1e-3
    assert (moved_mixed - moved).norm() < 0.05 * moved.norm()  # measured 0.014
    assert not torch.equal(moved_mixed, moved)  # the forward did run in bf16


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def resume_and_compare(make_run, out_whole, out_resumed, steps: int = 4) -> dict:
    """`resume_from_step_2` on `make_run(out, steps, extra)`; the weights moved after the checkpoint. Returns the
    checkpoint's weights."""
    from tests.helpers import resume_from_step_2

    checkpoint = resume_from_step_2(lambda out, extra: make_run(out, steps, extra), out_resumed, out_whole)
    a = load_file(str(out_whole / "model.safetensors"))
    saved = load_file(str(next(checkpoint.glob("model*.safetensors"))))
    assert max((a[k].double() - saved[k].double()).abs().max().item() for k in a) > 0  # steps 3-4 moved them
    return saved


@pytest.mark.parametrize("precision,scheme", [("bf16-mixed", "doplus"), ("bf16", "doplus"), ("bf16", "dualoptim"),
                                              ("bf16", "alternate")])
def test_resume_is_bit_identical_under_the_bf16_precisions(tiny_llama, data, tmp_path, precision, scheme):
    def make_run(out, steps, extra):
        assert run_cli(*unlearn(tiny_llama, data, out, steps, "--precision", precision, "--scheme", scheme,
                                "--save-dtype", "float32", *extra)) == 0

    saved = resume_and_compare(make_run, tmp_path / "whole", tmp_path / "resumed")
    assert {t.dtype for t in saved.values()} == {torch.float32 if precision == "bf16-mixed" else torch.bfloat16}
    if precision == "bf16":  # the compensation buffers are in the checkpoint, in bf16
        state = torch.load(tmp_path / "resumed" / "checkpoints" / "step-2" / "optimizer.pt", weights_only=True)
        buffers = (list(state["compensation"].values()) if "compensation" in state else
                   [s["compensation"] for s in state["state"].values()])
        assert len(buffers) == len(saved) and {b.dtype for b in buffers} == {torch.bfloat16}
        assert any(b.abs().max() > 0 for b in buffers)


@pytest.mark.cpu_processes
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16"])
def test_two_process_resume_is_bit_identical_under_the_bf16_precisions(tiny_llama, data, tmp_path, precision):
    from tests.helpers import two_processes

    def make_run(out, steps, extra):
        two_processes(unlearn(tiny_llama, data, out, steps, "--precision", precision, *extra))

    resume_and_compare(make_run, tmp_path / "whole", tmp_path / "resumed")
    report = json.loads((tmp_path / "resumed" / "report.json").read_text())
    assert report["environment"]["world_size"] == 2 and report["precision"]["mode"] == precision


@pytest.mark.parametrize("precision,save_dtype,expected", [
    ("fp32", None, torch.float32), ("bf16-mixed", None, torch.bfloat16), ("bf16", None, torch.bfloat16),
    ("bf16", "float32", torch.float32), ("fp32", "bfloat16", torch.bfloat16),
])
def test_save_dtype_sets_the_final_files_dtype(tiny_llama, data, tmp_path, precision, save_dtype, expected):
    out = tmp_path / "run"
    extra = ["--save-dtype", save_dtype] if save_dtype else []
    assert run_cli(*unlearn(tiny_llama, data, out, 1, "--precision", precision, *extra)) == 0
    assert {t.dtype for t in load_file(str(out / "final" / "model.safetensors")).values()} == {expected}
    config = json.loads((out / "final" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == str(expected).removeprefix("torch.")


@pytest.mark.parametrize("extra,message", [
    (["--precision", "fp16"], "unknown precision 'fp16': choose one of auto, fp32, bf16-mixed, bf16"),
    (["--save-dtype", "int8"], "unknown save-dtype 'int8': choose one of auto, float32, bfloat16"),
    (["--precision", "bf16", "--dtype", "float32"], "--precision bf16 trains bfloat16 weights, --dtype float32"),
    (["--precision", "fp32", "--dtype", "bfloat16"], "--precision fp32 trains float32 weights, --dtype bfloat16"),
    (["--precision", "bf16", "--state-bits", "8", "--scheme", "joint"],
     "--precision bf16 with --state-bits 8 needs --scheme doplus"),
])
def test_bad_precision_input_is_one_line_and_exit_code_2(tiny_llama, data, tmp_path, capsys, extra, message):
    capsys.readouterr()
    assert run_cli(*unlearn(tiny_llama, data, tmp_path / "out", 1, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


def test_bf16_mixed_with_a_bfloat16_load_dtype_is_accepted_and_auto_follows_the_load_dtype(tiny_llama, data,
                                                                                          tmp_path):
    out = tmp_path / "run"
    assert run_cli(*unlearn(tiny_llama, data, out, 1, "--dtype", "bfloat16", "--loss", "NPO+GD")) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["precision"]["mode"] == "bf16-mixed"  # auto with a bf16 load dtype (CUDA's default)
    assert report["environment"]["dtype"] == "float32"  # float32 master weights ...
    parameters = sum(t.numel() for t in load_file(str(tiny_llama / "model.safetensors")).values())
    assert 0 < report["reference"]["memory_gb"] * 1e9 < 2.1 * parameters  # ... and a bf16 reference (2 bytes)


@pytest.mark.cpu_processes
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16"])
def test_fsdp_keeps_float32_or_compensated_shards_and_tracks_one_float32_process(tiny_llama, data, tmp_path,
                                                                                precision):
    from tests.helpers import two_processes

    one, two = tmp_path / "one", tmp_path / "two"
    assert run_cli(*unlearn(tiny_llama, data, one, 4, "--batch-size", 4, "--precision", "fp32")) == 0
    two_processes(unlearn(tiny_llama, data, two, 4, "--fsdp", "--precision", precision, "--save-every", 2,
                          "--save-dtype", "float32"))
    checkpoint = two / "checkpoints" / "step-2"
    shards = load_file(str(checkpoint / "model.rank1.safetensors"))
    weight_dtype = torch.float32 if precision == "bf16-mixed" else torch.bfloat16
    assert {t.dtype for t in shards.values()} == {weight_dtype}  # float32 master shards under bf16-mixed
    states = torch.load(checkpoint / "optimizer.rank1.pt", weights_only=True)["state"]
    assert {s["exp_avg"].dtype for s in states.values()} == {torch.float32}
    assert all(("compensation" in s) == (precision == "bf16") for s in states.values())
    start = load_file(str(tiny_llama / "model.safetensors"))
    a, b = load_file(str(one / "final" / "model.safetensors")), load_file(str(two / "final" / "model.safetensors"))
    moved = torch.cat([(a[k] - start[k]).flatten() for k in start])
    moved_two = torch.cat([(b[k].float() - start[k]).flatten() for k in start])
    assert moved.abs().max() > 1e-3 and (moved_two - moved).norm() < 0.1 * moved.norm()


def test_bench_precision_shows_the_lost_updates_and_the_bytes(tiny_llama, tmp_path, capsys):
    """`doplus bench precision` on the tiny Llama (weights of scale 0.02) at lr 1e-5: bf16 updated in place
    travels a fraction of fp32's distance; compensated bf16 and bf16-mixed follow fp32's path."""
    capsys.readouterr()
    assert run_cli("bench", "precision", "--model", tiny_llama, "--out", tmp_path, "--steps", 10, "--json") == 0
    rows = {row["mode"]: row for row in json.loads(capsys.readouterr().out)["rows"]}
    assert list(rows) == ["fp32", "bf16-mixed", "bf16", "bf16-uncompensated"]
    assert rows["fp32"]["changed"] > 0.99 and rows["fp32"]["distance_vs_fp32"] == 1.0
    assert rows["bf16-mixed"]["changed"] > 0.99 and rows["bf16-mixed"]["error_vs_fp32"] < 0.05
    # final/ in float32 holds a bf16 run's carried weights θ_bf16 + c: every one moved, on fp32's path
    assert rows["bf16"]["changed"] > 0.99 and rows["bf16"]["error_vs_fp32"] < 0.1
    assert rows["bf16-uncompensated"]["distance_vs_fp32"] < 0.6
    assert rows["bf16-uncompensated"]["changed"] < 0.5 * rows["bf16"]["changed"]
    # DualOptim+ with two objectives: m_B, v_B and m_k, v_k of each objective, float32 (plus step counters)
    for mode, weights, compensation in (("fp32", 4, 0), ("bf16-mixed", 4, 0), ("bf16", 2, 2),
                                        ("bf16-uncompensated", 2, 0)):
        b = rows[mode]["bytes_per_parameter"]
        assert (b["weights"], b["compensation"], b["gradients"]) == (weights, compensation, weights)
        assert b["optimizer_states"] == pytest.approx(24.0, abs=0.05)


def test_multitask_and_align_train_under_each_bf16_precision(tiny_llama, tmp_path):
    """--precision on the other training commands; multitask with LoRA under bf16-mixed: float32 adapters on a
    frozen base loaded at --dtype (bfloat16 here), final/ merged and saved in bfloat16."""
    from tests.helpers import align_args

    folder = tmp_path / "tasks"
    folder.mkdir()
    rows = [{"prompt": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(10)]
    (folder / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "mt"
    assert run_cli("multitask", "--model", tiny_llama, "--task", f"sums={folder / 'sums.jsonl'},metric=exact",
                   "--steps", 3, "--lr", 1e-3, "--batch-size", 2, "--max-length", 48, "--max-new-tokens", 4,
                   "--eval-rows", 2, "--out", out, "--precision", "bf16-mixed", "--dtype", "bfloat16",
                   "--lora-rank", 4) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["precision"]["mode"] == "bf16-mixed" and report["lora"]["adapter_norms"]["delta_total"] > 0
    assert {t.dtype for t in load_file(str(out / "final" / "model.safetensors")).values()} == {torch.bfloat16}
    out = tmp_path / "align"
    assert run_cli(*align_args(tiny_llama, out, "--steps", 3, "--precision", "bf16", "--scheme", "dualoptim")) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["precision"]["mode"] == "bf16" and report["environment"]["dtype"] == "bfloat16"
    assert "precision: bf16" in (out / "config.yaml").read_text()


# Run in a process of its own: accelerate's state is one per process, and other tests' accelerators set it to "no".
PREPARED_FORWARD = """
import json, torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM
from doplus_cli.engine.training_precision import autocast
torch.manual_seed(0)
config = LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
model = LlamaForCausalLM(config)
ids = torch.randint(0, config.vocab_size, (4, 64))
with torch.no_grad(), autocast("bf16-mixed", torch.device("cpu")):
    own = model(ids).logits
prepared = Accelerator(cpu=True, mixed_precision="bf16").prepare(model)
with torch.no_grad():
    theirs = prepared(ids).logits
print(json.dumps({"own": [str(own.dtype), own.nbytes], "theirs": [str(theirs.dtype), theirs.nbytes],
                  "equal": bool(torch.equal(theirs, own.float()))}))
"""


def test_accelerates_bf16_mixed_precision_returns_a_float32_copy_of_the_logits_that_doplus_autocast_does_not():
    """Why bf16-mixed runs under doplus's own autocast (engine/training_precision.autocast) and not accelerate's
    `mixed_precision="bf16"` (docs/architecture.md, "Hand-written where a library has it"): the model accelerate
    prepares converts its outputs to float32, so every forward holds a float32 copy of the logits (twice the bf16
    bytes: 525 MB for a batch of 4 x 256 tokens over Llama 3's 128,256-token vocabulary) whose values are the
    bf16 ones, upcast. If accelerate stops doing so, this test fails and the piece can be replaced."""
    import os
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", PREPARED_FORWARD], capture_output=True, text=True, timeout=300,
                            env=os.environ.copy())
    assert result.returncode == 0, result.stderr[-2000:]
    found = json.loads(result.stdout.splitlines()[-1])
    assert found["own"] == ["torch.bfloat16", 4 * 64 * 4096 * 2]
    assert found["theirs"] == ["torch.float32", 4 * 64 * 4096 * 4]
    assert found["equal"]  # the same values: the copy buys no precision
