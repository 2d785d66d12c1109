"""`--dry-run`'s memory plan against byte counts worked out by hand for a small Llama written here as a config.json
alone: every scheme at 32 and 8 bits, Muon, LoRA, the precisions, DDP and FSDP; and the plan reads no weight."""

from __future__ import annotations

import json

import pytest

# The model: vocabulary 512, hidden 64, MLP 128, 2 layers, 4 heads of 16, 2 key/value heads, untied output layer.
V, H, INNER, L, HEADS, KV, D = 512, 64, 128, 2, 4, 2, 16
Q = OUT = H * H  # 4096: 8-bit sized (>= 4096 elements)
K_ = V_ = H * KV * D  # 2048: keeps float32 states at 8 bits
MLP = H * INNER  # 8192 each of gate, up, down
NORM = H
LAYER = Q + K_ + V_ + OUT + 3 * MLP + 2 * NORM  # 36,992
TABLE = V * H  # 32,768, the input table and the output layer each
N = 2 * TABLE + L * LAYER + NORM  # 139,584
LINEAR = L * (Q + K_ + V_ + OUT + 3 * MLP) + TABLE  # the linear layers' weights, the output layer's included


def eight_bit(n: int) -> int:
    """One 8-bit state: a byte per element, a float32 absmax per 256."""
    return n + 4 * -(-n // 256)


@pytest.fixture(scope="module")
def config_only_model(tmp_path_factory):
    """A model folder with its config.json and a weight file that holds no weight: a whole safetensors file (its
    header, which --dry-run checks) listing no tensor, so a run that loaded the model from it would fail."""
    folder = tmp_path_factory.mktemp("config-only")
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": V, "hidden_size": H,
        "intermediate_size": INNER, "num_hidden_layers": L, "num_attention_heads": HEADS, "num_key_value_heads": KV,
        "max_position_embeddings": 128, "tie_word_embeddings": False}))
    (folder / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")
    return folder


def plan_of(model, tofu_dir, cuda=False, **values):
    from doplus_cli.commands import command_for
    from doplus_cli.commands.unlearn import UnlearnConfig
    from doplus_cli.config import resolve_config
    from doplus_cli.engine.memory_plan import build_plan, model_plan

    values = {"model": str(model), "forget": str(tofu_dir / "forget01.json"),
              "retain": str(tofu_dir / "retain90.json"), "batch_size": 2, "max_length": 8, "loss": "GA+GD",
              "precision": "fp32", "dtype": "float32", **values}
    config = resolve_config(None, values, UnlearnConfig)
    run = command_for(config)
    return build_plan(config, model_plan(config, run), run, cuda=cuda)


# Optimizer states of every scheme, 2 objectives (forget, retain), float32 weights.
JOINT_8BIT = (L * (2 * 2 * eight_bit(Q) + 3 * 2 * eight_bit(MLP) + 2 * 8 * K_ + 8 * 2 * NORM)
              + 2 * 8 * TABLE + 8 * NORM)  # bitsandbytes keeps the tables (and tensors under 4096) at float32
DOPLUS_8BIT = (L * (2 * 6 * eight_bit(Q) + 3 * 6 * eight_bit(MLP) + 2 * 6 * 4 * K_ + 6 * 4 * 2 * NORM)
               + 2 * 6 * eight_bit(TABLE) + 6 * 4 * NORM)  # DualOptim+ quantises the tables too
MUON_MATRICES = L * (Q + K_ + V_ + OUT + 3 * MLP)
STATES = {
    "joint": 8 * N, "alternate": 8 * N, "dualoptim": 16 * N, "local-adam": 16 * N,
    "doplus": 24 * N, "scaffold": 24 * N, "fedcm": 24 * N,
    "joint-8bit": JOINT_8BIT, "alternate-8bit": JOINT_8BIT,
    "dualoptim-8bit": 2 * JOINT_8BIT, "doplus-8bit": DOPLUS_8BIT,
    # Muon: one momentum buffer (base + 2 deltas) for the hidden matrices, AdamW's two for the rest
    "doplus-muon": 3 * 4 * MUON_MATRICES + 6 * 4 * (N - MUON_MATRICES),
}


@pytest.mark.parametrize("scheme", sorted(STATES))
def test_optimizer_states_of_every_scheme_match_the_hand_count(config_only_model, tofu_dir, scheme):
    from doplus_cli.config import SCHEMES

    values = {k: v for k, v in SCHEMES[scheme].values.items()}
    plan = plan_of(config_only_model, tofu_dir, **values)
    assert plan.model.trainable == N and plan.model.frozen == 0
    assert plan.parts["optimizer states"] == STATES[scheme]
    assert plan.parts["weights"] == 4 * N and plan.parts["gradients"] == 4 * N
    assert plan.parts["reference model"] == 0 and plan.parts["compensation"] == 0


def test_precisions_activations_reference_and_sharding(config_only_model, tofu_dir):
    # fp32, NPO (a float32 reference copy), batch 2 x 8 tokens
    plan = plan_of(config_only_model, tofu_dir, loss="NPO+GD")
    per_token = 4 * H + H + 2 * KV * D + H + 4 * INNER  # norms in/out, q/k/v, attention out, gate/up/act/product
    assert plan.parts["activations"] == L * 2 * 8 * per_token * 4
    assert plan.parts["logits"] == 2 * 8 * V * (4 + 8)
    assert plan.parts["reference model"] == 4 * N
    whole = 4 * N + 4 * N + 24 * N + 4 * N + L * 2 * 8 * per_token * 4 + 2 * 8 * V * 12
    assert plan.total(1, fsdp=False) == whole
    assert plan.total(2, fsdp=False) == whole + 4 * N  # DDP's gradient buckets
    split = sum(-(-b // 2) for b in (4 * N, 4 * N, 24 * N, 4 * N))
    gathered = (2 * TABLE + NORM + 2 * LAYER) * 4
    assert plan.total(2, fsdp=True) == split + gathered + L * 2 * 8 * per_token * 4 + 2 * 8 * V * 12
    # with gradient checkpointing: each layer's input, and one layer's activations again
    checkpointed = plan_of(config_only_model, tofu_dir, gradient_checkpointing=True)
    assert checkpointed.parts["activations"] == L * 2 * 8 * H * 4 + 2 * 8 * per_token * 4

    # bf16-mixed: float32 weights, bf16 compute copies of the linear weights, bf16 activations
    mixed = plan_of(config_only_model, tofu_dir, precision="bf16-mixed", dtype="bfloat16", loss="NPO+GD")
    assert mixed.parts["weights"] == 4 * N and mixed.parts["compute copies"] == 2 * LINEAR
    assert mixed.parts["activations"] == L * 2 * 8 * per_token * 2
    assert mixed.parts["reference model"] == 2 * N  # at --dtype
    # FSDP gathers bf16 parameters itself: no autocast copies, the gathered root and two layers at 2 B
    split = sum(-(-b // 2) for b in (4 * N, 4 * N, 24 * N, 2 * N))
    assert mixed.total(2, fsdp=True) == (split + (2 * TABLE + NORM + 2 * LAYER) * 2
                                         + L * 2 * 8 * per_token * 2 + 2 * 8 * V * (2 + 8))
    # bf16: bf16 weights and gradients, a bf16 compensation buffer, float32 states
    bf16 = plan_of(config_only_model, tofu_dir, precision="bf16", dtype="bfloat16")
    assert (bf16.parts["weights"], bf16.parts["gradients"], bf16.parts["compensation"]) == (2 * N, 2 * N, 2 * N)
    assert bf16.parts["optimizer states"] == 24 * N and bf16.parts["compute copies"] == 0
    # auto on a GPU: bf16-mixed
    assert plan_of(config_only_model, tofu_dir, cuda=True, precision="auto", dtype="auto").settings[
        "precision"] == "bf16-mixed"


def test_lora_trains_the_adapters_only(config_only_model, tofu_dir):
    plan = plan_of(config_only_model, tofu_dir, lora_rank=4, lora_targets="q_proj,v_proj", scheme="joint")
    adapters = L * ((4 * H + H * 4) + (4 * H + KV * D * 4))  # q: A 4x64, B 64x4; v: A 4x64, B 32x4
    assert plan.model.trainable == adapters and plan.model.frozen == N
    assert plan.parts["weights"] == 4 * (N + adapters)
    assert plan.parts["gradients"] == 4 * adapters
    assert plan.parts["optimizer states"] == 8 * adapters
    # bf16-mixed: the frozen base at --dtype (bf16, nothing for autocast to cast), the adapters float32
    mixed = plan_of(config_only_model, tofu_dir, lora_rank=4, lora_targets="q_proj,v_proj", scheme="joint",
                    precision="bf16-mixed", dtype="bfloat16")
    assert mixed.parts["weights"] == 2 * N + 4 * adapters and mixed.parts["compute copies"] == 0


def test_dry_run_reads_no_weight_and_writes_nothing(config_only_model, tofu_dir, tmp_path, capsys):
    """The weight file is not a safetensors file: a run that read it would fail. The plan prints, the command
    exits 0 and the output folder is never made."""
    from tests.helpers import run_cli

    out = tmp_path / "run"
    code = run_cli("unlearn", "--model", config_only_model, "--forget", tofu_dir / "forget01.json",
                   "--retain", tofu_dir / "retain90.json", "--out", out, "--dry-run", "--num-processes", "2",
                   "--gpu-memory", "0.001", "--precision", "fp32", "--dtype", "float32", "--scheme", "joint")
    printed = capsys.readouterr().out
    assert code == 0 and not out.exists()
    assert f"parameters: {N:,} trainable, 0 frozen" in printed
    assert "DDP x 2" in printed and "FSDP x 2" in printed and "does not fit in 0.001 GiB" in printed


def test_dry_run_refuses_a_model_whose_weights_file_is_not_one(config_only_model, tofu_dir, tmp_path, capsys):
    """What the run would stop on when it loads the model, the dry run names first (it reads the file's header)."""
    import shutil

    from tests.helpers import run_cli

    broken = tmp_path / "broken"
    shutil.copytree(config_only_model, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    capsys.readouterr()
    code = run_cli("unlearn", "--model", broken, "--forget", tofu_dir / "forget01.json", "--retain",
                   tofu_dir / "retain90.json", "--out", tmp_path / "run", "--dry-run")
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and f"{broken / 'model.safetensors'}: a corrupt or unreadable" in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("folder", "published"), [
    ("llama-3.2-1b", 1_235_814_400), ("llama-2-7b", 6_738_415_616), ("llama-3-8b", 8_030_261_248)])
def test_the_sizing_configs_give_the_published_parameter_counts(tofu_dir, folder, published):
    """docs/memory.md's sizing table is computed from these config.json files; each gives its model's count."""
    from pathlib import Path

    model = Path(__file__).parent / "data" / "model-configs" / folder
    plan = plan_of(model, tofu_dir)
    assert plan.model.trainable == published


def test_rmu_trains_its_modules_only_and_the_reference_offloads(config_only_model, tofu_dir):
    # RMU on this 2-layer model: layer 0 (7/32 of the depth), its MLP output projection alone trains
    rmu = plan_of(config_only_model, tofu_dir, loss="RMU+EMBED", scheme="joint")
    assert rmu.model.trainable == MLP and rmu.model.frozen == N - MLP
    assert rmu.parts["optimizer states"] == 8 * MLP and rmu.parts["reference model"] == 4 * N  # EMBED's reference
    # the reference on the host: none on the device; LLM.int8: a byte per linear weight, the rest at --dtype
    assert plan_of(config_only_model, tofu_dir, loss="NPO+GD", ref_offload="cpu").parts["reference model"] == 0
    int8 = plan_of(config_only_model, tofu_dir, loss="NPO+GD", ref_offload="8bit")
    assert int8.parts["reference model"] == LINEAR + 4 * (N - LINEAR)
