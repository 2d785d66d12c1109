"""8-bit states: bitsandbytes' own functions are the reference."""

from __future__ import annotations

import bitsandbytes.functional as bnbf
import pytest
import torch

from doplus_cli.optim import DualOptimPlus, quant
from doplus_cli.optim.kernels import dequantize_blocks, quantize_blocks
from tests.helpers import bnb_quantize, check_8bit_step_against_bitsandbytes, check_dualoptim_8bit_against_adamw8bit


def spread_values(n: int, signed: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.rand(n, generator=g) * 12 - 6)
    x[:256] = 0.0  # an all-zero block
    x[256:512] = 1e-30  # a block of tiny values
    return x if signed else x.abs()


@pytest.mark.parametrize("signed", [True, False])
def test_search_tables_reproduce_bitsandbytes_codes(signed):
    x = spread_values(256 * 3000, signed, seed=1)
    expected_codes, expected_absmax = bnb_quantize(x, signed)
    t = quant.search_tables(signed, "cpu")
    full = (t.bucket_start, t.thresholds, t.skip, t.fixup_steps, t.bucket_threshold, t.bucket_codes)
    codes, absmax = quantize_blocks(x.view(-1, 256), full)
    # the generic path (a fix-up loop over runs of equal thresholds) must agree with the one-threshold path
    generic = quantize_blocks(x.view(-1, 256), full[:3] + (t.fixup_steps + 1,) + full[4:])[0]
    assert torch.equal(generic, codes)
    assert torch.equal(absmax, expected_absmax)
    assert torch.equal(codes.view(-1), expected_codes)
    # and dequantisation is bitsandbytes' code[A]·absmax
    expected = bnbf.dequantize_blockwise(
        expected_codes, absmax=expected_absmax, code=quant.code_map(signed, "cpu"), blocksize=256
    )
    assert torch.equal(dequantize_blocks(codes, absmax, quant.code_map(signed, "cpu")).view(-1), expected)


def test_thresholds_are_sorted_and_bracket_the_map():
    for signed in (True, False):
        thresholds = quant.decision_thresholds(signed, "cpu")
        assert thresholds.shape == (255,)
        assert bool((thresholds[1:] >= thresholds[:-1]).all())
        code = quant.code_map(signed, "cpu")
        # a code's own value quantises to itself
        t = quant.search_tables(signed, "cpu")
        full = (t.bucket_start, t.thresholds, t.skip, t.fixup_steps, t.bucket_threshold, t.bucket_codes)
        own = quantize_blocks(code.view(1, 256), full)[0].view(-1)
        bnb_own, _ = bnb_quantize(code, signed)
        assert torch.equal(own, bnb_own)


def make_params(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    # 70_000 elements: whole blocks plus a short last block (70_000 % 256 = 112); 100 elements: fp32 states
    return [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in [(70_000,), (64, 80), (100,)]]


def run(opt, params, steps, seed=4, frequencies=(1, 2)):
    g = torch.Generator().manual_seed(seed)
    order = ["forget"] * frequencies[0] + ["retain"] * frequencies[1]
    for i in range(steps):
        objective = order[i % len(order)]
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * 0.1 + (0.05 if objective == "forget" else -0.05)).to(
                p.dtype
            )
        opt.step(objective=objective)


@pytest.mark.parametrize("quantize", ["all", "base", "delta"])
def test_fused_8bit_equals_bitsandbytes_reference_path(quantize):
    fused_params, ref_params = make_params(), make_params()
    kwargs = dict(lr=1e-2, weight_decay=0.01, state_bits=8, quantize=quantize)
    fused = DualOptimPlus(fused_params, fused=True, **kwargs)
    reference = DualOptimPlus(ref_params, fused=False, **kwargs)
    run(fused, fused_params, 9)
    run(reference, ref_params, 9)
    # The compiled arithmetic may round the last bit of θ differently from eager code (it is free to
    # reassociate x/y); the 8-bit codes, which a rule or quantiser error would change, must be identical.
    for p, q in zip(fused_params, ref_params):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        a, b = fused.state[p], reference.state[q]
        for key in ("exp_avg", "exp_avg_sq"):
            for sa, sb in ((a, b), (a["delta"]["retain"], b["delta"]["retain"])):
                if sa[key].dtype == torch.uint8:
                    assert torch.equal(sa[key], sb[key]), key
                    torch.testing.assert_close(sa[key + "_absmax"], sb[key + "_absmax"], rtol=1e-6, atol=0)
                else:
                    torch.testing.assert_close(sa[key], sb[key], rtol=1e-6, atol=1e-9)


def test_which_states_are_8bit():
    params = make_params()
    cases = [("all", True, True), ("base", True, False), ("delta", False, True)]
    for quantize, base_8bit, delta_8bit in cases:
        opt = DualOptimPlus(params, lr=1e-3, state_bits=8, quantize=quantize)
        run(opt, params, 2)
        big, small = params[0], params[2]
        assert (opt.state[big]["exp_avg"].dtype == torch.uint8) == base_8bit
        assert (opt.state[big]["delta"]["forget"]["exp_avg_sq"].dtype == torch.uint8) == delta_8bit
        assert opt.state[small]["exp_avg"].dtype == torch.float32  # < 4096 elements stay fp32
        if base_8bit:
            assert opt.state[big]["exp_avg_absmax"].shape == (-(-70_000 // 256),)


def test_8bit_state_bytes_at_most_030_of_32bit():
    params32, params8 = make_params(), make_params()
    opt32 = DualOptimPlus(params32, lr=1e-3)
    opt8 = DualOptimPlus(params8, lr=1e-3, state_bits=8)
    run(opt32, params32, 2)
    run(opt8, params8, 2)
    bytes32 = sum(quant.state_bytes(s) for s in opt32.state.values())
    bytes8 = sum(quant.state_bytes(s) for s in opt8.state.values())
    # 6 states: 32-bit = 24 B/element; 8-bit = 6 · (1 + 4/256) B/element for the tensors >= 4096 elements
    n_big = 70_000 + 64 * 80
    assert bytes32 == 24 * (n_big + 100) + 3 * 3 * 4  # + one float32 step counter per state dict
    assert bytes8 <= 0.30 * bytes32


def test_delta_second_moment_can_be_negative_in_8bit():
    params8 = make_params()
    opt = DualOptimPlus(params8, lr=1e-3, state_bits=8)
    run(opt, params8, 6)
    state = opt.state[params8[0]]["delta"]["retain"]
    values = quant.dequantize(state["exp_avg_sq"], state["exp_avg_sq_absmax"], signed=True)
    assert (values < 0).any()


def test_8bit_tracks_32bit_on_a_small_regression():
    """Two least-squares objectives with conflicting targets; 8-bit states must land where 32-bit ones do."""
    torch.manual_seed(0)
    features = torch.randn(256, 64)
    shared = torch.randn(64, 80)
    targets = {name: features @ (shared + 0.3 * torch.randn(64, 80)) for name in ("forget", "retain")}
    start = torch.randn(64, 80) * 0.1

    def total_loss(weight):
        return sum(((features @ weight - t) ** 2).mean().item() for t in targets.values())

    def train(state_bits):
        weight = torch.nn.Parameter(start.clone())
        opt = DualOptimPlus([weight], lr=1e-2, state_bits=state_bits)
        for step in range(150):
            objective = "forget" if step % 3 == 0 else "retain"
            loss = ((features @ weight - targets[objective]) ** 2).mean()
            weight.grad = torch.autograd.grad(loss, weight)[0]
            opt.step(objective=objective)
        return weight.detach()

    w32, w8 = train(32), train(8)
    assert total_loss(w32) < 0.2 * total_loss(start)
    # Measured: 8-bit ends 3.4% above 32-bit in loss, 16% of the path apart (bitsandbytes AdamW8bit vs
    # AdamW: 1.8%, 4%); quantisation error in v_B and v_k is amplified where v̂_B + v̂_k nearly cancels.
    assert abs(total_loss(w8) - total_loss(w32)) < 0.05 * total_loss(w32)
    assert (w8 - w32).norm() < 0.25 * (w32 - start).norm()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference"])
def test_8bit_doplus_step_is_bitsandbytes_dequantize_float64_rule_bitsandbytes_quantize(fused):
    """Each step from DualOptim+'s own 8-bit states: bitsandbytes dequantizes them, the float64 rule updates,
    bitsandbytes quantizes the result; DualOptim+'s new weights and codes must be those."""
    check_8bit_step_against_bitsandbytes(torch.device("cpu"), fused, cycles=4)


def test_8bit_dualoptim_equals_two_bitsandbytes_adamw8bit_stepped_alternately():
    check_dualoptim_8bit_against_adamw8bit(torch.device("cpu"))


@pytest.mark.parametrize("scheme", ["alternate", "dualoptim"])
def test_bitsandbytes_schemes_keep_32bit_states_for_embedding_tables(scheme):
    """bitsandbytes' advice: embedding tables keep 32-bit states (rows absent from a batch took steps of thousands
    of lr on CUDA with 8-bit ones, quant.adamw8bit); every other tensor of 4,096 elements or more stays 8-bit."""
    from doplus_cli.engine.optimizers import OptimizerSettings, build_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(600, 32), torch.nn.Linear(32, 256, bias=False),
                                torch.nn.Linear(256, 600, bias=False))
    settings = OptimizerSettings(scheme=scheme, optimizer="adamw", lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0,
                                 state_bits=8, rule="safeguarded", compensated=False)
    stepped, _ = build_optimizer(model, ("forget", "retain"), {}, settings)
    ids = torch.randint(0, 300, (4, 5))  # rows 300 to 599 of the table absent from the batch
    model(ids).logsumexp(-1).sum().backward()
    stepped.step(objective="forget")
    inner = stepped.inner["forget"] if scheme == "dualoptim" else stepped.inner
    embedding, first, second = model[0].weight, model[1].weight, model[2].weight
    assert embedding.grad[300:].abs().sum() == 0
    assert inner.state[embedding]["state1"].dtype == torch.float32
    assert inner.state[embedding]["state2"].dtype == torch.float32
    for weight in (first, second):  # 8,192 and 153,600 elements
        assert inner.state[weight]["state1"].dtype == torch.uint8 and inner.state[weight]["state2"].dtype == torch.uint8


def test_adamw8bit_without_tables_is_bitsandbytes_own():
    """The subclass changes only the tensors it is given: the same table without them gets 8-bit states."""
    table = torch.nn.Parameter(torch.randn(600, 32))
    table.grad = torch.randn(600, 32)
    plain = quant.adamw8bit([table], lr=1e-3)
    plain.step()
    assert plain.state[table]["state1"].dtype == torch.uint8


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_output_layer_keeps_32bit_states_too_tied_or_not(tied):
    """The output layer is a vocabulary table as well: untied, it is a second table with 32-bit states (Alternate
    with 8-bit states and bf16 weights took steps of 2,610 lr on an H100 with only the input table kept 32-bit);
    tied, it is the input table, listed once."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from doplus_cli.engine.optimizers import OptimizerSettings, build_optimizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=600, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    tables = quant.embedding_weights(model)
    expected = [model.model.embed_tokens.weight] + ([] if tied else [model.lm_head.weight])
    assert len(tables) == len(expected) and all(a is b for a, b in zip(tables, expected))
    settings = OptimizerSettings(scheme="alternate", optimizer="adamw", lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0,
                                 state_bits=8, rule="safeguarded", compensated=False)
    stepped, _ = build_optimizer(model, ("forget", "retain"), {}, settings)
    ids = torch.randint(0, 300, (2, 6))
    model(input_ids=ids, labels=ids).loss.backward()
    stepped.step(objective="forget")
    state = stepped.inner.state
    for table in tables:
        assert state[table]["state1"].dtype == torch.float32 and state[table]["state2"].dtype == torch.float32
    gate = model.model.layers[0].mlp.gate_proj.weight  # 8,192 elements: 8-bit
    assert state[gate]["state1"].dtype == torch.uint8 and state[gate]["state2"].dtype == torch.uint8
