"""OpenUnlearning's TOFU metrics (locuslab/open-unlearning), one function each, next to the paper's.

forget_quality (KS test of truth ratios against a retain model), model_utility (harmonic mean of 9 values),
the membership-inference attacks LOSS, ZLib, Min-K%, Min-K%++, GradNorm and reference as AUCs of forget against
holdout, privleak, extraction strength, exact memorisation, and the paraphrased-answer probability and truth
ratio that the paper's Memorization aggregate takes (`aggregates.py`). Each docstring states the formula as
OpenUnlearning computes it; the per-token inputs (answer-token log-probabilities, the mean and variance of the
log-probability under the model's own next-token distribution, greedy predictions) come from
`scoring.answer_token_stats`.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping, Sequence

from doplus_cli.registry import Registry

# OpenUnlearning's TOFU model_utility: retain, real authors (ra) and world facts (wf), 3 values each.
OU_MODEL_UTILITY_KEYS = (
    "retain_Q_A_Prob", "retain_Q_A_ROUGE", "retain_Truth_Ratio",
    "ra_Q_A_Prob_normalised", "ra_Q_A_ROUGE", "ra_Truth_Ratio",
    "wf_Q_A_Prob_normalised", "wf_Q_A_ROUGE", "wf_Truth_Ratio",
)
MIN_K = 0.4  # OpenUnlearning's TOFU configuration of mia_min_k and mia_min_k_plus_plus
EPS = 1e-10


def truth_ratio_scores(paraphrased_nlls: Sequence[float], perturbed_nlls: Sequence[Sequence[float]]) -> list[float]:
    """OpenUnlearning's per-question truth ratio tr_i = exp(-mean_j NLL(perturbed_ij)) / (exp(-NLL(paraphrased_i))
    + 1e-10): p(wrong) over p(correct), the inverse of the paper's r_i. Its `value_by_index` scores."""
    return [math.exp(-sum(options) / len(options)) / (math.exp(-para) + EPS)
            for para, options in zip(paraphrased_nlls, perturbed_nlls)]


def forget_quality(forget_scores: Sequence[float], retain_model_scores: Sequence[float]) -> float:
    """forget_quality = two-sided two-sample Kolmogorov-Smirnov p-value (scipy.stats.ks_2samp, method "auto")
    between this model's forget truth ratios and the retain model's; 1 when indistinguishable."""
    from scipy.stats import ks_2samp

    if not forget_scores or not retain_model_scores:
        raise ValueError("forget_quality: no truth ratios")
    return float(ks_2samp(list(forget_scores), list(retain_model_scores)).pvalue)


def model_utility_ou(values: Mapping[str, float | None]) -> float | None:
    """model_utility (OpenUnlearning) = harmonic mean (scipy.stats.hmean) of the 9 values OU_MODEL_UTILITY_KEYS:
    Probability (normalised over the options for ra/wf), ROUGE-L recall and Truth Ratio (mean max(0, 1 - tr))
    of retain, real authors and world facts; 0 when any is 0; None when any is missing."""
    picked = [values.get(key) for key in OU_MODEL_UTILITY_KEYS]
    if any(v is None for v in picked):
        return None
    if any(v <= 0 for v in picked):
        return 0.0
    return len(picked) / sum(1.0 / v for v in picked)


def mia_auc(forget_scores: Sequence[float], holdout_scores: Sequence[float]) -> float:
    """AUC = sklearn roc_auc_score with label 0 for forget (members) and 1 for holdout (non-members): the
    probability that a holdout sample scores above a forget sample (ties count one half). Scores are "higher =
    less likely a member", so a model that still knows the forget set has AUC near 1, a retain model near 0.5."""
    from sklearn.metrics import roc_auc_score

    if not forget_scores or not holdout_scores:
        raise ValueError("mia_auc: need forget and holdout scores")
    labels = [0] * len(forget_scores) + [1] * len(holdout_scores)
    return float(roc_auc_score(labels, list(forget_scores) + list(holdout_scores)))


def loss_score(token_log_probs: Sequence[float]) -> float:
    """LOSS attack score = mean NLL of the answer tokens = -mean_t log p(x_t | x_<t)."""
    return -sum(token_log_probs) / len(token_log_probs)


def zlib_score(token_log_probs: Sequence[float], answer_text: str) -> float:
    """ZLib attack score = mean answer-token NLL / len(zlib.compress(answer text as UTF-8)), the answer text
    being its target tokens decoded without special tokens."""
    return loss_score(token_log_probs) / max(len(zlib.compress(answer_text.encode("utf-8"))), 1)


def min_k_score(token_log_probs: Sequence[float], k: float = MIN_K) -> float:
    """Min-K% score = -mean of the lowest max(1, int(n * k)) of the n answer-token log-probabilities."""
    if not token_log_probs:
        return 0.0
    lowest = sorted(token_log_probs)[:max(1, int(len(token_log_probs) * k))]
    return -sum(lowest) / len(lowest)


def min_k_plus_plus_score(token_log_probs: Sequence[float], means: Sequence[float], variances: Sequence[float],
                          k: float = MIN_K) -> float:
    """Min-K%++ score = -mean of the lowest max(1, int(n * k)) of z_t = (log p(x_t) - mu_t) / sqrt(max(s2_t,
    1e-6)), mu_t = sum_v p(v) log p(v) and s2_t = sum_v p(v) log^2 p(v) - mu_t^2 under the model's next-token
    distribution at position t."""
    if not token_log_probs:
        return 0.0
    z = [(lp - mu) / math.sqrt(max(s2, 1e-6)) for lp, mu, s2 in zip(token_log_probs, means, variances)]
    return min_k_score(z, k)


def gradnorm_score(parameter_grad_norms: Sequence[float]) -> float:
    """GradNorm attack score = mean over the parameters that get a gradient of ||dL/dW||_p (p = 2), L the mean
    NLL of one answer's tokens (batch size 1): a larger gradient, a worse fit, less likely a member."""
    if not parameter_grad_norms:
        raise ValueError("gradnorm_score: no parameter got a gradient")
    return sum(parameter_grad_norms) / len(parameter_grad_norms)


def reference_score(token_log_probs: Sequence[float], reference_token_log_probs: Sequence[float]) -> float:
    """Reference attack score = mean answer-token NLL under the model - the same under the reference model (a
    retain model): near 0 where both fit the answer alike, above 0 where the model fits it worse."""
    return loss_score(token_log_probs) - loss_score(reference_token_log_probs)


def paraphrased_probability(paraphrased_nlls: Sequence[float]) -> float:
    """forget_Q_A_PARA_Prob = mean_i exp(-NLL(paraphrased_i)), NLL the mean over the paraphrased answer's tokens."""
    if not paraphrased_nlls:
        raise ValueError("paraphrased_probability: no answers")
    return sum(math.exp(-nll) for nll in paraphrased_nlls) / len(paraphrased_nlls)


def truth_ratio_prob_mean(paraphrased_nlls: Sequence[float], perturbed_nlls: Sequence[Sequence[float]]) -> float:
    """Truth ratio with OpenUnlearning's `prob_mean` aggregator (the paper's extent of knowledge) = mean_i p_c /
    (p_c + p_w + 1e-10), p_c = exp(-NLL(paraphrased_i)), p_w = exp(-mean_j NLL(perturbed_ij)): near 1 while the
    model prefers the true answer, 0.5 when it cannot tell true from false."""
    if not paraphrased_nlls:
        raise ValueError("truth_ratio_prob_mean: no answers")
    shares = []
    for para, options in zip(paraphrased_nlls, perturbed_nlls):
        correct, wrong = math.exp(-para), math.exp(-sum(options) / len(options))
        shares.append(correct / (correct + wrong + EPS))
    return sum(shares) / len(shares)


def privleak(auc: float, reference_auc: float = 0.5) -> float:
    """privleak (OpenUnlearning, MUSE's convention) = ((1 - auc) - (1 - ref)) / ((1 - ref) + 1e-10) * 100, auc
    the Min-K% AUC of this model and ref the retain model's (0.5 without one): 0 for a model like the retain
    model, about -100 for one that still knows the forget set."""
    return ((1 - auc) - (1 - reference_auc)) / ((1 - reference_auc) + EPS) * 100


def exact_memorization(predicted: Sequence[int], labels: Sequence[int]) -> float:
    """Exact memorisation = (1/n) #{t : argmax_v p(v | x_<t) == x_t} over the n answer tokens (teacher forced)."""
    if not labels:
        raise ValueError("exact_memorization: no answer tokens")
    return sum(p == y for p, y in zip(predicted, labels)) / len(labels)


def extraction_strength(predicted: Sequence[int], labels: Sequence[int]) -> float:
    """Extraction strength = 1 - k/n, k the smallest index whose suffix the greedy (teacher-forced) predictions
    reproduce exactly; as OpenUnlearning's loop leaves it, k = n - 1 when no suffix matches (so 1/n, not 0)."""
    n = len(labels)
    if n == 0:
        return 0.0
    k = 0
    for k in range(n):
        if list(predicted[k:]) == list(labels[k:]):
            break
    return 1 - k / n


OU_METRICS: Registry[Callable] = Registry("OpenUnlearning metric", Callable, (
    (fn.__name__, fn)
    for fn in (truth_ratio_scores, forget_quality, model_utility_ou, mia_auc, loss_score, zlib_score, min_k_score,
               min_k_plus_plus_score, gradnorm_score, reference_score, paraphrased_probability,
               truth_ratio_prob_mean, privleak, exact_memorization, extraction_strength)
))
