"""SimNPO, RMU (+ EMBED), UNDIAL, WGA, SatImp and CE-U: each against a plain float64 loop on
hand-made logits and activations with a prompt, padding and the answer mask (-100 labels), values and
gradients; RMU trains only its chosen modules; each loss steps under every scheme, with 8-bit states and LoRA,
and on two processes; bad input is one line with exit code 2."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from doplus_cli.losses import FORGET_LOSSES, RETAIN_LOSSES, LossContext, LossParams, rmu_direction, rmu_layer_index
from tests.helpers import run_cli, two_processes, write_sets

NEW_FORGET = ("SimNPO", "RMU", "UNDIAL", "WGA", "SatImp", "CE-U")
PARAMS = LossParams(simnpo_beta=1.5, simnpo_gamma=0.4, undial_beta=2.5, wga_beta=0.7, satimp_beta1=1.3,
                    satimp_beta2=0.6, rmu_layer=1, rmu_coeff=2.0, seed=3)
VOCAB, WIDTH, LAYERS = 5, 3, 2
# Two rows of 6 tokens: row 0 has a 2-token prompt and a 4-token answer; row 1 a 1-token prompt, a 2-token
# answer and 3 padding positions (attention 0). -100 marks everything that is not an answer token.
LABELS = torch.tensor([[-100, -100, 3, 1, 0, 2], [-100, 2, 4, -100, -100, -100]])
ATTENTION = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
OFF_ANSWER = 40.0  # logits and activations where no answer token is: any leak past the mask would show


def hand_made_logits(shift: float) -> torch.Tensor:
    """[2, 6, 5] float64: a fixed pattern; positions that predict no answer token hold OFF_ANSWER."""
    logits = torch.empty(2, 6, VOCAB, dtype=torch.float64)
    for b in range(2):
        for t in range(6):
            for v in range(VOCAB):
                logits[b, t, v] = ((3 * b + 5 * t + 7 * v) % 11) / 3.0 - 1.5 + shift * (v - 2)
            if t == 5 or LABELS[b, t + 1] == -100:
                logits[b, t] = OFF_ANSWER
    return logits


def hand_made_hidden(shift: float) -> torch.Tensor:
    """[LAYERS, 2, 6, 3] float64 activations; positions off the answer hold OFF_ANSWER."""
    hidden = torch.empty(LAYERS, 2, 6, WIDTH, dtype=torch.float64)
    for layer in range(LAYERS):
        for b in range(2):
            for t in range(6):
                for i in range(WIDTH):
                    hidden[layer, b, t, i] = ((2 * layer + 3 * b + t + 4 * i) % 7) / 2.0 - 1.0 + shift * i
                if LABELS[b, t] == -100:
                    hidden[layer, b, t] = OFF_ANSWER
    return hidden


class Emit(nn.Module):
    """A decoder layer that outputs fixed activations (as a tuple, like older transformers layers)."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = nn.Parameter(hidden.clone())

    def forward(self):
        return (self.hidden * 1.0,)


class HandMadeModel(nn.Module):
    """Returns the hand-made logits; its `layers` emit the hand-made activations, which RMU's hook reads."""

    def __init__(self, logits: torch.Tensor, hidden: torch.Tensor) -> None:
        super().__init__()
        self.logits = nn.Parameter(logits.clone())
        self.layers = nn.ModuleList(Emit(h) for h in hidden)

    def forward(self, input_ids, attention_mask):
        for layer in self.layers:
            layer()
        return SimpleNamespace(logits=self.logits * 1.0)


def batch() -> dict:
    answer = {"input_ids": torch.zeros(2, 6, dtype=torch.long), "attention_mask": ATTENTION, "labels": LABELS}
    return {"answer": answer}


# ---- the reference: plain Python float64 over rows, positions and the vocabulary ----

def log_softmax(row: list[float]) -> list[float]:
    top = max(row)
    log_z = top + math.log(sum(math.exp(x - top) for x in row))
    return [x - log_z for x in row]


def softmax(row: list[float]) -> list[float]:
    return [math.exp(x) for x in log_softmax(row)]


def answer_positions():
    """(row, position t, label y) for every position t whose next token t+1 is an answer token."""
    return [(b, t, int(LABELS[b, t + 1])) for b in range(2) for t in range(5) if LABELS[b, t + 1] != -100]


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def reference_loss(name: str, logits: torch.Tensor, ref_logits: torch.Tensor, hidden, ref_hidden) -> float:
    P = PARAMS
    rows = {(b, t): logits[b, t].tolist() for b, t, _ in answer_positions()}
    positions = answer_positions()
    n = len(positions)
    if name == "SimNPO":  # per row: NLL summed over its answer tokens / their count
        values = []
        for b in range(2):
            mine = [(t, y) for r, t, y in positions if r == b]
            nll = -sum(log_softmax(rows[b, t])[y] for t, y in mine) / len(mine)
            values.append(log_sigmoid(P.simnpo_beta * nll - P.simnpo_gamma))
        return -(2 / P.simnpo_beta) * sum(values) / len(values)
    if name in ("WGA", "SatImp"):
        total = 0.0
        for b, t, y in positions:
            lp = log_softmax(rows[b, t])[y]
            p = math.exp(lp)
            weight = p ** P.wga_beta if name == "WGA" else p ** P.satimp_beta1 * (1 - p) ** P.satimp_beta2
            total += weight * -lp
        return -total / n
    if name in ("UNDIAL", "CE-U"):
        total = 0.0
        for b, t, y in positions:
            lp = log_softmax(rows[b, t])
            if name == "UNDIAL":
                lowered = [z - (P.undial_beta if v == y else 0.0) for v, z in enumerate(ref_logits[b, t].tolist())]
                target = softmax(lowered)
            else:
                others = softmax([z for v, z in enumerate(rows[b, t]) if v != y])
                target = others[:y] + [0.0] + others[y:]
            total += -sum(q * x for q, x in zip(target, lp))
        return total / n
    if name in ("RMU", "EMBED"):  # activations at the answer tokens themselves (unshifted labels)
        layer = P.rmu_layer
        draw = torch.rand(WIDTH, generator=torch.Generator().manual_seed(P.seed), dtype=torch.float64).tolist()
        norm = math.sqrt(sum(x * x for x in draw))
        tokens = [(b, t) for b in range(2) for t in range(6) if LABELS[b, t] != -100]
        total = 0.0
        for b, t in tokens:
            h = hidden[layer, b, t].tolist()
            target = ([P.rmu_coeff * x / norm for x in draw] if name == "RMU" else ref_hidden[layer, b, t].tolist())
            total += sum((a - c) ** 2 for a, c in zip(h, target)) / WIDTH
        return total / len(tokens)
    raise KeyError(name)


def reference_logit_gradient(name: str, logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """d loss / d logits: (p - target) / N at each answer position, target the constant the loss builds:
    one-hot(y) weighted by -w for WGA and SatImp (their weights are detached), q for UNDIAL and CE-U."""
    P = PARAMS
    grad = torch.zeros_like(logits)
    positions = answer_positions()
    n = len(positions)
    for b, t, y in positions:
        row = logits[b, t].tolist()
        p = softmax(row)
        if name in ("WGA", "SatImp"):
            py = p[y]
            w = py ** P.wga_beta if name == "WGA" else py ** P.satimp_beta1 * (1 - py) ** P.satimp_beta2
            values = [-w * (p[v] - (1.0 if v == y else 0.0)) / n for v in range(VOCAB)]
        elif name == "UNDIAL":
            q = softmax([z - (P.undial_beta if v == y else 0.0) for v, z in enumerate(ref_logits[b, t].tolist())])
            values = [(p[v] - q[v]) / n for v in range(VOCAB)]
        else:  # CE-U
            rest = 1 - p[y]
            values = [(p[v] - (0.0 if v == y else p[v] / rest)) / n for v in range(VOCAB)]
        grad[b, t] = torch.tensor(values, dtype=torch.float64)
    return grad


@pytest.fixture
def models():
    model = HandMadeModel(hand_made_logits(0.0), hand_made_hidden(0.0))
    reference = HandMadeModel(hand_made_logits(0.3), hand_made_hidden(0.25)).requires_grad_(False)
    return model, reference


@pytest.mark.parametrize("kind,name", [("forget", n) for n in NEW_FORGET] + [("retain", "EMBED")])
def test_loss_equals_a_float64_loop_on_hand_made_logits_and_activations(models, kind, name):
    model, reference = models
    spec = (FORGET_LOSSES if kind == "forget" else RETAIN_LOSSES)[name]
    value = spec.fn(LossContext(model, reference if spec.needs_reference else None, params=PARAMS), batch())
    assert value.dtype == torch.float64
    expected = reference_loss(name, model.logits.detach(), reference.logits, model_hidden(model),
                              model_hidden(reference))
    assert value.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert abs(expected) > 1e-3  # the hand-made inputs make every term count


def model_hidden(model: HandMadeModel) -> torch.Tensor:
    return torch.stack([layer.hidden.detach() for layer in model.layers])


@pytest.mark.parametrize("name", ["WGA", "SatImp", "UNDIAL", "CE-U"])
def test_gradient_treats_the_weights_and_targets_as_constants(models, name):
    """WGA's and SatImp's p_t weights, CE-U's and UNDIAL's soft targets are detached: the gradient is
    (p - target) / N exactly, never zero at the padding."""
    model, reference = models
    spec = FORGET_LOSSES[name]
    spec.fn(LossContext(model, reference if spec.needs_reference else None, params=PARAMS), batch()).backward()
    expected = reference_logit_gradient(name, model.logits.detach(), reference.logits)
    assert torch.allclose(model.logits.grad, expected, rtol=1e-10, atol=1e-14)
    assert expected.abs().sum() > 1e-3


def test_rmu_gradient_reaches_only_the_steered_layer_and_answer_tokens(models):
    """d/dh of mean_t (1/d)||h_t - c u||^2 = 2 (h_t - c u) / (N d) at answer tokens of layer 1, 0 elsewhere."""
    model, _ = models
    FORGET_LOSSES["RMU"].fn(LossContext(model, params=PARAMS), batch()).backward()
    u = rmu_direction(PARAMS, WIDTH, torch.device("cpu"), torch.float64)
    tokens = [(b, t) for b in range(2) for t in range(6) if LABELS[b, t] != -100]
    expected = torch.zeros(2, 6, WIDTH, dtype=torch.float64)
    for b, t in tokens:
        expected[b, t] = 2 * (model.layers[1].hidden[b, t].detach() - PARAMS.rmu_coeff * u) / (len(tokens) * WIDTH)
    assert torch.allclose(model.layers[1].hidden.grad, expected, rtol=1e-12, atol=1e-15)
    assert model.layers[0].hidden.grad is None or not model.layers[0].hidden.grad.any()


def test_rmu_direction_is_a_seeded_unit_vector_and_the_default_layer_follows_the_depth():
    u = rmu_direction(LossParams(seed=3), 64, torch.device("cpu"), torch.float64)
    assert u.norm().item() == pytest.approx(1.0, rel=1e-12) and (u >= 0).all()
    assert torch.equal(u, rmu_direction(LossParams(seed=3), 64, torch.device("cpu"), torch.float64))
    assert not torch.equal(u, rmu_direction(LossParams(seed=4), 64, torch.device("cpu"), torch.float64))
    # OpenUnlearning's layer 7 where the model has it; 7/32 of the depth, rounded down, below that
    for depth, layer in ((32, 7), (24, 7), (8, 7), (7, 1), (6, 1), (4, 0), (2, 0)):
        assert rmu_layer_index(LossParams(), depth) == layer
    assert rmu_layer_index(LossParams(rmu_layer=1), 2) == 1


# ---- end to end on the tiny Llama ----

PAIRS = {"SimNPO": "SimNPO+GD", "RMU": "RMU+EMBED", "UNDIAL": "UNDIAL+GD", "WGA": "WGA+KL", "SatImp": "SatImp+GD",
         "CE-U": "CE-U+GD"}


@pytest.fixture(scope="module")
def data(tofu_dir, tmp_path_factory):
    folder = write_sets(tofu_dir, tmp_path_factory.mktemp("data-2026"), 8, 12)
    return {role: folder / f"{role}.jsonl" for role in ("forget", "retain")}


def unlearn(model, data, out, *extra):
    return ["unlearn", "--model", model, "--forget", data["forget"], "--retain", data["retain"], "--out", out,
            "--batch-size", 2, "--max-length", 48, "--show-samples", 0, "--lr", 1e-3, "--steps", 2,
            "--retain-freq", 1, *extra]


def changed_tensors(start: dict, final: dict) -> set[str]:
    """Tensors the run changed, compared in the saved dtype: on CUDA a run loads the float32 test model in
    bfloat16 and saves bfloat16, so an untouched tensor comes back as the start rounded to bfloat16."""
    return {name for name in start if not torch.equal(start[name].to(final[name].dtype), final[name])}


@pytest.mark.parametrize("scheme", ["joint", "alternate", "dualoptim", "doplus"])
@pytest.mark.parametrize("name", NEW_FORGET)
def test_each_loss_steps_under_each_scheme(tiny_llama, data, tmp_path, name, scheme):
    out = tmp_path / "run"
    assert run_cli(*unlearn(tiny_llama, data, out, "--loss", PAIRS[name], "--scheme", scheme)) == 0
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["objective"] for r in records] == (["joint"] * 2 if scheme == "joint" else ["forget", "retain"])
    keys = ("forget_loss", "retain_loss") if scheme == "joint" else ("forget_loss",)
    assert all(math.isfinite(records[0][k]) for k in keys) and math.isfinite(records[-1]["retain_loss"])
    changed = changed_tensors(load_file(str(tiny_llama / "model.safetensors")),
                              load_file(str(out / "final" / "model.safetensors")))
    if name == "RMU":  # 2 layers: RMU steers layer 0 and trains its MLP output projection only
        assert changed == {"model.layers.0.mlp.down_proj.weight"}
    else:
        assert "lm_head.weight" in changed and len(changed) > 10


@pytest.mark.parametrize("name", NEW_FORGET)
def test_each_loss_steps_with_8bit_states_and_lora(tiny_llama, data, tmp_path, name):
    out = tmp_path / "run"
    code = run_cli(*unlearn(tiny_llama, data, out, "--loss", PAIRS[name], "--scheme", "doplus", "--state-bits", 8,
                            "--lora-rank", 2, "--lora-targets", "q_proj,down_proj",
                            # float32 weights on every device: on CUDA the default loads and saves bf16, and RMU's
                            # merged update (two steps, the first at lr 0) rounded away there (seen on an H100)
                            "--dtype", "float32"))
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["lora"]["adapter_norms"]["delta_total"] > 0  # the adapters trained
    changed = changed_tensors(load_file(str(tiny_llama / "model.safetensors")),
                              load_file(str(out / "final" / "model.safetensors")))
    adapted = {f"model.layers.{i}.{m}.weight" for i in range(2) for m in ("self_attn.q_proj", "mlp.down_proj")}
    assert changed <= adapted and changed
    if name == "RMU":  # only layer 0's down_proj adapters were left trainable
        assert changed == {"model.layers.0.mlp.down_proj.weight"}


def test_rmu_trains_exactly_the_modules_named_and_nothing_else(tiny_llama, data, tmp_path):
    out = tmp_path / "run"
    code = run_cli(*unlearn(tiny_llama, data, out, "--loss", "RMU+EMBED", "--scheme", "dualoptim", "--state-bits", 8,
                            "--rmu-layer", 1, "--rmu-update-layers", "0,1", "--rmu-modules",
                            "mlp.down_proj,self_attn.o_proj", "--rmu-coeff", 5))
    assert code == 0
    start = load_file(str(tiny_llama / "model.safetensors"))
    final = load_file(str(out / "final" / "model.safetensors"))
    assert changed_tensors(start, final) == {f"model.layers.{i}.{m}.weight" for i in (0, 1)
                                             for m in ("mlp.down_proj", "self_attn.o_proj")}
    assert all(torch.equal(start[k].to(final[k].dtype), final[k]) for k in start
               if "down_proj" not in k and "o_proj" not in k)
    report = json.loads((out / "report.json").read_text())
    assert report["data"]["rmu_trained_modules"] == ["0.mlp.down_proj", "0.self_attn.o_proj", "1.mlp.down_proj",
                                                     "1.self_attn.o_proj"]


@pytest.mark.cpu_processes
@pytest.mark.parametrize("loss,scheme,sharding", [("RMU+EMBED", "doplus", []), ("UNDIAL+GD", "joint", []),
                                                   ("RMU+EMBED", "doplus", ["--fsdp"])],
                         ids=["rmu-doplus", "undial-joint", "rmu-doplus-fsdp"])
def test_two_processes_at_batch_b_equal_one_at_2b(tiny_llama, data, tmp_path, loss, scheme, sharding):
    """Token means divide by the global token count: 2 processes at batch 2 train like 1 at batch 4 (DDP, and
    FSDP, where RMU's frozen weights and hooked layer are sharded and EMBED's reference too)."""
    one, two = tmp_path / "one", tmp_path / "two"
    common = ["--loss", loss, "--scheme", scheme, "--steps", 4, "--seed", 1]
    assert run_cli(*unlearn(tiny_llama, data, one, "--batch-size", 4, *common)) == 0
    two_processes(unlearn(tiny_llama, data, two, "--batch-size", 2, *common, *sharding))
    a, b = (load_file(str(out / "final" / "model.safetensors")) for out in (one, two))
    start = load_file(str(tiny_llama / "model.safetensors"))
    assert max((a[k] - start[k]).abs().max().item() for k in a) > 1e-3
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--loss", "SIMNPO+GD"], "unknown loss 'SIMNPO+GD'"),
        (["--loss", "RMU+EMBEDDING"], "unknown loss 'RMU+EMBEDDING'"),
        (["--loss", "RMU+EMBED", "--rmu-layer", 5], "--rmu-layer 5: out of range, the model has 2 decoder layers"),
        (["--loss", "GA+EMBED", "--rmu-layer", 2], "--rmu-layer 2: out of range, the model has 2 decoder layers"),
        (["--loss", "RMU+EMBED", "--rmu-layer", -1], "--rmu-layer must be a layer number >= 0, got -1"),
        (["--loss", "RMU+EMBED", "--rmu-update-layers", "0,3"], "--rmu-update-layers 0,3: layer 3 is out of range"),
        (["--loss", "RMU+EMBED", "--rmu-update-layers", "0,x"],
         "--rmu-update-layers 0,x: 'x' is not a whole number >= 0"),
        (["--loss", "RMU+EMBED", "--rmu-modules", "mlp.nothing"], "--rmu-modules mlp.nothing: layer 0 has no module"),
        (["--loss", "RMU+GD", "--lora-rank", 2, "--lora-targets", "q_proj"], "none of their weights is trainable"),
        (["--loss", "SimNPO+GD", "--simnpo-beta", -1], "--simnpo-beta must be a number >= 0, got -1.0"),
        (["--loss", "SimNPO+GD", "--simnpo-beta", 0], "--simnpo-beta must be > 0 for SimNPO"),
        (["--loss", "UNDIAL+GD", "--undial-beta", -2], "--undial-beta must be a number >= 0, got -2.0"),
        (["--loss", "WGA+GD", "--wga-beta", -0.5], "--wga-beta must be a number >= 0, got -0.5"),
        (["--loss", "SatImp+GD", "--satimp-beta2", -1], "--satimp-beta2 must be a number >= 0, got -1.0"),
        (["--loss", "RMU+EMBED", "--rmu-coeff", -3], "--rmu-coeff must be a number >= 0, got -3.0"),
    ],
)
def test_bad_input_is_one_line_with_exit_code_2(tiny_llama, data, tmp_path, capsys, flags, needle):
    capsys.readouterr()
    assert run_cli(*unlearn(tiny_llama, data, tmp_path / "out", *flags)) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err
    assert err.count("\n") == 0 and "Traceback" not in err


def test_a_checkpoint_from_before_these_options_resumes_at_their_defaults_and_refuses_other_values():
    import dataclasses

    from doplus_cli.commands.unlearn import UnlearnConfig
    from doplus_cli.engine.checkpoint import differing_keys

    now = UnlearnConfig().to_dict()
    added = {f.name for f in dataclasses.fields(LossParams)} - {"seed"}
    assert added <= set(now)  # every hyper-parameter is a recipe key
    before = {k: v for k, v in now.items() if k not in added}
    assert differing_keys(before, now) == []
    assert differing_keys(before, {**now, "rmu_coeff": 6.5, "rmu_layer": 1}) == ["rmu_coeff", "rmu_layer"]


def test_rmu_default_modules_follow_the_architecture_phi_fc2():
    """A 9-layer Phi: layer 7 fits, so layers 5-7 train their MLP output projection, which Phi calls fc2."""
    from transformers import PhiConfig, PhiForCausalLM

    from doplus_cli.losses import prepare_rmu

    model = PhiForCausalLM(PhiConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=9,
                                     num_attention_heads=2))
    assert prepare_rmu(model, LossParams()) == ["5.mlp.fc2", "6.mlp.fc2", "7.mlp.fc2"]
    assert sorted(n for n, p in model.named_parameters() if p.requires_grad) == [
        f"model.layers.{i}.mlp.fc2.{kind}" for i in (5, 6, 7) for kind in ("bias", "weight")]


RECIPE_PARAMS = {
    "simnpo_gd": ("SimNPO+GD", {"simnpo_beta": 4.5, "simnpo_gamma": 0.0, "retain_coeff": 0.125}),
    "rmu_embed": ("RMU+EMBED", {"rmu_layer": 7, "rmu_coeff": 20.0, "rmu_update_layers": (5, 6, 7)}),
    "undial_gd": ("UNDIAL+GD", {"undial_beta": 10.0}),
    "wga_gd": ("WGA+GD", {"wga_beta": 1.0}),
    "satimp_gd": ("SatImp+GD", {"satimp_beta1": 5.0, "satimp_beta2": 1.0}),
    "ceu_gd": ("CE-U+GD", {}),
}


@pytest.mark.parametrize("model", ["phi-1.5", "llama2-7b"])
@pytest.mark.parametrize("name", list(RECIPE_PARAMS))
def test_tofu_recipes_of_the_2026_losses(model, name):
    """Each loss has a TOFU recipe per paper model: the paper's lr, steps and 1:5 cycle, the method's values."""
    from pathlib import Path

    from doplus_cli.commands.unlearn import UnlearnConfig
    from doplus_cli.config import resolve_config

    path = Path(__file__).resolve().parents[1] / "recipes" / "tofu" / model / f"{name}.yaml"
    config = resolve_config(str(path), {}, UnlearnConfig)
    loss, values = RECIPE_PARAMS[name]
    assert config.loss == loss and config.model == f"locuslab/tofu_ft_{model}"
    assert (config.lr, config.steps, config.forget_freq, config.retain_freq, config.scheme) == (
        1e-5, 300, 1, 5, "doplus")
    assert {k: getattr(config, k) for k in values} == values
    if name == "rmu_embed":
        assert config.rmu_modules == ({"phi-1.5": "mlp.fc2", "llama2-7b": "mlp.down_proj"}[model],)
