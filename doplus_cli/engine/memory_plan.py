"""The memory a training run will hold, worked out before it starts (`--dry-run`).

The model is built on the meta device from its configuration only (transformers' `AutoConfig` and
`from_config` under `torch.device("meta")`: no weight file is read, no memory is taken), LoRA and RMU applied to
it as a run applies them, and each parameter is then counted once per place a run keeps a copy of it:

    weights              every parameter in the dtype the run trains it in (`training_precision.py`: float32 under
                         fp32 and bf16-mixed, bfloat16 under bf16; LoRA's frozen base at --dtype under bf16-mixed,
                         its adapters float32)
    gradients            one per trainable parameter, in its dtype
    master weights       a float32 copy kept beside lower-precision weights: none in doplus (under bf16-mixed the
                         float32 weights are the master copy; under bf16 the compensation buffer stands for it)
    optimizer states     per trainable parameter, by scheme (`optimizer_state_bytes`)
    compensation         one bfloat16 buffer per bf16 trainable weight under --precision bf16
    compute copies       bf16-mixed: autocast's bfloat16 cast of each linear weight, kept for backward
    reference model      NPO, DPO, KL, UNDIAL, EMBED: a frozen copy of the starting model (--ref-offload cpu: on
                         the host, 8bit: one byte per linear weight)
    activations          what the backward pass needs (`activation_bytes`): an estimate
    logits               the output layer's logits, their float32 log-softmax and its gradient

A process holds all of it under DDP (with DDP's gradient buckets, a second gradient-sized buffer); under FSDP
the weights, gradients, states, compensation and reference are split over the N processes, and each holds
besides the gathered parameters of the root module and of two decoder layers (the one computed and the one
prefetched), in the compute dtype (FSDP's mixed-precision policy gathers them in bf16 under bf16-mixed, so
autocast makes no copies there). Activations and logits are per process either way: --batch-size is per
process.

Not counted: the CUDA context and the caching allocator's slack (`OVERHEAD_GIB` is reserved for them in the
verdict), temporaries of the optimizer step, the evaluation during training, and the host's copies.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from doplus_cli.config import TrainConfig
from doplus_cli.engine import training_precision as precisions
from doplus_cli.errors import UserError
from doplus_cli.optim.quant import BLOCKSIZE, MIN_8BIT_SIZE

if TYPE_CHECKING:
    from doplus_cli.engine.objectives import Plan

GIB = 2 ** 30
OVERHEAD_GIB = 1.0  # the CUDA context and the caching allocator's slack, reserved before the verdict "fits"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
FLOAT32, BF16 = 4, 2


@dataclass(frozen=True)
class Param:
    """One parameter as the plan sees it."""

    name: str
    numel: int
    trainable: bool
    adapter: bool = False  # a LoRA adapter weight (float32 whatever the base's dtype)
    table: bool = False  # a vocabulary table (input embedding, or the output layer's weight)
    muon: bool = False  # a hidden 2-D weight that DualOptim+ Muon steps with Muon
    linear: bool = False  # the weight of a linear layer (cast by autocast, LLM.int8 in an 8-bit reference)


@dataclass(frozen=True)
class Shape:
    """The architecture numbers the activation estimate reads (from the model's config)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


@dataclass(frozen=True)
class ModelPlan:
    """The parameters of the model a run trains and the numbers of its architecture."""

    params: tuple[Param, ...]
    shape: Shape
    layer_params: int  # the parameters of the largest decoder layer (an FSDP unit)
    root_params: int  # the parameters outside the decoder layers (embeddings, final norm, output layer)

    @property
    def trainable(self) -> int:
        return sum(p.numel for p in self.params if p.trainable)

    @property
    def frozen(self) -> int:
        return sum(p.numel for p in self.params if not p.trainable)


@dataclass
class MemoryPlan:
    """Bytes per process of each part (`parts`, name -> bytes, unsharded), and the totals."""

    model: ModelPlan
    settings: dict[str, Any]
    parts: dict[str, int] = field(default_factory=dict)
    per_param: dict[str, float] = field(default_factory=dict)  # bytes per trainable (or every) parameter
    sharded: set[str] = field(default_factory=set)  # the parts FSDP splits over the processes
    ddp_extra: int = 0  # DDP's gradient buckets
    fsdp_extra: int = 0  # FSDP's gathered parameters

    def total(self, processes: int, fsdp: bool) -> int:
        """Bytes one of `processes` processes holds (DDP when not `fsdp`)."""
        if fsdp and processes > 1:  # FSDP gathers bf16 parameters itself under bf16-mixed: no autocast copies
            return sum(math.ceil(b / processes) if name in self.sharded else b
                       for name, b in self.parts.items() if name != "compute copies") + self.fsdp_extra
        return sum(self.parts.values()) + (self.ddp_extra if processes > 1 else 0)


# --- the optimizer states ---------------------------------------------------------------------------------------

def eight_bit_bytes(numel: int) -> int:
    """One 8-bit blockwise state of `numel` elements: a uint8 code each and a float32 absmax per block of 256
    (bitsandbytes' layout, `optim/quant.py`)."""
    return numel + FLOAT32 * math.ceil(numel / BLOCKSIZE)


def optimizer_state_bytes(param: Param, scheme: str, optimizer: str, state_bits: int, objectives: int) -> int:
    """The optimizer state one trainable parameter keeps, by scheme (`engine/optimizers.py`):

    joint, alternate   one AdamW: 2 states (torch AdamW; bitsandbytes AdamW8bit at 8 bits)
    dualoptim          one AdamW per objective: 2 per objective
    doplus             a base AdamW state and a delta per objective: 2 + 2 per objective; with Muon a hidden
                       matrix keeps one momentum buffer instead of two states, 1 + 1 per objective
    scaffold, fedcm    a base and a delta per objective, as doplus: 2 + 2 per objective
    local-adam         one AdamW per objective: 2 per objective

    States are float32. At 8 bits a state is a code byte per element plus a float32 absmax per 256 elements,
    for tensors of at least 4096 elements (smaller ones keep float32 states); bitsandbytes' AdamW8bit (joint,
    alternate, dualoptim) also keeps the vocabulary tables' states in float32 (`quant.adamw8bit`), DualOptim+
    quantises every large state."""
    if scheme in ("joint", "alternate"):
        counts, per_state = 2, 2
    elif scheme in ("dualoptim", "local-adam"):
        counts, per_state = 2 * objectives, 2
    elif scheme in ("doplus", "scaffold", "fedcm"):
        muon = scheme == "doplus" and optimizer == "muon" and param.muon
        per_state = 1 if muon else 2
        counts = per_state * (1 + objectives)
    else:
        raise UserError(f"--scheme {scheme}: the memory plan knows no such scheme")
    if state_bits == 8 and scheme in ("joint", "alternate", "dualoptim", "doplus") and param.numel >= MIN_8BIT_SIZE:
        if scheme == "doplus" or not param.table:
            return counts * eight_bit_bytes(param.numel)
    return counts * FLOAT32 * param.numel


# --- the activations --------------------------------------------------------------------------------------------

def activation_bytes(shape: Shape, batch: int, tokens: int, compute_bytes: int, checkpointing: bool,
                     attention_matrix: bool = False) -> int:
    """What the backward pass keeps of one micro-batch, over the decoder layers: an estimate.

    The counting is Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer Models",
    section 4.1: every tensor a layer saves for its backward, s·b·h·(34 + 5·a·s/h) bytes for GPT's layer in
    16-bit. Applied to a Llama layer (RMSNorm, rotary attention with grouped key/value heads, SwiGLU MLP, no
    dropout) it saves, in elements per token: the two norms' inputs and outputs (4h), the queries, keys and
    values (h + 2·kv·d), the attention output (h), the MLP's gate, up, activated gate and product (4i); and
    a·s per token for the attention probabilities where attention is computed as a matrix (eager attention;
    PyTorch's fused attention keeps none). With gradient checkpointing each layer keeps its input only (h per
    token) and one layer's activations exist again during its backward."""
    per_token = 4 * shape.hidden + shape.hidden + 2 * shape.kv_heads * shape.head_dim + shape.hidden \
        + 4 * shape.intermediate
    if attention_matrix:
        per_token += shape.heads * tokens
    layer = batch * tokens * per_token * compute_bytes
    if checkpointing:
        return shape.layers * batch * tokens * shape.hidden * compute_bytes + layer
    return shape.layers * layer


def logits_bytes(shape: Shape, batch: int, tokens: int, compute_bytes: int) -> int:
    """The output layer's logits (compute dtype), their float32 log-softmax kept for backward and the logits'
    float32 gradient: b·s·V·(c + 8) bytes."""
    return batch * tokens * shape.vocab * (compute_bytes + 2 * FLOAT32)


# --- the model on the meta device --------------------------------------------------------------------------------

def _shape(config: Any) -> Shape:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = text.hidden_size
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    intermediate = getattr(text, "intermediate_size", None) or 4 * hidden
    return Shape(layers=text.num_hidden_layers, hidden=hidden, intermediate=intermediate, heads=heads,
                 kv_heads=kv_heads, head_dim=head_dim, vocab=text.vocab_size)


def model_plan(config: TrainConfig, run: Plan) -> ModelPlan:
    """The run's model built on the meta device from its config.json alone, with LoRA and RMU applied as the
    run applies them (`engine/loop.setup`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from doplus_cli.models import model_config as read_model_config

    model_config, _ = read_model_config(config.model, config.trust_remote_code)
    with torch.device("meta"):  # every tensor created here has a shape and a dtype and no storage
        model = AutoModelForCausalLM.from_config(model_config, trust_remote_code=config.trust_remote_code)
        model.tie_weights()
        tables = {id(module.weight) for module in model.modules() if isinstance(module, torch.nn.Embedding)}
        output = model.get_output_embeddings()
        if output is not None:
            tables.add(id(output.weight))
        skip_muon = set(tables)
        linear = {id(module.weight) for module in model.modules() if isinstance(module, torch.nn.Linear)}
        layers = _decoder_layers(model)
        layer_params = max((sum(p.numel() for p in layer.parameters()) for layer in layers), default=0)
        total = sum(p.numel() for p in model.parameters())
        root_params = total - sum(sum(p.numel() for p in layer.parameters()) for layer in layers)
        if config.lora_rank > 0:
            from doplus_cli.lora import LoraSettings, apply_lora

            model = apply_lora(model, LoraSettings(rank=config.lora_rank, alpha=config.lora_alpha,
                                                   targets=config.lora_targets,
                                                   dropout=config.lora_dropout))
        run.prepare_model(model)  # as the loop does once the model is final: RMU leaves its modules trainable
    params = tuple(
        Param(name=name, numel=p.numel(), trainable=p.requires_grad, adapter="lora_" in name,
              table=id(p) in tables, muon=p.ndim == 2 and id(p) not in skip_muon, linear=id(p) in linear)
        for name, p in model.named_parameters())
    return ModelPlan(params=params, shape=_shape(model_config), layer_params=layer_params, root_params=root_params)


def _decoder_layers(model: Any) -> list[Any]:
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and len(module) == getattr(
                model.config, "num_hidden_layers", -1):
            return list(module)
    return []


# --- the plan -------------------------------------------------------------------------------------------------------

def build_plan(config: TrainConfig, model: ModelPlan, run: Plan, cuda: bool) -> MemoryPlan:
    """The plan of `config`'s run on `model`, as `run` (its command bound to `config`) says: how many objectives
    keep a state, whether a reference model is kept. `cuda`: `auto` dtype and precision resolve as on a GPU."""
    dtype = config.dtype if config.dtype != "auto" else ("bfloat16" if cuda else "float32")
    mode = config.precision if config.precision != "auto" else ("bf16-mixed" if dtype == "bfloat16" else "fp32")
    lora = config.lora_rank > 0
    trained = DTYPE_BYTES[precisions.WEIGHT_DTYPES[mode]]
    base = DTYPE_BYTES[precisions.weights_dtype(mode, dtype, lora=lora)]
    compute = FLOAT32 if mode == "fp32" else BF16
    objectives = run.state_objectives()
    trainable = [p for p in model.params if p.trainable]

    def weight_bytes(p: Param) -> int:
        return FLOAT32 if p.adapter else (base if lora else trained)

    plan = MemoryPlan(model=model, settings={
        "dtype": dtype, "precision": mode, "scheme": config.scheme, "optimizer": config.optimizer,
        "state_bits": config.state_bits, "objectives": objectives, "batch_size": config.batch_size,
        "max_length": config.max_length, "gradient_checkpointing": config.gradient_checkpointing,
        "lora_rank": config.lora_rank, "reference": run.needs_reference(), "ref_offload": config.ref_offload})
    parts = plan.parts
    parts["weights"] = sum(p.numel * weight_bytes(p) for p in model.params)
    parts["gradients"] = sum(p.numel * weight_bytes(p) for p in trainable)
    parts["master weights"] = 0
    parts["optimizer states"] = sum(optimizer_state_bytes(p, config.scheme, config.optimizer, config.state_bits,
                                                          objectives) for p in trainable)
    parts["compensation"] = sum(p.numel * BF16 for p in trainable if weight_bytes(p) == BF16 and mode == "bf16")
    # autocast casts a float32 linear weight to bf16 once per forward and keeps the cast for backward
    parts["compute copies"] = sum(p.numel * BF16 for p in model.params
                                  if mode == "bf16-mixed" and p.linear and weight_bytes(p) == FLOAT32)
    parts["reference model"] = _reference_bytes(config, model, mode, dtype) if plan.settings["reference"] else 0
    parts["activations"] = activation_bytes(model.shape, config.batch_size, config.max_length, compute,
                                            config.gradient_checkpointing)
    parts["logits"] = logits_bytes(model.shape, config.batch_size, config.max_length, compute)
    plan.sharded = {"weights", "gradients", "optimizer states", "compensation"}
    if config.ref_offload is None:
        plan.sharded.add("reference model")
    plan.ddp_extra = parts["gradients"]
    plan.fsdp_extra = (model.root_params + 2 * model.layer_params) * compute
    # bytes per parameter: the weights' over every parameter, the others' over the trainable ones
    every, trained_count = max(1, sum(p.numel for p in model.params)), max(1, model.trainable)
    for name in ("weights", "gradients", "optimizer states", "compensation"):
        plan.per_param[name] = parts[name] / (every if name == "weights" else trained_count)
    return plan


def _reference_bytes(config: TrainConfig, model: ModelPlan, mode: str, dtype: str) -> int:
    """The frozen starting model on the device: the base parameters (no adapters) in the reference dtype; none
    with --ref-offload cpu; LLM.int8 (a byte per linear weight, its row scales aside) with --ref-offload 8bit."""
    if config.ref_offload == "cpu":
        return 0
    base = [p for p in model.params if not p.adapter]
    size = DTYPE_BYTES[dtype] if mode == "bf16-mixed" else DTYPE_BYTES[precisions.WEIGHT_DTYPES[mode]]
    if config.ref_offload == "8bit":
        return sum(p.numel * (1 if p.linear else DTYPE_BYTES[dtype]) for p in base)
    return sum(p.numel * size for p in base)


# --- the disk plan ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DiskPlan:
    """What a run writes under its output folder that counts: final/, and its checkpoints (`engine/checkpoint.py`):
    each holds the trained weights as they train and the optimizer's state (the memory plan's gradients, optimizer
    states and compensation parts: the same tensors, the same bytes); metrics, reports and evaluations are small."""

    final: int  # bytes of final/ (the model in --save-dtype; with --save-adapter-only the adapters)
    checkpoint: int  # bytes of one checkpoint
    every: int  # --save-every (0: none by steps)
    minutes: float  # --save-minutes (0: none by time)
    held: int  # the most checkpoints on disk at once
    kept: int  # the checkpoints left when the run ends (its newest --keep-last; every one without it)

    @property
    def peak(self) -> int:
        """The most the run holds on disk at once, an upper bound: its checkpoints and final/."""
        return self.held * self.checkpoint + self.final


def checkpoints_held(steps: int, save_every: int, keep_last: int | None, save_minutes: float = 0) -> tuple[int, int]:
    """(the most checkpoints on disk at once, those left when the run ends). A run saves after every
    `save_every`-th step before its last (`engine/loop.py`), and with `save_minutes` after any step before its last
    (an upper bound: how many depends on the run's speed); `--keep-last K` with K >= 2 removes the oldest before
    writing the next (K at most), K = 1 writes the next before removing the old one (2 for a moment), and without
    it every checkpoint stays."""
    if steps < 1:
        saves = 0
    elif save_minutes > 0:
        saves = steps - 1
    else:
        saves = (steps - 1) // save_every if save_every > 0 else 0
    if not keep_last:
        return saves, saves
    return min(saves, 2 if keep_last == 1 else keep_last), min(saves, keep_last)


def disk_plan(config: TrainConfig, plan: MemoryPlan, steps: int) -> DiskPlan:
    """The disk plan of `config`'s run of `steps` steps, from its memory plan `plan` (which resolved the dtype and
    the precision)."""
    _, save_dtype = precisions.resolve(plan.settings["precision"], plan.settings["dtype"], config.save_dtype)
    lora = config.lora_rank > 0
    saved = [p for p in plan.model.params if p.adapter == (lora and config.save_adapter_only)]
    final = sum(p.numel for p in saved) * DTYPE_BYTES[save_dtype]
    checkpoint = plan.parts["gradients"] + plan.parts["optimizer states"] + plan.parts["compensation"]
    held, kept = checkpoints_held(steps, config.save_every, config.keep_last, config.save_minutes)
    return DiskPlan(final=final, checkpoint=checkpoint, every=config.save_every, minutes=config.save_minutes,
                    held=held, kept=kept)


def bytes_text(count: float) -> str:
    """A byte count in the largest binary unit it reaches, two decimals."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count:.0f} B"


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds `path`, or would hold it (its nearest existing parent)."""
    path = Path(path).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def render_disk(disk: DiskPlan, out: Path) -> str:
    """The disk plan as one line, with the free space where `out` is (or would be)."""
    cadence = " and ".join([f"every {disk.every} steps"] * bool(disk.every)
                           + [f"every {disk.minutes:g} minutes"] * bool(disk.minutes))
    if disk.held:
        saving = (f"a checkpoint {cadence}, {bytes_text(disk.checkpoint)} each (the trained weights and the "
                  f"optimizer states), up to {disk.held} on disk at once")
    else:
        saving = "no checkpoint" + (" (the run ends first)" if cadence else "")
    free = free_bytes(out)
    word = "fits" if disk.peak <= free else "does not fit"
    return (f"disk plan (an estimate): final/ {bytes_text(disk.final)}; {saving}; the run's most: "
            f"{bytes_text(disk.peak)}; {bytes_text(free)} free where {out} is: {word}")


# --- the printed plan ---------------------------------------------------------------------------------------------

def visible_gpu_gib() -> float | None:
    """The first visible GPU's memory in GiB, None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / GIB


def verdict(total: int, memory_gib: float | None) -> str:
    if memory_gib is None:
        return "no GPU visible and no --gpu-memory: no verdict"
    need = total / GIB + OVERHEAD_GIB
    word = "fits" if need <= memory_gib else "does not fit"
    return f"{word} in {memory_gib:g} GiB ({need:.2f} GiB with {OVERHEAD_GIB:g} GiB for the CUDA context)"


def render(plan: MemoryPlan, processes: int, memory_gib: float | None, fsdp: bool) -> str:
    """The plan as plain lines: the parameters, each part with its bytes per parameter, the totals."""
    s = plan.settings
    lines = [f"memory plan (an estimate; nothing loaded, nothing written): precision {s['precision']}, dtype "
             f"{s['dtype']}, scheme {s['scheme']} ({s['optimizer']}, {s['state_bits']}-bit states, "
             f"{s['objectives']} objective(s)), batch {s['batch_size']} x {s['max_length']} tokens"
             + (", LoRA rank " + str(s["lora_rank"]) if s["lora_rank"] else ""),
             f"parameters: {plan.model.trainable:,} trainable, {plan.model.frozen:,} frozen"]
    for name, value in plan.parts.items():
        per = plan.per_param.get(name)
        per_text = f"{per:6.2f} B/param" if per is not None else " " * 13
        lines.append(f"  {name:<18} {per_text}  {value / GIB:9.3f} GiB")
    other = activation_bytes(plan.model.shape, s["batch_size"], s["max_length"],
                             FLOAT32 if s["precision"] == "fp32" else BF16, not s["gradient_checkpointing"])
    lines.append(f"  (activations {'without' if s['gradient_checkpointing'] else 'with'} gradient checkpointing: "
                 f"{other / GIB:.3f} GiB)")
    lines.append(f"total, 1 process: {plan.total(1, False) / GIB:.3f} GiB")
    if processes > 1:
        lines.append(f"total per process, DDP x {processes}: {plan.total(processes, False) / GIB:.3f} GiB "
                     "(with DDP's gradient buckets)")
        lines.append(f"total per process, FSDP x {processes}: {plan.total(processes, True) / GIB:.3f} GiB "
                     "(with the gathered root and two decoder layers)")
    total = plan.total(processes, fsdp)
    lines.append(f"{'FSDP' if fsdp and processes > 1 else 'DDP' if processes > 1 else 'this run'}: "
                 + verdict(total, memory_gib))
    return "\n".join(lines)


def dry_run(config: TrainConfig, run: Plan, processes: int | None, gpu_memory: float | None,
            steps: int | None = None, out: Path | None = None) -> str:
    """`--dry-run`: the plan of `config`'s run (`run`: its command bound to it) as text; with `steps` and `out`, its
    disk plan too. A GPU is assumed when one is visible or --gpu-memory is given (`auto` dtype and precision
    resolve as there)."""
    visible = visible_gpu_gib()
    memory = gpu_memory if gpu_memory is not None else visible
    plan = build_plan(config, model_plan(config, run), run, cuda=memory is not None)
    text = render(plan, processes or 1, memory, config.fsdp)
    if steps is not None and out is not None:
        text += "\n" + render_disk(disk_plan(config, plan, steps), out)
    return text
