"""Forget losses (GA, NPO, DPO, ME, IDK and the 2026 set SimNPO, RMU, UNDIAL, WGA, SatImp, CE-U), retain
losses (GD, KL, AP, EMBED) and the task loss (CE), one function each, by name.

Every loss takes a `LossContext` (the model, the frozen reference model when it needs one, beta, the other
losses' hyper-parameters in `LossParams`) and a batch {"answer": tensors, "rejection": tensors} built by
`doplus_cli.data.batches`. NLLs are over answer tokens only (labels != -100); "CE" is the mean token
cross-entropy over all answer tokens of the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from doplus_cli.data.formatting import IGNORE_INDEX
from doplus_cli.errors import UserError
from doplus_cli.registry import Registry

Batch = dict[str, dict[str, Tensor]]


def local_token_count(mask: Tensor) -> Tensor:
    return mask.sum().clamp_min(1)


@dataclass(frozen=True)
class LossParams:
    """The hyper-parameters of SimNPO, UNDIAL, WGA, SatImp and RMU (NPO, DPO and AP take `LossContext.beta`).
    Each field is a recipe key and an option of `doplus unlearn` of the same name; these defaults are the one
    source of them (config.UnlearnConfig reads them from here)."""

    simnpo_beta: float = 4.5  # SimNPO's beta: the authors' TOFU forget10 Llama-2-7b setting
    simnpo_gamma: float = 0.0  # SimNPO's reward margin gamma (the paper's; OpenUnlearning's delta = gamma / beta)
    undial_beta: float = 10.0  # UNDIAL's logit reduction of the true token (OpenUnlearning's UNDIAL.yaml)
    wga_beta: float = 1.0  # WGA's exponent of the detached token probability (OpenUnlearning's WGA.yaml)
    satimp_beta1: float = 5.0  # SatImp's saturation exponent on p (OpenUnlearning's SatImp.yaml)
    satimp_beta2: float = 1.0  # SatImp's importance exponent on 1 - p (OpenUnlearning's SatImp.yaml)
    rmu_layer: int | None = None  # the decoder layer whose output RMU steers; None: 7, or 7/32 of a shallower depth
    rmu_coeff: float = 20.0  # the steering coefficient c (OpenUnlearning's RMU class default)
    rmu_update_layers: tuple[int, ...] | None = None  # the layers whose modules RMU trains; None: layer-2 .. layer
    rmu_modules: tuple[str, ...] | None = None  # modules of those layers; None: the MLP's output projection
    seed: int = 0  # seeds RMU's random direction u (the run's --seed)


@dataclass
class LossContext:
    """What a loss needs besides its batch.

    `token_count` turns a batch's answer-token mask into the denominator of token-mean losses. On one
    process it is the batch's count; on N processes the loop passes the all-reduced count divided by N, so
    that the gradients DDP averages equal those of one process on the whole global batch.
    """

    model: torch.nn.Module
    reference: torch.nn.Module | None = None
    beta: float = 0.1
    token_count: Callable[[Tensor], Tensor] = local_token_count
    tally: PartTally | None = None  # set by the loop during a step of a mixture objective
    params: LossParams = field(default_factory=LossParams)


class PartTally:
    """The log of a mixture objective's step (`MixtureSource`, `doplus align --scheme joint`): per part (the set a
    row comes from), the summed NLL of its rows' answer tokens, their token count and the row count, over the
    step's micro-batches. The loss itself is one CE over the whole batch; this only splits what it saw."""

    def __init__(self, names: tuple[str, ...], device: torch.device | str = "cpu") -> None:
        self.names = names
        self.sums = torch.zeros(len(names), 3, dtype=torch.float64, device=device)  # NLL, tokens, rows

    def add(self, part: Tensor, row_nll: Tensor, row_tokens: Tensor) -> None:
        values = torch.stack([row_nll.detach().double(), row_tokens.double(), torch.ones_like(row_tokens).double()], -1)
        self.sums.index_add_(0, part.to(self.sums.device), values.to(self.sums.device))

    def terms(self) -> dict[str, float | None]:
        """{part}_loss: the token-mean CE over the rows of that part (None when the step drew none of them);
        {part}_rows: how many rows of the step's batch came from it."""
        terms: dict[str, float | None] = {}
        for name, (nll, tokens, rows) in zip(self.names, self.sums.tolist()):
            terms[f"{name}_loss"] = nll / tokens if tokens > 0 else None
            terms[f"{name}_rows"] = int(rows)
        return terms


@dataclass(frozen=True)
class LossSpec:
    name: str
    fn: Callable[[LossContext, Batch], Tensor]
    needs_reference: bool = False
    needs_rejection: bool = False
    targeted: bool = False  # trains toward a rejection answer (IDK, DPO): the paper's targeted unlearning


FORGET_LOSSES: Registry[LossSpec] = Registry("forget loss", LossSpec)
RETAIN_LOSSES: Registry[LossSpec] = Registry("retain loss", LossSpec)
TASK_LOSSES: Registry[LossSpec] = Registry("task loss", LossSpec)  # `doplus multitask`


def _register(table: Registry[LossSpec], name: str, **flags: bool):
    """Registers the decorated loss function under `name` as a LossSpec with these flags."""
    return table.register(name, build=lambda fn: LossSpec(name, fn, **flags))


def logits_of(model: torch.nn.Module, tensors: dict[str, Tensor]) -> Tensor:
    return model(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"]).logits


def _upcast(x: Tensor) -> Tensor:
    """bf16/fp16 logits are upcast to float32 before softmax; float32 and float64 stay as they are."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def shifted(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Logits at positions that predict a label, the labels, and the answer-token mask."""
    logits, labels = logits[:, :-1, :], labels[:, 1:]
    mask = labels != IGNORE_INDEX
    return logits, labels, mask


def token_nll(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token NLL [B, T-1] (0 off the answer) and the answer-token mask."""
    logits, labels, mask = shifted(logits, labels)
    nll = F.cross_entropy(
        _upcast(logits).reshape(-1, logits.size(-1)), labels.clamp_min(0).reshape(-1), reduction="none"
    ).view(labels.shape)
    return nll * mask, mask


def sequence_nll(model: torch.nn.Module, tensors: dict[str, Tensor]) -> Tensor:
    """NLL summed over each sample's answer tokens: [B]."""
    nll, _ = token_nll(logits_of(model, tensors), tensors["labels"])
    return nll.sum(-1)


def mean_ce(model: torch.nn.Module, tensors: dict[str, Tensor], token_count=local_token_count) -> Tensor:
    """Mean token cross-entropy over every answer token of the batch."""
    nll, mask = token_nll(logits_of(model, tensors), tensors["labels"])
    return nll.sum() / token_count(mask)


def _on_reference_device(ctx: LossContext, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The batch moved to the reference model's device (it may be kept on CPU: `--ref-offload cpu`)."""
    device = next(ctx.reference.parameters()).device
    return {k: v.to(device) for k, v in tensors.items()}


def _reference_logits(ctx: LossContext, tensors: dict[str, Tensor]) -> Tensor:
    """The reference model's logits at the positions that predict a label (`shifted`), on the batch's device."""
    with torch.no_grad():
        logits = logits_of(ctx.reference, _on_reference_device(ctx, tensors)).to(tensors["labels"].device)
    return logits[:, :-1, :]


def _reference_nll(ctx: LossContext, tensors: dict[str, Tensor]) -> Tensor:
    with torch.no_grad():
        return sequence_nll(ctx.reference, _on_reference_device(ctx, tensors)).to(tensors["labels"].device)


@_register(FORGET_LOSSES, "GA")
def gradient_ascent(ctx: LossContext, batch: Batch) -> Tensor:
    """GA: -CE on the forget answers."""
    return -mean_ce(ctx.model, batch["answer"], ctx.token_count)


@_register(FORGET_LOSSES, "NPO", needs_reference=True)
def npo(ctx: LossContext, batch: Batch) -> Tensor:
    """NPO (Zhang et al., 2024): -(2/beta) * mean log sigmoid(beta * (NLL_theta - NLL_ref)), NLL summed
    over answer tokens."""
    nll = sequence_nll(ctx.model, batch["answer"])
    nll_ref = _reference_nll(ctx, batch["answer"])
    return -(2.0 / ctx.beta) * F.logsigmoid(ctx.beta * (nll - nll_ref)).mean()


@_register(FORGET_LOSSES, "DPO", needs_reference=True, needs_rejection=True, targeted=True)
def dpo(ctx: LossContext, batch: Batch) -> Tensor:
    """DPO with the rejection answer preferred over the true answer, as in the TOFU/closer-look code:
    -(2/beta) * mean log sigmoid(beta * ((logp_theta(idk) - logp_ref(idk)) - (logp_theta(ans) - logp_ref(ans)))),
    log-probabilities summed over answer tokens."""
    win = -sequence_nll(ctx.model, batch["rejection"]) + _reference_nll(ctx, batch["rejection"])
    lose = -sequence_nll(ctx.model, batch["answer"]) + _reference_nll(ctx, batch["answer"])
    return -(2.0 / ctx.beta) * F.logsigmoid(ctx.beta * (win - lose)).mean()


@_register(FORGET_LOSSES, "ME")
def maximum_entropy(ctx: LossContext, batch: Batch) -> Tensor:
    """ME: mean over answer tokens of KL(uniform || p_theta) = -log V - (1/V) * sum_v log p_theta(v)."""
    logits, _, mask = shifted(logits_of(ctx.model, batch["answer"]), batch["answer"]["labels"])
    log_probs = F.log_softmax(_upcast(logits), dim=-1)
    vocab = log_probs.size(-1)
    kl = -math.log(vocab) - log_probs.mean(-1)
    return (kl * mask).sum() / ctx.token_count(mask)


@_register(FORGET_LOSSES, "IDK", needs_rejection=True, targeted=True)
def idk(ctx: LossContext, batch: Batch) -> Tensor:
    """IDK: CE of a rejection answer given the forget question."""
    return mean_ce(ctx.model, batch["rejection"], ctx.token_count)


@_register(RETAIN_LOSSES, "GD")
def gradient_descent(ctx: LossContext, batch: Batch) -> Tensor:
    """GD: CE on the retain answers."""
    return mean_ce(ctx.model, batch["answer"], ctx.token_count)


@_register(RETAIN_LOSSES, "KL", needs_reference=True)
def kl_to_reference(ctx: LossContext, batch: Batch) -> Tensor:
    """KL: mean over retain answer tokens of KL(p_ref || p_theta) = sum_v p_ref(v) (log p_ref(v) - log p_theta(v))."""
    tensors = batch["answer"]
    logits, _, mask = shifted(logits_of(ctx.model, tensors), tensors["labels"])
    ref_logits = _reference_logits(ctx, tensors)
    log_p = F.log_softmax(_upcast(logits), dim=-1)
    log_ref = F.log_softmax(_upcast(ref_logits), dim=-1)
    kl = (log_ref.exp() * (log_ref - log_p)).sum(-1)
    return (kl * mask).sum() / ctx.token_count(mask)


@_register(RETAIN_LOSSES, "AP", needs_rejection=True)
def answer_preservation(ctx: LossContext, batch: Batch) -> Tensor:
    """AP (Yuan et al., 2024): -(1/beta) * mean log sigmoid(beta * (NLL_theta(idk) - NLL_theta(answer))) on
    retain questions, NLL summed over answer tokens."""
    nll_idk = sequence_nll(ctx.model, batch["rejection"])
    nll_answer = sequence_nll(ctx.model, batch["answer"])
    return -(1.0 / ctx.beta) * F.logsigmoid(ctx.beta * (nll_idk - nll_answer)).mean()


@_register(TASK_LOSSES, "CE")
def supervised_cross_entropy(ctx: LossContext, batch: Batch) -> Tensor:
    """CE: mean token cross-entropy of a task's answers given its prompts (prompt tokens masked). On a mixture's
    batch the per-part NLLs are tallied for the log as well (`PartTally`); the loss is the same."""
    nll, mask = token_nll(logits_of(ctx.model, batch["answer"]), batch["answer"]["labels"])
    if ctx.tally is not None and "part" in batch:
        ctx.tally.add(batch["part"]["index"], nll.sum(-1), mask.sum(-1))
    return nll.sum() / ctx.token_count(mask)


# ---- The losses of OpenUnlearning's leaderboard: SimNPO, RMU (+ its EMBED retain term), UNDIAL,
# WGA, SatImp, CE-U. Token means divide by `ctx.token_count` like the losses above, so that N processes
# compute the gradients of one process on the global batch.


@_register(FORGET_LOSSES, "SimNPO")
def simnpo(ctx: LossContext, batch: Batch) -> Tensor:
    """SimNPO (Fan et al., 2024, "Simplicity Prevails: Rethinking Negative Preference Optimization for LLM
    Unlearning"): -(2/beta) * mean log sigmoid(beta * NLL_theta(y)/|y| - gamma), NLL summed over the
    |y| answer tokens of each sample; reference-free and length-normalised. The paper's sign and margin
    convention (gamma subtracted outside the beta); OpenUnlearning writes beta * (NLL/|y| - delta), the same
    loss with delta = gamma / beta. Defaults beta 4.5, gamma 0 (`LossParams`)."""
    beta, gamma = ctx.params.simnpo_beta, ctx.params.simnpo_gamma
    nll, mask = token_nll(logits_of(ctx.model, batch["answer"]), batch["answer"]["labels"])
    per_token = nll.sum(-1) / mask.sum(-1).clamp_min(1)
    return -(2.0 / beta) * F.logsigmoid(beta * per_token - gamma).mean()


def _detached_token_probability(nll: Tensor) -> Tensor:
    """p_t = exp(-NLL_t), cut from the graph (WGA's and SatImp's weights are constants of the step)."""
    return torch.exp(-nll.detach())


@_register(FORGET_LOSSES, "WGA")
def weighted_gradient_ascent(ctx: LossContext, batch: Batch) -> Tensor:
    """WGA (Wang et al., 2025, "Rethinking LLM Unlearning Objectives: A Gradient Perspective and Go Beyond"):
    -mean over answer tokens of p_t^beta * NLL_t, p_t = p_theta(y_t | y_<t, x) detached: gradient ascent whose
    tokens weigh by how likely the model still finds them. As OpenUnlearning's wga.py; default beta 1."""
    nll, mask = token_nll(logits_of(ctx.model, batch["answer"]), batch["answer"]["labels"])
    weight = _detached_token_probability(nll) ** ctx.params.wga_beta
    return -(weight * nll * mask).sum() / ctx.token_count(mask)


@_register(FORGET_LOSSES, "SatImp")
def saturation_importance(ctx: LossContext, batch: Batch) -> Tensor:
    """SatImp (Yang et al., 2025, "Exploring Criteria of Loss Reweighting to Enhance LLM Unlearning"):
    -mean over answer tokens of p_t^beta1 * (1 - p_t)^beta2 * NLL_t, p_t detached (saturation times
    importance weights). As OpenUnlearning's satimp.py; defaults beta1 5, beta2 1."""
    nll, mask = token_nll(logits_of(ctx.model, batch["answer"]), batch["answer"]["labels"])
    p = _detached_token_probability(nll)
    weight = p ** ctx.params.satimp_beta1 * (1 - p) ** ctx.params.satimp_beta2
    return -(weight * nll * mask).sum() / ctx.token_count(mask)


def _cross_entropy_to(logits: Tensor, target: Tensor, mask: Tensor, ctx: LossContext) -> Tensor:
    """Mean over answer positions of -sum_v target_v log softmax(logits)_v."""
    log_p = F.log_softmax(_upcast(logits), dim=-1)
    per_position = -(target * log_p).sum(-1)
    return (per_position * mask).sum() / ctx.token_count(mask)


def _lower_true_token(logits: Tensor, labels: Tensor, amount: float) -> Tensor:
    """A float32 (or wider) copy of `logits` [B, T-1, V] with each position's label logit lowered by `amount`
    (inf: set to -inf); labels off the answer are clamped to 0, their positions masked by the caller."""
    index = labels.clamp_min(0).unsqueeze(-1)
    logits = _upcast(logits).clone()
    if amount == float("inf"):
        return logits.scatter_(-1, index, float("-inf"))
    return logits.scatter_add_(-1, index, torch.full(index.shape, -amount, dtype=logits.dtype, device=logits.device))


@_register(FORGET_LOSSES, "UNDIAL", needs_reference=True)
def undial(ctx: LossContext, batch: Batch) -> Tensor:
    """UNDIAL (Dong et al., 2024, "UNDIAL: Self-Distillation with Adjusted Logits for Robust Unlearning in Large
    Language Models"): mean over answer tokens of CE(softmax(z_ref - beta * onehot(y_t)), p_theta), the frozen
    reference's logits with the true token's lowered by beta as a soft target. Answer tokens only (older
    OpenUnlearning releases average over every position, prompt and padding included); default beta 10."""
    tensors = batch["answer"]
    logits, labels, mask = shifted(logits_of(ctx.model, tensors), tensors["labels"])
    ref_logits = _reference_logits(ctx, tensors)
    target = F.softmax(_lower_true_token(ref_logits, labels, ctx.params.undial_beta), dim=-1)
    return _cross_entropy_to(logits, target, mask, ctx)


@_register(FORGET_LOSSES, "CE-U")
def cross_entropy_unlearning(ctx: LossContext, batch: Batch) -> Tensor:
    """CE-U (Yang et al., 2025, "CE-U: Cross Entropy Unlearning"): mean over answer tokens of
    CE(softmax(z_theta with z_y = -inf), p_theta), the target being the model's own (detached) distribution
    with the true token removed. Every answer token counts: OpenUnlearning's ceu.py also skips the first one
    (the paper's footnote), doplus does not."""
    tensors = batch["answer"]
    logits, labels, mask = shifted(logits_of(ctx.model, tensors), tensors["labels"])
    suppressed = _lower_true_token(logits.detach(), labels, float("inf"))
    return _cross_entropy_to(logits, F.softmax(suppressed, dim=-1), mask, ctx)


# ---- RMU: activations of one decoder layer, steered on the forget set and held on the retain set.


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's list of transformer blocks (`model.layers` of Llama, Phi, Qwen; `transformer.h` of GPT-2),
    found through any wrapper (DDP, peft, FSDP)."""
    found = [m for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h", "blocks")]
    if not found:
        raise UserError("RMU: cannot find the model's decoder layers (a ModuleList named layers, h or blocks)")
    return max(found, key=len)


OPENUNLEARNING_RMU_LAYER, OPENUNLEARNING_DEPTH = 7, 32  # layer 7 of a 32-layer 7B model (WMDP, OpenUnlearning)


def rmu_layer_index(params: LossParams, depth: int) -> int:
    """`rmu_layer`, or by default OpenUnlearning's layer 7 when the model has more than 7 layers, else the
    same relative depth 7/32 of its layers (rounded down)."""
    if params.rmu_layer is not None:
        return params.rmu_layer
    if depth > OPENUNLEARNING_RMU_LAYER:
        return OPENUNLEARNING_RMU_LAYER
    return OPENUNLEARNING_RMU_LAYER * depth // OPENUNLEARNING_DEPTH


def _layer_output(model: torch.nn.Module, tensors: dict[str, Tensor], layer: int) -> Tensor:
    """The hidden state [B, T, d] that decoder layer `layer` outputs, captured by a forward hook during one
    forward pass of `model` (the hook is removed right after, so gradient checkpointing's recompute leaves it)."""
    captured: list[Tensor] = []

    def keep(module, inputs, output):
        captured.append(output[0] if isinstance(output, tuple) else output)

    handle = decoder_layers(model)[layer].register_forward_hook(keep)
    try:
        logits_of(model, tensors)
    finally:
        handle.remove()
    return captured[0]


def rmu_direction(params: LossParams, width: int, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    """RMU's fixed random unit vector u (WMDP's and OpenUnlearning's draw: uniform [0, 1) entries, normalised),
    the same on every process and every resume: drawn from its own generator seeded with `params.seed`."""
    generator = torch.Generator().manual_seed(params.seed)
    u = torch.rand(width, generator=generator, dtype=torch.float64)
    return (u / u.norm()).to(device=device, dtype=dtype)


def _mean_square_per_token(difference: Tensor, mask: Tensor, ctx: LossContext) -> Tensor:
    """Mean over answer tokens of (1/d) * ||difference_t||^2."""
    per_token = _upcast(difference).pow(2).mean(-1)
    return (per_token * mask).sum() / ctx.token_count(mask)


@_register(FORGET_LOSSES, "RMU")
def rmu(ctx: LossContext, batch: Batch) -> Tensor:
    """RMU (Li et al., 2024, "The WMDP Benchmark: Measuring and Reducing Malicious Use With Unlearning", Sec. 5):
    mean over answer tokens of (1/d) * ||h_l(x_f)_t - c * u||^2, the output h_l of decoder layer l pushed to a
    fixed random unit vector u scaled by c. Only the modules `prepare_rmu` leaves trainable change (WMDP and
    OpenUnlearning: mlp.down_proj of layers l-2..l). Answer tokens as OpenUnlearning's rmu.py (the WMDP code
    uses every token of its plain-text corpus; a text row here has every token in its answer). Defaults:
    layer 7 (scaled to shallower models, `rmu_layer_index`), c = 20."""
    tensors = batch["answer"]
    layer = rmu_layer_index(ctx.params, len(decoder_layers(ctx.model)))
    hidden = _upcast(_layer_output(ctx.model, tensors, layer))  # bf16 activations: the distance in float32
    steer = ctx.params.rmu_coeff * rmu_direction(ctx.params, hidden.size(-1), hidden.device, hidden.dtype)
    return _mean_square_per_token(hidden - steer, tensors["labels"] != IGNORE_INDEX, ctx)


@_register(RETAIN_LOSSES, "EMBED", needs_reference=True)
def activation_preservation(ctx: LossContext, batch: Batch) -> Tensor:
    """EMBED, RMU's retain term (Li et al., 2024; OpenUnlearning's EMBED_DIFF): mean over retain answer tokens of
    (1/d) * ||h_l(x_r)_t - h_l^ref(x_r)_t||^2, decoder layer l's output held at the frozen reference's. Takes
    RMU's layer (`rmu_layer`), with any forget loss."""
    tensors = batch["answer"]
    layer = rmu_layer_index(ctx.params, len(decoder_layers(ctx.model)))
    hidden = _upcast(_layer_output(ctx.model, tensors, layer))
    with torch.no_grad():
        ref_hidden = _layer_output(ctx.reference, _on_reference_device(ctx, tensors), layer)
    difference = hidden - ref_hidden.to(hidden.device, hidden.dtype)
    return _mean_square_per_token(difference, tensors["labels"] != IGNORE_INDEX, ctx)


def _mlp_output_projection(block: torch.nn.Module) -> str:
    """The name (inside one decoder layer) of its MLP's output projection: down_proj (Llama, Qwen, Mistral),
    fc2 (Phi), c_proj (GPT-2), dense_4h_to_h (GPT-NeoX)."""
    names = {name for name, _ in block.named_modules()}
    for candidate in ("mlp.down_proj", "mlp.fc2", "mlp.c_proj", "mlp.dense_4h_to_h"):
        if candidate in names:
            return candidate
    raise UserError("RMU: this model's MLP output projection is none of down_proj, fc2, c_proj, dense_4h_to_h; "
                    "name the modules to train with --rmu-modules")


def _listed(items: tuple | range) -> str:
    """A list option's items as its flag is typed: (5, 6, 7) -> 5,6,7."""
    return ",".join(str(item) for item in items)


def checked_rmu_layer(model: torch.nn.Module, params: LossParams) -> int:
    """RMU's and EMBED's layer on this model, or one line (UserError) when the model has no such layer."""
    depth = len(decoder_layers(model))
    layer = rmu_layer_index(params, depth)
    if not 0 <= layer < depth:
        raise UserError(f"--rmu-layer {layer}: out of range, the model has {depth} decoder layers (0..{depth - 1})")
    return layer


def prepare_rmu(model: torch.nn.Module, params: LossParams) -> list[str]:
    """Leave only RMU's chosen modules trainable: `rmu_modules` (default: the MLP's output projection) of
    layers `rmu_update_layers` (default: l-2..l, the two before RMU's layer and itself); every other
    parameter gets requires_grad False, and under LoRA only the adapters inside those modules train. Returns
    the trained modules' names (within the decoder layers). One line (UserError) for a layer out of range or
    a module that is not there."""
    layers = decoder_layers(model)
    depth = len(layers)
    layer = checked_rmu_layer(model, params)
    update = (params.rmu_update_layers if params.rmu_update_layers is not None
              else range(max(0, layer - 2), layer + 1))
    for index in update:
        if not index < depth:
            raise UserError(f"--rmu-update-layers {_listed(update)}: layer {index} is out of range, the "
                            f"model has {depth} decoder layers (0..{depth - 1})")
    chosen: dict[str, torch.nn.Module] = {}
    for index in update:
        block = layers[index]
        paths = params.rmu_modules or (_mlp_output_projection(block),)
        present = dict(block.named_modules())
        for path in paths:
            if path not in present or not path:
                raise UserError(f"--rmu-modules {_listed(paths)}: layer {index} has no module '{path}' "
                                f"(e.g. {_mlp_output_projection(block)})")
            chosen[f"{index}.{path}"] = present[path]
    keep = {id(p) for module in chosen.values() for p in module.parameters() if p.requires_grad}
    if not keep:
        raise UserError(f"RMU trains {', '.join(chosen)} and none of their weights is trainable: with LoRA, adapt "
                        "them (--lora-targets), e.g. --lora-targets down_proj")
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)
    return list(chosen)
