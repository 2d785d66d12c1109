"""`doplus evaluate` end to end on a tiny model: TOFU and real-world suites, missing judge models, the
batched NLLs against one-sample computations, --compare, evaluation during training, bad input."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForSequenceClassification

from doplus_cli.data.formatting import IGNORE_INDEX, PromptFormatter
from tests.helpers import run_cli, write_parity_task


@pytest.fixture(scope="module")
def tiny_nli(tiny_llama, tmp_path_factory):
    """A tiny random 3-way sequence classifier with NLI labels (stands in for the DeBERTa NLI model)."""
    folder = tmp_path_factory.mktemp("tiny-nli")
    config = AutoConfig.from_pretrained(tiny_llama)
    config.num_labels = 3
    config.id2label = {0: "entailment", 1: "neutral", 2: "contradiction"}
    config.label2id = {v: k for k, v in config.id2label.items()}
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(folder)
    return folder


def test_tofu_suite_without_an_nli_model_says_what_the_aggregates_cover(tiny_llama, tofu_dir, tmp_path, capsys):
    out = tmp_path / "eval"
    code = run_cli("evaluate", "--model", tiny_llama, "--data-dir", tofu_dir, "--max-samples", 3,
                   "--max-new-tokens", 6, "--out", out, "--nli-model", tmp_path / "no-such-nli")
    assert code == 0
    summary = json.loads((out / "TOFU_SUMMARY.json").read_text())
    for key in ("forget_Q_A_ROUGE", "forget_Q_A_Prob", "forget_truth_ratio", "retain_Q_A_Prob",
                "ra_Q_A_Prob_normalised", "wf_Truth_Ratio", "forget_Token_Entropy", "retain_Cosine_Similarity",
                "MU", "UFE", "TFE"):
        assert key in summary
    assert summary["forget_Entailment_Score"] is None and summary["retain_Entailment_Score"] is None
    assert summary["retain_Cosine_Similarity"] is not None  # the packaged embedding model works offline
    report = (out / "report.md").read_text()
    assert "no NLI model" in report and "MU over 15 of 18 values: no NLI model" in report
    assert "UFE over 4 of 5 indicators: no NLI model" in report
    assert "MU over 15 of 18" in capsys.readouterr().out
    per_sample = json.loads((out / "TOFU_EVAL.json").read_text())["sets"]
    assert [len(per_sample[s]) for s in ("forget", "retain", "real_authors", "world_facts")] == [3, 3, 3, 3]
    first = per_sample["forget"][0]
    assert {"question", "generation", "rouge_l_recall", "nll_answer", "nll_perturbed", "truth_ratio",
            "entailment_label", "rejection"} <= set(first)
    # the summary is the mean of the per-sample values it came from
    probs = [math.exp(-r["nll_answer"]) for r in per_sample["retain"]]
    assert summary["retain_Q_A_Prob"] == pytest.approx(sum(probs) / 3)
    ratios = [r["truth_ratio"] for r in per_sample["forget"]]
    assert summary["forget_truth_ratio"] == pytest.approx(sum(min(r, 1 / r) for r in ratios) / 3)


def test_batched_nlls_equal_one_sample_at_a_time(tiny_llama, tofu_dir, tmp_path):
    out = tmp_path / "eval"
    assert run_cli("evaluate", "--model", tiny_llama, "--data-dir", tofu_dir, "--max-samples", 4,
                   "--max-new-tokens", 2, "--out", out, "--batch-size", 3) == 0
    records = json.loads((out / "TOFU_EVAL.json").read_text())["sets"]["retain"]
    rows = [json.loads(line) for line in open(tofu_dir / "retain_perturbed.json")][:4]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    formatter = PromptFormatter(AutoTokenizer.from_pretrained(tiny_llama), max_length=512)
    for record, row in zip(records, rows):
        for answer, value in [(row["answer"], record["nll_answer"])] + list(zip(row["perturbed_answer"],
                                                                                 record["nll_perturbed"])):
            encoded = formatter.encode(row["question"], answer)
            ids = torch.tensor([encoded.input_ids])
            with torch.no_grad():
                log_probs = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
            nlls = [-log_probs[t, encoded.labels[t + 1]].item() for t in range(len(encoded.labels) - 1)
                    if encoded.labels[t + 1] != IGNORE_INDEX]
            assert value == pytest.approx(sum(nlls) / len(nlls), rel=1e-4)


def test_with_an_nli_model_every_indicator_and_aggregate_is_computed(tiny_llama, tiny_nli, tofu_dir, tmp_path):
    out = tmp_path / "eval"
    started = time.perf_counter()
    assert run_cli("evaluate", "--model", tiny_llama, "--data-dir", tofu_dir, "--max-samples", 2,
                   "--max-new-tokens", 4, "--out", out, "--nli-model", tiny_nli, "--targeted") == 0
    elapsed = time.perf_counter() - started
    summary = json.loads((out / "SUMMARY.json").read_text())
    assert summary.pop("forget_quality") is None  # no --retain-logs: absent, by design
    assert summary.pop("forget_fluency") is None  # no gibberish classifier offline: its reason is said
    assert summary.pop("forget_fluency_missing").startswith("not available: ")
    assert all(value is not None for value in summary.values())
    assert "OVR" in summary and "OVR_targeted" not in summary
    labels = [r["entailment_label"] for r in json.loads((out / "TOFU_EVAL.json").read_text())["sets"]["retain"]]
    assert set(labels) <= {"entailment", "neutral", "contradiction"}
    record = json.loads((out / "eval.json").read_text())
    aggregates = {a["name"]: a for a in record["sections"][0]["aggregates"]}
    assert aggregates["MU"]["note"] == "" and len(aggregates["MU"]["used"]) == 18
    # OVR (targeted) = 0.25 (TFE + UFE) + 0.5 MU, from the summary's own aggregates
    assert summary["OVR"] == pytest.approx(0.25 * (summary["TFE"] + summary["UFE"]) + 0.5 * summary["MU"])
    sets = record["sections"][0]["sets"]  # per-set seconds: generating, scoring NLLs, judge models
    assert [s["name"] for s in sets] == ["forget", "retain", "real_authors", "world_facts"]
    assert all(set(s["seconds"]) == {"generation", "scoring", "judges"} for s in sets)
    # seconds measured, not placeholders: each phase took some time, and together no more than the whole call
    assert all(s["seconds"]["generation"] > 0 and s["seconds"]["scoring"] > 0 and s["seconds"]["judges"] > 0
               for s in sets)
    assert sum(sum(s["seconds"].values()) for s in sets) <= elapsed
    assert "Per set: forget (2 questions): generation" in (out / "report.md").read_text()


def test_real_world_suite(tiny_llama, tmp_path):
    def rows(names):
        return "".join(json.dumps({
            "name": n, "question": f"Where was {n} born?", "answer": f"{n} was born in Paris.",
            "paraphrased_answer": f"Paris is where {n} was born.",
            "perturbed_answer": [f"{n} was born in Rome.", f"{n} was born in Oslo."], "task_id": i,
        }) + "\n" for i, n in enumerate(names))

    forget, retain = tmp_path / "forget.jsonl", tmp_path / "neighbours.jsonl"
    forget.write_text(rows(["Ada Lovelace", "Alan Turing"]))
    retain.write_text(rows(["Grace Hopper", "John von Neumann", "Emmy Noether"]))
    out = tmp_path / "rw"
    assert run_cli("evaluate", "--model", tiny_llama, "--suite", "real-world", "--forget", forget, "--retain", retain,
                   "--max-new-tokens", 4, "--out", out, "--untargeted", "--nli-model", tmp_path / "no-such-nli") == 0
    summary = json.loads((out / "REAL_WORLD_SUMMARY.json").read_text())
    records = json.loads((out / "REAL_WORLD_EVAL.json").read_text())["sets"]
    assert len(records["forget"]) == 2 and len(records["neighbour"]) == 3
    assert records["neighbour"][2]["name"] == "Emmy Noether"
    assert "MU over 5 of 6 values: no NLI model" in (out / "report.md").read_text()
    assert summary["neighbour_Probability"] == pytest.approx(
        sum(math.exp(-r["nll_answer"]) for r in records["neighbour"]) / 3)


def test_compare_puts_runs_side_by_side(tiny_llama, tofu_dir, tmp_path, capsys):
    """Two different evaluations (one and two questions per set): each column holds its own folder's values."""
    for name, samples in (("one", 1), ("two", 2)):
        assert run_cli("evaluate", "--model", tiny_llama, "--data-dir", tofu_dir, "--max-samples", samples,
                       "--max-new-tokens", 2, "--out", tmp_path / name) == 0
    summaries = [json.loads((tmp_path / name / "SUMMARY.json").read_text()) for name in ("two", "one")]
    capsys.readouterr()
    assert run_cli("evaluate", "--compare", tmp_path / "two", tmp_path / "one") == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert lines[0].replace(" ", "") == "|metric|two|one|"
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])}
    assert list(rows)[0] == "MU" and "forget_Q_A_ROUGE" in rows
    differing = 0
    for key, cells in rows.items():
        for cell, summary in zip(cells, summaries):
            value = summary[key]
            if value is None:
                assert cell == "n/a", key
            elif isinstance(value, float):
                assert float(cell) == pytest.approx(value, rel=1e-3, abs=1e-12), key
            else:
                assert cell == str(value), key
        differing += isinstance(summaries[0][key], float) and summaries[0][key] != pytest.approx(
            summaries[1][key], rel=1e-2)
    assert differing >= 5  # the two evaluations differ, so swapped columns would fail above


def test_unlearn_evaluates_during_training(tiny_llama, tofu_dir, tmp_path):
    forget = tmp_path / "f.jsonl"
    forget.write_text("".join(line for line in list(open(tofu_dir / "forget01.json"))[:6]))
    out = tmp_path / "run"
    assert run_cli("unlearn", "--model", tiny_llama, "--forget", forget, "--loss", "GA", "--steps", 4,
                   "--eval-every", 2, "--eval-data-dir", tofu_dir, "--eval-max-samples", 1,
                   "--eval-max-new-tokens", 2, "--out", out, "--show-samples", 0) == 0
    assert (out / "evals" / "step-2" / "TOFU_SUMMARY.json").is_file()
    assert (out / "evals" / "step-4" / "TOFU_SUMMARY.json").is_file()
    report = json.loads((out / "report.json").read_text())
    assert [e["step"] for e in report["evals"]] == [2, 4]
    step4 = json.loads((out / "evals" / "step-4" / "SUMMARY.json").read_text())
    assert report["evals"][1]["UFE"] == pytest.approx(step4["UFE"])
    assert "Evaluations during training" in (out / "report.md").read_text()


@pytest.mark.parametrize(
    "case,needle",
    [
        ("missing_dir", "forget10_perturbed.json: file not found"),
        ("malformed", "forget10_perturbed.json:2: malformed JSON"),
        ("missing_field", "retain_perturbed.json:1: missing field 'paraphrased_answer'"),
        ("unknown_suite", "unknown suite 'tofuu'"),
        ("no_tokenizer", "cannot load a tokenizer"),
        ("compare_one", "--compare needs at least two evaluation folders"),
    ],
)
def test_bad_input_is_one_line_with_exit_code_2(tiny_llama, tofu_dir, tmp_path, capsys, case, needle):
    data = tmp_path / "tofu"
    data.mkdir()
    for name in ("forget10_perturbed", "retain_perturbed", "real_authors_perturbed", "world_facts_perturbed"):
        (data / f"{name}.json").write_text("".join(list(open(tofu_dir / f"{name}.json"))[:2]))
    model = tiny_llama
    args = ["evaluate", "--data-dir", data, "--max-samples", 1, "--max-new-tokens", 2, "--out", tmp_path / "o"]
    if case == "missing_dir":
        args[2] = tmp_path / "nowhere"
    elif case == "malformed":
        (data / "forget10_perturbed.json").write_text(open(tofu_dir / "forget10_perturbed.json").readline() + "{oops\n")
        args[4] = 5
    elif case == "missing_field":
        row = json.loads(open(tofu_dir / "retain_perturbed.json").readline())
        del row["paraphrased_answer"]
        (data / "retain_perturbed.json").write_text(json.dumps(row) + "\n")
    elif case == "unknown_suite":
        args += ["--suite", "tofuu"]
    elif case == "no_tokenizer":
        model = tmp_path / "bare"
        AutoModelForCausalLM.from_pretrained(tiny_llama).save_pretrained(model)
    elif case == "compare_one":
        args = ["evaluate", "--compare", tmp_path]
    capsys.readouterr()
    code = run_cli(*args, *(["--model", model] if case != "compare_one" else []))
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and err.count("\n") == 0 and "Traceback" not in err


@pytest.mark.processes
def test_tofu_and_lm_eval_in_one_call(tiny_llama, tofu_dir, tmp_path):
    tasks = write_parity_task(tmp_path / "tasks")
    out = tmp_path / "both"
    assert run_cli("evaluate", "--model", tiny_llama, "--suite", "tofu,lm-eval", "--data-dir", tofu_dir,
                   "--max-samples", 1, "--max-new-tokens", 2, "--tasks", "tiny_parity", "--limit", 3,
                   "--lm-eval-include", tasks, "--out", out) == 0
    summary = json.loads((out / "SUMMARY.json").read_text())
    assert "MU" in summary
    assert summary["lmeval_tiny_parity_acc"] == pytest.approx(parity_accuracy(tiny_llama, 3))
    assert json.loads((out / "LM_EVAL.json").read_text())["n_samples"]["tiny_parity"] == 3
    assert "## lm-eval" in (out / "report.md").read_text()


def parity_accuracy(model_dir, limit: int) -> float:
    """tiny_parity's accuracy computed here: for each of the first `limit` questions, the choice (" yes" or " no"
    after the prompt) whose tokens the model gives the larger summed log-probability, against the label (lm-eval's
    multiple-choice `acc`; its HF model encodes without special tokens and splits prompt and choice as below)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    correct = 0
    for n in range(limit):
        context = f"Question: Is {n} even?\nAnswer:"
        scores = []
        for choice in (" yes", " no"):
            whole = tokenizer(context + choice, add_special_tokens=False).input_ids
            start = len(tokenizer(context, add_special_tokens=False).input_ids)
            with torch.no_grad():
                log_probs = torch.log_softmax(model(input_ids=torch.tensor([whole])).logits[0].double(), dim=-1)
            scores.append(sum(log_probs[t - 1, whole[t]].item() for t in range(start, len(whole))))
        correct += int(scores.index(max(scores)) == n % 2)
    return correct / limit
