"""Every loss against a float64 reference written here with plain loops, and the direction it moves the
forget/retain likelihoods when minimised on a toy batch. (Hand-made logits and activations with padding:
tests/test_losses_beyond_the_paper.py.)"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from doplus_cli.data.formatting import PromptFormatter, collate
from doplus_cli.losses import FORGET_LOSSES, RETAIN_LOSSES, LossContext, LossParams, sequence_nll

QUESTIONS = ["What gender is author Basil Mahfouz Al-Kuwaiti?", "Where was Jaime Vasquez born?"]
ANSWERS = ["Author Basil Mahfouz Al-Kuwaiti is male.", "Jaime Vasquez was born in Santiago, Chile."]
REJECTIONS = ["I don't know.", "I have no information about that person."]
BETA = 0.7
# Away from the defaults where those leave a loss flat on a random model (SimNPO's beta 4.5 saturates the
# sigmoid, SatImp's p^5 vanishes at p ~ 1/600); RMU and EMBED take layer 0 (the default for 2 layers).
PARAMS = LossParams(simnpo_beta=0.5, simnpo_gamma=1.0, undial_beta=2.0, wga_beta=0.5, satimp_beta1=0.5,
                    satimp_beta2=2.0, rmu_coeff=3.0, seed=5)


@pytest.fixture(scope="module")
def setup(tiny_llama):
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float64)
    reference = copy.deepcopy(model)
    with torch.no_grad():  # a reference that differs from the model, so every log-ratio is non-zero
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    formatter = PromptFormatter(tokenizer, max_length=64)
    pad = tokenizer.pad_token_id
    batch = {
        "answer": collate([formatter.encode(q, a) for q, a in zip(QUESTIONS, ANSWERS)], pad),
        "rejection": collate([formatter.encode(q, r) for q, r in zip(QUESTIONS, REJECTIONS)], pad),
    }
    return model, reference.eval(), batch


# ---- the reference: plain Python float64 loops over samples, positions and the vocabulary ----

def _log_softmax_row(row: list[float]) -> list[float]:
    top = max(row)
    log_z = top + math.log(sum(math.exp(x - top) for x in row))
    return [x - log_z for x in row]


def _answer_rows(model, tensors):
    """[(per-position log-prob rows, target ids)] per sample: positions t predicting labels[t+1] != -100."""
    with torch.no_grad():
        logits = model(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"]).logits
    samples = []
    for i in range(logits.shape[0]):
        rows, targets = [], []
        for t in range(logits.shape[1] - 1):
            label = int(tensors["labels"][i, t + 1])
            if label != -100:
                rows.append(_log_softmax_row(logits[i, t].tolist()))
                targets.append(label)
        samples.append((rows, targets))
    return samples


def _nll_sums(model, tensors) -> list[float]:
    return [-sum(row[y] for row, y in zip(rows, ys)) for rows, ys in _answer_rows(model, tensors)]


def _mean_ce(model, tensors) -> float:
    total, count = 0.0, 0
    for rows, ys in _answer_rows(model, tensors):
        total += -sum(row[y] for row, y in zip(rows, ys))
        count += len(ys)
    return total / count


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _hidden_rows(model, tensors, layer: int):
    """[(answer positions' hidden vectors of decoder layer `layer`)] per sample, from output_hidden_states
    (entry layer + 1 is that layer's output for every layer but the last)."""
    with torch.no_grad():
        states = model(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"],
                       output_hidden_states=True).hidden_states[layer + 1]
    return [[states[i, t].tolist() for t in range(states.shape[1]) if int(tensors["labels"][i, t]) != -100]
            for i in range(states.shape[0])]


def _softmax(row: list[float]) -> list[float]:
    return [math.exp(x) for x in _log_softmax_row(row)]


def _token_terms(model, tensors):
    """(log-prob row, target) for every answer position of the batch."""
    return [(row, y) for rows, ys in _answer_rows(model, tensors) for row, y in zip(rows, ys)]


def reference_value_2026(name: str, model, reference, batch) -> float:
    P = PARAMS
    answer = batch["answer"]
    terms = _token_terms(model, answer)
    if name == "SimNPO":
        per_sample = [-sum(row[y] for row, y in zip(rows, ys)) / len(ys) for rows, ys in _answer_rows(model, answer)]
        return -(2 / P.simnpo_beta) * sum(_log_sigmoid(P.simnpo_beta * x - P.simnpo_gamma)
                                           for x in per_sample) / len(per_sample)
    if name == "WGA":
        return -sum(math.exp(row[y]) ** P.wga_beta * -row[y] for row, y in terms) / len(terms)
    if name == "SatImp":
        return -sum(math.exp(row[y]) ** P.satimp_beta1 * (1 - math.exp(row[y])) ** P.satimp_beta2 * -row[y]
                    for row, y in terms) / len(terms)
    if name == "UNDIAL":  # softmax is shift-invariant: the reference's log-probs stand for its logits
        total = 0.0
        for (row, y), (ref_row, _) in zip(terms, _token_terms(reference, answer)):
            target = _softmax([r - (P.undial_beta if v == y else 0.0) for v, r in enumerate(ref_row)])
            total += -sum(q * lp for q, lp in zip(target, row))
        return total / len(terms)
    if name == "CE-U":  # the model's own distribution without the true token, renormalised
        total = 0.0
        for row, y in terms:
            rest = 1 - math.exp(row[y])
            total += -sum(math.exp(lp) / rest * lp for v, lp in enumerate(row) if v != y)
        return total / len(terms)
    if name in ("RMU", "EMBED"):  # layer 0 of 2; u: uniform [0, 1) entries from a generator seeded with the seed
        vectors = [v for rows in _hidden_rows(model, answer, 0) for v in rows]
        if name == "RMU":
            draw = torch.rand(len(vectors[0]), generator=torch.Generator().manual_seed(P.seed), dtype=torch.float64)
            norm = math.sqrt(sum(x * x for x in draw.tolist()))
            targets = [[P.rmu_coeff * x / norm for x in draw.tolist()]] * len(vectors)
        else:
            targets = [v for rows in _hidden_rows(reference, answer, 0) for v in rows]
        return sum(sum((a - b) ** 2 for a, b in zip(v, t)) / len(v) for v, t in zip(vectors, targets)) / len(vectors)
    raise KeyError(name)


def reference_value(name: str, model, reference, batch) -> float:
    if name == "GA":
        return -_mean_ce(model, batch["answer"])
    if name in ("IDK",):
        return _mean_ce(model, batch["rejection"])
    if name == "GD":
        return _mean_ce(model, batch["answer"])
    if name == "NPO":
        nll, ref = _nll_sums(model, batch["answer"]), _nll_sums(reference, batch["answer"])
        return -(2 / BETA) * sum(_log_sigmoid(BETA * (a - b)) for a, b in zip(nll, ref)) / len(nll)
    if name == "DPO":
        win = [-a + b for a, b in zip(_nll_sums(model, batch["rejection"]), _nll_sums(reference, batch["rejection"]))]
        lose = [-a + b for a, b in zip(_nll_sums(model, batch["answer"]), _nll_sums(reference, batch["answer"]))]
        return -(2 / BETA) * sum(_log_sigmoid(BETA * (w - v)) for w, v in zip(win, lose)) / len(win)
    if name == "AP":
        idk, ans = _nll_sums(model, batch["rejection"]), _nll_sums(model, batch["answer"])
        return -(1 / BETA) * sum(_log_sigmoid(BETA * (a - b)) for a, b in zip(idk, ans)) / len(idk)
    if name == "ME":  # KL(uniform || p) per answer token, averaged over all answer tokens
        total, count = 0.0, 0
        for rows, _ in _answer_rows(model, batch["answer"]):
            for row in rows:
                v = len(row)
                total += sum((1 / v) * (math.log(1 / v) - lp) for lp in row)
                count += 1
        return total / count
    if name == "KL":  # KL(p_ref || p_theta) per answer token, averaged
        total, count = 0.0, 0
        pairs = zip(_answer_rows(model, batch["answer"]), _answer_rows(reference, batch["answer"]))
        for (rows, _), (ref_rows, _) in pairs:
            for row, ref_row in zip(rows, ref_rows):
                total += sum(math.exp(r) * (r - p) for r, p in zip(ref_row, row))
                count += 1
        return total / count
    return reference_value_2026(name, model, reference, batch)


ALL_LOSSES = [("forget", n) for n in FORGET_LOSSES] + [("retain", n) for n in RETAIN_LOSSES]


@pytest.mark.parametrize("kind,name", ALL_LOSSES)
def test_loss_equals_float64_loop_reference(setup, kind, name):
    model, reference, batch = setup
    spec = (FORGET_LOSSES if kind == "forget" else RETAIN_LOSSES)[name]
    value = spec.fn(LossContext(model, reference if spec.needs_reference else None, BETA, params=PARAMS), batch)
    assert value.dtype == torch.float32 or value.dtype == torch.float64
    assert torch.isfinite(value)
    expected = reference_value(name, model, reference, batch)
    assert value.item() == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_npo_at_the_reference_is_2_log2_over_beta(setup):
    model, _, batch = setup
    value = FORGET_LOSSES["NPO"].fn(LossContext(model, model, BETA), batch)
    assert value.item() == pytest.approx(2 * math.log(2) / BETA, rel=1e-9)


def _nll(model, tensors) -> float:
    with torch.no_grad():
        return sequence_nll(model, tensors).sum().item()


def _minimise(spec, model, reference, batch, steps=15, lr=0.05):
    model = copy.deepcopy(model).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        loss = spec.fn(LossContext(model, reference, BETA, params=PARAMS), batch)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return model


def _uniform_kl(model, tensors) -> float:
    with torch.no_grad():
        return FORGET_LOSSES["ME"].fn(LossContext(model), {"answer": tensors}).item()


@pytest.mark.parametrize("name", list(FORGET_LOSSES) + list(RETAIN_LOSSES))
def test_minimising_the_loss_moves_likelihoods_the_intended_way(setup, name):
    model, reference, batch = setup
    spec = FORGET_LOSSES.get(name) or RETAIN_LOSSES[name]
    if name in ("KL", "EMBED"):  # start away from the reference, so pulling back toward it is visible
        start = _minimise(FORGET_LOSSES["GA"], model, None, batch, steps=5)
        ref = model
    elif name == "UNDIAL":  # self-distillation: the reference is the starting model
        start, ref = model, model
    else:
        start, ref = model, reference
    # a random init predicts nearly uniformly already, so ME needs a larger step to move visibly; so do RMU and
    # EMBED, whose gradients reach layer 0's output through few weights
    trained = _minimise(spec, start, ref, batch, lr=1.0 if name in ("ME", "RMU", "EMBED") else 0.05)
    answer, rejection = batch["answer"], batch["rejection"]
    if name in ("GA", "NPO", "SimNPO", "WGA", "SatImp", "UNDIAL", "CE-U"):  # forget answers become less likely
        assert _nll(trained, answer) > _nll(start, answer) + 1e-3
    elif name == "ME":  # predictions on forget answers move toward uniform
        assert _uniform_kl(trained, answer) < 0.9 * _uniform_kl(start, answer)
    elif name == "IDK":  # the rejection answer becomes more likely
        assert _nll(trained, rejection) < _nll(start, rejection) - 1e-3
    elif name == "DPO":  # the rejection answer gains on the true answer
        assert _nll(trained, rejection) - _nll(trained, answer) < _nll(start, rejection) - _nll(start, answer) - 1e-3
    elif name == "GD":  # retain answers become more likely
        assert _nll(trained, answer) < _nll(start, answer) - 1e-3
    elif name == "KL":  # back toward the reference's likelihood of the retain answers (not the KL itself)
        assert abs(_nll(trained, answer) - _nll(ref, answer)) < abs(_nll(start, answer) - _nll(ref, answer)) - 0.1
    elif name == "AP":  # the true answer gains on the rejection answer
        assert _nll(trained, answer) - _nll(trained, rejection) < _nll(start, answer) - _nll(start, rejection) - 1e-3
    elif name == "RMU":  # layer 0's answer-token outputs turn toward the random direction u
        u = _rmu_target(len(_hidden_rows(start, answer, 0)[0][0]))
        assert _mean_cosine(trained, answer, u) > _mean_cosine(start, answer, u) + 0.05
    elif name == "EMBED":  # layer 0's answer-token outputs move back toward the reference's, measured here
        target = [v for rows in _hidden_rows(ref, answer, 0) for v in rows]
        assert _mean_distance(trained, answer, target) < 0.98 * _mean_distance(start, answer, target)
    else:
        raise AssertionError(f"no expected direction written for {name}")


def _rmu_target(width: int) -> list[float]:
    """c·u/|u| with u's entries uniform in [0, 1) from a generator seeded with the seed (RMU's target)."""
    draw = torch.rand(width, generator=torch.Generator().manual_seed(PARAMS.seed), dtype=torch.float64).tolist()
    norm = math.sqrt(sum(x * x for x in draw))
    return [PARAMS.rmu_coeff * x / norm for x in draw]


def _mean_cosine(model, tensors, u: list[float]) -> float:
    vectors = [v for rows in _hidden_rows(model, tensors, 0) for v in rows]
    u_norm = math.sqrt(sum(x * x for x in u))
    return sum(sum(a * b for a, b in zip(v, u)) / (math.sqrt(sum(a * a for a in v)) * u_norm)
               for v in vectors) / len(vectors)


def _mean_distance(model, tensors, targets: list[list[float]]) -> float:
    vectors = [v for rows in _hidden_rows(model, tensors, 0) for v in rows]
    return sum(math.sqrt(sum((a - b) ** 2 for a, b in zip(v, t))) for v, t in zip(vectors, targets)) / len(vectors)


def _retaining_grad(module) -> tuple[list[torch.Tensor], object]:
    """A forward hook that keeps `module`'s output and its gradient."""
    store: list[torch.Tensor] = []

    def hook(mod, inputs, output):
        tensor = output[0] if isinstance(output, tuple) else output
        tensor.retain_grad()
        store.append(tensor)

    return store, module.register_forward_hook(hook)


@pytest.mark.parametrize("name", ["KL", "RMU", "EMBED"])
def test_kl_rmu_and_embed_gradients_equal_their_closed_forms(setup, name):
    """The gradient each loss sends into the model, derived by hand: KL(p_ref || softmax(z)) averaged over the N
    answer positions gives dL/dz = (softmax(z) − p_ref)/N there and 0 elsewhere; RMU and EMBED, the mean over N
    answer tokens of the mean over d dimensions of (h − target)², give dL/dh = 2(h − target)/(N·d) at layer 0's
    output (target c·u/|u| for RMU, the reference's layer-0 output for EMBED) and 0 at prompt and padding."""
    model, reference, batch = setup
    model = copy.deepcopy(model)
    spec = RETAIN_LOSSES.get(name) or FORGET_LOSSES[name]
    answer = batch["answer"]
    labels = answer["labels"]
    store, handle = _retaining_grad(model.lm_head if name == "KL" else model.model.layers[0])
    try:
        loss = spec.fn(LossContext(model, reference, BETA, params=PARAMS), batch)
    finally:
        handle.remove()
    loss.backward()
    (out,) = store
    values = out.detach()
    expected = torch.zeros_like(values)
    with torch.no_grad():
        if name == "KL":
            mask = torch.zeros_like(labels, dtype=torch.bool)
            mask[:, :-1] = labels[:, 1:] != -100
            ref_logits = reference(input_ids=answer["input_ids"], attention_mask=answer["attention_mask"]).logits
            count = mask.sum()
            expected[mask] = (torch.softmax(values[mask], -1) - torch.softmax(ref_logits[mask], -1)) / count
        else:
            mask = labels != -100
            if name == "RMU":
                target = torch.tensor(_rmu_target(values.shape[-1]), dtype=values.dtype)
            else:
                target = reference(input_ids=answer["input_ids"], attention_mask=answer["attention_mask"],
                                   output_hidden_states=True).hidden_states[1][mask]
            expected[mask] = 2 * (values[mask] - target) / (mask.sum() * values.shape[-1])
    assert expected.abs().max() > 0
    torch.testing.assert_close(out.grad, expected, rtol=1e-9, atol=1e-15)
