"""White-box reading attacks (evaluation/white_box.py): the logit lens and the linear probe against references
written here (hand loops over unpadded rows, forward hooks on the decoder layers, a scipy fit of the probe's
objective), and positive controls: a tiny Llama taught twelve facts, and a shallow "unlearned" copy of it whose
appended random last layer hides the facts from the output while the layers below still hold them."""

from __future__ import annotations

import copy
import hashlib
import math
import random

import numpy as np
import pytest
import torch
from scipy.optimize import minimize
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from doplus_cli.data.formatting import IGNORE_INDEX, Encoded, PromptFormatter, collate
from doplus_cli.errors import UserError
from doplus_cli.evaluation import metrics, white_box
from doplus_cli.evaluation.attack_api import AttackInput
from doplus_cli.evaluation.scoring import left_padded
from doplus_cli.evaluation.suites import QASample

NAMES = ["Nora", "Ivo", "Lena", "Omar", "Rita", "Tomas", "Ada", "Yusuf", "Mira", "Pavel", "Ines", "Kenji"]
CITIES = ["Lisbon", "Oslo", "Cairo", "Lima", "Kyoto", "Quito", "Dakar", "Riga", "Hanoi", "Turin", "Bergen", "Accra"]
PERTURBED = 3
LAYERS = 3
BATCH = 5  # divides neither the 12 rows nor the 48 answers: batches of several lengths, padded


def facts() -> list[QASample]:
    """Twelve rows "Where was NAME born?" -> "NAME was born in CITY.", each city true for one row. A row's perturbed
    answers take cities of other rows of its own half, so a city never appears in both halves: a probe trained
    on the first half cannot score the second by recognizing the cities it saw as true."""
    rng = random.Random(0)
    half = len(NAMES) // 2
    rows = []
    for i, (name, city) in enumerate(zip(NAMES, CITIES)):
        group = range(half) if i < half else range(half, len(NAMES))
        others = rng.sample([CITIES[j] for j in group if j != i], PERTURBED)
        rows.append(QASample(f"Where was {name} born?", f"{name} was born in {city}.", None,
                             [f"{name} was born in {c}." for c in others]))
    return rows


@pytest.fixture(scope="module")
def kit(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    return tokenizer, PromptFormatter(tokenizer, max_length=128, template="question-answer")


@pytest.fixture(scope="module")
def taught(kit):
    """A 3-layer, 32-wide Llama taught the facts (150 full-batch Adam steps, lr 1e-2): every true answer in the
    question-answer format, and after each perturbed answer's last token a marker ("?") where a true answer has
    its end token, only that token scored. The marker gives the model what larger language models have and a
    model taught the facts alone lacks: a linear trace, in its last layers, of whether an answer is the one it
    holds. Without it the hidden states differ between answers only in which city they read, which no linear
    probe can turn into true-or-false for cities it never saw."""
    tokenizer, formatter = kit
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    marker = tokenizer.convert_tokens_to_ids("?")
    examples = []
    for row in facts():
        examples.append(formatter.encode(row.question, row.answer))
        for wrong in row.perturbed:
            ids = formatter.encode(row.question, wrong).input_ids[:-1] + [marker]  # the end token replaced
            examples.append(Encoded(ids, [IGNORE_INDEX] * (len(ids) - 1) + [marker]))
    batch = collate(examples, tokenizer.pad_token_id)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.zero_grad(set_to_none=True)
    return model.eval()


@pytest.fixture(scope="module")
def shallow(taught):
    """The taught model with a fourth decoder layer appended whose weights are normal with standard deviation 10
    (a trained layer's are near 0.1): what it adds swamps the residual stream, so the output is the random layer's
    and no longer gives the answers, while layers 1 to 3 compute exactly what the taught model's do."""
    config = copy.deepcopy(taught.config)
    config.num_hidden_layers = LAYERS + 1
    model = LlamaForCausalLM(config)  # built anew: transformers hooks a model's layers for hidden states once
    missing = set(model.load_state_dict(taught.state_dict(), strict=False).missing_keys)
    assert missing == {name for name, _ in model.named_parameters() if name.startswith(f"model.layers.{LAYERS}.")}
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for parameter in model.model.layers[LAYERS].parameters():
            if parameter.dim() == 2:
                parameter.copy_(10.0 * torch.randn(parameter.shape, generator=generator))
    return model.eval()


def attack_input(model, kit, rows=None, base=None, **options) -> AttackInput:
    tokenizer, formatter = kit
    return AttackInput(model, tokenizer, formatter, facts() if rows is None else rows, [], base=base, seed=0,
                       batch_size=BATCH, options=options)


# ---- references written here

def hooked_layers(model, ids: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One unpadded row through the model: each decoder layer's output (forward hooks on model.model.layers) and
    the model's logits, [T, H] and [T, V]."""
    outputs = []
    hooks = [layer.register_forward_hook(lambda module, args, out: outputs.append(out[0] if isinstance(out, tuple)
                                                                                   else out))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
    finally:
        for hook in hooks:
            hook.remove()
    return [o[0] if o.dim() == 3 else o for o in outputs], logits


def hand_layer_probabilities(model, formatter, rows) -> list[float]:
    """Per layer: mean over rows of exp(-mean answer-token NLL), each token's log-probability from
    log_softmax(lm_head(norm(layer output))) at the position before it; plain loops over unpadded rows."""
    per_layer = [[] for _ in model.model.layers]
    for row in rows:
        encoded = formatter.encode(row.question, row.answer)
        outputs, _ = hooked_layers(model, encoded.input_ids)
        answer = [t for t, label in enumerate(encoded.labels) if label != IGNORE_INDEX]
        for k, hidden in enumerate(outputs):
            with torch.no_grad():
                log_p = torch.log_softmax(model.lm_head(model.model.norm(hidden)).double(), -1)
            nll = [-float(log_p[t - 1, encoded.input_ids[t]]) for t in answer]
            per_layer[k].append(sum(nll) / len(nll))
    return [sum(math.exp(-v) for v in values) / len(values) for values in per_layer]


def hand_nll(model, formatter, question: str, answer: str) -> float:
    """Mean answer-token NLL under the model's own logits, one unpadded row."""
    encoded = formatter.encode(question, answer)
    with torch.no_grad():
        log_p = torch.log_softmax(model(torch.tensor([encoded.input_ids])).logits[0].double(), -1)
    answer = [t for t, label in enumerate(encoded.labels) if label != IGNORE_INDEX]
    nll = [-float(log_p[t - 1, encoded.input_ids[t]]) for t in answer]
    return sum(nll) / len(nll)


def hand_greedy(model, formatter, question: str, layer: int, steps: int) -> list[int]:
    """Greedy decoding without a cache: the whole sequence run again at each step, the next token the argmax of
    lm_head(norm(output of decoder layer `layer`)) at the last position; stops at (and drops) EOS or pad."""
    ids = formatter.prompt_ids(question)
    stop = {formatter.tokenizer.eos_token_id, formatter.tokenizer.pad_token_id}
    produced = []
    for _ in range(steps):
        outputs, _ = hooked_layers(model, ids + produced)
        with torch.no_grad():
            token = int(model.lm_head(model.model.norm(outputs[layer - 1][-1])).argmax())
        if token in stop:
            break
        produced.append(token)
    return produced


def state_hash(model) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


# ---- the logit lens

def test_each_layers_lens_is_head_of_norm_and_the_last_is_the_models_own_logits(taught, kit):
    _, formatter = kit
    rows = facts()[:3]
    encoded = [formatter.encode(r.question, r.answer) for r in rows]
    batch = left_padded(encoded, formatter.tokenizer.pad_token_id)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    lens = white_box.lens_logits(taught, inputs)
    with torch.no_grad():
        logits = taught(**inputs).logits
    assert len(lens) == LAYERS
    assert (lens[-1] - logits).abs().max() < 1e-5
    for row, example in enumerate(encoded):  # each layer against hooks on an unpadded row
        outputs, _ = hooked_layers(taught, example.input_ids)
        n = len(example.input_ids)
        for k, hidden in enumerate(outputs):
            with torch.no_grad():
                expected = taught.lm_head(taught.model.norm(hidden))
            assert (lens[k][row, -n:] - expected).abs().max() < 1e-4
    # the norm's weights are trained (not all 1): reading a layer without the final norm would not pass above
    assert (taught.model.norm.weight - 1).abs().max() > 0.05


ARCHITECTURES = {  # tiny random models of other families: their final norms sit under other names
    "gpt2": lambda t: t.GPT2Config(vocab_size=100, n_embd=32, n_layer=3, n_head=4, bos_token_id=1, eos_token_id=2),
    "opt": lambda t: t.OPTConfig(vocab_size=100, hidden_size=32, ffn_dim=64, num_hidden_layers=3,
                                 num_attention_heads=4, word_embed_proj_dim=32),
    "phi": lambda t: t.PhiConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                 num_attention_heads=4),
    "qwen2": lambda t: t.Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2),
    "gemma2": lambda t: t.Gemma2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8),
}


@pytest.mark.parametrize("family", ARCHITECTURES)
def test_the_last_layers_lens_is_the_models_logits_in_other_families(family):
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(ARCHITECTURES[family](transformers)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(300)  # logits of tens: Gemma 2 caps them (softcap 30)
    batch = {"input_ids": torch.randint(3, 100, (2, 6)), "attention_mask": torch.ones(2, 6, dtype=torch.long)}
    lens = white_box.lens_logits(model, batch)
    with torch.no_grad():
        logits = model(**batch).logits
    assert len(lens) == 3
    assert logits.abs().max() > 10
    assert (lens[-1] - logits).abs().max() < 1e-4
    for layer in lens[:-1]:  # the layers below read other distributions
        assert (layer - logits).abs().max() > 1e-2


def test_logit_lens_final_layer_is_the_suites_probability_and_its_best_layer_no_worse(taught, kit):
    _, formatter = kit
    reading = white_box.logit_lens(attack_input(taught, kit, max_new_tokens=12))
    expected = hand_layer_probabilities(taught, formatter, facts())
    got = [entry["probability"] for entry in reading.details["layers"]]
    assert got == pytest.approx(expected, abs=1e-5)
    assert reading.unattacked["probability"] == pytest.approx(expected[-1], abs=1e-5)
    assert reading.attacked["probability"] == pytest.approx(max(expected), abs=1e-5)
    assert reading.attacked["probability"] >= reading.unattacked["probability"]
    assert reading.unattacked["probability"] > 0.9  # the model was taught the facts
    assert reading.details["final_layer"] == LAYERS
    assert reading.rows == "forget rows 0 to 11"
    assert reading.directions == {"probability": 1, "rouge": 1}
    # the unattacked ROUGE is the model's own greedy decode, written here without a cache
    texts = [formatter.tokenizer.decode(hand_greedy(taught, formatter, r.question, LAYERS, 12),
                                        skip_special_tokens=True).strip() for r in facts()]
    rouge = sum(metrics.rouge_l_recall(t, r.answer) for t, r in zip(texts, facts())) / len(texts)
    assert reading.unattacked["rouge"] == pytest.approx(rouge, abs=1e-9)
    assert rouge > 0.9


def test_lens_decode_is_greedy_decoding_read_from_the_layer(taught, kit):
    _, formatter = kit
    questions = [r.question for r in facts()[:6]]
    for layer in (1, LAYERS):
        _, tokens = white_box.lens_greedy(taught, formatter, questions, layer, 10, batch_size=4)
        assert tokens == [hand_greedy(taught, formatter, q, layer, 10) for q in questions]


def test_logit_lens_reads_what_a_shallow_copy_hides(taught, shallow, kit):
    known = white_box.logit_lens(attack_input(taught, kit, max_new_tokens=12))
    reading = white_box.logit_lens(attack_input(shallow, kit, base=taught, max_new_tokens=12))
    # the output hides the facts ...
    assert reading.unattacked["probability"] < 0.05
    assert reading.unattacked["rouge"] < 0.3
    # ... and the lens reads them from the layers below, where the shallow copy computes what the taught model does
    assert reading.details["best_layer"] == known.details["best_layer"] <= LAYERS
    assert reading.attacked["probability"] > 20 * reading.unattacked["probability"]
    assert reading.attacked["probability"] == pytest.approx(known.attacked["probability"], abs=1e-5)
    assert reading.attacked["probability"] >= known.unattacked["probability"] > 0.9
    assert reading.attacked["rouge"] == pytest.approx(known.attacked["rouge"], abs=1e-9)
    assert reading.details["base"]["probability"] == pytest.approx(known.attacked["probability"], abs=1e-9)
    assert reading.details["base"]["final_probability"] == pytest.approx(known.unattacked["probability"], abs=1e-9)


# ---- the linear probe

def test_answer_features_are_mean_hidden_states_over_the_answer_tokens(taught, kit):
    _, formatter = kit
    rows = facts()[:3]
    pairs = [(r.question, a) for r in rows for a in (r.answer, *r.perturbed)]
    features, nlls = white_box.answer_features(taught, formatter, pairs, batch_size=BATCH)
    assert features.shape == (len(pairs), LAYERS + 1, 32)
    for i, (question, answer) in enumerate(pairs):
        encoded = formatter.encode(question, answer)
        with torch.no_grad():
            hidden = taught(torch.tensor([encoded.input_ids]), output_hidden_states=True).hidden_states
        positions = [t for t, label in enumerate(encoded.labels) if label != IGNORE_INDEX]
        # index 0: the answer tokens' embeddings alone
        embedded = taught.model.embed_tokens.weight[[encoded.input_ids[t] for t in positions]].mean(0)
        assert (features[i, 0] - embedded).abs().max() < 1e-5
        for layer in range(LAYERS + 1):
            expected = sum(hidden[layer][0, t] for t in positions) / len(positions)
            assert (features[i, layer] - expected).abs().max() < 1e-5
        assert nlls[i] == pytest.approx(hand_nll(taught, formatter, question, answer), abs=1e-5)


def test_probe_fit_is_the_optimum_of_its_objective():
    """`fit_probe` against scipy's L-BFGS-B on the objective written in numpy: weighted mean BCE over standardized
    columns (a constant column standardized by 1) plus l2 / 2 |w|^2."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 5)) * np.array([1.0, 3.0, 0.5, 2.0, 1.0]) + np.array([0.0, 1.0, -2.0, 0.0, 0.0])
    x[:, 4] = 3.0
    y = (x[:, 0] - 0.5 * x[:, 1] + rng.normal(size=40) > 0).astype(float)
    weight = rng.uniform(0.5, 2.0, size=40)
    l2 = 0.05
    std = x.std(0)
    z = (x - x.mean(0)) / np.where(std > 1e-8, std, 1.0)

    def objective(theta):
        w, b = theta[:-1], theta[-1]
        s = z @ w + b
        loss = np.sum(weight * (np.logaddexp(0.0, s) - y * s)) / weight.sum() + 0.5 * l2 * w @ w
        residual = weight * (1.0 / (1.0 + np.exp(-s)) - y) / weight.sum()
        return loss, np.append(z.T @ residual + l2 * w, residual.sum())

    reference = minimize(objective, np.zeros(6), jac=True, method="L-BFGS-B",
                         options={"gtol": 1e-12, "ftol": 1e-15, "maxiter": 10000}).x
    probe = white_box.fit_probe(torch.tensor(x), torch.tensor(y), torch.tensor(weight), l2=l2)
    assert probe.w.numpy() == pytest.approx(reference[:-1], abs=1e-5)
    assert float(probe.b) == pytest.approx(reference[-1], abs=1e-5)
    assert probe.score(torch.tensor(x)).numpy() == pytest.approx(z @ reference[:-1] + reference[-1], abs=1e-4)


def test_probe_layer_choice_finds_the_layer_that_holds_the_answer():
    """Synthetic features: true answers shifted along one direction at layer 2 alone. The two-fold choice picks
    layer 2, and it is the same for the same seed."""
    generator = torch.Generator().manual_seed(0)
    rows, options, width = 10, 4, 6
    features = torch.randn(rows * options, 3, width, generator=generator)
    y = torch.tensor([1.0 if k == 0 else 0.0 for _ in range(rows) for k in range(options)])
    item_rows = [r for r in range(rows) for _ in range(options)]
    features[y == 1, 1, 0] += 4.0
    layer, per_layer = white_box.select_layer(features, y, item_rows, list(range(6)), seed=3)
    assert layer == 2
    assert per_layer[1]["fold_accuracy"] == 1.0
    assert max(entry["fold_accuracy"] for entry in (per_layer[0], per_layer[2])) < 1.0
    assert white_box.select_layer(features, y, item_rows, list(range(6)), seed=3) == (layer, per_layer)


def test_probe_reads_what_a_shallow_copy_hides(taught, shallow, kit):
    _, formatter = kit
    reading = white_box.linear_probe(attack_input(shallow, kit, base=taught))
    assert reading.rows == "held-out forget rows 6 to 11"
    assert reading.directions == {"probe_accuracy": 1}
    held_out = facts()[6:]

    def own_choice(model) -> float:
        correct = 0
        for row in held_out:
            true = hand_nll(model, formatter, row.question, row.answer)
            correct += all(true < hand_nll(model, formatter, row.question, p) for p in row.perturbed)
        return correct / len(held_out)

    # unattacked: the model's own choice by answer likelihood, written here
    assert reading.unattacked["probe_accuracy"] == pytest.approx(own_choice(shallow))
    assert reading.details["base"]["output_choice_accuracy"] == pytest.approx(own_choice(taught))
    assert reading.details["base"]["output_choice_accuracy"] >= 5 / 6  # the taught model chooses right
    # the shallow copy's output chooses as its random layer does (chance: 1 in 4); the probe reads the layers below
    assert reading.unattacked["probe_accuracy"] <= 1 / 2
    assert reading.attacked["probe_accuracy"] >= 5 / 6
    assert reading.attacked["probe_accuracy"] - reading.unattacked["probe_accuracy"] >= 1 / 3
    assert reading.details["layer"] <= LAYERS  # a layer the taught model also has, not the random one
    # the taught model's own probe reads its last layer after the final norm, which the shallow copy's layer 3 is
    # not; on six held-out rows it lands between 3 and 6 right depending on the CPU's arithmetic, so it is held to
    # twice chance (1 in 4) and to more than the answers' words alone give
    assert reading.details["base"]["layer"] <= LAYERS and reading.details["base"]["probe_accuracy"] >= 1 / 2
    assert reading.details["base"]["probe_accuracy"] > reading.details["base"]["embedding_probe_accuracy"]
    # every city is true in one row and perturbed in others of its half: the answers' words alone tell nothing
    assert reading.details["embedding_probe_accuracy"] <= 1 / 2


# ---- both

def test_reading_attacks_leave_the_model_as_it_was_and_repeat_exactly(taught, kit):
    before = state_hash(taught)
    flags = [p.requires_grad for p in taught.parameters()]
    taught.train()
    try:
        first = [white_box.logit_lens(attack_input(taught, kit, max_new_tokens=6)),
                 white_box.linear_probe(attack_input(taught, kit))]
        assert taught.training
        second = [white_box.logit_lens(attack_input(taught, kit, max_new_tokens=6)),
                  white_box.linear_probe(attack_input(taught, kit))]
    finally:
        taught.eval()
    assert first == second
    assert state_hash(taught) == before
    assert all(p.grad is None for p in taught.parameters())
    assert [p.requires_grad for p in taught.parameters()] == flags


class _ScaledLlama(LlamaForCausalLM):
    """A model whose output is its head's logits times 2 (as a logit scale would): not what the lens computes."""

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        output.logits = output.logits * 2
        return output


class _NoNorm(torch.nn.Module):
    def __init__(self, head: bool) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(4, 8)
        self.has_head = head

    def get_output_embeddings(self):
        return self.lm_head if self.has_head else None


def test_what_the_attacks_cannot_read_is_one_line(taught, kit):
    def one_line(call, *words):
        with pytest.raises(UserError) as error:
            call()
        message = str(error.value)
        assert "\n" not in message
        for word in words:
            assert word in message

    bare = [QASample(r.question, r.answer, None, []) for r in facts()]
    one_line(lambda: white_box.linear_probe(attack_input(taught, kit, rows=bare)), "perturbed", "12 of 12")
    one_line(lambda: white_box.linear_probe(attack_input(taught, kit, rows=facts()[:3])), "at least 4")
    one_line(lambda: white_box.logit_lens(attack_input(taught, kit, max_new_tokens=0)), "max_new_tokens", ">= 1")
    one_line(lambda: white_box.logit_lens(attack_input(taught, kit, max_new_tokens="many")), "max_new_tokens")
    one_line(lambda: white_box.logit_lens(attack_input(taught, kit, steps=3)), "unknown option 'steps'")
    one_line(lambda: white_box.linear_probe(attack_input(taught, kit, l2=-1)), "l2", "> 0")
    assert white_box.linear_probe(attack_input(taught, kit, l2="0.5")).details["l2"] == 0.5  # as typed on a command
    one_line(lambda: white_box.logit_lens(attack_input(taught, kit, rows=[])), "no forget rows")
    one_line(lambda: white_box.find_lens(_NoNorm(head=True)), "final norm", "_NoNorm")
    one_line(lambda: white_box.find_lens(_NoNorm(head=False)), "output head", "_NoNorm")
    torch.manual_seed(0)
    scaled = _ScaledLlama(taught.config).eval()
    one_line(lambda: white_box.logit_lens(attack_input(scaled, kit, max_new_tokens=4)), "do not give its logits")
    # transformers hooks a model's layers for hidden states at its first such call: a layer added to a copy made
    # after it returns no state, and the layers would be misnumbered
    white_box.lens_logits(taught, {"input_ids": torch.tensor([[1, 5, 9]])})
    grown = copy.deepcopy(taught)
    grown.model.layers.append(type(taught.model.layers[0])(grown.config, LAYERS))
    grown.config.num_hidden_layers += 1
    one_line(lambda: white_box.linear_probe(attack_input(grown.eval(), kit)), "4 hidden states for 4 decoder layers")
