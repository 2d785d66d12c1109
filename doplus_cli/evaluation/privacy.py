"""The privacy suite (membership inference, privleak, extraction strength, exact memorisation) and the
reading of a retain model's logs (`--retain-logs`), for OpenUnlearning's metrics.

Forget rows are members, holdout rows (`--holdout FILE`, TOFU's `holdout10` layout: `question`, `answer`)
non-members. Every attack scores each answer once, from the statistics of its scored tokens.
"""

from __future__ import annotations

import json
import os
from typing import Any

from doplus_cli.data.sources import read_json_lines
from doplus_cli.errors import UserError
from doplus_cli.evaluation import openunlearning as ou
from doplus_cli.evaluation.scoring import answer_token_stats

ATTACKS = ("mia_loss", "mia_zlib", "mia_min_k", "mia_min_k_plus_plus")


def attack_scores(stats: dict[str, Any]) -> dict[str, float]:
    """The four attacks' scores of one answer (higher: less likely a member)."""
    lp = stats["token_log_probs"]
    return {
        "mia_loss": ou.loss_score(lp),
        "mia_zlib": ou.zlib_score(lp, stats["text"]),
        "mia_min_k": ou.min_k_score(lp),
        "mia_min_k_plus_plus": ou.min_k_plus_plus_score(lp, stats["means"], stats["variances"]),
    }


def privacy_metrics(
    model, formatter, forget: list[tuple[str, str]], holdout: list[tuple[str, str]], batch_size: int,
    reference_auc: float | None,
) -> tuple[dict[str, float], dict[str, Any], list[str]]:
    """(summary values, OpenUnlearning-layout logs with per-index scores, notes)."""
    forget_stats = answer_token_stats(model, formatter, forget, batch_size)
    holdout_stats = answer_token_stats(model, formatter, holdout, batch_size)
    forget_scores = [attack_scores(s) for s in forget_stats]
    holdout_scores = [attack_scores(s) for s in holdout_stats]
    summary: dict[str, float] = {}
    logs: dict[str, Any] = {}
    for attack in ATTACKS:
        f = [s[attack] for s in forget_scores]
        h = [s[attack] for s in holdout_scores]
        auc = ou.mia_auc(f, h)
        summary[attack] = auc
        logs[attack] = {"agg_value": auc, "auc": auc, "forget": _by_index(f), "holdout": _by_index(h)}
    notes = []
    if reference_auc is None:
        notes.append("privleak against a reference AUC of 0.5: no --retain-logs with mia_min_k")
    summary["privleak"] = ou.privleak(summary["mia_min_k"], 0.5 if reference_auc is None else reference_auc)
    es = [ou.extraction_strength(s["predicted"], s["labels"]) for s in forget_stats]
    em = [ou.exact_memorization(s["predicted"], s["labels"]) for s in forget_stats]
    summary["extraction_strength"] = sum(es) / len(es)
    summary["exact_memorization"] = sum(em) / len(em)
    logs["privleak"] = {"agg_value": summary["privleak"]}
    logs["extraction_strength"] = {"agg_value": summary["extraction_strength"], **_by_index(es)}
    logs["exact_memorization"] = {"agg_value": summary["exact_memorization"], **_by_index(em)}
    return summary, logs, notes


def _by_index(values: list[float]) -> dict[str, Any]:
    return {"value_by_index": {str(i): {"score": v} for i, v in enumerate(values)}}


def read_holdout(path: str, max_samples: int | None) -> list[tuple[str, str]]:
    """(question, answer) rows of a JSON-lines holdout file."""
    if not os.path.isfile(path):
        raise UserError(f"{path}: --holdout file not found")
    rows = []
    for line in read_json_lines(path, first_line_hint=False):
        row = line.record
        for key in ("question", "answer"):
            if not isinstance(row, dict) or not isinstance(row.get(key), str):
                raise UserError(f"{path}:{line.number}: missing field '{key}' (a string)")
        rows.append((row["question"], row["answer"]))
        if max_samples is not None and len(rows) >= max_samples:
            break
    if not rows:
        raise UserError(f"{path}: the holdout set is empty")
    return rows


def read_retain_logs(path: str) -> tuple[list[float] | None, float | None]:
    """(the retain model's forget truth ratios as OpenUnlearning scores them, its Min-K% AUC) from a
    TOFU_EVAL.json: OpenUnlearning's (`forget_truth_ratio.value_by_index`, `mia_min_k.agg_value`) or doplus's
    (the same keys, or older files' per-sample `sets.forget[].nll_paraphrased`/`nll_perturbed`)."""
    if not os.path.isfile(path):
        raise UserError(f"{path}: --retain-logs file not found")
    try:
        with open(path) as handle:
            data = json.load(handle)
    except json.JSONDecodeError as error:
        raise UserError(f"{path}:{error.lineno}: malformed JSON ({error.msg})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object (a TOFU_EVAL.json)")
    ratios = _ratios(data, path)
    auc = None
    mia = data.get("mia_min_k")
    if isinstance(mia, dict) and mia.get("agg_value") is not None:
        auc = _number(mia["agg_value"], f"{path}: field 'mia_min_k.agg_value'")
    if ratios is None and auc is None:
        raise UserError(f"{path}: no field 'forget_truth_ratio.value_by_index' (OpenUnlearning's layout), "
                        "'sets.forget' (doplus's) or 'mia_min_k.agg_value': not a TOFU_EVAL.json of a retain model")
    return ratios, auc


def _ratios(data: dict, path: str) -> list[float] | None:
    block = data.get("forget_truth_ratio")
    if isinstance(block, dict) and isinstance(block.get("value_by_index"), dict):
        scores = []
        for index, entry in block["value_by_index"].items():
            where = f"{path}: field 'forget_truth_ratio.value_by_index.{index}.score'"
            if not isinstance(entry, dict) or "score" not in entry:
                raise UserError(f"{where} is missing")
            if entry["score"] is not None:
                scores.append(_number(entry["score"], where))
        return scores
    forget = (data.get("sets") or {}).get("forget") if isinstance(data.get("sets"), dict) else None
    if isinstance(forget, list):
        para, pert = [], []
        for i, record in enumerate(forget):
            where = f"{path}: field 'sets.forget[{i}]"
            if not isinstance(record, dict) or "nll_paraphrased" not in record or "nll_perturbed" not in record:
                raise UserError(f"{where}.nll_paraphrased/nll_perturbed' is missing")
            para.append(_number(record["nll_paraphrased"], f"{where}.nll_paraphrased'"))
            pert.append([_number(v, f"{where}.nll_perturbed'") for v in record["nll_perturbed"]])
        return ou.truth_ratio_scores(para, pert)
    return None


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{where} must be a number, got {value!r}")
    return float(value)
