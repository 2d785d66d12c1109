"""Evaluations on CPU run their linear layers on oneDNN with packed weights (`packed_linears`): the products agree
with a float64 reference as torch's own do, every plain `nn.Linear` really ran packed, tied weights pack once,
the layers get their own forward back, and the switch and the floor's rates behave as documented. Where this CPU
cannot run the packed product for a dtype (bfloat16 without AVX-512 or AVX-NE-CONVERT) the layers keep their own
forward and the evaluation says so: the suite passes on AVX2-only CPUs and on AVX-512/AMX ones alike."""

from __future__ import annotations

import json
import time

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
    assert compute.packing_unsupported(torch.float32) is None  # float32's path needs no more than AVX2


def test_the_verdict_names_what_cannot_be_packed(monkeypatch):
    monkeypatch.setattr(compute, "PACKING_VERDICTS", {})  # this process's table left as it was
    assert "not float16" in compute.packing_unsupported(torch.float16)
    assert "not float64" in compute.packing_unsupported(torch.float64)


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
    original_linear, original_pack = compute.packed_linear, compute.pack
    monkeypatch.setattr(compute, "packed_linear", lambda *a: calls.append(1) or original_linear(*a))
    monkeypatch.setattr(compute, "pack", lambda w, *a: packs.append(w) or original_pack(w, *a))
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
    original = compute.pack
    monkeypatch.setattr(compute, "pack", lambda w, *a: packs.append(w) or original(w, *a))
    with packed_linears(model) as swapped:
        assert swapped == 2
    assert len(packs) == 1


def test_bfloat16_layers_run_packed_where_the_cpu_can_and_as_torchs_own_where_it_cannot(monkeypatch):
    """oneDNN's bfloat16 packed product needs AVX-512 BW/VL/DQ (torch's `_is_avx512_supported` asks cpuinfo for
    exactly those) or AVX-NE-CONVERT. Where the CPU has them the layers run packed; where the probe says no, none
    is swapped and torch's own layer runs, with the same result within bfloat16 rounding and no exception."""
    monkeypatch.setattr(compute, "PACKING_VERDICTS", {})  # decided afresh, and this process's table left as it was
    verdict = compute.packing_unsupported(torch.bfloat16)
    if torch.cpu._is_avx512_supported():
        assert verdict is None
    model = _model(tied=False, dtype=torch.bfloat16)
    layer = model.model.layers[0].mlp.up_proj
    torch.manual_seed(2)
    x = torch.randn(5, 48).to(torch.bfloat16)
    reference = x.double() @ layer.weight.double().T
    calls = []
    original_linear = compute.packed_linear
    monkeypatch.setattr(compute, "packed_linear", lambda *a: calls.append(1) or original_linear(*a))
    with packed_linears(model) as swapped, torch.no_grad():
        out = layer(x)
    if verdict is None:  # the packed path ran
        assert swapped == len(_linears(model)) and len(calls) == 1
    else:  # the fallback ran: nothing swapped, the product not called, the reason names the CPU
        assert swapped == 0 and not calls and "cannot run on this CPU" in verdict
        assert list(matmul_gflops(torch.bfloat16, size=64, seconds=0.01)) == ["matmul"]
    assert out.dtype == torch.bfloat16
    # bfloat16 keeps 8 significant bits: the output is rounded once, to within 2^-8 of its scale
    assert (out.double() - reference).abs().max().item() < 2 ** -7 * reference.abs().max().item()


def test_a_dtype_this_cpu_cannot_pack_keeps_torchs_layers_and_drops_the_packed_rate(monkeypatch):
    """The verdict forced to "unsupported" for float32 (the decision's own table, not torch): nothing is swapped,
    the floor measures torch's matmul only, and `linear_kernel` says which kernel ran and why."""
    model = _model(tied=False)
    monkeypatch.setitem(compute.PACKING_VERDICTS, torch.float32, "oneDNN's float32 packed linear cannot run here")
    with packed_linears(model) as swapped:
        assert swapped == 0 and all("forward" not in vars(m) for m in _linears(model))
    assert list(matmul_gflops(torch.float32, size=64, seconds=0.01)) == ["matmul"]
    assert compute.linear_kernel(model) == {"kernel": compute.TORCH_LINEAR, "dtype": "float32",
                                            "reason": "oneDNN's float32 packed linear cannot run here"}
    monkeypatch.setitem(compute.PACKING_VERDICTS, torch.float32, None)
    assert compute.linear_kernel(model) == {"kernel": compute.ONEDNN_KERNEL, "dtype": "float32", "reason": None}
    assert compute.linear_kernel(None) is None


@pytest.mark.cpu_processes  # a CPU's kernel choice: on a GPU machine the evaluation would run on CUDA
def test_a_bfloat16_evaluation_on_a_cpu_without_the_packed_path_completes_and_says_so(tiny_llama, tofu_dir,
                                                                                      tmp_path, monkeypatch):
    """The failure this guards against: on an AVX2-only CPU `doplus evaluate --dtype bfloat16` ended in oneDNN's
    RuntimeError. With the decision forced to "unsupported" (as such a CPU answers it) the evaluation runs on
    torch's own layers, exit 0, and eval.json and report.md name the kernel and the reason."""
    from tests.helpers import run_cli

    reason = "oneDNN's bfloat16 packed linear cannot run on this CPU (forced by the test)"
    monkeypatch.setitem(compute.PACKING_VERDICTS, torch.bfloat16, reason)
    out = tmp_path / "eval"
    assert run_cli("evaluate", "--model", tiny_llama, "--data-dir", tofu_dir, "--split", "forget01", "--dtype",
                   "bfloat16", "--max-samples", 2, "--max-new-tokens", 2, "--out", out) == 0
    record = json.loads((out / "eval.json").read_text())["compute"]
    assert record["matmul_dtype"] == "bfloat16" and record["packed_linear_layers"] == 0
    assert record["linear_kernel"] == {"kernel": compute.TORCH_LINEAR, "dtype": "bfloat16", "reason": reason}
    assert list(record["kernel_gflops"]) == ["matmul"] and record["floor_kernel"] == "matmul"
    report = (out / "report.md").read_text()
    assert f"The linear layers ran as {compute.TORCH_LINEAR} (bfloat16): {reason}." in report
    assert "ran on oneDNN with packed weights" not in report


def test_a_training_report_names_the_dtypes_whose_layers_ran_unpacked(tmp_path, monkeypatch):
    from doplus_cli.engine.outputs import environment_lines, write_report

    monkeypatch.setattr(compute, "PACKING_VERDICTS", {torch.float32: None, torch.bfloat16: "no AVX-512 here"})
    report = {"environment": {"device": "cpu", "world_size": 1, "dtype": "bfloat16", "versions": {"torch": "2"},
                              "python": "3"}}
    write_report(tmp_path, report, render=lambda r: "\n".join(environment_lines(r["environment"])))
    assert json.loads((tmp_path / "report.json").read_text())["environment"]["linear_fallbacks"] == {
        "bfloat16": "no AVX-512 here"}
    assert (f"- evaluations ran bfloat16 linear layers as {compute.TORCH_LINEAR} (same results within rounding, "
            "slower): no AVX-512 here") in (tmp_path / "report.md").read_text()
    compute.PACKING_VERDICTS[torch.bfloat16] = None  # where every dtype packs, the report says nothing of it
    report["environment"].pop("linear_fallbacks")
    write_report(tmp_path, report, render=lambda r: "\n".join(environment_lines(r["environment"])))
    assert "linear_fallbacks" not in json.loads((tmp_path / "report.json").read_text())["environment"]


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


def test_the_timed_product_is_the_largest_size_where_it_is_quick_and_smaller_where_it_is_slow():
    """A kernel fast enough gets the largest size; one whose product (with its synchronisation) takes a tenth of
    a second, as bfloat16 does on a CPU without native bfloat16 arithmetic, stays at the first size, so that the
    floor's measure takes seconds there and not minutes."""
    assert compute._product_size(torch.float32, "cpu", 1024, seconds=1000.0, sync=lambda: None) == 1024
    assert compute._product_size(torch.float32, "cpu", 2048, seconds=1.0,
                                 sync=lambda: time.sleep(0.1)) == compute.MATMUL_START
    calls = []

    def slow_from_512():  # two calls a size (warm-up, timed): from 512 on a product takes a tenth of a second
        calls.append(1)
        time.sleep(0.1 if len(calls) >= 3 else 0)

    assert compute._product_size(torch.float32, "cpu", 2048, seconds=1.0, sync=slow_from_512) == 512


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
