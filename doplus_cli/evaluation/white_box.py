"""White-box reading attacks: does an unlearned model still hold the forget set's answers in its hidden states?

- `logit_lens`: every decoder layer's output read through the model's own final norm and output head (the logit
  lens, nostalgebraist 2020; applied to unlearned models by Łucki et al. 2024 and, as the "head projection" attack,
  by Patil et al. 2024). Per layer, the forget set's Probability (teacher-forced answers); the layer where the
  forget set is most likely is the attacked value, the last layer (the model's own output) the unattacked one. A
  greedy decode that reads every next token from that layer gives its ROUGE-L recall.
- `linear_probe`: a logistic-regression probe on the mean hidden state of each answer, trained on the first half of
  the forget rows to tell the true answer from its perturbed ones, scored on the second half (latent knowledge
  probing, after Lynch et al. 2024); the unattacked value is the model's own choice by answer likelihood.

Both read the model without changing it: no gradient reaches its parameters, its training mode is restored, and
every hook is removed. Each returns an `attack_api.Reading`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from doplus_cli.data.formatting import IGNORE_INDEX, PromptFormatter, left_padded_prompts
from doplus_cli.errors import UserError, shown
from doplus_cli.evaluation import metrics
from doplus_cli.evaluation.attack_api import AttackInput, Reading
from doplus_cli.evaluation.scoring import answer_batches
from doplus_cli.generation import cache_argument
from doplus_cli.losses import token_nll
from doplus_cli.progress import count_tokens

# The attribute names transformers gives the norm after the last decoder layer (Llama, Mistral, Qwen, Gemma: norm;
# Phi: final_layernorm; GPT-2, GPT-J, Falcon: ln_f; OPT: final_layer_norm; Mamba: norm_f).
FINAL_NORMS = ("norm", "final_layernorm", "ln_f", "final_layer_norm", "norm_f")
LENS_MAX_NEW_TOKENS = 32  # the lens decode's length (option max_new_tokens): ROUGE on each answer's start
LENS_TOLERANCE = 1e-3  # |lens(last layer) - logits| allowed, relative to the logits' scale
PROBE_L2 = 1e-2  # the probe's L2 penalty on its weights (standardized features; option l2)
# the settings `--attack-option ATTACK.NAME=VALUE` may change, with their defaults
SETTINGS = {"logit-lens": {"max_new_tokens": LENS_MAX_NEW_TOKENS}, "linear-probe": {"l2": PROBE_L2}}
PROBE_MIN_ROWS = 4  # two to train (one per fold of the layer choice), two held out
PROBE_MAX_ITER = 500  # LBFGS iterations per fit


# ---------------------------------------------------------------------------------------------- the lens

@dataclass
class Lens:
    """A model's final norm and output head: lens(h) = head(norm(h)), the model's logits when h is its last
    decoder layer's output; with `softcap` (Gemma 2's `final_logit_softcapping`), softcap * tanh(logits / softcap)
    as the model caps its own."""

    norm: torch.nn.Module
    head: torch.nn.Module
    softcap: float | None = None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(hidden))
        return logits if not self.softcap else self.softcap * torch.tanh(logits / self.softcap)


def find_lens(model: torch.nn.Module) -> Lens:
    """The final norm (an attribute named as in `FINAL_NORMS` on the decoder, `get_decoder()` or `base_model`),
    the output head (`get_output_embeddings()`) and the logit soft-capping of its config, if any, of `model`, a peft
    model's base model looked into; a model without a norm or a head is one line naming its class."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = type(inner).__name__
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if head is None:
        raise UserError(f"--attacks logit-lens: {name} has no output head (get_output_embeddings) to read its "
                        "layers through")
    owners = []
    if hasattr(inner, "get_decoder"):
        try:
            owners.append(inner.get_decoder())
        except (AttributeError, NotImplementedError):
            pass
    owners.append(getattr(inner, "base_model", inner))
    config = getattr(inner, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    softcap = getattr(config, "final_logit_softcapping", None)
    for owner in owners:
        for attribute in FINAL_NORMS:
            norm = getattr(owner, attribute, None)
            if isinstance(norm, torch.nn.Module):
                return Lens(norm, head, float(softcap) if softcap else None)
    raise UserError(f"--attacks logit-lens: cannot find the final norm of {name} (looked for "
                    f"{', '.join(FINAL_NORMS)} on its decoder); the logit lens reads Llama-like models")


def _forward(model: torch.nn.Module, inputs: dict[str, Any], keep: int | None, norm: torch.nn.Module | None = None):
    """`model(**inputs)` with every hidden state; with `norm`, also the input of its last call (the last decoder
    layer's output, before the final norm). `keep`: logits of the last `keep` positions only."""
    captured: list[torch.Tensor] = []

    def grab(module, args, kwargs):
        captured.append(args[0] if args else next(iter(kwargs.values())))

    handle = norm.register_forward_pre_hook(grab, with_kwargs=True) if norm is not None else None
    try:
        try:
            output = model(**inputs, output_hidden_states=True, **({} if keep is None else {"logits_to_keep": keep}))
        except TypeError:  # an architecture without logits_to_keep
            output = model(**inputs, output_hidden_states=True)
    finally:
        if handle is not None:
            handle.remove()
    if output.hidden_states is None:
        raise UserError(f"--attacks: {type(model).__name__} returns no hidden states (output_hidden_states)")
    layers = _declared_layers(model)
    if layers is not None and len(output.hidden_states) != layers + 1:
        raise UserError(f"--attacks: {type(model).__name__} returned {len(output.hidden_states)} hidden states for "
                        f"{layers} decoder layers (its config's num_hidden_layers) and the embedding: which state "
                        "is which layer's is unknown")
    if norm is not None and not captured:
        raise UserError(f"--attacks logit-lens: the final norm found in {type(model).__name__} is not called in its "
                        "forward; the logit lens cannot read its layers")
    return output, (captured[-1] if captured else None)


def _declared_layers(model: torch.nn.Module) -> int | None:
    """The number of decoder layers the model's (text) config declares, None without one."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    layers = getattr(config, "num_hidden_layers", None)
    return layers if isinstance(layers, int) else None


def layer_states(output, last: torch.Tensor) -> list[torch.Tensor]:
    """The outputs of decoder layers 1..N: hidden states 1..N-1 as the model returns them (0 is the embedding) and
    the last layer's output `last` as it enters the final norm (the model's own N-th hidden state is already
    normed in Llama-like models)."""
    return [*output.hidden_states[1:-1], last]


@torch.no_grad()
def lens_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor], lens: Lens | None = None
                ) -> list[torch.Tensor]:
    """Every decoder layer's output read through the lens, lens(h_l) for l = 1..N: a list of N [B, T, V] logits.
    lens(h_N) is the model's own output."""
    lens = lens or find_lens(model)
    output, last = _forward(model, batch, None, lens.norm)
    return [lens(h) for h in layer_states(output, last)]


def _check_last_layer(lens_last: torch.Tensor, logits: torch.Tensor, model) -> None:
    """The lens of the last layer must reproduce the model's logits: a model with a logit scale or soft-capping
    after its head would otherwise be read with another function than its own."""
    scale = float(logits.abs().max().clamp_min(1.0))
    gap = float((lens_last.float() - logits.float()).abs().max())
    if gap > LENS_TOLERANCE * scale:
        raise UserError(f"--attacks logit-lens: the final norm and output head of {type(model).__name__} do not "
                        f"give its logits (max difference {gap:.3g}: a logit scale or soft-capping?); the lens "
                        "cannot read its layers")


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


class _Reading:
    """The model in eval mode for the block, its training mode restored after."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.was_training = model, model.training

    def __enter__(self):
        self.model.eval()
        return self.model

    def __exit__(self, *exc) -> None:
        self.model.train(self.was_training)


@torch.no_grad()
def layer_answer_nlls(model: torch.nn.Module, formatter: PromptFormatter, pairs: Sequence[tuple[str, str]],
                      batch_size: int = 16, lens: Lens | None = None) -> list[list[float]]:
    """Per layer l = 1..N and pair (question, answer): the mean NLL of the answer tokens given the prompt, each
    next-token distribution read from layer l through the lens, softmax(lens(h_l)); [N][pairs]. Batched as
    `scoring.mean_token_nlls` (sorted by length, left-padded), the head run only at the positions that predict an
    answer token; each batch checks that the last layer's lens gives the model's own logits there."""
    lens = lens or find_lens(model)
    result: list[list[float]] = []
    with _Reading(model):
        for chunk, batch, keep in answer_batches(model, formatter, pairs, batch_size):
            inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
            output, last = _forward(model, inputs, keep, lens.norm)
            # position t predicts token t + 1: the head runs at the positions whose next token is an answer token
            targets = batch["labels"][:, -keep:][:, 1:]
            scored = targets != IGNORE_INDEX
            row_of = scored.nonzero()[:, 0]
            counts = scored.sum(-1).clamp_min(1).double()
            states = layer_states(output, last)
            if not result:
                result = [[0.0] * len(pairs) for _ in states]
            for layer, hidden in enumerate(states):
                logits = lens(hidden[:, -keep:][:, :-1][scored])
                if layer == len(states) - 1:
                    _check_last_layer(logits, output.logits[:, -keep:][:, :-1][scored], model)
                nll = torch.nn.functional.cross_entropy(logits.float(), targets[scored], reduction="none")
                sums = torch.zeros(len(chunk), dtype=torch.float64, device=nll.device)
                sums.index_add_(0, row_of, nll.double())
                for i, value in zip(chunk, (sums / counts).tolist()):
                    result[layer][i] = value
    return result


def _stop_tokens(model, tokenizer) -> set[int]:
    """EOS and pad of the tokenizer and the generation config's EOS ids: a decoded row ends at the first."""
    stop = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    stop |= set(eos) if isinstance(eos, (list, tuple)) else {eos}
    return stop - {None}


@torch.no_grad()
def lens_greedy(model: torch.nn.Module, formatter: PromptFormatter, questions: Sequence[str], layer: int,
                max_new_tokens: int, batch_size: int = 16, lens: Lens | None = None
                ) -> tuple[list[str], list[list[int]]]:
    """Greedy completions of each question's prompt where every next token is argmax lens(h_layer) at the last
    position (`layer` in 1..N; N gives the model's own greedy decode): (texts, token ids), the ids stopping before
    the first EOS/pad token and the texts decoded without special tokens, as `generation.greedy_generate`.
    Batched with left padding in order of prompt length, with the model's KV cache; a batch stops when each of its
    rows has stopped or produced `max_new_tokens`."""
    lens = lens or find_lens(model)
    device = _device(model)
    tokenizer = formatter.tokenizer
    stop = _stop_tokens(model, tokenizer)
    prompts = [formatter.prompt_ids(q)[-formatter.max_length:] for q in questions]
    order = sorted(range(len(questions)), key=lambda i: len(prompts[i]))
    tokens: list[list[int]] = [[] for _ in questions]
    # the name the model's own forward takes (a peft model passes it on to its base model's)
    cache_kwarg = cache_argument(model.get_base_model() if hasattr(model, "get_base_model") else model)

    def next_token(output, last) -> torch.Tensor:
        if layer == len(output.hidden_states) - 1:  # the last layer: the model's own logits
            return output.logits[:, -1].argmax(-1)
        return lens(layer_states(output, last)[layer - 1][:, -1]).argmax(-1)

    with _Reading(model):
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            padded = {k: v.to(device) for k, v in left_padded_prompts(formatter, [questions[i] for i in chunk]).items()}
            mask = padded["attention_mask"]
            positions = (mask.cumsum(-1) - 1).clamp_min(0)
            count_tokens("prompt", int(mask.sum()))
            output, last = _forward(model, {**padded, "position_ids": positions, "use_cache": True}, 1, lens.norm)
            token, position = next_token(output, last), positions[:, -1] + 1
            rows: list[list[int]] = [[] for _ in chunk]
            done = [False] * len(chunk)
            for step in range(max_new_tokens):
                for k, value in enumerate(token.tolist()):
                    if not done[k]:
                        rows[k].append(value)
                        done[k] = value in stop
                count_tokens("generated", len(chunk))
                if all(done) or step == max_new_tokens - 1:
                    break
                mask = torch.cat([mask, mask.new_ones((len(chunk), 1))], dim=1)
                inputs = {"input_ids": token[:, None], "attention_mask": mask, "position_ids": position[:, None],
                          "use_cache": True, cache_kwarg: _cache_of(output)}
                output, last = _forward(model, inputs, 1, lens.norm)
                token, position = next_token(output, last), position + 1
            for i, row in zip(chunk, rows):
                tokens[i] = row[:-1] if row and row[-1] in stop else row
    texts = [tokenizer.decode(row, skip_special_tokens=True).strip() for row in tokens]
    return texts, tokens


def _cache_of(output):
    """The KV cache a forward returned: `cache` (transformers 5.x, which deprecates the old name), else
    `past_key_values`."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def checked_options(attack: str, options: dict[str, Any]) -> dict[str, Any]:
    """`--attack-option` values of the logit lens or the probe, checked and typed (`SETTINGS`: their names)."""
    values = _options(attack, options, SETTINGS[attack])
    return {name: values[name] for name in options}


def _options(attack: str, options: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """`AttackInput.options` checked against the attack's own (`defaults`: name -> default value): an unknown name,
    a whole-number option that is not a whole number >= 1 or a float option that is not a number > 0 is one line
    naming it."""
    values = dict(defaults)
    for name, value in options.items():
        if name not in defaults:
            raise UserError(f"--attack-option {attack}.{name}: unknown option '{name}': choose from "
                            f"{', '.join(defaults)}")
        if isinstance(defaults[name], int):
            number = int(str(value)) if not isinstance(value, bool) and str(value).strip().isdigit() else 0
            if number < 1:
                raise UserError(f"--attack-option {attack}.{name}: must be a whole number >= 1, got {shown(value)}")
        else:
            try:
                number = float(value)
            except (TypeError, ValueError):
                number = math.nan
            if not number > 0 or math.isinf(number):
                raise UserError(f"--attack-option {attack}.{name}: must be a number > 0, got {shown(value)}")
        values[name] = number
    return values


def _best_layer(values: Sequence[float]) -> int:
    """1-based index of the largest value (a tie goes to the later layer, the one nearer the output)."""
    return max(range(len(values)), key=lambda i: (values[i], i)) + 1


def _layer_probabilities(model, formatter, rows, batch_size: int, lens: Lens) -> list[float]:
    nlls = layer_answer_nlls(model, formatter, [(s.question, s.answer) for s in rows], batch_size, lens)
    return [metrics.probability(layer) for layer in nlls]


def logit_lens(inp: AttackInput) -> Reading:
    """The logit lens on the forget rows. Per decoder layer l = 1..N, Probability_l = mean_i exp(-NLL_il), NLL_il
    the mean NLL of answer i's tokens (teacher-forced, as `PromptFormatter.encode` builds prompt + answer) under
    softmax(head(norm(h_l))). Attacked: "probability" at the best layer l* = argmax_l Probability_l, and "rouge",
    the mean ROUGE-L recall against the answers of a greedy decode that takes every next token from layer l*'s lens
    (`max_new_tokens`, default 32). Unattacked: Probability_N (the model's own output) and the ROUGE-L recall of
    the same decode from layer N, the model's own greedy decode. `details`: every layer's
    Probability, l*, and with `inp.base` the starting model's per-layer values (no decode)."""
    rows = list(inp.forget)
    if not rows:
        raise UserError("--attacks logit-lens: the suite has no forget rows to read")
    max_new_tokens = _options("logit-lens", inp.options, SETTINGS["logit-lens"])["max_new_tokens"]
    lens = find_lens(inp.model)
    values = _layer_probabilities(inp.model, inp.formatter, rows, inp.batch_size, lens)
    best, last = _best_layer(values), len(values)
    questions, answers = [s.question for s in rows], [s.answer for s in rows]
    own, _ = lens_greedy(inp.model, inp.formatter, questions, last, max_new_tokens, inp.batch_size, lens)
    read = own if best == last else lens_greedy(inp.model, inp.formatter, questions, best, max_new_tokens,
                                                inp.batch_size, lens)[0]

    def rouge(texts: list[str]) -> float:
        return sum(metrics.rouge_l_recall(t, a) for t, a in zip(texts, answers)) / len(answers)

    details: dict[str, Any] = {
        "layers": [{"layer": k + 1, "probability": v} for k, v in enumerate(values)],
        "best_layer": best, "final_layer": last, "max_new_tokens": max_new_tokens,
        "cost": {"teacher_forced_rows": len(rows), "lens_reads": len(rows) * last,
                 "decoded_rows": len(rows) * (1 if best == last else 2)},
    }
    if inp.base is not None:
        base_values = _layer_probabilities(inp.base, inp.formatter, rows, inp.batch_size, find_lens(inp.base))
        base_best = _best_layer(base_values)
        details["base"] = {"layers": [{"layer": k + 1, "probability": v} for k, v in enumerate(base_values)],
                           "best_layer": base_best, "probability": base_values[base_best - 1],
                           "final_probability": base_values[-1]}
    return Reading(rows=f"forget rows 0 to {len(rows) - 1}",
                   unattacked={"probability": values[-1], "rouge": rouge(own)},
                   attacked={"probability": values[best - 1], "rouge": rouge(read)},
                   directions={"probability": 1, "rouge": 1}, details=details)


# ---------------------------------------------------------------------------------------------- the probe

@torch.no_grad()
def answer_features(model: torch.nn.Module, formatter: PromptFormatter, pairs: Sequence[tuple[str, str]],
                    batch_size: int = 16) -> tuple[torch.Tensor, list[float]]:
    """For each (question, answer): the mean over the answer's tokens (the positions `encode` labels: the answer
    and its end token) of every hidden state the model returns, index 0 the embedding and l = 1..N decoder layer
    l's output (the N-th after the final norm in Llama-like models), float32 on the CPU [pairs, N + 1, H]; and the
    answer's mean token NLL under the model's own logits."""
    features: torch.Tensor | None = None
    nlls = [0.0] * len(pairs)
    with _Reading(model):
        for chunk, batch, keep in answer_batches(model, formatter, pairs, batch_size):
            inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
            output, _ = _forward(model, inputs, keep)
            labels = batch["labels"][:, -keep:]
            nll, mask = token_nll(output.logits[:, -keep:], labels)
            for i, value in zip(chunk, (nll.sum(-1) / mask.sum(-1).clamp_min(1)).tolist()):
                nlls[i] = value
            answer = (labels != IGNORE_INDEX).unsqueeze(-1).float()  # [B, keep, 1]
            states = torch.stack([h[:, -keep:].float() for h in output.hidden_states], dim=1)  # [B, N + 1, keep, H]
            means = (states * answer.unsqueeze(1)).sum(2) / answer.sum(1).clamp_min(1).unsqueeze(1)
            if features is None:
                features = torch.zeros(len(pairs), *means.shape[1:])
            features[chunk] = means.cpu()
    return features, nlls


@dataclass
class Probe:
    """A logistic-regression probe on standardized features: score(x) = ((x - mean) / std) . w + b, the log-odds
    that x is the state of a true answer."""

    mean: torch.Tensor
    std: torch.Tensor
    w: torch.Tensor
    b: torch.Tensor

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return ((x.double() - self.mean) / self.std) @ self.w + self.b


def fit_probe(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, l2: float = PROBE_L2) -> Probe:
    """The probe minimizing sum_i weight_i * BCE(sigmoid(z_i . w + b), y_i) / sum_i weight_i + l2 / 2 * |w|^2 over
    z = (x - mean) / std (the columns' mean and population std over x; a constant column's std taken as 1), from
    w = 0, b = 0 by full-batch LBFGS (strong Wolfe line search) in float64: the objective is strictly convex, so the
    optimum is unique and the fit deterministic."""
    x, y, weight = x.double(), y.double(), weight.double()
    mean, std = x.mean(0), x.std(0, unbiased=False)
    std = torch.where(std > 1e-8, std, torch.ones_like(std))
    z = (x - mean) / std
    w = torch.zeros(z.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    total = weight.sum()
    optimizer = torch.optim.LBFGS([w, b], lr=1.0, max_iter=PROBE_MAX_ITER, tolerance_grad=1e-10,
                                  tolerance_change=1e-14, history_size=20, line_search_fn="strong_wolfe")

    def objective() -> torch.Tensor:
        optimizer.zero_grad()
        loss = (weight * torch.nn.functional.binary_cross_entropy_with_logits(z @ w + b, y, reduction="none")
                ).sum() / total + 0.5 * l2 * (w * w).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(objective)
    return Probe(mean, std, w.detach(), b.detach())


def class_weights(y: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """Each item's weight in the probe's loss: a perturbed answer weighs 1 and a true answer as much as its row's
    perturbed answers together, so that the two classes weigh the same."""
    labels = y.tolist()
    wrong: dict[int, int] = {}
    for row, label in zip(rows, labels):
        if not label:
            wrong[row] = wrong.get(row, 0) + 1
    return torch.tensor([float(wrong.get(row, 1)) if label else 1.0 for row, label in zip(rows, labels)])


def _choice_correct(scores: Sequence[float], y: Sequence[float], rows: Sequence[int]) -> dict[int, bool]:
    """Per row: whether its true answer scores above every perturbed answer of the row."""
    true: dict[int, float] = {}
    best_false: dict[int, float] = {}
    for score, label, row in zip(scores, y, rows):
        if label:
            true[row] = score
        else:
            best_false[row] = max(best_false.get(row, -float("inf")), score)
    return {row: true[row] > best_false[row] for row in true}


def select_layer(features: torch.Tensor, y: torch.Tensor, item_rows: list[int], train_rows: list[int],
                 seed: int, l2: float = PROBE_L2) -> tuple[int, list[dict[str, float]]]:
    """The layer l (1-based: `features[:, l - 1]`) whose probe chooses best on held-out folds of the training rows:
    the training rows in two folds (a permutation drawn with `seed`), a probe trained on each fold and scored on the
    other; the layer with the highest fold accuracy, a tie going to the lower weighted BCE on the folds, then the
    later layer."""
    generator = torch.Generator().manual_seed(seed)
    permuted = [train_rows[i] for i in torch.randperm(len(train_rows), generator=generator).tolist()]
    folds = [set(permuted[: len(permuted) // 2]), set(permuted[len(permuted) // 2:])]
    per_layer = []
    for layer in range(features.shape[1]):
        correct, loss, weight_sum = 0, 0.0, 0.0
        for k in (0, 1):
            fit = [i for i, r in enumerate(item_rows) if r in folds[k]]
            held = [i for i, r in enumerate(item_rows) if r in folds[1 - k]]
            probe = fit_probe(features[fit, layer], y[fit], class_weights(y[fit], [item_rows[i] for i in fit]), l2)
            held_rows = [item_rows[i] for i in held]
            weight = class_weights(y[held], held_rows)
            scores = probe.score(features[held, layer])
            correct += sum(_choice_correct(scores.tolist(), y[held].tolist(), held_rows).values())
            loss += float((weight.double() * torch.nn.functional.binary_cross_entropy_with_logits(
                scores, y[held].double(), reduction="none")).sum())
            weight_sum += float(weight.sum())
        per_layer.append({"layer": layer + 1, "fold_accuracy": correct / len(train_rows),
                          "fold_bce": loss / weight_sum})
    best = max(range(len(per_layer)), key=lambda i: (per_layer[i]["fold_accuracy"], -per_layer[i]["fold_bce"], i))
    return best + 1, per_layer


def _held_out_accuracy(features: torch.Tensor, y: torch.Tensor, item_rows: list[int], split: int,
                       l2: float = PROBE_L2) -> float:
    """A probe fitted on the items of rows 0 to `split`-1 (`features`: [items, H], one layer's), scored on the
    others: the fraction of those rows whose true answer it scores above every perturbed one."""
    train = [i for i, r in enumerate(item_rows) if r < split]
    held = [i for i, r in enumerate(item_rows) if r >= split]
    probe = fit_probe(features[train], y[train], class_weights(y[train], [item_rows[i] for i in train]), l2)
    correct = _choice_correct(probe.score(features[held]).tolist(), y[held].tolist(), [item_rows[i] for i in held])
    return sum(correct.values()) / len(correct)


def _probe_run(model, formatter: PromptFormatter, rows: list, batch_size: int, seed: int,
               l2: float = PROBE_L2) -> dict[str, Any]:
    """The probe procedure on one model: features of every answer, the layer chosen on the first half, the probe
    trained there on the whole first half and scored on the second; the same probe on the embedding alone; the
    model's own choice on the second half."""
    pairs, item_rows, labels = [], [], []
    for r, sample in enumerate(rows):
        for option, label in [(sample.answer, 1.0)] + [(p, 0.0) for p in sample.perturbed]:
            pairs.append((sample.question, option))
            item_rows.append(r)
            labels.append(label)
    features, nlls = answer_features(model, formatter, pairs, batch_size)
    y = torch.tensor(labels)
    split = len(rows) // 2
    layer, per_layer = select_layer(features[:, 1:], y, item_rows, list(range(split)), seed, l2)
    held = [i for i, r in enumerate(item_rows) if r >= split]
    # the model's own choice: the answer with the lowest mean token NLL (negated as a score)
    own = _choice_correct([-nlls[i] for i in held], y[held].tolist(), [item_rows[i] for i in held])
    return {"probe_accuracy": _held_out_accuracy(features[:, layer], y, item_rows, split, l2),
            "output_choice_accuracy": sum(own.values()) / len(own),
            "embedding_probe_accuracy": _held_out_accuracy(features[:, 0], y, item_rows, split, l2),
            "layer": layer, "layers": per_layer}


def linear_probe(inp: AttackInput) -> Reading:
    """A linear probe for the true answer. Per forget row and each of its answers (the true one and the perturbed
    ones), x_l = the mean hidden state over the answer's tokens at layer l. On the first half of the rows (0 to
    k-1, k = N // 2) a logistic-regression probe (`fit_probe`) learns true-vs-perturbed at every layer; the layer
    is chosen by two-fold accuracy within that half (`select_layer`) and the probe refitted there on the whole half.
    Attacked: "probe_accuracy", the fraction of held-out rows (k to N-1) whose true answer the probe scores above
    every perturbed one. Unattacked: the fraction of those rows whose true answer has a lower mean token NLL than
    every perturbed one (the model's own choice). `details["embedding_probe_accuracy"]`: the same probe on the mean
    token embedding (hidden state 0: the answer's words without context), how far wording alone tells the true
    answers from the perturbed ones. With `inp.base`, the same procedure on the starting model is in
    `details["base"]`."""
    l2 = _options("linear-probe", inp.options, SETTINGS["linear-probe"])["l2"]
    rows = list(inp.forget)
    missing = [i for i, s in enumerate(rows) if not s.perturbed]
    if missing:
        raise UserError(f"--attacks linear-probe needs perturbed answers on every forget row (TOFU's "
                        f"perturbed_answer); {len(missing)} of {len(rows)} rows have none (the first: row "
                        f"{missing[0]})")
    if len(rows) < PROBE_MIN_ROWS:
        raise UserError(f"--attacks linear-probe needs at least {PROBE_MIN_ROWS} forget rows (half to train, half "
                        f"held out); the suite has {len(rows)}")
    run = _probe_run(inp.model, inp.formatter, rows, inp.batch_size, inp.seed, l2)
    split = len(rows) // 2
    details: dict[str, Any] = {
        "layer": run["layer"], "layers": run["layers"], "train_rows": f"forget rows 0 to {split - 1}",
        "embedding_probe_accuracy": run["embedding_probe_accuracy"], "l2": l2,
        "cost": {"teacher_forced_answers": sum(1 + len(s.perturbed) for s in rows),
                 "probe_fits": 2 * len(run["layers"]) + 2},
    }
    if inp.base is not None:
        base = _probe_run(inp.base, inp.formatter, rows, inp.batch_size, inp.seed, l2)
        details["base"] = {k: base[k] for k in ("probe_accuracy", "output_choice_accuracy",
                                                "embedding_probe_accuracy", "layer")}
    return Reading(rows=f"held-out forget rows {split} to {len(rows) - 1}",
                   unattacked={"probe_accuracy": run["output_choice_accuracy"]},
                   attacked={"probe_accuracy": run["probe_accuracy"]},
                   directions={"probe_accuracy": 1}, details=details)


READERS: dict[str, Callable[[AttackInput], Reading]] = {"logit-lens": logit_lens, "linear-probe": linear_probe}
