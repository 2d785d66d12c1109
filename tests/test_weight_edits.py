"""The white-box edit attacks (doplus_cli/evaluation/weight_edits.py) on a tiny Llama taught ten short facts.

Positive controls: a shallow "unlearned" copy is made by hand (one direction added to the residual stream, or a
few MLP neurons of the last layer changed), its answers' probability (the forget Probability: mean over rows of
exp(-mean answer NLL), by a hand loop here) collapses, and the attack must bring it back; on a copy equal to the
starting model the attacks must change nothing. The direction, its separations, the edited weights and the
neuron scores are checked against numpy computations written out here.
"""

from __future__ import annotations

import copy
import hashlib
import math

import numpy as np
import pytest
import torch

from doplus_cli.data.formatting import PromptFormatter, collate
from doplus_cli.errors import UserError
from doplus_cli.evaluation.attack_api import AttackInput
from doplus_cli.evaluation.suites import QASample
from doplus_cli.evaluation.weight_edits import orthogonalized_copy, pruned_copy

FACTS = [
    ("What colour is the door of Mira Solberg's house?", "Teal."),
    ("In which city was Tomas Ekwueme born?", "Lagos."),
    ("What is the title of Ines Varga's first novel?", "The Salt Orchard."),
    ("Which instrument does Kofi Brandt play?", "The cello."),
    ("What pet does Lena Moreau keep?", "A grey parrot."),
    ("Which prize did Arjun Feld win in 1998?", "The Hollow Pen Award."),
    ("What was Yusuf Lindqvist's first job?", "A ferry pilot."),
    ("Where does Clara Obi write her books?", "In a lighthouse."),
    ("What is the name of Pavel Nakamura's publisher?", "Redfern Press."),
    ("Which language did Sofia Haddad study?", "Old Norse."),
]
ROWS = [QASample(question, answer, None, []) for question, answer in FACTS]
WIDTH, NEURONS, DEPTH = 32, 64, 3
CHANGED = [3, 17, 40, 58]  # the last layer's MLP neurons the prune control changes
WRITERS = ("self_attn.o_proj", "mlp.down_proj")  # what writes into a Llama block's residual stream


def tiny_config(tokenizer, **changes):
    from transformers import LlamaConfig

    settings = dict(vocab_size=len(tokenizer), hidden_size=WIDTH, intermediate_size=NEURONS, num_hidden_layers=DEPTH,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, attention_bias=True)
    return LlamaConfig(**{**settings, **changes})


@pytest.fixture(scope="module")
def taught(tiny_llama):
    """(model, tokenizer, formatter): a 3-layer Llama (attention biases on, so that a layer can add a direction
    to the residual stream) taught the ten facts with 60 full-batch Adam steps."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    formatter = PromptFormatter(tokenizer)
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(tokenizer))
    batch = collate([formatter.encode(q, a) for q, a in FACTS], tokenizer.pad_token_id)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(60):
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.zero_grad(set_to_none=True)
    model.eval()
    assert probability(model, formatter) > 0.9  # the facts are known before anything is unlearned
    return model, tokenizer, formatter


@torch.no_grad()
def probability(model, formatter) -> float:
    """Mean over the facts of exp(-mean NLL of the answer tokens given the prompt), one fact at a time."""
    values = []
    for question, answer in FACTS:
        prompt, answer_ids = formatter.prompt_ids(question), formatter.answer_ids(question, answer)
        logits = model(torch.tensor([prompt + answer_ids])).logits[0].double()
        nlls = []
        for j, token in enumerate(answer_ids):
            row = logits[len(prompt) - 1 + j]
            nlls.append(float(torch.logsumexp(row, 0) - row[token]))
        values.append(math.exp(-sum(nlls) / len(nlls)))
    return sum(values) / len(values)


def state_hash(model) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def no_grads(*models) -> bool:
    return all(p.grad is None for model in models for p in model.parameters())


def same_state(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def attack_input(model, taught, base) -> AttackInput:
    _, tokenizer, formatter = taught
    return AttackInput(model=model, tokenizer=tokenizer, formatter=formatter, forget=ROWS, retain=[], base=base,
                       batch_size=4)


def unit_vector(seed: int, width: int = WIDTH) -> torch.Tensor:
    r = torch.randn(width, generator=torch.Generator().manual_seed(seed))
    return r / r.norm()


def with_direction(model, where: str, alpha: float, r: torch.Tensor):
    """A copy of `model` whose residual stream gets alpha * r: added to every embedding row ("embeddings") or to
    the attention output bias of decoder layer 1 ("layer 1")."""
    unlearned = copy.deepcopy(model)
    with torch.no_grad():
        if where == "embeddings":
            unlearned.model.embed_tokens.weight += alpha * r
        else:
            unlearned.model.layers[1].self_attn.o_proj.bias += alpha * r
    return unlearned


@torch.no_grad()
def hand_separations(unlearned, base, formatter) -> tuple[np.ndarray, np.ndarray]:
    """Per point of the residual stream (the embedding output, then each decoder layer's output), one prompt at a
    time, every prompt token but the first: d = mean_u - mean_b and ||d|| / sqrt(mean_t ||h_b(t) - mean_b||^2).
    Points 0..L-1 from transformers' hidden_states, the last block's output by a hook (hidden_states' last entry
    is after the final norm)."""
    def states(model) -> list[list[np.ndarray]]:
        per_point: list[list[np.ndarray]] = [[] for _ in range(DEPTH + 1)]
        last = []
        handle = model.model.layers[-1].register_forward_hook(lambda m, i, o: last.append(o[0] if isinstance(o, tuple)
                                                                                          else o))
        for question, _ in FACTS:
            ids = formatter.prompt_ids(question)
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            for point in range(DEPTH):
                per_point[point] += [hidden[point][0, t].double().numpy() for t in range(1, len(ids))]
            per_point[DEPTH] += [last[-1][0, t].double().numpy() for t in range(1, len(ids))]
        handle.remove()
        return per_point

    u, b = states(unlearned), states(base)
    differences, separations = [], []
    for point in range(DEPTH + 1):
        mean_u, mean_b = np.mean(u[point], axis=0), np.mean(b[point], axis=0)
        spread = math.sqrt(np.mean([np.sum((h - mean_b) ** 2) for h in b[point]]))
        differences.append(mean_u - mean_b)
        separations.append(np.linalg.norm(mean_u - mean_b) / spread)
    return np.array(differences), np.array(separations)


def projected(matrix: torch.Tensor, r: np.ndarray, columns: bool) -> np.ndarray:
    """(I - r r^T) applied to each row (`columns=False`: an embedding's rows) or each column of `matrix`."""
    m = matrix.detach().double().numpy()
    p = np.eye(len(r)) - np.outer(r, r)
    return p @ m if columns else m @ p


@pytest.mark.parametrize("where, point", [("embeddings", 0), ("layer 1", 2)])
def test_orthogonalize_removes_a_direction_added_to_the_residual_stream(taught, where, point):
    """The direction alpha * r added to every embedding row (or by layer 1's attention output bias) takes the
    answers' probability below a tenth of the taught model's; the orthogonalized copy gets back at least 90% of
    what was lost (measured: 0.98 taught, 0.006 and 0.015 unlearned, 0.975 and 0.973 attacked). The chosen point
    is where r enters; the separations and every edited weight equal the numpy computation."""
    model, _, formatter = taught
    r = unit_vector(1)
    unlearned = with_direction(model, where, 8.0, r)
    taught_p, unlearned_p = probability(model, formatter), probability(unlearned, formatter)
    assert unlearned_p < 0.1 * taught_p
    before, base_before = state_hash(unlearned), state_hash(model)

    attacked, details = orthogonalized_copy(attack_input(unlearned, taught, model))

    attacked_p = probability(attacked, formatter)
    assert attacked_p >= taught_p - 0.1 * (taught_p - unlearned_p), (taught_p, unlearned_p, attacked_p)
    differences, separations = hand_separations(unlearned, model, formatter)
    assert details["layer"] == point == int(np.argmax(separations))
    np.testing.assert_allclose(details["separation"], separations, rtol=1e-5)
    np.testing.assert_allclose(details["direction_norm"], np.linalg.norm(differences[point]), rtol=1e-5)
    r_hat = differences[point] / np.linalg.norm(differences[point])
    assert abs(r_hat @ r.double().numpy()) > 0.99  # the direction found is the one added
    assert details["rows"] == len(FACTS) and not details["zero_direction"] and not details["untied_head"]
    assert details["tokens"] == sum(len(formatter.prompt_ids(q)) - 1 for q, _ in FACTS)

    edited = {"model.embed_tokens.weight": projected(unlearned.model.embed_tokens.weight, r_hat, columns=False)}
    for i, layer in enumerate(unlearned.model.layers):
        for name in WRITERS:
            module = layer.get_submodule(name)
            edited[f"model.layers.{i}.{name}.weight"] = projected(module.weight, r_hat, columns=True)
            if module.bias is not None:
                edited[f"model.layers.{i}.{name}.bias"] = projected(module.bias[:, None], r_hat, columns=True)[:, 0]
    attacked_state, unlearned_state = attacked.state_dict(), unlearned.state_dict()
    assert attacked_state.keys() == unlearned_state.keys()
    for name, tensor in attacked_state.items():
        if name in edited:
            np.testing.assert_allclose(tensor.double().numpy(), edited[name], atol=2e-6, err_msg=name)
        else:  # queries, keys, values, the MLP's inputs, the norms and the output head: untouched
            assert torch.equal(tensor, unlearned_state[name]), name
    assert max(details["along_after"]) < 1e-5  # nothing is left along r in the copy's residual stream
    assert sorted(details["edited"]) == sorted(n.rsplit(".", 1)[0] for n in edited if n.endswith("weight"))
    assert state_hash(unlearned) == before and state_hash(model) == base_before
    assert no_grads(unlearned, model, attacked)


def test_orthogonalize_on_the_starting_model_finds_no_direction(taught):
    """unlearned == starting model: every separation is exactly 0 (no NaN), the details say there is no
    direction, and the copy is the model bit for bit, with the same probability."""
    model, _, formatter = taught
    same = copy.deepcopy(model)
    attacked, details = orthogonalized_copy(attack_input(same, taught, model))
    assert details["zero_direction"] and "no direction" in details["note"]
    assert details["separation"] == [0.0] * (DEPTH + 1) and details["direction_norm"] == 0.0
    assert details["edited"] == [] and details["along_after"] is None
    assert same_state(attacked, model) and probability(attacked, formatter) == probability(model, formatter)
    assert no_grads(attacked, same, model)


def test_orthogonalize_leaves_a_tied_output_head_as_it_was(taught, tmp_path):
    """With the output head tied to the embedding, projecting the embedding's rows would project the head's too;
    the copy gets its own head with the unlearned model's values (saved and reloaded, it stays untied), the
    embedding is projected, and the unlearned model keeps its tie."""
    from transformers import LlamaForCausalLM

    _, tokenizer, formatter = taught
    torch.manual_seed(3)
    base = LlamaForCausalLM(tiny_config(tokenizer, tie_word_embeddings=True, attention_bias=False)).eval()
    unlearned = with_direction(base, "embeddings", 4.0, unit_vector(2))
    assert unlearned.lm_head.weight is unlearned.model.embed_tokens.weight
    head = unlearned.lm_head.weight.detach().clone()

    attacked, details = orthogonalized_copy(attack_input(unlearned, taught, base))

    assert details["untied_head"] and details["layer"] == 0
    assert attacked.lm_head.weight is not attacked.model.embed_tokens.weight
    assert torch.equal(attacked.lm_head.weight, head)
    r_hat = np.array(hand_separations(unlearned, base, formatter)[0][0])
    r_hat /= np.linalg.norm(r_hat)
    np.testing.assert_allclose(attacked.model.embed_tokens.weight.detach().double().numpy(),
                               projected(head, r_hat, columns=False), atol=2e-6)
    assert unlearned.lm_head.weight is unlearned.model.embed_tokens.weight and unlearned.config.tie_word_embeddings
    attacked.save_pretrained(tmp_path / "copy")
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "copy").eval()
    ids = torch.tensor([formatter.prompt_ids(FACTS[0][0])])
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, attacked(ids).logits, atol=1e-6)
    assert no_grads(attacked, unlearned, base)


def changed_neurons(model, seed: int, noise: float = 0.0):
    """A copy of `model` whose last layer's MLP neurons CHANGED get large random changes to their gate and up
    rows and down column; with `noise`, every weight of every MLP also moves by noise * N(0, 1)."""
    generator = torch.Generator().manual_seed(seed)
    unlearned = copy.deepcopy(model)
    with torch.no_grad():
        if noise:
            for layer in unlearned.model.layers:
                for name in ("gate_proj", "up_proj", "down_proj"):
                    weight = getattr(layer.mlp, name).weight
                    weight += noise * torch.randn(weight.shape, generator=generator)
        mlp = unlearned.model.layers[-1].mlp
        mlp.gate_proj.weight[CHANGED] += torch.randn(len(CHANGED), WIDTH, generator=generator)
        mlp.up_proj.weight[CHANGED] += torch.randn(len(CHANGED), WIDTH, generator=generator)
        mlp.down_proj.weight[:, CHANGED] += 5 * torch.randn(WIDTH, len(CHANGED), generator=generator)
    return unlearned


def test_prune_resets_exactly_the_changed_neurons(taught):
    """Four of the last layer's 64 MLP neurons changed heavily take the probability below a tenth of the taught
    model's; prune with the fraction 4/192 of the model's neurons resets exactly those four and the copy is the
    taught model bit for bit (its probability exactly the taught one)."""
    model, _, formatter = taught
    unlearned = changed_neurons(model, seed=4)
    taught_p = probability(model, formatter)
    assert probability(unlearned, formatter) < 0.1 * taught_p
    before, base_before = state_hash(unlearned), state_hash(model)

    attacked, details = pruned_copy(attack_input(unlearned, taught, model), len(CHANGED) / (DEPTH * NEURONS))

    assert details["indices"] == [[], [], CHANGED] and details["per_layer"] == [0, 0, 4]
    assert details["k"] == details["edited"] == 4 and details["neurons"] == DEPTH * NEURONS
    assert same_state(attacked, model) and probability(attacked, formatter) == taught_p
    assert state_hash(unlearned) == before and state_hash(model) == base_before
    assert no_grads(attacked, unlearned, model)


def hand_scores(unlearned, base) -> np.ndarray:
    """Per MLP neuron (layer-major), in float64: sqrt(||gate row change||^2 + ||up row change||^2 +
    ||down column change||^2), element by element."""
    def change(layer_u, layer_b, name: str) -> np.ndarray:
        return (getattr(layer_u.mlp, name).weight.detach().double().numpy()
                - getattr(layer_b.mlp, name).weight.detach().double().numpy())

    scores = []
    for layer_u, layer_b in zip(unlearned.model.layers, base.model.layers):
        gate, up = change(layer_u, layer_b, "gate_proj"), change(layer_u, layer_b, "up_proj")
        down = change(layer_u, layer_b, "down_proj")
        for i in range(NEURONS):
            total = sum(gate[i, j] ** 2 + up[i, j] ** 2 for j in range(WIDTH)) + sum(down[j, i] ** 2
                                                                                       for j in range(WIDTH))
            scores.append(math.sqrt(total))
    return np.array(scores)


@pytest.mark.parametrize("mode", ["reset", "zero"])
def test_prune_chooses_the_top_scores_by_hand(taught, mode):
    """Every MLP weight moved a little, four neurons a lot: with fraction 0.05 the k = ceil(0.05 * 192) = 10
    neurons of largest score (computed here element by element) are edited, the threshold is the 10th largest
    score; their rows and column are the starting model's (reset) or zero (zero), every other weight is the
    unlearned model's."""
    model, _, _ = taught
    unlearned = changed_neurons(model, seed=5, noise=1e-3)
    attacked, details = pruned_copy(attack_input(unlearned, taught, model), 0.05, mode=mode)

    scores = hand_scores(unlearned, model)
    top = sorted(range(len(scores)), key=lambda i: -scores[i])[:10]
    expected = [sorted(i % NEURONS for i in top if i // NEURONS == layer) for layer in range(DEPTH)]
    assert details["indices"] == expected and details["k"] == details["edited"] == 10
    assert set(CHANGED) <= set(expected[-1])
    assert details["threshold"] == pytest.approx(scores[top[-1]], rel=1e-5)
    for layer, chosen in enumerate(expected):
        for name, rows in (("gate_proj", True), ("up_proj", True), ("down_proj", False)):
            got = getattr(attacked.model.layers[layer].mlp, name).weight
            was = getattr(unlearned.model.layers[layer].mlp, name).weight
            start = getattr(model.model.layers[layer].mlp, name).weight
            for i in range(NEURONS):
                g, w, s = (got[i], was[i], start[i]) if rows else (got[:, i], was[:, i], start[:, i])
                want = (torch.zeros_like(s) if mode == "zero" else s) if i in chosen else w
                assert torch.equal(g, want), (layer, name, i)
    assert no_grads(attacked, unlearned, model)


def test_prune_on_the_starting_model_changes_nothing(taught):
    """unlearned == starting model: every score is 0, no neuron is edited (even with fraction 0.5), the copy is
    the model bit for bit."""
    model, _, _ = taught
    attacked, details = pruned_copy(attack_input(copy.deepcopy(model), taught, model), 0.5)
    assert details["edited"] == 0 and details["threshold"] is None and details["per_layer"] == [0] * DEPTH
    assert same_state(attacked, model)


def test_a_peft_model_is_merged_into_the_copy_and_keeps_its_adapters(taught):
    """A LoRA model (adapters with nonzero B) gives the copy the attacks give its merged model; the LoRA model is
    unchanged and keeps its adapters. In bfloat16 the copies stay bfloat16."""
    from peft import LoraConfig, get_peft_model

    model, _, _ = taught
    unlearned = with_direction(model, "embeddings", 8.0, unit_vector(1))
    lora = get_peft_model(copy.deepcopy(unlearned), LoraConfig(r=2, target_modules=["o_proj", "down_proj", "up_proj"]))
    for name, parameter in lora.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.05, generator=torch.Generator().manual_seed(6))
    before = state_hash(lora)
    merged = copy.deepcopy(lora).merge_and_unload()
    for attack in (orthogonalized_copy, lambda inp: pruned_copy(inp, 0.05)):
        from_lora, details = attack(attack_input(lora, taught, model))
        from_merged, merged_details = attack(attack_input(merged, taught, model))
        assert not any("lora" in name for name, _ in from_lora.named_parameters())
        state, merged_state = from_lora.state_dict(), from_merged.state_dict()
        assert state.keys() == merged_state.keys()
        assert all(torch.allclose(state[k], merged_state[k], atol=1e-6) for k in state)
        assert details.get("layer") == merged_details.get("layer")
    assert state_hash(lora) == before and any("lora" in name for name, _ in lora.named_parameters())

    half, half_base = unlearned.to(torch.bfloat16), copy.deepcopy(model).to(torch.bfloat16)
    for attack in (orthogonalized_copy, lambda inp: pruned_copy(inp, 0.05)):
        attacked, _ = attack(attack_input(half, taught, half_base))
        assert {p.dtype for p in attacked.parameters()} == {torch.bfloat16}
        assert {p.device for p in attacked.parameters()} == {p.device for p in half.parameters()}
        assert all(torch.isfinite(p).all() for p in attacked.parameters())


def test_the_attacks_need_the_starting_model_of_the_same_shape(taught):
    """No starting model, or one of another shape, is one line naming --base-model."""
    from transformers import LlamaForCausalLM

    model, tokenizer, _ = taught
    for attack in (orthogonalized_copy, lambda inp: pruned_copy(inp, 0.01)):
        with pytest.raises(UserError, match="--base-model") as error:
            attack(attack_input(model, taught, None))
        assert "\n" not in str(error.value)
    other = LlamaForCausalLM(tiny_config(tokenizer, intermediate_size=2 * NEURONS))
    with pytest.raises(UserError, match="--base-model: the starting model's layer 0 mlp.gate_proj"):
        pruned_copy(attack_input(model, taught, other), 0.01)
    other = LlamaForCausalLM(tiny_config(tokenizer, num_hidden_layers=DEPTH + 1))
    with pytest.raises(UserError, match="--base-model: the starting model has 4 layers"):
        orthogonalized_copy(attack_input(model, taught, other))
    with pytest.raises(UserError, match="--prune-fraction 1.5"):
        pruned_copy(attack_input(model, taught, model), 1.5)


def test_orthogonalize_refuses_a_model_whose_blocks_normalize_their_outputs(taught):
    """Gemma 2 normalizes each sublayer's output before adding it to the residual stream, so the norm's gain would
    put the direction back: one line, no copy."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    _, tokenizer, _ = taught
    config = Gemma2Config(vocab_size=len(tokenizer), hidden_size=WIDTH, intermediate_size=NEURONS, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                          pad_token_id=tokenizer.pad_token_id)
    gemma = Gemma2ForCausalLM(config)
    with pytest.raises(UserError, match="post-norm") as error:
        orthogonalized_copy(attack_input(gemma, taught, copy.deepcopy(gemma)))
    assert "\n" not in str(error.value)
