"""The authors' evaluation protocol. Prompt templates, scored tokens (the answer and its end token,
nothing after it), the real-world files' `golden_answer`, a run's template reused by its evaluation, and
`--protocol paper`."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from doplus_cli.commands.unlearn import UnlearnConfig
from doplus_cli.data.formatting import IGNORE_INDEX, PromptFormatter
from doplus_cli.errors import UserError
from doplus_cli.evaluation import suites
from doplus_cli.evaluation.scoring import mean_token_nlls
from doplus_cli.generation import greedy_generate
from tests.helpers import run_cli

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
Q, A = "Where was Basil born?", "In Kuwait City."


@pytest.fixture(scope="module")
def chatml_tokenizer(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    return tokenizer


def split(tokenizer, encoded):
    n_prompt = sum(1 for label in encoded.labels if label == IGNORE_INDEX)
    assert encoded.input_ids[n_prompt:] == encoded.labels[n_prompt:]
    return tokenizer.decode(encoded.input_ids[:n_prompt]), encoded.labels[n_prompt:]


@pytest.mark.parametrize("template, prompt, answer", [
    ("question-answer", "<s>Question: Where was Basil born?\nAnswer:", " In Kuwait City."),
    ("phi-tofu", "<s><|user|>\nWhere was Basil born?<|end|>\n<|assistant|>\n", "In Kuwait City."),
    ("llama2", "<s>[INST] Where was Basil born? [/INST]", "In Kuwait City."),
    ("Q: {question} A:", "<s>Q: Where was Basil born? A:", "In Kuwait City."),
])
def test_each_plain_preset_renders_its_string_and_scores_the_answer_and_eos(tiny_llama, template, prompt, answer):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    formatter = PromptFormatter(tokenizer, 128, template)
    prompt_text, labels = split(tokenizer, formatter.encode(Q, A))
    assert prompt_text == prompt
    assert labels == tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def test_chat_preset_scores_the_answer_and_im_end_not_the_newline_after_it(chatml_tokenizer):
    formatter = PromptFormatter(chatml_tokenizer, 128)  # default: the tokenizer's chat template
    assert formatter.template_name == "chat"
    prompt_text, labels = split(chatml_tokenizer, formatter.encode(Q, A))
    assert prompt_text == "<|im_start|>user\nWhere was Basil born?<|im_end|>\n<|im_start|>assistant\n"
    im_end = chatml_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert labels == chatml_tokenizer(A, add_special_tokens=False)["input_ids"] + [im_end]


def test_template_errors_are_one_line(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    with pytest.raises(UserError, match="no chat template"):
        PromptFormatter(tokenizer, 64, "chat")
    with pytest.raises(UserError, match=r"unknown --prompt-template 'phi'"):
        PromptFormatter(tokenizer, 64, "phi")
    assert PromptFormatter(tokenizer, 64).template_name == "question-answer"  # the default without a chat template


def reference_nll(model, tokenizer, prompt_ids, scored_ids):
    """Mean NLL of exactly `scored_ids` after `prompt_ids`: one float64 forward, a plain loop."""
    ids = torch.tensor([prompt_ids + scored_ids])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    total = 0.0
    for k, token in enumerate(scored_ids):
        total -= log_probs[len(prompt_ids) + k - 1, token].item()
    return total / len(scored_ids)


@pytest.mark.parametrize("chat", [False, True])
def test_evaluation_nlls_cover_exactly_the_answer_and_its_end_token(tiny_llama, tiny_chat_llama, chat):
    folder = tiny_chat_llama if chat else tiny_llama
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    formatter = PromptFormatter(tokenizer, 512)
    pairs = [(Q, A), ("Who wrote Romeo and Juliet?", "William Shakespeare wrote it.")]
    values = mean_token_nlls(model, formatter, pairs, batch_size=2)
    for (question, answer), value in zip(pairs, values):
        if chat:  # the tiny template writes "answer</s>\n": the "\n" is not scored
            prompt = tokenizer(f"<|user|>\n{question}</s>\n<|assistant|>\n", add_special_tokens=False)["input_ids"]
            scored = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        else:
            prompt = tokenizer(f"Question: {question}\nAnswer:")["input_ids"]
            scored = tokenizer(" " + answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        assert value == pytest.approx(reference_nll(model, tokenizer, prompt, scored), abs=1e-5)


class FakeEmbedder:
    """Fixed vectors: the generation [1, 0], the long answer [1, 1], the short answer [0, 1]."""

    name = "fake"
    vectors = {"gen": [1.0, 0.0], "long": [1.0, 1.0], "short": [0.0, 1.0]}

    def encode(self, texts):
        return torch.tensor([self.vectors[t.split(":")[0]] for t in texts])


class FakeNLI:
    name = "fake-nli"

    def labels(self, premises, hypotheses):
        return ["entailment" if h.startswith("short") else "neutral" for h in hypotheses]


def test_real_world_rows_with_golden_answer_score_as_the_authors(tiny_llama, tmp_path, monkeypatch):
    row = {"question": "Who wrote Hamlet?", "answer": "long: The play Hamlet was written by William Shakespeare",
           "golden_answer": "short: William Shakespeare", "paraphrased_answer": "Shakespeare wrote it",
           "perturbed_answer": ["Charles Dickens", "Jane Austen"]}
    path = tmp_path / "forget_perturbed.json"
    path.write_text(json.dumps(row) + "\n")
    sets = suites.load_real_world_sets(str(path), str(path), None)
    generation = "gen: Shakespeare William"
    monkeypatch.setattr(suites, "greedy_generate", lambda *a, **k: ([generation], [[5, 6, 7]]))
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    formatter = PromptFormatter(tokenizer, 512)
    values, records = suites.evaluate_set(sets[0], model, formatter, suites.Judges(FakeEmbedder(), FakeNLI()), 8, 4)
    # ROUGE-L recall against "short: William Shakespeare" (tokens short, william, shakespeare): the LCS with
    # "gen shakespeare william" is one token ("shakespeare" or "william"): 1/3. Against the long answer: 1/9.
    assert values["rouge"] == pytest.approx(1 / 3)
    # Cosine against the long answer: [1, 0] . [1, 1] / sqrt(2); against the short one it would be 0.
    assert values["cosine_similarity"] == pytest.approx(1 / math.sqrt(2))
    assert values["entailment"] == 1.0  # the NLI judge saw the short answer
    nll = mean_token_nlls(model, formatter, [(row["question"], row["golden_answer"])])[0]
    assert records[0]["nll_answer"] == pytest.approx(nll) and records[0]["answer"] == row["golden_answer"]
    assert values["probability"] == pytest.approx(math.exp(-nll))
    fields = suites.field_sources(sets[0].samples)
    assert fields["rouge"] == fields["entailment"] == fields["probability"] == "golden_answer"
    assert fields["cosine_similarity"] == "answer"


def test_rows_without_golden_answer_keep_the_answer_for_everything(tmp_path):
    row = {"question": "q", "answer": "a", "paraphrased_answer": "p", "perturbed_answer": ["x"]}
    path = tmp_path / "rw.jsonl"
    path.write_text(json.dumps(row) + "\n")
    sample = suites.load_real_world_sets(str(path), str(path), None)[0].samples[0]
    assert (sample.answer, sample.cosine_reference, sample.entailment_reference) == ("a", None, None)
    assert set(suites.field_sources([sample]).values()) == {"answer", "paraphrased_answer vs perturbed_answer"}


def test_generation_budget_counts_the_prompt(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    formatter = PromptFormatter(tokenizer, 512)
    questions = ["Who?", "Where was the author born and what is the full name of the author?"]
    _, tokens = greedy_generate(model, formatter, questions, 1, max_total_tokens=40)
    for question, ids in zip(questions, tokens):
        assert len(formatter.prompt_ids(question)) + len(ids) <= 40
    assert len(tokens[0]) > len(tokens[1]) or len(tokens[0]) == 40 - len(formatter.prompt_ids(questions[0]))


def test_a_runs_template_is_reused_by_its_evaluation_and_paper_protocol_names_its_judge(tiny_llama, tofu_dir,
                                                                                       tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_llama, run / "final")
    (run / "config.yaml").write_text("loss: NPO+GD\nprompt_template: phi-tofu\n")
    out = tmp_path / "eval"
    assert run_cli("evaluate", "--model", run / "final", "--data-dir", tofu_dir, "--max-samples", 2,
                   "--max-new-tokens", 2, "--out", out, "--nli-model", tmp_path / "none", "--protocol", "paper") == 0
    record = json.loads((out / "eval.json").read_text())
    assert record["prompt_template"] == "phi-tofu"
    assert record["protocol"].startswith("paper: embedding model paraphrase-MiniLM-L6-v2")
    assert "paraphrase-MiniLM-L6-v2" in record["judges"]["embedding_missing"]  # offline: named, not replaced
    report = (out / "report.md").read_text()
    assert "protocol paper" in report and "'phi-tofu'" in report and "Cosine" not in record["judges"]
    per_sample = json.loads((out / "TOFU_EVAL.json").read_text())["sets"]["forget"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    from doplus_cli.evaluation.metrics import token_entropy

    for r in per_sample:  # the authors' Token Entropy input: the generated text re-tokenised
        assert r["token_entropy"] == pytest.approx(token_entropy(tokenizer.tokenize(r["generation"])))


def test_unlearn_config_takes_a_template_and_a_protocol():
    from doplus_cli.config import resolve_config

    config = resolve_config(None, {"forget": "f.jsonl", "loss": "GA", "prompt_template": "phi-tofu",
                                   "eval_protocol": "paper"}, UnlearnConfig)
    assert (config.prompt_template, config.eval_protocol) == ("phi-tofu", "paper")
    assert config.to_dict()["prompt_template"] == "phi-tofu"  # what config.yaml records for the evaluation
    with pytest.raises(UserError, match="unknown --prompt-template 'Q:'"):
        resolve_config(None, {"forget": "f.jsonl", "loss": "GA", "prompt_template": "Q:"}, UnlearnConfig)
    with pytest.raises(UserError, match="unknown --protocol 'tofu'"):
        resolve_config(None, {"forget": "f.jsonl", "loss": "GA", "eval_protocol": "tofu"}, UnlearnConfig)


def test_config_validates_the_protocols_the_evaluation_defines():
    """config.py checks --eval-protocol without importing the evaluation: its list of names must be PROTOCOLS'."""
    from doplus_cli.config import PROTOCOL_NAMES
    from doplus_cli.evaluation.protocol import PROTOCOLS, get_protocol

    assert tuple(PROTOCOLS) == PROTOCOL_NAMES
    with pytest.raises(UserError, match="unknown --protocol 'authors': choose doplus, paper"):
        get_protocol("authors")
