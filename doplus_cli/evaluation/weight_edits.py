"""White-box edit attacks that read the starting model (`doplus evaluate --attacks orthogonalize,prune`): each
returns a changed copy of the evaluated (unlearned) model, on which the forget suites run again, as on a
quantized copy.

- orthogonalize (`orthogonalized_copy`): the direction the unlearning added to the residual stream, the mean
  difference of the two models' residual streams over the forget prompts at the layer where it stands out most,
  projected out of every weight that writes into the residual stream (Arditi et al. 2024, "Refusal in
  language models is mediated by a single direction", weight orthogonalization; Łucki et al. 2024, "An
  adversarial perspective on machine unlearning for AI safety", who ablate such a direction to undo RMU).
- prune (`pruned_copy`): the MLP neurons whose weights changed most during unlearning reset to the starting
  model's values (or zeroed), after Łucki et al. 2024's pruning of the weights unlearning changed (the
  `recover_from_base` patching of Wei et al. 2024's set-difference pruning code).

The model and the starting model are never changed; a peft model's adapters are merged into the copy first.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from doplus_cli.errors import UserError
from doplus_cli.evaluation.attack_api import AttackInput

# The last name of a linear layer of a decoder block whose output is added to the residual stream: the attention
# output projection (o_proj: Llama, Qwen, Mistral, Gemma; dense: Phi, GPT-NeoX; out_proj) and the MLP output
# projection (down_proj; fc2: Phi; dense_4h_to_h: GPT-NeoX; w2: experts held as linear layers).
ATTENTION_WRITERS = ("o_proj", "dense", "out_proj")
MLP_WRITERS = ("down_proj", "fc2", "dense_4h_to_h", "w2")
# A block with this norm normalizes each sublayer's output before adding it (Gemma 2 and 3, OLMo 2): the norm's
# gain would put the direction back, so no weight edit can keep it out of the residual stream.
POST_NORM = "post_feedforward_layernorm"
# Below this separation (mean difference over the starting model's spread) the two models' activations agree:
# there is no direction to remove and the copy is left as it is.
ZERO_SEPARATION = 1e-6
ROWS_PER_CHUNK = 8192  # rows of a matrix projected at a time in float32 (a 128k-token embedding is not upcast whole)

# An MLP's neurons: the linear layers whose rows are the neuron's inputs (each at a row offset: a fused gate_up
# projection holds the gate's rows, then the up projection's), and the one whose columns are its outputs.
MLP_LAYOUTS = (
    ((("mlp.gate_proj", 0), ("mlp.up_proj", 0)), "mlp.down_proj"),  # Llama, Qwen, Mistral, Gemma
    ((("mlp.gate_up_proj", 0), ("mlp.gate_up_proj", 1)), "mlp.down_proj"),  # Phi-3 (offset: in widths)
    ((("mlp.fc1", 0),), "mlp.fc2"),  # Phi
    ((("mlp.dense_h_to_4h", 0),), "mlp.dense_4h_to_h"),  # GPT-NeoX
)


# ---- shared ----

def _needs_base(inp: AttackInput, attack: str) -> None:
    if inp.base is None:
        raise UserError(f"--attacks {attack}: needs the starting model (the model the unlearning began from); "
                        "the run's record names none: give it with --base-model")


def _merged_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `model` with a peft model's adapters merged into its weights; no gradients carried over."""
    attacked = copy.deepcopy(model)
    if hasattr(attacked, "merge_and_unload"):
        attacked = attacked.merge_and_unload()
    for parameter in attacked.parameters():
        parameter.grad = None
    return attacked


def _plain(model: torch.nn.Module) -> torch.nn.Module:
    """`model` itself, or for a peft model a merged copy (the model is only read)."""
    return _merged_copy(model) if hasattr(model, "merge_and_unload") else model


def decoder_blocks(model: torch.nn.Module, attack: str) -> torch.nn.ModuleList:
    """The model's transformer blocks: the longest ModuleList named layers, h or blocks (`model.layers` of Llama,
    Phi, Qwen; `transformer.h` of GPT-2), through any wrapper."""
    found = [module for name, module in model.named_modules()
             if isinstance(module, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h", "blocks")]
    if not found:
        raise UserError(f"--attacks {attack}: cannot find the model's decoder layers (a ModuleList named layers, h "
                        "or blocks)")
    return max(found, key=len)


@contextmanager
def _eval_mode(*models: torch.nn.Module) -> Iterator[None]:
    """The models in eval mode (no dropout) for the block, each put back in its own mode after."""
    modes = [model.training for model in models]
    try:
        for model in models:
            model.eval()
        yield
    finally:
        for model, mode in zip(models, modes):
            model.train(mode)


# ---- orthogonalize ----

def _prompt_batches(prompts: list[list[int]], pad_id: int, batch_size: int):
    """Right-padded batches of prompt ids: (input_ids, attention_mask, counted), `counted` marking every prompt
    token but the first (the first of a one-token prompt is counted)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in range(0, len(order), batch_size):
        chunk = [prompts[i] for i in order[start:start + batch_size]]
        width = max(len(ids) for ids in chunk)
        input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
        counted = torch.zeros((len(chunk), width), dtype=torch.bool)
        for row, ids in enumerate(chunk):
            input_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, :len(ids)] = 1
            counted[row, min(1, len(ids) - 1):len(ids)] = True
        yield input_ids, attention_mask, counted


@torch.no_grad()
def stream_sums(model: torch.nn.Module, prompts: list[list[int]], pad_id: int, batch_size: int, attack: str,
                direction: torch.Tensor | None = None) -> dict[str, Any]:
    """Over the counted prompt tokens t (`_prompt_batches`), at each point p of the residual stream (p = 0: the
    first decoder layer's input, the embedding output; p = l + 1: decoder layer l's output; transformers'
    `hidden_states` order), in float64 on the CPU: the sum of the states sum_t h_p(t), the sum of their squares
    sum_t h_p(t)^2 (per coordinate), and, given a unit `direction` r, sum_t |h_p(t) . r| / ||h_p(t)||; `tokens`,
    the count. The states are read by hooks on the blocks (transformers' last `hidden_states` entry is after the
    final norm, not the last block's output). The model runs without its output head (`get_decoder`): no logits
    are needed."""
    blocks = decoder_blocks(model, attack)
    points = len(blocks) + 1
    sums: list[torch.Tensor | None] = [None] * points
    squares: list[torch.Tensor | None] = [None] * points
    along = [0.0] * points
    current: dict[str, torch.Tensor] = {}

    def add(point: int, hidden: torch.Tensor) -> None:
        states = hidden[current["counted"].to(hidden.device)].double()
        total, square = states.sum(0).cpu(), states.pow(2).sum(0).cpu()
        sums[point] = total if sums[point] is None else sums[point] + total
        squares[point] = square if squares[point] is None else squares[point] + square
        if direction is not None:
            unit = direction.to(states.device, torch.float64)
            along[point] += float(((states @ unit).abs() / states.norm(dim=-1).clamp_min(1e-30)).sum())

    def first_input(module, args, kwargs):
        add(0, args[0] if args else kwargs["hidden_states"])

    def output_of(point: int):
        def keep(module, inputs, output):
            add(point, output[0] if isinstance(output, tuple) else output)
        return keep

    handles = [blocks[0].register_forward_pre_hook(first_input, with_kwargs=True)]
    handles += [block.register_forward_hook(output_of(i + 1)) for i, block in enumerate(blocks)]
    device = model.get_input_embeddings().weight.device
    decoder = getattr(model, "get_decoder", lambda: None)() or model  # the blocks without the output head
    tokens = 0
    try:
        with _eval_mode(model):
            for input_ids, attention_mask, counted in _prompt_batches(prompts, pad_id, batch_size):
                current["counted"] = counted
                tokens += int(counted.sum())
                decoder(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return {"sum": torch.stack(sums), "square": torch.stack(squares), "along": along, "tokens": tokens}


def separations(unlearned: dict[str, Any], base: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per point p of the residual stream (`stream_sums`): the mean difference d_p = mean_t h^u_p(t) -
    mean_t h^b_p(t) [L + 1, d], and its separation s_p = ||d_p|| / sigma_p, where sigma_p =
    sqrt(mean_t ||h^b_p(t) - mean_t h^b_p||^2) is the spread of the starting model's states there (the shift in
    units of the states' own spread, so that deeper layers, whose residual stream has grown larger, are not
    favoured)."""
    n = base["tokens"]
    mean_u, mean_b = unlearned["sum"] / n, base["sum"] / n
    difference = mean_u - mean_b
    spread = (base["square"] / n - mean_b.pow(2)).clamp_min(0).sum(-1).sqrt()
    return difference, difference.norm(dim=-1) / spread.clamp_min(1e-30)


def _project_rows(rows: torch.Tensor, unit: torch.Tensor) -> None:
    """rows <- rows - (rows r) r^T in place: each row (a vector of the residual stream's width) loses its component
    along the unit vector r. Computed in float32 a chunk of rows at a time, rounded once to the rows' dtype."""
    unit = unit.to(rows.device, torch.float32)
    for start in range(0, rows.shape[0], ROWS_PER_CHUNK):
        block = rows[start:start + ROWS_PER_CHUNK].float()
        block -= torch.outer(block @ unit, unit)
        rows[start:start + ROWS_PER_CHUNK].copy_(block.to(rows.dtype))


def untie_output_head(model: torch.nn.Module) -> bool:
    """When the output head shares its weight with the input embedding, give the head a weight of its own (the
    same values) and mark the model's config untied (saved and reloaded, the two stay apart); True when it did.
    Projecting the embedding's rows then leaves the head as it was."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or (head.weight is not embedding.weight
                        and head.weight.data_ptr() != embedding.weight.data_ptr()):
        return False
    head.weight = torch.nn.Parameter(embedding.weight.detach().clone(), requires_grad=embedding.weight.requires_grad)
    configs = {id(model.config): model.config}
    if hasattr(model.config, "get_text_config"):
        configs.setdefault(id(model.config.get_text_config()), model.config.get_text_config())
    for config in configs.values():
        config.tie_word_embeddings = False
    if hasattr(model, "get_expanded_tied_weights_keys"):  # transformers 5 keeps the tie's mapping on the model
        model.all_tied_weights_keys = model.get_expanded_tied_weights_keys(all_submodels=True)
    return True


def residual_writers(model: torch.nn.Module, attack: str) -> tuple[list[str], list[str]]:
    """The names of the modules that write into the residual stream: the embeddings of its width outside the
    decoder blocks (the token embedding, a learned position embedding) and, in each block, the linear layers
    named in ATTENTION_WRITERS and MLP_WRITERS whose output has its width. One line for a model whose blocks
    normalize their sublayers' outputs (POST_NORM) or in which a block lacks an attention or an MLP writer (its
    MLP's experts held in one tensor, say)."""
    blocks = decoder_blocks(model, attack)
    width = model.get_input_embeddings().weight.shape[1]
    inside = {id(m) for block in blocks for m in block.modules()}
    embeddings = [name for name, m in model.named_modules()
                  if isinstance(m, torch.nn.Embedding) and id(m) not in inside and m.weight.shape[1] == width]
    names = {id(m): name for name, m in model.named_modules()}
    linears = []
    for block in blocks:
        inner = dict(block.named_modules())
        if any(name.rsplit(".", 1)[-1] == POST_NORM for name in inner):
            raise UserError(f"--attacks {attack}: this model ({type(model).__name__}) normalizes each sublayer's "
                            "output before the residual stream (a post-norm), so no weight edit can remove a "
                            "direction from it; the attack takes models without post-norms (Llama, Qwen, Mistral, "
                            "Phi, GPT-NeoX, Gemma 1)")
        found = {kind: [names[id(m)] for name, m in inner.items() if isinstance(m, torch.nn.Linear)
                        and name.rsplit(".", 1)[-1] in kind and m.out_features == width]
                 for kind in (ATTENTION_WRITERS, MLP_WRITERS)}
        for kind, what in ((ATTENTION_WRITERS, "attention"), (MLP_WRITERS, "MLP")):
            if not found[kind]:
                raise UserError(f"--attacks {attack}: a decoder layer of {type(model).__name__} has no {what} output "
                                f"projection held as a linear layer named {' or '.join(kind)}; the attack cannot "
                                "edit this model")
        linears += found[ATTENTION_WRITERS] + found[MLP_WRITERS]
    return embeddings, linears


@torch.no_grad()
def orthogonalized_copy(inp: AttackInput) -> tuple[torch.nn.Module, dict[str, Any]]:
    """A copy of the evaluated model with the direction the unlearning added to the residual stream projected out
    of every weight that writes into it.

    The direction: both models (the unlearned model and `inp.base`, the starting model) read the forget rows'
    prompts (`PromptFormatter.prompt_ids` of each question, nothing of the answer); at each point p of the
    residual stream (p = 0: the embedding output; p = l + 1: decoder layer l's output, transformers'
    `hidden_states` order), the mean state over every prompt token but each prompt's first (the BOS or first
    template token, the same in every prompt, where real models hold an attention-sink state of outsized norm),
    in float64. d_p = mean_unlearned - mean_starting; the point chosen is the one of largest separation
    s_p = ||d_p|| / sigma_p (sigma_p: the starting model's spread there, `separations`); r = d_p / ||d_p||.

    The edit (Arditi et al. 2024's weight orthogonalization): every matrix whose output is the residual stream
    loses its output's component along r, W <- W - r r^T W, its bias b <- b - r r^T b: the embedding's rows (and a
    learned position embedding's), each attention output projection and each MLP output projection
    (`residual_writers`). Nothing can then write r into the residual stream, so no layer reads it. The output head
    reads the stream and is not edited: a head tied to the embedding is untied first (`untie_output_head`), so it
    keeps the unlearned model's values.

    With s_p <= ZERO_SEPARATION at every point (the two models' states agree) there is no direction: the copy is
    the unlearned model unchanged and the details say so. Returns the copy and the details: the point chosen
    (`layer`, its index p, and `where`, in words), the separation and ||d_p|| per point, the direction's norm
    ||d_p||, the prompts and tokens read, the modules edited, whether the head was untied, and per point the mean
    of |h . r| / ||h|| on the edited copy over the first `batch_size` prompts (`along_after`: what is left along
    r, rounding only)."""
    _needs_base(inp, "orthogonalize")
    if not inp.forget:
        raise UserError("--attacks orthogonalize: the suite has no forget rows to read the direction from")
    attacked = _merged_copy(inp.model)
    base = _plain(inp.base)
    depth, base_depth = len(decoder_blocks(attacked, "orthogonalize")), len(decoder_blocks(base, "orthogonalize"))
    width, base_width = attacked.get_input_embeddings().weight.shape[1], base.get_input_embeddings().weight.shape[1]
    if (depth, width) != (base_depth, base_width):
        raise UserError(f"--base-model: the starting model has {base_depth} layers of width {base_width}, the "
                        f"evaluated model {depth} of width {width}: not the model the unlearning began from")
    embeddings, linears = residual_writers(attacked, "orthogonalize")
    formatter = inp.formatter
    prompts = [formatter.prompt_ids(row.question)[-formatter.max_length:] for row in inp.forget]
    pad_id = formatter.tokenizer.pad_token_id if formatter.tokenizer.pad_token_id is not None else 0
    unlearned_sums = stream_sums(attacked, prompts, pad_id, inp.batch_size, "orthogonalize")
    base_sums = stream_sums(base, prompts, pad_id, inp.batch_size, "orthogonalize")
    difference, separation = separations(unlearned_sums, base_sums)
    layer = int(torch.argmax(separation))
    details: dict[str, Any] = {
        "layer": layer, "where": "the embedding output" if layer == 0 else f"decoder layer {layer - 1}'s output",
        "separation": separation.tolist(), "difference_norm": difference.norm(dim=-1).tolist(),
        "direction_norm": float(difference[layer].norm()), "rows": len(prompts), "tokens": base_sums["tokens"],
        "positions": "every prompt token but the first", "rule": "largest ||mean difference|| / starting spread",
    }
    if float(separation[layer]) <= ZERO_SEPARATION:
        details.update(zero_direction=True, edited=[], untied_head=False, along_after=None,
                       note=f"no direction: the two models' activations agree (separation <= {ZERO_SEPARATION:g} "
                            "at every point of the residual stream); the copy is the unlearned model unchanged")
        return attacked, details
    unit = (difference[layer] / difference[layer].norm()).float()
    untied = untie_output_head(attacked)
    for name in embeddings:
        _project_rows(attacked.get_submodule(name).weight.data, unit)
    for name in linears:
        linear = attacked.get_submodule(name)
        _project_rows(linear.weight.data.t(), unit)  # W^T's rows are W's columns, the output's vectors
        if linear.bias is not None:
            _project_rows(linear.bias.data.unsqueeze(0), unit)
    check = prompts[:inp.batch_size]  # one batch: what is left along r is rounding wherever the edit is exact
    after = stream_sums(attacked, check, pad_id, inp.batch_size, "orthogonalize", direction=unit)
    details.update(zero_direction=False, edited=embeddings + linears, untied_head=untied,
                   along_after=[value / after["tokens"] for value in after["along"]])
    return attacked, details


# ---- prune ----

def mlp_neurons(block: torch.nn.Module, attack: str = "prune") -> tuple[list[tuple[str, int]], str, int]:
    """The block's MLP as `MLP_LAYOUTS` names it: the input layers with each one's row offset in neurons, the
    output layer, and the number of neurons (the output layer's input width)."""
    names = {name for name, _ in block.named_modules()}
    for inputs, output in MLP_LAYOUTS:
        if output in names and all(name in names for name, _ in inputs):
            neurons = block.get_submodule(output).in_features
            return [(name, part * neurons) for name, part in inputs], output, neurons
    raise UserError(f"--attacks {attack}: the model's MLP is none of gate_proj/up_proj/down_proj, "
                    "gate_up_proj/down_proj, fc1/fc2, dense_h_to_4h/dense_4h_to_h; the attack cannot find its neurons")


def _paired(block: torch.nn.Module, base_block: torch.nn.Module, name: str, layer: int):
    module, base_module = block.get_submodule(name), base_block.get_submodule(name)
    if module.weight.shape != base_module.weight.shape:
        raise UserError(f"--base-model: the starting model's layer {layer} {name} is "
                        f"{tuple(base_module.weight.shape)}, the evaluated model's {tuple(module.weight.shape)}: "
                        "not the model the unlearning began from")
    return module, base_module


def neuron_scores(block: torch.nn.Module, base_block: torch.nn.Module, layer: int) -> torch.Tensor:
    """Per MLP neuron i of one block: how far its weights moved during unlearning, the absolute norm
    sqrt(sum over input layers ||W_u[o + i, :] - W_b[o + i, :]||^2 + (b_u[o + i] - b_b[o + i])^2
    + ||D_u[:, i] - D_b[:, i]||^2), over the rows feeding it (gate and up projections, or fc1, at offset o, with
    their bias entries) and the output layer's column D[:, i]; float32 on the CPU."""
    inputs, output, neurons = mlp_neurons(block)
    total = torch.zeros(neurons, dtype=torch.float32)
    for name, offset in inputs:
        module, base_module = _paired(block, base_block, name, layer)
        rows = slice(offset, offset + neurons)
        change = module.weight[rows].float() - base_module.weight[rows].to(module.weight.device).float()
        total += change.pow(2).sum(1).cpu()
        if module.bias is not None and base_module.bias is not None:
            total += (module.bias[rows].float() - base_module.bias[rows].to(module.bias.device).float()).pow(2).cpu()
    module, base_module = _paired(block, base_block, output, layer)
    change = module.weight.float() - base_module.weight.to(module.weight.device).float()
    return (total + change.pow(2).sum(0).cpu()).sqrt()


def _edit_neurons(block: torch.nn.Module, base_block: torch.nn.Module, chosen: torch.Tensor, zero: bool) -> None:
    """The chosen neurons' input rows (and bias entries) and output columns set to the starting model's values, or
    to zero (`zero`), in `block`."""
    inputs, output, _ = mlp_neurons(block)
    for name, offset in inputs:
        module, base_module = block.get_submodule(name), base_block.get_submodule(name)
        rows = (chosen + offset).to(module.weight.device)
        for tensor, base_tensor in ((module.weight, base_module.weight), (module.bias, base_module.bias)):
            if tensor is not None:
                tensor.data[rows] = 0 if zero else _rows_of(base_tensor, rows, tensor)
    module, base_module = block.get_submodule(output), base_block.get_submodule(output)
    columns = chosen.to(module.weight.device)
    module.weight.data[:, columns] = 0 if zero else _rows_of(base_module.weight.t(), columns, module.weight).t()


def _rows_of(source: torch.Tensor, rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`source[rows]` on `like`'s device, in its dtype."""
    return source.data[rows.to(source.device)].to(like.device, like.dtype)


@torch.no_grad()
def pruned_copy(inp: AttackInput, fraction: float, mode: str = "reset") -> tuple[torch.nn.Module, dict[str, Any]]:
    """A copy of the evaluated model whose MLP neurons that changed most during unlearning are reset to the
    starting model's values (`mode="reset"`) or removed, their weights zeroed (`mode="zero"`).

    Every MLP neuron of every decoder layer gets its score (`neuron_scores`: the norm of its weights' change from
    the starting model `inp.base`); the k = ceil(fraction * N) of largest score over all N neurons of the model
    are chosen (one ranking across layers, since unlearning often changes a few layers only; ties in layer, then
    neuron, order), those whose score is 0 (unchanged) left out. Resetting a neuron writes the starting model's
    values into its input rows (gate and up projections, or fc1, with their bias entries) and its output column;
    the output projection's bias, shared by all neurons, is not a neuron's and stays. Returns the copy and the
    details: the fraction, the neurons in all, k, the number edited, the score threshold (the smallest score
    edited; None when none is), and per layer the count and the indices."""
    _needs_base(inp, "prune")
    if not 0 <= fraction <= 1:
        raise UserError(f"--prune-fraction {fraction}: give a fraction of the MLP neurons between 0 and 1, e.g. 0.01")
    if mode not in ("reset", "zero"):
        raise ValueError(f"prune mode: {mode}")
    attacked = _merged_copy(inp.model)
    base = _plain(inp.base)
    blocks, base_blocks = decoder_blocks(attacked, "prune"), decoder_blocks(base, "prune")
    if len(blocks) != len(base_blocks):
        raise UserError(f"--base-model: the starting model has {len(base_blocks)} layers, the evaluated model "
                        f"{len(blocks)}: not the model the unlearning began from")
    scores = [neuron_scores(block, base_block, layer)
              for layer, (block, base_block) in enumerate(zip(blocks, base_blocks))]
    flat = torch.cat(scores)
    total = flat.numel()
    k = min(total, math.ceil(round(fraction * total, 6)))
    order = torch.sort(flat, descending=True, stable=True).indices[:k]
    order = order[flat[order] > 0]
    starts = [0]
    for layer_scores in scores:
        starts.append(starts[-1] + layer_scores.numel())
    per_layer: list[list[int]] = []
    for layer, (block, base_block) in enumerate(zip(blocks, base_blocks)):
        inside = order[(order >= starts[layer]) & (order < starts[layer + 1])] - starts[layer]
        chosen = torch.sort(inside).values
        if chosen.numel():
            _edit_neurons(block, base_block, chosen, zero=mode == "zero")
        per_layer.append(chosen.tolist())
    details = {
        "fraction": fraction, "mode": mode, "neurons": total, "k": k, "edited": int(order.numel()),
        "threshold": float(flat[order[-1]]) if order.numel() else None,
        "per_layer": [len(indices) for indices in per_layer], "indices": per_layer,
        "score": "||change of the neuron's input rows and output column|| (absolute)",
    }
    return attacked, details
