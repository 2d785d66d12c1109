"""The privacy suite (membership inference, privleak, extraction strength, exact memorisation) and the
reading of a retain model's logs (`--retain-logs`), for OpenUnlearning's metrics.

Forget rows are members, holdout rows (`--holdout FILE`, TOFU's `holdout10` layout: `question`, `answer`)
non-members. The LOSS, ZLib, Min-K% and Min-K%++ attacks score each answer once, from the statistics of its
scored tokens; GradNorm runs one backward pass per answer; the reference attack scores every answer under a
second model (`--mia-reference`) too.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from doplus_cli.data.formatting import IGNORE_INDEX, PromptFormatter
from doplus_cli.data.sources import read_json_lines
from doplus_cli.errors import UserError
from doplus_cli.evaluation import openunlearning as ou
from doplus_cli.evaluation.aggregates import AggregateScore, aggregate_lines, openunlearning_aggregates
from doplus_cli.evaluation.scoring import answer_token_stats, forward_keeping, shared_prefix_nlls
from doplus_cli.losses import token_nll
from doplus_cli.progress import count_tokens

ATTACKS = ("mia_loss", "mia_zlib", "mia_min_k", "mia_min_k_plus_plus")
# Every attack whose retain-model AUC `--retain-logs` can carry (OpenUnlearning's key names).
ALL_ATTACKS = (*ATTACKS, "mia_gradnorm", "mia_reference")
GRADNORM_P = 2  # OpenUnlearning's TOFU configuration of mia_gradnorm


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
    reference_auc: float | None, *, gradnorm: bool = False, reference: torch.nn.Module | None = None,
    progress=None,
) -> tuple[dict[str, float], dict[str, Any], list[str]]:
    """(summary values, OpenUnlearning-layout logs with per-index scores, notes). `gradnorm` adds mia_gradnorm
    (one backward pass per answer), `reference` (a model sharing the tokenizer) mia_reference."""
    forget_stats = answer_token_stats(model, formatter, forget, batch_size)
    holdout_stats = answer_token_stats(model, formatter, holdout, batch_size)
    forget_scores = [attack_scores(s) for s in forget_stats]
    holdout_scores = [attack_scores(s) for s in holdout_stats]
    attacks = list(ATTACKS)
    if gradnorm:
        attacks.append("mia_gradnorm")
        for scores, pairs in ((forget_scores, forget), (holdout_scores, holdout)):
            for row, value in zip(scores, gradnorm_scores(model, formatter, pairs, progress=progress)):
                row["mia_gradnorm"] = value
    if reference is not None:
        attacks.append("mia_reference")
        for scores, pairs, stats in ((forget_scores, forget, forget_stats), (holdout_scores, holdout, holdout_stats)):
            for row, value in zip(scores, reference_scores(stats, answer_token_stats(reference, formatter, pairs,
                                                                                     batch_size))):
                row["mia_reference"] = value
    summary: dict[str, float] = {}
    logs: dict[str, Any] = {}
    for attack in attacks:
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


def gradnorm_scores(model: torch.nn.Module, formatter: PromptFormatter, pairs: Sequence[tuple[str, str]],
                    p: float = GRADNORM_P, progress=None) -> list[float]:
    """OpenUnlearning's GradNorm score of each (question, answer), one at a time (`ou.gradnorm_score`): L = the
    mean NLL of the answer tokens (answer + EOS, the tokens the other attacks score), one backward pass, then the
    mean over the parameters that get a gradient of ||dL/dW||_p, each norm in float32.

    The model runs in eval mode (dropout off: the same score on every run), every floating-point parameter
    requiring a gradient for the pass (as a freshly loaded model does), whatever it required before. Each
    parameter's gradient is read and dropped as soon as backward has accumulated it, so at most one extra
    gradient is held beyond the backward pass's own buffers; the parameters' `.grad`, `requires_grad` and the
    model's train/eval mode are as they were afterwards, the weights untouched."""
    params = [param for param in model.parameters() if param.is_floating_point()]
    before = [(param.requires_grad, param.grad) for param in params]
    norms: list[torch.Tensor] = []

    def read_and_drop(param: torch.Tensor) -> None:
        if param.grad is not None:
            norms.append(torch.linalg.vector_norm(param.grad.detach(), ord=p, dtype=torch.float32))
            param.grad = None

    was_training = model.training
    device = next(model.parameters()).device
    task = progress.add_task("GradNorm (one backward pass a row)", total=len(pairs), status="") \
        if progress is not None else None
    handles = []
    scores = []
    from doplus_cli.evaluation.compute import own_forwards

    # the evaluation's packed copies of the linear weights carry no gradient: the layers' own weights here
    with own_forwards(model):
        try:
            model.eval()
            for param in params:
                param.grad = None
                param.requires_grad_(True)
                handles.append(param.register_post_accumulate_grad_hook(read_and_drop))
            for q, (question, answer) in enumerate(pairs):
                encoded = formatter.encode(question, answer)
                n_answer = sum(1 for label in encoded.labels if label != IGNORE_INDEX)
                if n_answer == 0 or encoded.labels[0] != IGNORE_INDEX:
                    raise ValueError(f"gradnorm_scores: pair {q} has no prompt or no answer tokens after truncation")
                count_tokens("teacher_forced", len(encoded.input_ids))  # the forward pass; its backward is not counted
                ids = torch.tensor([encoded.input_ids], device=device)
                labels = torch.tensor([encoded.labels], device=device)
                norms.clear()
                with torch.enable_grad():
                    logits = _last_logits(model, ids, n_answer + 1)
                    nll, mask = token_nll(logits, labels[:, -logits.shape[1]:])
                    (nll.sum() / mask.sum()).backward()
                scores.append(ou.gradnorm_score(torch.stack(norms).double().tolist() if norms else []))
                if task is not None:
                    progress.advance(task, 1)
        finally:
            for handle in handles:
                handle.remove()
            for param, (requires_grad, grad) in zip(params, before):
                param.requires_grad_(requires_grad)
                param.grad = grad
            model.train(was_training)
    return scores


def _last_logits(model: torch.nn.Module, input_ids: torch.Tensor, keep: int) -> torch.Tensor:
    """Logits of the last `keep` positions of one unpadded row, no KV cache (all positions for models without
    `logits_to_keep`)."""
    return forward_keeping(model, keep, input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                           use_cache=False).logits


def reference_scores(stats: Sequence[dict[str, Any]], reference_stats: Sequence[dict[str, Any]]) -> list[float]:
    """The reference attack's score of each answer (`ou.reference_score`) from its token statistics under the
    model and under the reference model (`answer_token_stats` of both, the same tokens)."""
    return [ou.reference_score(s["token_log_probs"], r["token_log_probs"]) for s, r in zip(stats, reference_stats)]


def load_reference_model(spec: str, model: torch.nn.Module, tokenizer, dtype: str = "auto",
                         trust_remote_code: bool = False) -> tuple[torch.nn.Module, str]:
    """(the reference model of mia_reference, in eval mode on the evaluated model's device and dtype; its
    description). Its tokenizer must have the evaluated model's vocabulary: both models score the same token ids."""
    from doplus_cli.models import load_model_and_tokenizer, load_tokenizer

    theirs = load_tokenizer(spec, trust_remote_code).get_vocab()
    ours = tokenizer.get_vocab()
    if theirs != ours:
        differ = len(set(theirs.items()) ^ set(ours.items()))
        raise UserError(f"--mia-reference {spec}: its tokenizer's vocabulary differs from the evaluated model's "
                        f"({len(theirs)} against {len(ours)} tokens, {differ} (token, id) pairs not in both); the "
                        "reference attack compares the same token ids under both models")
    parameter = next(model.parameters())
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(parameter.dtype, dtype)
    reference, _, description = load_model_and_tokenizer(spec, name, trust_remote_code)
    return reference.to(device=parameter.device, dtype=parameter.dtype).eval(), description


def paraphrase_metrics(model: torch.nn.Module, formatter: PromptFormatter,
                       rows: Sequence[tuple[str, str, Sequence[str]]], batch_size: int,
                       progress=None) -> dict[str, float]:
    """forget_Q_A_PARA_Prob and forget_truth_ratio_prob_mean (`ou.paraphrased_probability`,
    `ou.truth_ratio_prob_mean`) of (question, paraphrased answer, perturbed answers) rows, every answer of a
    question scored from its prompt encoded once (`shared_prefix_nlls`)."""
    nlls = shared_prefix_nlls(model, formatter, [q for q, _, _ in rows], [[para, *pert] for _, para, pert in rows],
                              batch_size, progress, "scoring paraphrases (privacy)")
    paraphrased, perturbed = [n[0] for n in nlls], [n[1:] for n in nlls]
    return {"forget_Q_A_PARA_Prob": ou.paraphrased_probability(paraphrased),
            "forget_truth_ratio_prob_mean": ou.truth_ratio_prob_mean(paraphrased, perturbed)}


def privacy_suite_notes(reference_name: str | None) -> list[str]:
    """The privacy suite's words on its two costlier attacks: how GradNorm ran, and the reference model or why
    mia_reference is not available."""
    notes = ["mia_gradnorm: one backward pass per forget and holdout row, the model in eval mode (OpenUnlearning "
             "runs it in train mode, with dropout)"]
    if reference_name is None:
        notes.append("mia_reference: not available, no --mia-reference MODEL (a model sharing the tokenizer, "
                     "OpenUnlearning's a retain model)")
    else:
        notes.append(f"mia_reference: answer NLL under this model minus under {reference_name}")
    return notes


def privacy_aggregates(values: dict[str, Any], config, out: Path) -> tuple[
        dict[str, AggregateScore], dict[str, float], list[str]]:
    """(OpenUnlearning's aggregates of the privacy suite's values, the retain model's AUCs from --retain-logs, the
    report's lines). model_utility and forget_fluency, which Utility takes, are the tofu suite's: they are read from
    this evaluation's TOFU_SUMMARY.json when --suite runs tofu before privacy."""
    retain_aucs = read_retain_mia_aucs(config.retain_logs) if config.retain_logs else {}
    utility_inputs, why = _tofu_utility_inputs(config, out)
    scores = openunlearning_aggregates({**values, **utility_inputs}, retain_aucs)
    if why is not None and scores["agg_utility"].value is None:
        scores["agg_utility"] = scores["agg_utility"]._replace(reason=f"agg_utility not available: {why}")
    return scores, retain_aucs, aggregate_lines(scores)


def _tofu_utility_inputs(config, out: Path) -> tuple[dict[str, Any], str | None]:
    """model_utility and forget_fluency from the TOFU_SUMMARY.json the tofu suite of this evaluation wrote (it runs
    before privacy when --suite lists it first; an interrupted evaluation resumed keeps it), or why they are
    absent."""
    suites = list(config.suites)
    if "tofu" not in suites:
        return {}, "model_utility and forget_fluency come from the tofu suite: run --suite tofu,privacy"
    if "privacy" in suites and suites.index("tofu") > suites.index("privacy"):
        return {}, "model_utility and forget_fluency come from the tofu suite, which runs after privacy here: " \
                   "list tofu first in --suite"
    path = out / "TOFU_SUMMARY.json"
    if not path.is_file():
        return {}, f"model_utility and forget_fluency come from the tofu suite: no {path}"
    summary = json.loads(path.read_text())
    inputs = {key: _number_or_none(summary.get(key)) for key in ("model_utility", "forget_fluency")}
    if inputs["forget_fluency"] is None:
        return inputs, f"forget_fluency {summary.get('forget_fluency_missing') or 'not available'}"
    return inputs, None


def _number_or_none(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


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
    (the same keys, or older files' per-sample `sets.forget[].nll_paraphrased`/`nll_perturbed`). The AUCs of the
    other attacks: `read_retain_mia_aucs`."""
    data = _load_logs(path)
    ratios = _ratios(data, path)
    aucs = _mia_aucs(data, path)
    if ratios is None and not aucs:
        raise UserError(f"{path}: no field 'forget_truth_ratio.value_by_index' (OpenUnlearning's layout), "
                        "'sets.forget' (doplus's) or 'mia_min_k.agg_value' (or another attack's mia_*.agg_value): "
                        "not a TOFU_EVAL.json of a retain model")
    return ratios, aucs.get("mia_min_k")


def read_retain_mia_aucs(path: str) -> dict[str, float]:
    """The retain model's AUC of every membership-inference attack its logs hold, attack -> `mia_*.agg_value`
    for each of ALL_ATTACKS present (OpenUnlearning's layout, which doplus's PRIVACY_EVAL.json and
    TOFU_EVAL.json share); {} when none is. An AUC outside [0, 1] is refused."""
    return _mia_aucs(_load_logs(path), path)


def _load_logs(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise UserError(f"{path}: --retain-logs file not found")
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except json.JSONDecodeError as error:
        raise UserError(f"{path}:{error.lineno}: malformed JSON ({error.msg})") from None
    except (ValueError, RecursionError) as error:  # not UTF-8, an integer past Python's digit limit, deep nesting
        raise UserError(f"{path}: not a readable JSON file ({type(error).__name__})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object (a TOFU_EVAL.json)")
    return data


def _mia_aucs(data: dict, path: str) -> dict[str, float]:
    aucs = {}
    for attack in ALL_ATTACKS:
        block = data.get(attack)
        if isinstance(block, dict) and block.get("agg_value") is not None:
            where = f"{path}: field '{attack}.agg_value'"
            value = _number(block["agg_value"], where)
            if not 0 <= value <= 1:
                raise UserError(f"{where} is an AUC, a number in [0, 1], got {value}")
            aucs[attack] = value
    return aucs


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
            para.append(_nll(record["nll_paraphrased"], f"{where}.nll_paraphrased'"))
            options = record["nll_perturbed"]
            if not isinstance(options, list) or not options:
                raise UserError(f"{where}.nll_perturbed' must be a non-empty list of mean NLLs")
            pert.append([_nll(v, f"{where}.nll_perturbed'") for v in options])
        return ou.truth_ratio_scores(para, pert)
    return None


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{where} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:
        raise UserError(f"{where} must be a finite number, got an integer of {len(str(value))} digits") from None
    if not math.isfinite(number):
        raise UserError(f"{where} must be a finite number, got {value!r}")
    return number


def _nll(value: Any, where: str) -> float:
    """A mean token NLL: a finite number >= 0 (so exp(-NLL) lies in (0, 1])."""
    number = _number(value, where)
    if number < 0:
        raise UserError(f"{where} is a mean NLL, a number >= 0, got {number}")
    return number
