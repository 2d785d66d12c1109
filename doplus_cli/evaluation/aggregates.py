"""OpenUnlearning's aggregate scores of a TOFU model (arXiv 2506.12618, Appendix F and Table 3): Memorization,
Privacy, Utility and Overall, each a harmonic mean in [0, 1] where higher is better.

- Memorization = HM(1 - ES, 1 - EM, 1 - Para.Prob, 1 - Truth Ratio) over the forget set: extraction strength,
  exact memorisation, the paraphrased answer's probability and the truth ratio as an extent of knowledge
  (`ou.truth_ratio_prob_mean`, p_c / (p_c + p_w));
- Privacy = HM(sLOSS, sZLib, sMin-K, sMin-K++), each s in [0, 1] saying how close the attack's AUC is to the
  retain model's (`mia_closeness`);
- Utility = HM(model_utility, forget_fluency): OpenUnlearning's 9-value model utility and the gibberish
  classifier's mean probability of clean text over the forget generations (its `forget_Q_A_gibberish`);
- Overall = HM(Memorization, Privacy, Utility).

OpenUnlearning computed these after its evaluations, in a notebook it did not publish, and never published how
it turns an AUC into its s (its issues #150 and #172): `mia_closeness` is doplus's choice, so Privacy and Overall
need not reproduce the paper's Table 3. Each function takes its named inputs (metric -> value or None) and gives
an `AggregateScore`: the value (None when an input is missing), the inputs it used, and why it is missing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from doplus_cli.evaluation.metrics import harmonic_mean

MEMORIZATION_INPUTS = ("extraction_strength", "exact_memorization", "forget_Q_A_PARA_Prob",
                       "forget_truth_ratio_prob_mean")
PRIVACY_INPUTS = ("mia_loss", "mia_zlib", "mia_min_k", "mia_min_k_plus_plus")
UTILITY_INPUTS = ("model_utility", "forget_fluency")
OVERALL_INPUTS = ("agg_memorization", "agg_privacy", "agg_utility")
KEYS = OVERALL_INPUTS + ("agg_overall",)

# Where each input comes from, for the reason given when it is missing.
SOURCES = {
    "extraction_strength": "the privacy suite, or the tofu suite with --holdout FILE",
    "exact_memorization": "the privacy suite, or the tofu suite with --holdout FILE",
    "forget_Q_A_PARA_Prob": "the privacy suite",
    "forget_truth_ratio_prob_mean": "the privacy suite",
    "model_utility": "the tofu suite (run --suite tofu,privacy)",
    "forget_fluency": "the tofu suite with a gibberish classifier (--fluency-model)",
}


class AggregateScore(NamedTuple):
    """An aggregate's value (None when an input is missing), the inputs it used (name -> value as it entered,
    None where missing) and, when the value is None, the reason in words."""

    value: float | None
    inputs: dict[str, float | None]
    reason: str | None


def _missing(inputs: Mapping[str, float | None], what: str) -> AggregateScore | None:
    """The not-available score naming every missing input and where it comes from; None when none is missing."""
    absent = [key for key, value in inputs.items() if value is None]
    if not absent:
        return None
    where = "; ".join(f"{key}: {SOURCES[key]}" if key in SOURCES else key for key in absent)
    return AggregateScore(None, dict(inputs), f"{what} not available: no {', '.join(absent)} ({where})")


def memorization(values: Mapping[str, float | None]) -> AggregateScore:
    """Memorization = HM(1 - extraction_strength, 1 - exact_memorization, 1 - forget_Q_A_PARA_Prob,
    1 - forget_truth_ratio_prob_mean): 1 when the model shows none of the forget answers, 0 when any of the four
    is at its maximum."""
    inputs = {key: values.get(key) for key in MEMORIZATION_INPUTS}
    missing = _missing(inputs, "agg_memorization")
    if missing is not None:
        return missing
    return AggregateScore(harmonic_mean([_unit(1 - v) for v in inputs.values()]), inputs, None)


def mia_closeness(auc: float, retain_auc: float) -> float:
    """sMIA = 1 - |AUC - AUC_retain| / max(AUC_retain, 1 - AUC_retain), in [0, 1]: 1 at the retain model's AUC, 0
    at the AUC farthest from it that an AUC can take (0 or 1). doplus's choice: OpenUnlearning's transform is
    unpublished."""
    return _unit(1 - abs(auc - retain_auc) / max(retain_auc, 1 - retain_auc))


def privacy(values: Mapping[str, float | None], retain_aucs: Mapping[str, float | None]) -> AggregateScore:
    """Privacy = HM(sLOSS, sZLib, sMin-K, sMin-K++), s = `mia_closeness`(this model's AUC, the retain model's AUC)
    of each attack (`values[mia_*]`, `retain_aucs[mia_*]`, from --retain-logs)."""
    inputs: dict[str, float | None] = {}
    for attack in PRIVACY_INPUTS:
        auc, retain = values.get(attack), retain_aucs.get(attack)
        inputs[attack], inputs[f"retain {attack}"] = auc, retain
        inputs[f"s {attack}"] = None if auc is None or retain is None else mia_closeness(auc, retain)
    parts = []
    absent = [attack for attack in PRIVACY_INPUTS if inputs[attack] is None]
    if absent:
        parts.append(f"no {', '.join(absent)} (the privacy suite, or the tofu suite with --holdout FILE)")
    absent = [attack for attack in PRIVACY_INPUTS if inputs[f"retain {attack}"] is None]
    if absent:
        parts.append(f"no retain model AUC of {', '.join(absent)} (--retain-logs FILE: a retain model's "
                     "TOFU_EVAL.json or PRIVACY_EVAL.json, with mia_*.agg_value)")
    if parts:
        return AggregateScore(None, inputs, "agg_privacy not available: " + "; ".join(parts))
    return AggregateScore(harmonic_mean([inputs[f"s {attack}"] for attack in PRIVACY_INPUTS]), inputs, None)


def utility(values: Mapping[str, float | None]) -> AggregateScore:
    """Utility = HM(model_utility, forget_fluency)."""
    inputs = {key: values.get(key) for key in UTILITY_INPUTS}
    return _missing(inputs, "agg_utility") or AggregateScore(harmonic_mean([_unit(v) for v in inputs.values()]),
                                                             inputs, None)


def overall(values: Mapping[str, float | None]) -> AggregateScore:
    """Overall = HM(agg_memorization, agg_privacy, agg_utility)."""
    inputs = {key: values.get(key) for key in OVERALL_INPUTS}
    absent = [key for key, value in inputs.items() if value is None]
    if absent:
        return AggregateScore(None, inputs, f"agg_overall not available: no {', '.join(absent)}")
    return AggregateScore(harmonic_mean(list(inputs.values())), inputs, None)


def openunlearning_aggregates(values: Mapping[str, float | None],
                              retain_aucs: Mapping[str, float | None]) -> dict[str, AggregateScore]:
    """agg_memorization, agg_privacy, agg_utility and agg_overall from one evaluation's values and the retain
    model's AUCs."""
    scores = {"agg_memorization": memorization(values), "agg_privacy": privacy(values, retain_aucs),
              "agg_utility": utility(values)}
    scores["agg_overall"] = overall({key: score.value for key, score in scores.items()})
    return scores


def aggregate_lines(scores: Mapping[str, AggregateScore]) -> list[str]:
    """One line per aggregate for the report: its value and every input as it entered, or why it is missing."""
    lines = []
    for key, score in scores.items():
        inputs = ", ".join(f"{name} {_fmt(value)}" for name, value in score.inputs.items())
        if score.value is None:
            lines.append(f"{score.reason} (inputs: {inputs})")
        else:
            lines.append(f"{key} = {score.value:.4g}, harmonic mean over: {inputs}")
    return lines


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def _unit(value: float) -> float:
    """`value` clipped to [0, 1] (the inputs are shares and probabilities; float rounding can pass the ends)."""
    return min(1.0, max(0.0, value))
