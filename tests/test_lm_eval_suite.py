"""run_lm_eval on a tiny random Llama with local lm-eval task YAMLs, fully offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from doplus_cli.errors import UserError
from doplus_cli.evaluation.lm_eval_suite import clean_metric_name, headline_metric, run_lm_eval, suite_tasks

MC_TASK = "doplus_tiny_mc"
GEN_TASK = "doplus_tiny_gen"
MC_DOCS = [
    {"question": "What is the capital of France?", "choices": ["Paris", "London", "Berlin"]},
    {"question": "Which author wrote the novel?", "choices": ["the old man", "a young woman", "nobody", "42"]},
    {"question": "Is the sky blue?", "choices": ["yes", "no"]},
]
GEN_DOCS = [
    {"question": "How many legs does a cat have?", "answer": "4"},
    {"question": "What is two plus two?", "answer": "4"},
    {"question": "How many days are in a week?", "answer": "7"},
]


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    return model, tokenizer


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_task(folder: Path, config: dict) -> None:
    (folder / f"{config['task']}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


STRICT_MATCH = {"name": "strict-match", "filter": [{"function": "regex", "regex_pattern": "(\\d+)"},
                                                   {"function": "take_first"}]}
FLEXIBLE_EXTRACT = {"name": "flexible-extract", "filter": [
    {"function": "regex", "group_select": -1, "regex_pattern": "(-?[$0-9.,]{2,})|(-?[0-9]+)"},
    {"function": "take_first"}]}


def write_gen_task(folder: Path, name: str, filters: list[dict]) -> None:
    """A generation task over GEN_DOCS scored by exact match after each of `filters`."""
    write_task(folder, {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(write_jsonl(folder / "gen.jsonl", GEN_DOCS))}},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "Q: {{question}}\nA:",
        "doc_to_target": "answer",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": 4, "do_sample": False},
        "filter_list": filters,
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 2.0},
    })


def mc_prompt(doc: dict) -> str:
    return f"Question: {doc['question']}\nAnswer:"


@torch.no_grad()
def continuation_logprob(model, tokenizer, context: str, continuation: str) -> float:
    """Sum of the log-probs of the continuation's tokens given the context, from one plain forward pass."""
    context_ids = tokenizer(context)["input_ids"]
    full_ids = tokenizer(context + continuation)["input_ids"]
    assert full_ids[: len(context_ids)] == context_ids, "the continuation must not merge into the context's tokens"
    logprobs = model(torch.tensor([full_ids])).logits[0].float().log_softmax(-1)
    return sum(logprobs[i - 1, full_ids[i]].item() for i in range(len(context_ids), len(full_ids)))


def model_choice(model, tokenizer, doc: dict) -> int:
    """argmax over the choices of loglik(" " + choice | prompt); the best must win by a clear margin."""
    scores = [continuation_logprob(model, tokenizer, mc_prompt(doc), " " + choice) for choice in doc["choices"]]
    ranked = sorted(scores, reverse=True)
    assert ranked[0] - ranked[1] > 1e-3, f"near tie between choices: {scores}"
    return max(range(len(scores)), key=scores.__getitem__)


def test_clean_metric_name_and_headline():
    assert clean_metric_name("acc,none") == "acc"
    assert clean_metric_name("acc_stderr,none") == "acc_stderr"
    assert clean_metric_name("exact_match,strict-match") == "exact_match_strict-match"
    gsm = {"exact_match_flexible-extract": 0.1, "exact_match_strict-match": 0.3, "exact_match_strict-match_stderr": 1}
    assert headline_metric("gsm8k", gsm) == ("exact_match_strict-match", 0.3)
    assert headline_metric("arc_challenge", {"acc": 0.2, "acc_norm": 0.4}) == ("acc_norm", 0.4)
    assert headline_metric("triviaqa", {"exact_match_remove_whitespace": 0.5}) == ("exact_match_remove_whitespace", 0.5)
    assert headline_metric("other", {"f1_stderr": 0.1, "f1": 0.7}) == ("f1", 0.7)


def test_run_lm_eval_local_tasks(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    model.eval()
    # Gold labels from the model's own argmax: right on the first doc, wrong on the second, so acc must be 1/2.
    choices = [model_choice(model, tokenizer, doc) for doc in MC_DOCS[:2]]
    labels = [choices[0], (choices[1] + 1) % len(MC_DOCS[1]["choices"]), 0]
    expected_acc = sum(label == choice for label, choice in zip(labels, choices)) / 2
    assert expected_acc == 0.5
    mc_rows = [doc | {"label": label} for doc, label in zip(MC_DOCS, labels)]
    write_task(tmp_path, {
        "task": MC_TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(write_jsonl(tmp_path / "mc.jsonl", mc_rows))}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0},
    })
    write_gen_task(tmp_path, GEN_TASK, [STRICT_MATCH])
    model.train()
    first_weight = next(model.parameters()).detach().clone()
    rng_state = torch.random.get_rng_state()

    result = run_lm_eval(model, tokenizer, [MC_TASK, GEN_TASK], limit=2, batch_size=4, include_path=tmp_path,
                         max_new_tokens=3)

    assert model.training and next(model.parameters()).device == first_weight.device
    assert torch.equal(next(model.parameters()), first_weight)
    assert torch.equal(torch.random.get_rng_state(), rng_state)
    assert set(result) >= {"tasks", "summary", "headline", "limit", "versions", "n_samples"}
    assert result["limit"] == 2
    assert result["n_samples"] == {MC_TASK: 2, GEN_TASK: 2}
    assert set(result["tasks"]) == {MC_TASK, GEN_TASK}
    assert set(result["versions"]) >= {MC_TASK, GEN_TASK}

    mc = result["tasks"][MC_TASK]
    assert "acc" in mc and "acc_stderr" in mc and not any("," in name for name in mc)
    assert 0.0 <= mc["acc"] <= 1.0
    assert mc["acc"] == pytest.approx(expected_acc)
    gen = result["tasks"][GEN_TASK]
    assert "exact_match_strict-match" in gen and 0.0 <= gen["exact_match_strict-match"] <= 1.0

    assert result["summary"][f"lmeval_{MC_TASK}_acc"] == mc["acc"]
    assert f"lmeval_{GEN_TASK}_exact_match_strict-match" in result["summary"]
    assert not any("stderr" in key for key in result["summary"])
    assert result["headline"][MC_TASK] == ("acc", mc["acc"])
    assert result["headline"][GEN_TASK] == ("exact_match_strict-match", gen["exact_match_strict-match"])
    json.dumps(result)  # written as LM_EVAL.json by `doplus evaluate`


# What the DualOptim+ code's real_world_eval.py runs and reads: `lm_eval --model hf --model_args
# pretrained=...,add_bos_token=True --tasks arc_challenge,truthfulqa_mc1,mmlu,triviaqa,gsm8k`, then
# results[task][key] for these keys.
AUTHORS_KEYS = {"arc_challenge": "acc_norm,none", "mmlu": "acc,none", "truthfulqa_mc1": "acc,none",
                "triviaqa": "exact_match,remove_whitespace", "gsm8k": "exact_match,flexible-extract"}


def test_the_paper_protocol_runs_the_authors_tasks_and_reports_their_metric_keys():
    from doplus_cli.evaluation.runner import resolve_eval_config
    from doplus_cli.evaluation.suite_api import EvalConfig

    assert set(suite_tasks(EvalConfig(protocol="paper"))) == set(AUTHORS_KEYS)
    assert suite_tasks(EvalConfig()) == ("arc_challenge", "mmlu", "truthfulqa_mc2", "triviaqa", "gsm8k")
    assert suite_tasks(EvalConfig(tasks=("mmlu",), protocol="paper")) == ("mmlu",)  # --tasks given: those
    options = {"dtype": "auto", "suite": "lm-eval", "tasks": None, "protocol": "paper"}
    assert resolve_eval_config(options).tasks == ()  # not given: the protocol's
    from doplus_cli.evaluation.protocol import PROTOCOLS

    for task, key in AUTHORS_KEYS.items():  # lm-eval's "metric,filter" key, cleaned, is the paper's headline
        metrics = {clean_metric_name(k): 0.1 * i for i, k in enumerate(
            ["acc,none", "acc_norm,none", "exact_match,strict-match", "exact_match,flexible-extract",
             "exact_match,remove_whitespace"])}
        name, value = headline_metric(task, metrics, PROTOCOLS["paper"].lm_eval.headline)
        assert name == clean_metric_name(key) and value == metrics[name]
    gsm = {"exact_match_strict-match": 0.3, "exact_match_flexible-extract": 0.5}
    assert headline_metric("gsm8k", gsm)[0] == "exact_match_strict-match"  # doplus's default is another filter


def test_the_paper_protocol_reaches_lm_eval_with_the_bos_token_and_its_filter(model_and_tokenizer, tmp_path,
                                                                              monkeypatch):
    """A local task named gsm8k (it replaces lm-eval's own) with both of GSM8K's filters: the paper protocol reports
    flexible-extract, doplus's strict-match, from one lm-eval run each; lm-eval's HFLM is told to prepend BOS under
    the paper's protocol only."""
    import lm_eval.models.huggingface as huggingface

    model, tokenizer = model_and_tokenizer
    write_gen_task(tmp_path, "gsm8k", [STRICT_MATCH, FLEXIBLE_EXTRACT])
    seen = []

    class Recording(huggingface.HFLM):
        def __init__(self, *args, **kwargs):
            seen.append(kwargs.get("add_bos_token", "not passed"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(huggingface, "HFLM", Recording)
    headlines = {protocol: run_lm_eval(model, tokenizer, ["gsm8k"], limit=2, include_path=tmp_path,
                                       protocol=protocol)["headline"]["gsm8k"][0] for protocol in ("paper", "doplus")}
    assert headlines == {"paper": "exact_match_flexible-extract", "doplus": "exact_match_strict-match"}
    assert seen == [True, "not passed"]


def test_unknown_task_is_a_user_error(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    with pytest.raises(UserError, match="no_such_task_xyz") as info:
        run_lm_eval(model, tokenizer, ["no_such_task_xyz"], limit=2)
    assert "--lm-eval-include" in str(info.value) and "\n" not in str(info.value)


def test_dataset_unreachable_offline_is_a_user_error(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    write_task(tmp_path, {
        "task": "doplus_tiny_hub",
        "dataset_path": "doplus-test-org/no-such-dataset",
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    })
    with pytest.raises(UserError, match="doplus_tiny_hub") as info:
        run_lm_eval(model, tokenizer, ["doplus_tiny_hub"], limit=2, include_path=str(tmp_path))
    message = str(info.value)
    assert "offline" in message and "cache" in message and "\n" not in message
