"""Evaluations on CPU run their linear layers on oneDNN with packed weights (`packed_linears`): the products agree
with a float64 reference as torch's own do, every plain `nn.Linear` really ran packed, tied weights pack once,
the layers get their own forward back, and the switch and the floor's rates behave as documented."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from doplus_cli.evaluation import compute
from doplus_cli.evaluation.compute import matmul_gflops, packed_linears


def _model(tied: bool, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                         attention_bias=True)  # biases on q/k/v/o: the packed product adds them too
    return LlamaForCausalLM(config).to(dtype).eval()


def _linears(model) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


def test_this_torch_build_has_the_packed_linear():
    assert compute.onednn_linear_available()  # x86 CPU builds of torch ship oneDNN; CI runs one


def test_a_packed_linear_agrees_with_a_float64_reference_as_torch_does():
    torch.manual_seed(1)
    layer = torch.nn.Linear(576, 1536)
    x = torch.randn(3, 17, 576)
    reference = x.double() @ layer.weight.double().T + layer.bias.double()
    with torch.no_grad():
        plain = layer(x)
        with packed_linears(layer) as swapped:
            packed = layer(x)
    assert swapped == 1
    scale = reference.abs().max().item()
    # float32 with K = 576: both kernels within a few 1e-6 of the output's scale; a wrong weight layout, a missing
    # bias or a transposed product would be off by the scale itself
    assert (plain.double() - reference).abs().max().item() < 1e-5 * scale
    assert (packed.double() - reference).abs().max().item() < 1e-5 * scale
    assert packed.dtype == torch.float32 and packed.shape == (3, 17, 1536)


def test_every_plain_linear_runs_packed_and_tied_weights_pack_once(monkeypatch):
    model = _model(tied=True)
    ids = torch.randint(0, 300, (2, 9))
    with torch.no_grad():
        before = model(ids).logits
    calls, packs = [], []
    original_linear, original_pack = compute._packed_linear, compute._pack
    monkeypatch.setattr(compute, "_packed_linear", lambda *a: calls.append(1) or original_linear(*a))
    monkeypatch.setattr(compute, "_pack", lambda w, *a: packs.append(w) or original_pack(w, *a))
    linears = _linears(model)
    assert len(linears) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the output layer
    with packed_linears(model) as swapped, torch.no_grad():
        packed = model(ids).logits
    assert swapped == len(linears)
    assert len(calls) == len(linears)  # one forward: each layer once, all through the packed product
    # the output layer shares the embedding's weight (not a linear layer): every linear weight is packed once
    assert len(packs) == len({id(m.weight) for m in linears}) == len(linears)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens(ids), model.model.embed_tokens.weight[ids])  # the embedding unchanged
    torch.testing.assert_close(packed, before, rtol=1e-5, atol=1e-5)
    # back to torch's own layers: no instance forward left, the very same logits as before
    assert all("forward" not in vars(m) for m in linears)
    calls.clear()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    assert not calls


def test_shared_weights_across_layers_are_packed_once(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    model[1].weight = model[0].weight
    packs = []
    original = compute._pack
    monkeypatch.setattr(compute, "_pack", lambda w, *a: packs.append(w) or original(w, *a))
    with packed_linears(model) as swapped:
        assert swapped == 2
    assert len(packs) == 1


def test_bfloat16_layers_run_packed_within_bfloat16_rounding():
    model = _model(tied=False, dtype=torch.bfloat16)
    layer = model.model.layers[0].mlp.up_proj
    torch.manual_seed(2)
    x = torch.randn(5, 48).to(torch.bfloat16)
    reference = x.double() @ layer.weight.double().T
    with packed_linears(model) as swapped, torch.no_grad():
        out = layer(x)
    assert swapped == len(_linears(model))
    assert out.dtype == torch.bfloat16
    # bfloat16 keeps 8 significant bits: the output is rounded once, to within 2^-8 of its scale
    assert (out.double() - reference).abs().max().item() < 2 ** -7 * reference.abs().max().item()


def test_what_is_not_packed(monkeypatch):
    class Custom(torch.nn.Linear):  # a subclass (LoRA, quantized layers) keeps its own forward
        pass

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Custom(8, 8), torch.nn.Linear(8, 8).double())
    with packed_linears(model) as swapped:
        assert swapped == 1
        assert "forward" in vars(model[0]) and "forward" not in vars(model[1]) and "forward" not in vars(model[2])
    assert "forward" not in vars(model[0])
    with packed_linears(None) as swapped:
        assert swapped == 0
    monkeypatch.setenv(compute.ONEDNN_VARIABLE, "0")  # the documented switch
    with packed_linears(model) as swapped:
        assert swapped == 0 and "forward" not in vars(model[0])
    assert list(matmul_gflops(seconds=0.01)) == ["matmul"]
    monkeypatch.delenv(compute.ONEDNN_VARIABLE)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # one process of several: left alone
    with packed_linears(model) as swapped:
        assert swapped == 0


def test_the_layers_come_back_when_the_block_raises():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(RuntimeError), packed_linears(model):
        raise RuntimeError("a suite failed")
    assert "forward" not in vars(model[0])


def test_the_floor_rates_name_both_kernels_on_cpu():
    rates = matmul_gflops(size=256, seconds=0.01)
    assert set(rates) == {"matmul", compute.ONEDNN_KERNEL}
    assert all(rate > 0 for rate in rates.values())


def test_the_floor_is_over_the_fastest_kernel_and_names_torchs_matmul_beside_it():
    """Hand-computed: 100 tokens x 2 x 1M parameters = 2e8 FLOP; over oneDNN's 400 GFLOP/s 0.5 ms, over torch's
    matmul at 100 GFLOP/s 2 ms; a wall of 2 s is 4000x and 1000x. A floor the evaluation could beat is none (a
    Zen 5 EPYC read torch's matmul at 219 GFLOP/s and oneDNN's at 492, and an evaluation at 0.95x the first)."""
    from doplus_cli.progress import TokenCount

    tokens = TokenCount(prompt=10, generated=20, teacher_forced=70)
    record = compute.compute_floor(tokens, 1_000_000, {"matmul": 100.0, compute.ONEDNN_KERNEL: 400.0}, 2.0,
                                   "float32")
    assert record["floor_kernel"] == compute.ONEDNN_KERNEL and record["kernel_gflops"][record["floor_kernel"]] == 400.0
    assert record["floor_s"] == pytest.approx(5e-4) and record["ratio"] == pytest.approx(4000.0)
    assert record["matmul_floor_s"] == pytest.approx(2e-3) and record["matmul_ratio"] == pytest.approx(1000.0)
    line = compute.floor_line(record)
    assert "over 400 GFLOP/s (float32 oneDNN packed linear, the fastest product measured in this run)" in line
    assert "4000.00x the floor" in line and "Over torch's matmul (100 GFLOP/s): floor 0.0 s, 1000.00x." in line
    # where torch's matmul is the fastest (a GPU measures no other kernel), it is the floor, named once
    record = compute.compute_floor(tokens, 1_000_000, {"matmul": 100.0}, 2.0, "bfloat16")
    assert record["floor_kernel"] == "matmul" and record["ratio"] == record["matmul_ratio"] == pytest.approx(1000.0)
    line = compute.floor_line(record)
    assert "(bfloat16 matmul, measured in this run)" in line and "Over torch's matmul" not in line
