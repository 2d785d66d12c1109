"""The six indicators and four aggregates of the DualOptim+ paper's TOFU evaluation, one function each, by name.

Indicators turn per-question numbers (generations, mean token NLLs of answers, embeddings, NLI labels) into
one fraction in [0, 1]. Aggregates combine indicator values keyed f"{set}_{indicator}" (e.g. "retain_rouge",
"forget_entailment"); a value that is None or absent is left out and named in the aggregate's `missing` and
`note`, never counted as 0. Values are fractions; reports multiply by 100.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType

import torch
import torch.nn.functional as F

from doplus_cli.registry import Registry

# ---------------------------------------------------------------------------------------------- indicators


@lru_cache(maxsize=1)
def _rouge_scorer():
    from rouge_score.rouge_scorer import RougeScorer

    return RougeScorer(["rougeL"], use_stemmer=True)


def _require(values: Sequence, what: str) -> None:
    if len(values) == 0:
        raise ValueError(f"{what}: no values")


def _same_length(a: Sequence, b: Sequence, what: str) -> None:
    if len(a) != len(b):
        raise ValueError(f"{what}: {len(a)} vs {len(b)} values")


def rouge_l_recall(generation: str, reference: str) -> float:
    """ROUGE-L recall = LCS(generation, reference) / len(reference), over lower-cased, Porter-stemmed words."""
    return _rouge_scorer().score(reference, generation)["rougeL"].recall


def rouge_l_f1(generation: str, reference: str) -> float:
    """ROUGE-L F1 = 2PR / (P + R), P = LCS / len(generation), R = LCS / len(reference), over lower-cased,
    Porter-stemmed words."""
    return _rouge_scorer().score(reference, generation)["rougeL"].fmeasure


def probability(mean_nlls: Sequence[float]) -> float:
    """Probability (forget/retain sets) = mean_i exp(-NLL_i), NLL_i the mean token NLL of answer i."""
    _require(mean_nlls, "probability")
    return sum(math.exp(-nll) for nll in mean_nlls) / len(mean_nlls)


def choice_probability(true_nlls: Sequence[float], perturbed_nlls: Sequence[Sequence[float]]) -> float:
    """Probability (real authors, world facts) = mean_i p(true_i) / (p(true_i) + sum_j p(perturbed_ij)),
    p = exp(-mean token NLL of the answer)."""
    _require(true_nlls, "choice_probability")
    _same_length(true_nlls, perturbed_nlls, "choice_probability: true and perturbed answers")
    shares = []
    for true_nll, options in zip(true_nlls, perturbed_nlls):
        log_p = [-true_nll] + [-nll for nll in options]
        top = max(log_p)  # softmax over the options, shifted for stability
        shares.append(math.exp(log_p[0] - top) / sum(math.exp(x - top) for x in log_p))
    return sum(shares) / len(shares)


def truth_ratios(paraphrased_nlls: Sequence[float], perturbed_nlls: Sequence[Sequence[float]]) -> list[float]:
    """Per question r_i = exp(mean_j NLL(perturbed_ij) - NLL(paraphrased_i)), NLLs mean per token:
    p(paraphrased) over the geometric mean of p(perturbed)."""
    _require(paraphrased_nlls, "truth_ratios")
    _same_length(paraphrased_nlls, perturbed_nlls, "truth_ratios: paraphrased and perturbed answers")
    ratios = []
    for paraphrased, options in zip(paraphrased_nlls, perturbed_nlls):
        _require(options, "truth_ratios: perturbed answers of a question")
        ratios.append(math.exp(sum(options) / len(options) - paraphrased))
    return ratios


def _positive(ratios: Sequence[float], what: str) -> None:
    _require(ratios, what)
    if any(r <= 0 for r in ratios):
        raise ValueError(f"{what}: truth ratios must be positive")


def truth_ratio_forget(ratios: Sequence[float]) -> float:
    """Truth Ratio (forget set) = 1 - mean_i min(r_i, 1/r_i): 0 when paraphrased and perturbed are alike."""
    _positive(ratios, "truth_ratio_forget")
    return 1.0 - sum(min(r, 1.0 / r) for r in ratios) / len(ratios)


def truth_ratio_other(ratios: Sequence[float]) -> float:
    """Truth Ratio (retain, real authors, world facts) = mean_i max(0, 1 - 1/r_i)."""
    _positive(ratios, "truth_ratio_other")
    return sum(max(0.0, 1.0 - 1.0 / r) for r in ratios) / len(ratios)


def token_entropy(tokens: Sequence[int]) -> float:
    """Token Entropy = -sum_t f_t log f_t / log n over the unigram frequencies f_t of the n tokens:
    1 when all are distinct, 0 for one token repeated. Defined as 0.0 for n < 2 (an empty or one-token
    generation carries no diversity)."""
    n = len(tokens)
    if n < 2:
        return 0.0
    entropy = -sum(c / n * math.log(c / n) for c in Counter(tokens).values())
    return entropy / math.log(n)


def mean_token_entropy(generations_tokens: Sequence[Sequence[int]]) -> float:
    """Token Entropy of a set = mean_i token_entropy(tokens of generation i)."""
    _require(generations_tokens, "mean_token_entropy")
    return sum(token_entropy(tokens) for tokens in generations_tokens) / len(generations_tokens)


def cosine_similarities(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """Cosine Similarity per row i = max(0, a_i . b_i / (|a_i| |b_i|)) for [N, D] embeddings a, b."""
    if a.dim() != 2 or a.shape != b.shape:
        raise ValueError(f"cosine_similarities: need two [N, D] matrices of one shape, got {a.shape} and {b.shape}")
    return F.cosine_similarity(a.float(), b.float(), dim=-1).clamp_min(0.0).tolist()


def entailment_score(labels: Sequence[str], rouge_recalls: Sequence[float], cutoff: float = 0.1) -> float:
    """Entailment Score = (1/N) * #{i : label_i == "entailment" and rouge_i >= cutoff}; a pair whose
    ROUGE-L recall is below `cutoff` counts as not entailed whatever the NLI model says."""
    _require(labels, "entailment_score")
    _same_length(labels, rouge_recalls, "entailment_score: labels and ROUGE recalls")
    entailed = sum(label == "entailment" and rouge >= cutoff for label, rouge in zip(labels, rouge_recalls))
    return entailed / len(labels)


def harmonic_mean(values: Sequence[float]) -> float:
    """H = n / sum_i (1 / v_i) for values in [0, 1]; H = 0 when any v_i is 0."""
    _require(values, "harmonic_mean")
    if any(v < 0 for v in values):
        raise ValueError("harmonic_mean: values must be non-negative")
    if any(v == 0 for v in values):
        return 0.0
    return len(values) / sum(1.0 / v for v in values)


INDICATORS: Registry[Callable] = Registry("indicator", Callable, (
    (fn.__name__, fn)
    for fn in (
        rouge_l_recall, probability, choice_probability, truth_ratios, truth_ratio_forget, truth_ratio_other,
        token_entropy, mean_token_entropy, cosine_similarities, entailment_score,
    )
))

# ---------------------------------------------------------------------------------------------- aggregates

OTHER_SETS = ("retain", "real_authors", "world_facts")
MU_INDICATORS = ("rouge", "probability", "truth_ratio", "token_entropy", "cosine_similarity", "entailment")
MU_KEYS = tuple(f"{s}_{i}" for s in OTHER_SETS for i in MU_INDICATORS)
UFE_KEYS = tuple(f"forget_{i}" for i in ("rouge", "probability", "truth_ratio", "cosine_similarity", "entailment"))
TFE_KEYS = ("forget_token_entropy", "forget_idk_entailment")

_NO_REASONS: Mapping[str, str] = MappingProxyType({})


@dataclass
class Aggregate:
    name: str  # "MU", "UFE", "TFE", "OVR"
    value: float | None  # None when nothing it needs is available
    used: list[str]  # indicator keys that entered
    missing: list[str]  # indicator keys it needed but were absent
    note: str  # e.g. "UFE over 4 of 5 indicators: no NLI model"; "" when complete
    formula: str = ""  # the formula as computed, for reports


def _reason_for(key: str, reasons: Mapping[str, str]) -> str:
    """The reason given for the key or its longest indicator suffix: "forget_idk_entailment" looks up
    "forget_idk_entailment", "idk_entailment", then "entailment"."""
    parts = key.split("_")
    for start in range(len(parts)):
        reason = reasons.get("_".join(parts[start:]))
        if reason:
            return reason
    return f"no value for {key}"


def _split(
    name: str, keys: Sequence[str], values: Mapping[str, float | None], reasons: Mapping[str, str], unit: str
) -> tuple[list[str], list[str], str]:
    """(used keys, missing keys, note) of an aggregate over `keys`; the note gives each distinct reason."""
    used = [k for k in keys if values.get(k) is not None]
    missing = [k for k in keys if values.get(k) is None]
    if not missing:
        return used, missing, ""
    why: list[str] = []
    for key in missing:
        reason = _reason_for(key, reasons)
        if reason not in why:
            why.append(reason)
    return used, missing, f"{name} over {len(used)} of {len(keys)} {unit}: {'; '.join(why)}"


def model_utility(
    values: Mapping[str, float | None], reasons: Mapping[str, str] = _NO_REASONS, keys: Sequence[str] = MU_KEYS
) -> Aggregate:
    """MU = harmonic mean of the 18 values {retain, real_authors, world_facts} x {rouge, probability,
    truth_ratio, token_entropy, cosine_similarity, entailment}: high when knowledge outside the forget set is kept.
    `keys` names other sets' values (the real-world suite: the neighbour set's six)."""
    used, missing, note = _split("MU", keys, values, reasons, "values")
    value = harmonic_mean([values[k] for k in used]) if used else None
    return Aggregate("MU", value, used, missing, note, f"MU = HM({', '.join(used)})")


def untargeted_forget_efficacy(
    values: Mapping[str, float | None], reasons: Mapping[str, str] = _NO_REASONS
) -> Aggregate:
    """UFE = 1 - mean(forget_rouge, forget_probability, forget_truth_ratio, forget_cosine_similarity,
    forget_entailment)."""
    used, missing, note = _split("UFE", UFE_KEYS, values, reasons, "indicators")
    value = 1.0 - sum(values[k] for k in used) / len(used) if used else None
    return Aggregate("UFE", value, used, missing, note, f"UFE = 1 - mean({', '.join(used)})")


def targeted_forget_efficacy(
    values: Mapping[str, float | None], reasons: Mapping[str, str] = _NO_REASONS
) -> Aggregate:
    """TFE = harmonic mean(forget_token_entropy, forget_idk_entailment), the latter the entailment score of
    the generations on the forget set against a rejection answer ("I don't know")."""
    used, missing, note = _split("TFE", TFE_KEYS, values, reasons, "indicators")
    value = harmonic_mean([values[k] for k in used]) if used else None
    return Aggregate("TFE", value, used, missing, note, f"TFE = HM({', '.join(used)})")


def overall(tfe: Aggregate, ufe: Aggregate, mu: Aggregate, targeted: bool) -> Aggregate:
    """OVR = 0.25 * (TFE + UFE) + 0.5 * MU for targeted losses (IDK, DPO); OVR = 0.5 * (UFE + MU) otherwise.
    None when a part it needs is None; `used`/`missing` are the parts' indicator keys, `note` their notes."""
    parts = [tfe, ufe, mu] if targeted else [ufe, mu]
    formula = "OVR = 0.25 * (TFE + UFE) + 0.5 * MU" if targeted else "OVR = 0.5 * (UFE + MU)"
    used = [k for p in parts for k in p.used]
    missing = [k for p in parts for k in p.missing]
    notes = [p.note for p in parts if p.note]
    unavailable = [p.name for p in parts if p.value is None]
    if unavailable:
        notes.insert(0, f"OVR not computed: no {', '.join(unavailable)}")
        return Aggregate("OVR", None, used, missing, "; ".join(notes), formula)
    if targeted:
        value = 0.25 * (tfe.value + ufe.value) + 0.5 * mu.value
    else:
        value = 0.5 * (ufe.value + mu.value)
    return Aggregate("OVR", value, used, missing, "; ".join(notes), formula)


AGGREGATES: Registry[Callable[..., Aggregate]] = Registry("aggregate", Callable, {
    "MU": model_utility,
    "UFE": untargeted_forget_efficacy,
    "TFE": targeted_forget_efficacy,
    "OVR": overall,
})
