"""The MUSE suite and MUSE's training data: each metric against a reference written here (rouge-score configured
as MUSE's RougeEvalLogger, Min-K% and the AUC by hand, PrivLeak's formula by hand, a plain float64 scoring loop,
a hand-written greedy decoder), the suite end to end on the tiny model and a MUSE-layout folder written here, the
hub path through `datasets` on a local copy in the hub's layout, the training windows, and bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from doplus_cli.data.batches import build_batch
from doplus_cli.data.formatting import IGNORE_INDEX, PromptFormatter
from doplus_cli.data.muse import TextWindows, muse_rows, window_ids
from doplus_cli.data.sources import open_source, parse_hub_spec
from doplus_cli.evaluation import muse
from tests.helpers import greedy_by_hand, run_cli, write_jsonl

PLACES = ["Aldwick", "Brenmoor", "Caddle Cross", "Dunhallow", "Eskerby", "Fallowmere", "Greywick", "Harrowgate"]
TRADES = ["salt", "wool", "copper", "rye", "flax", "amber", "timber", "honey"]


def town_text(i: int) -> str:
    """A made-up paragraph about an invented town (nothing copied from a corpus)."""
    place, trade = PLACES[i % len(PLACES)], TRADES[(3 * i) % len(TRADES)]
    return (f"The river town of {place} traded {trade} every autumn. Its council of {i + 3} elders met in the "
            f"old mill, and the bridge over the river was rebuilt in the year {1700 + 13 * i}.")


def write_muse_folder(folder, n: int = 4):
    """A small folder in MUSE's layout (`<config>/<split>.jsonl`, the hub's field names)."""
    rows = {
        ("verbmem", "forget"): [{"prompt": town_text(i)[:40], "gt": town_text(i)[40:]} for i in range(n)],
        ("knowmem", "forget_qa"): [{"question": f"What did {PLACES[i]} trade?", "answer": TRADES[(3 * i) % 8]}
                                   for i in range(n)],
        ("knowmem", "forget_qa_icl"): [{"question": "Where did the elders meet?", "answer": "in the old mill"}],
        ("knowmem", "retain_qa"): [{"question": f"How many elders had {PLACES[i + 4]}?", "answer": str(i + 7)}
                                   for i in range(n)],
        ("knowmem", "retain_qa_icl"): [{"question": "What was rebuilt?", "answer": "the bridge"},
                                       {"question": "When was it traded?", "answer": "every autumn"}],
        ("privleak", "forget"): [{"text": town_text(i)} for i in range(n)],
        ("privleak", "retain"): [{"text": town_text(i + 10)} for i in range(n)],
        ("privleak", "holdout"): [{"text": town_text(i + 20)} for i in range(n + 1)],
        ("raw", "forget"): [{"text": town_text(i)} for i in range(n)],
        ("raw", "retain1"): [{"text": town_text(i + 10)} for i in range(n)],
    }
    for (config, split), content in rows.items():
        (folder / config).mkdir(parents=True, exist_ok=True)
        write_jsonl(folder / config / f"{split}.jsonl", content)
    return folder, rows


# ------------------------------------------------------------------------------------------------ the metrics


def lcs(a: list[str], b: list[str]) -> int:
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            table[i + 1][j + 1] = table[i][j] + 1 if x == y else max(table[i][j + 1], table[i + 1][j])
    return table[-1][-1]


def test_rouge_is_rouge_score_configured_as_muse_without_stemming():
    from rouge_score import rouge_scorer

    # MUSE's RougeEvalLogger: these four types, no stemmer; scored (gt, output)
    reference = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=False)
    pairs = [("The cat sat on the mat", "the cat on a mat"), ("cats were running home", "cat was run home"),
             ("Salt, wool and copper.", ""), ("one two three", "three two one")]
    for truth, generation in pairs:
        got = muse.rouge_scores(truth, generation)
        want = reference.score(truth, generation)
        assert got["rougeL_f1"] == want["rougeL"].fmeasure and got["rougeL_recall"] == want["rougeL"].recall
        assert got["rouge1_f1"] == want["rouge1"].fmeasure and got["rouge1_recall"] == want["rouge1"].recall
    # by hand: LCS("the cat sat on the mat", "the cat on a mat") = "the cat on mat" = 4 words
    p, r = 4 / 5, 4 / 6
    assert muse.rouge_scores(*pairs[0])["rougeL_f1"] == pytest.approx(2 * p * r / (p + r), abs=1e-12)
    # no stemming: only "home" matches ("cats"/"cat", "running"/"run" differ), so recall 1/4, precision 1/4
    assert muse.rouge_scores(*pairs[1])["rougeL_recall"] == pytest.approx(1 / 4, abs=1e-12)
    assert muse.rouge_scores(*pairs[1])["rouge1_f1"] == pytest.approx(1 / 4, abs=1e-12)
    assert lcs("one two three".split(), "three two one".split()) == 1
    assert muse.rouge_scores(*pairs[3])["rougeL_f1"] == pytest.approx(1 / 3, abs=1e-12)


def test_knowmem_prompt_and_answer_cut_as_muse_writes_them():
    icl = [{"question": "Q1?", "answer": "A1"}, {"question": "Q2?", "answer": "A2"}]
    assert muse.knowmem_prompt(icl, "Q3?") == ("Question: Q1?\nAnswer: A1\n\nQuestion: Q2?\nAnswer: A2\n\n"
                                               "Question: Q3?\nAnswer: ")
    assert muse.knowmem_prompt([], "Q?") == "Question: Q?\nAnswer: "
    assert muse.cut_answer("copper\n\nQuestion: next") == "copper"
    assert muse.cut_answer("copper and salt\nQuestion: next") == "copper and salt"
    assert muse.cut_answer("wool Question: x") == "wool "
    assert muse.cut_answer("\n\nwool") == ""  # the first piece, even when empty
    assert muse.cut_answer("plain answer") == "plain answer"


def test_min_k_auc_and_privleak_by_hand():
    # Min-40%: the lowest int(0.4 n) log-probabilities, negated and averaged
    assert muse.min_k_score([-0.1, -2.0, -0.5, -3.0, -1.0]) == pytest.approx(2.5)
    assert muse.min_k_score([-0.2, -0.4, -0.9, -0.1, -0.3, -0.6, -0.7, -0.8, -0.5, -1.1]) == pytest.approx(
        (1.1 + 0.9 + 0.8 + 0.7) / 4)
    assert muse.min_k_score([-0.7, -0.2]) == pytest.approx(0.7)  # int(0.8) = 0: at least one token
    forget = [0.5, 1.0, 2.0]
    holdout = [1.0, 3.0, 4.0, 0.2]
    # MUSE's orientation: P(holdout scores lower than forget), ties one half, over the 12 pairs
    pairs = [(f, h) for f in forget for h in holdout]
    by_hand = sum(1.0 if h < f else 0.5 if h == f else 0.0 for f, h in pairs) / len(pairs)
    assert by_hand == pytest.approx(4.5 / 12)
    assert muse.muse_auc(forget, holdout) == pytest.approx(by_hand, abs=1e-12)
    from doplus_cli.evaluation.openunlearning import mia_auc

    assert mia_auc(forget, holdout) == pytest.approx(1 - by_hand, abs=1e-12)  # OpenUnlearning's orientation
    # PrivLeak = (AUC - AUC_retrained) / AUC_retrained * 100, MUSE's published retrained AUCs
    assert muse.privleak(by_hand, 0.4772) == pytest.approx((4.5 / 12 - 0.4772) / 0.4772 * 100, abs=1e-9)
    assert muse.privleak(0.4772, 0.4772) == 0.0
    assert muse.privleak(0.0, muse.MUSE_RETRAINED_AUC["news"]) == pytest.approx(-100.0)
    assert muse.MUSE_RETRAINED_AUC == {"news": 0.4772, "books": 0.5393}


def test_scored_tokens_match_a_plain_float64_loop(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    texts = [town_text(0), town_text(5)[:30], town_text(9) + " " + town_text(2)]
    sequences = [tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]
    starts = [1, 3, 1]
    got = muse.scored_tokens(model, sequences, starts)
    for sequence, start, (log_probs, predicted) in zip(sequences, starts, got):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([sequence])).logits[0].double()
        want = [float(torch.log_softmax(logits[t - 1], -1)[sequence[t]]) for t in range(start, len(sequence))]
        assert log_probs == pytest.approx(want, abs=1e-5)
        assert predicted == [int(logits[t - 1].argmax()) for t in range(start, len(sequence))]
    scores = muse.min_k_scores(model, tokenizer, texts)
    for score, (log_probs, _) in zip(scores, muse.scored_tokens(model, sequences, [1, 1, 1])):
        lowest = sorted(log_probs)[:max(1, int(0.4 * len(log_probs)))]
        assert score == pytest.approx(-sum(lowest) / len(lowest), abs=1e-9)


# ------------------------------------------------------------------------------------------- the suite, end to end


def test_muse_suite_end_to_end_on_a_local_folder(tiny_llama, tmp_path, monkeypatch):
    # MUSE's budgets, shortened here so that the tiny model's decoding stays cheap; the suite reads them at run time
    assert (muse.VERBMEM_TOKENS, muse.KNOWMEM_TOKENS) == (128, 32)
    monkeypatch.setattr(muse, "VERBMEM_TOKENS", 24)
    monkeypatch.setattr(muse, "KNOWMEM_TOKENS", 12)
    folder, rows = write_muse_folder(tmp_path / "muse")
    out = tmp_path / "eval"
    assert run_cli("evaluate", "--model", tiny_llama, "--suite", "muse", "--muse-data", folder, "--out", out,
                   "--batch-size", 2, "--max-samples", 3) == 0
    logs = json.loads((out / "MUSE_EVAL.json").read_text())
    summary = json.loads((out / "SUMMARY.json").read_text())
    record = json.loads((out / "eval.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    raw = PromptFormatter(tokenizer, max_length=2048, template="{question}")

    # VerbMem: every row's greedy continuation (checked against a hand-written decoder on the first), the gt cut to
    # its first VERBMEM_TOKENS tokens, ROUGE-L F1 recomputed from the written texts
    verbmem = logs["forget_verbmem_ROUGE"]["value_by_index"]
    assert len(verbmem) == 3
    first = rows[("verbmem", "forget")][0]
    by_hand = greedy_by_hand(model, raw, first["prompt"], muse.VERBMEM_TOKENS)
    assert verbmem["0"]["generation"] == tokenizer.decode(by_hand, skip_special_tokens=True)
    assert verbmem["0"]["ground_truth"] == tokenizer.decode(
        tokenizer(first["gt"])["input_ids"][:24], skip_special_tokens=True)
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    for key, set_rows in (("forget_verbmem_ROUGE", None), ("forget_knowmem_ROUGE", ("knowmem", "forget_qa")),
                          ("retain_knowmem_ROUGE", ("knowmem", "retain_qa"))):
        entries = logs[key]["value_by_index"]
        f1 = [scorer.score(e["ground_truth"], e["generation"])["rougeL"].fmeasure for e in entries.values()]
        assert logs[key]["agg_value"] == pytest.approx(sum(f1) / len(f1), abs=1e-12)
        assert summary[key] == logs[key]["agg_value"]
        if set_rows is not None:
            assert [e["ground_truth"] for e in entries.values()] == [r["answer"] for r in rows[set_rows][:3]]
    # KnowMem: the generation after MUSE's in-context prefix, cut at its stop strings
    question = rows[("knowmem", "retain_qa")][1]["question"]
    prompt = muse.knowmem_prompt(rows[("knowmem", "retain_qa_icl")], question)
    text = tokenizer.decode(greedy_by_hand(model, raw, prompt, muse.KNOWMEM_TOKENS), skip_special_tokens=True)
    assert logs["retain_knowmem_ROUGE"]["value_by_index"]["1"]["generation"] == muse.cut_answer(text)

    # PrivLeak: per-text Min-40% scores, MUSE's AUC by hand from them, MUSE's retrained AUC for news
    forget = [e["score"] for e in logs["mia_min_k"]["forget"]["value_by_index"].values()]
    holdout = [e["score"] for e in logs["mia_min_k"]["holdout"]["value_by_index"].values()]
    assert len(forget) == 3 and len(holdout) == 3
    sequence = tokenizer(rows[("privleak", "holdout")][2]["text"])["input_ids"]
    with torch.no_grad():
        log_probs = torch.log_softmax(model(input_ids=torch.tensor([sequence])).logits[0].double(), -1)
    token_lp = sorted(float(log_probs[t - 1, sequence[t]]) for t in range(1, len(sequence)))
    lowest = token_lp[:int(0.4 * len(token_lp))]
    assert holdout[2] == pytest.approx(-sum(lowest) / len(lowest), abs=1e-5)
    auc = sum(1.0 if h < f else 0.5 if h == f else 0.0 for f in forget for h in holdout) / 9
    assert logs["mia_min_k"]["muse_auc"] == pytest.approx(auc, abs=1e-12)
    assert summary["muse_mia_min_k"] == pytest.approx(1 - auc, abs=1e-12)
    assert summary["muse_privleak"] == pytest.approx((auc - 0.4772) / 0.4772 * 100, abs=1e-9)
    assert summary["muse_verbmem_f"] == pytest.approx(100 * summary["forget_verbmem_ROUGE"])
    assert 0 <= summary["muse_extraction_strength"] <= 1
    section = next(s for s in record["sections"] if s["suite"] == "muse")
    assert set(muse.OU_KEYS) <= set(section["values"]) and section["muse"]["auc_retrained"] == 0.4772
    report = (out / "report.md").read_text()
    assert "## MUSE (news" in report and "- prompt template:" not in report  # MUSE feeds raw text
    from doplus_cli.evaluation.privacy import read_retain_logs

    # this MUSE_EVAL.json, as another evaluation's --retain-logs, gives privleak's reference AUC
    assert read_retain_logs(str(out / "MUSE_EVAL.json")) == (None, summary["muse_mia_min_k"])



def test_privleak_reference_from_a_retrained_model_retain_logs_or_muse_constants(tiny_llama):
    from types import SimpleNamespace

    def context(retain_auc, corpus_logs=None, retrained=None):
        config = SimpleNamespace(muse_retrained=retrained, retain_logs=corpus_logs, dtype="float32",
                                 trust_remote_code=False)
        return SimpleNamespace(config=config, retain=(None, retain_auc), model=torch.nn.Linear(1, 1))

    # a retrained model given: its own Min-40% AUC on the same texts, whatever else is given
    forget, holdout = [town_text(i) for i in range(3)], [town_text(i + 20) for i in range(3)]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    want = muse.muse_auc(muse.min_k_scores(model, tokenizer, forget), muse.min_k_scores(model, tokenizer, holdout))
    auc, where = muse.reference_auc(context(0.3, "x.json", str(tiny_llama)), "news", forget, holdout)
    assert auc == pytest.approx(want, abs=1e-12) and str(tiny_llama) in where

    # a retrained model's MUSE_EVAL.json holds mia_min_k in OpenUnlearning's orientation: MUSE's is 1 - it
    auc, where = muse.reference_auc(context(0.3, "retrained/MUSE_EVAL.json"), "news", [], [])
    assert auc == pytest.approx(0.7) and "retrained/MUSE_EVAL.json" in where
    assert muse.reference_auc(context(None), "books", [], [])[0] == 0.5393
    assert muse.reference_auc(context(None), "news", [], [])[0] == 0.4772


def write_hub_copy(folder, rows):
    """A local copy of a hub dataset repository in MUSE's layout: parquet files per config and split, and the
    README's `configs` metadata that tells `datasets` which files make which split."""
    import datasets

    configs: dict[str, list[str]] = {}
    for (config, split), content in rows.items():
        (folder / config).mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_list(content).to_parquet(str(folder / config / f"{split}-00000-of-00001.parquet"))
        configs.setdefault(config, []).append(split)
    lines = ["---", "configs:"]
    for config, splits in configs.items():
        lines += [f"- config_name: {config}", "  data_files:"]
        lines += [f"  - split: {split}\n    path: {config}/{split}-*" for split in splits]
    (folder / "README.md").write_text("\n".join(lines + ["---", ""]))
    return folder


def test_hub_path_reads_a_local_copy_in_the_hub_layout_through_datasets(tmp_path, capsys):
    local, rows = write_muse_folder(tmp_path / "local")
    hub = write_hub_copy(tmp_path / "hub", rows)
    for (config, split), content in rows.items():
        got, where = muse_rows(f"hf:{hub}", config, split)
        assert got == [{k: r[k] for k in got[0]} for r in content] and where == f"hf:{hub}:{config}@{split}"
        assert muse_rows(str(local), config, split)[0] == got
    assert muse_rows(f"hf:{hub}", "privleak", "holdout", max_rows=2)[0] == rows[("privleak", "holdout")][:2]
    # the training source: MUSE's `:raw/forget` spelling and doplus's `:raw@forget` name the same rows
    assert parse_hub_spec("hf:muse-bench/MUSE-News:raw/forget") == ("muse-bench/MUSE-News", "raw", "forget")
    source = open_source(f"hf:{hub}:raw/forget", "forget")
    assert [source[i].text for i in range(len(source))] == [r["text"] for r in rows[("raw", "forget")]]
    # a column missing on the hub: one line naming it
    broken = dict(rows)
    broken[("verbmem", "forget")] = [{"prompt": "p"}]
    write_hub_copy(tmp_path / "broken", broken)
    from doplus_cli.errors import UserError

    with pytest.raises(UserError, match=r"verbmem@forget: missing field 'gt'"):
        muse_rows(f"hf:{tmp_path / 'broken'}", "verbmem", "forget")


# -------------------------------------------------------------------------------------------- training windows


def test_text_rows_are_cut_into_full_windows_as_muse_trains(tiny_llama, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    texts = [town_text(i) for i in range(5)]
    ids = tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"]
    window = 40
    body = window - 1  # the tiny tokenizer adds its BOS
    windows = window_ids(texts, tokenizer, window)
    assert len(windows) == math.ceil(len(ids) / body)
    assert all(len(w) == body for w in windows)
    flat = [t for w in windows[:-1] for t in w]
    tail = len(ids) - len(flat)
    assert flat + windows[-1][:tail] == ids and windows[-1][tail:] == ids[:body - tail]  # filled from the start
    path = write_jsonl(tmp_path / "forget.jsonl", [{"text": t} for t in texts])
    source = TextWindows(open_source(str(path), "forget"), tokenizer, window)
    assert len(source) == len(windows) and source.text_rows == len(windows)
    formatter = PromptFormatter(tokenizer, max_length=window)
    batch = build_batch(source, list(range(len(source))), formatter, with_rejection=False, seed=0)["answer"]
    mask = batch["attention_mask"].bool()
    assert (batch["labels"][mask] == batch["input_ids"][mask]).all()  # every token is a target
    assert (batch["labels"][~mask] == IGNORE_INDEX).all()
    assert batch["input_ids"][0, 0] == tokenizer.bos_token_id and mask.sum(-1).max() <= window


@pytest.mark.parametrize("loss", ["NPO+KL", "GA+GD"])
def test_unlearn_trains_on_muse_text_windows(tiny_llama, tmp_path, loss):
    folder, rows = write_muse_folder(tmp_path / "muse")
    out = tmp_path / "run"
    assert run_cli("unlearn", "--model", tiny_llama, "--forget", folder / "raw" / "forget.jsonl", "--retain",
                   folder / "raw" / "retain1.jsonl", "--loss", loss, "--text-window", 32, "--max-length", 32,
                   "--steps", 2, "--batch-size", 2, "--show-samples", 0, "--out", out) == 0
    report = json.loads((out / "report.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    texts = [r["text"] for r in rows[("raw", "forget")]]
    assert report["data"]["forget_rows"] == len(window_ids(texts, tokenizer, 32))
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics and all(math.isfinite(m["loss"]) for m in metrics if "loss" in m)


# -------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("case, needle", [
    ("missing_split", "knowmem/retain_qa_icl.jsonl: not found"),
    ("missing_field", "verbmem/forget.jsonl:2: missing field 'gt'"),
    ("not_a_folder", "--muse-data is neither a folder nor hf:NAME"),
    ("corpus", "unknown --muse-corpus 'poems'"),
    ("offline", "hf:muse-bench/MUSE-Books:verbmem@forget: not in the local Hugging Face cache, and offline mode"),
    ("window", "--text-window must be between 2 and --max-length (32), got 64"),
])
def test_bad_muse_input_is_one_line_with_exit_code_2(tiny_llama, tmp_path, capsys, case, needle):
    folder, rows = write_muse_folder(tmp_path / "muse")
    args = ["evaluate", "--model", tiny_llama, "--suite", "muse", "--muse-data", folder, "--out", tmp_path / "o"]
    if case == "missing_split":
        (folder / "knowmem" / "retain_qa_icl.jsonl").unlink()
    elif case == "missing_field":
        write_jsonl(folder / "verbmem" / "forget.jsonl", [{"prompt": "a", "gt": "b"}, {"prompt": "c"}])
    elif case == "not_a_folder":
        args[args.index(folder)] = tmp_path / "nowhere"
    elif case == "offline":  # the default data is the corpus's hub repository, not reachable offline
        args = args[:args.index("--muse-data")] + args[args.index("--muse-data") + 2:] + ["--muse-corpus", "books"]
    elif case == "corpus":
        args += ["--muse-corpus", "poems"]
    elif case == "window":
        args = ["unlearn", "--model", tiny_llama, "--forget", folder / "raw" / "forget.jsonl", "--loss", "GA",
                "--text-window", 64, "--max-length", 32, "--steps", 1, "--out", tmp_path / "r"]
    capsys.readouterr()
    assert run_cli(*args) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and err.count("\n") == 0 and "Traceback" not in err
