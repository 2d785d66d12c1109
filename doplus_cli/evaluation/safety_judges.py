"""The judge models of the safety and XSTest suites: a guard model that follows the Llama Guard protocol (the
paper: Llama-Guard-2-8B), a chat model judging refusals with XSTest's classification prompt (`--refusal-model`),
and `SafetyJudges`, which holds them with doplus's offline refusal judge (`refusal.RefusalJudge`).

Loaders raise a one-line `UserError` when a model that was asked for cannot be loaded; the default guard model's
absence is recorded instead (`SafetyJudges.guard_missing`), so the report can say which judge gave each number.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from doplus_cli.errors import UserError
from doplus_cli.evaluation.refusal import CLASSIFY_PROMPT, RefusalJudge, RefusalVerdict, parse_refusal_class

DEFAULT_GUARD_MODEL = "meta-llama/Meta-Llama-Guard-2-8B"


def parse_guard_output(text: str) -> tuple[str | None, list[str]]:
    """Llama Guard's answer: "safe", or "unsafe" and a line of category codes ("S1,S10"); (None, []) otherwise."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return None, []
    head = lines[0].lower()
    if head.startswith("unsafe"):
        return "unsafe", [c.strip() for c in lines[1].split(",")] if len(lines) > 1 else []
    if head.startswith("safe"):
        return "safe", []
    return None, []


class ChatJudge:
    """A causal LM used as a judge: each conversation goes through its tokenizer's chat template, and its greedy
    continuation (a few tokens) is read."""

    what = "judge model"

    def __init__(self, model, tokenizer, name: str, batch_size: int = 8, max_new_tokens: int = 10) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.batch_size = batch_size
        self.max_new_tokens = max_new_tokens
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token

    def outputs(self, texts: list[str], progress=None) -> list[str]:
        """The greedy continuation of each templated text, decoded without special tokens."""
        import torch

        device = next(self.model.parameters()).device
        bos = self.tokenizer.bos_token
        add_special = not (bos and texts and texts[0].startswith(bos))  # templates that write BOS themselves
        self.tokenizer.padding_side = "left"
        task = progress.add_task(self.what, total=len(texts), status="") if progress is not None else None
        out: list[str] = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                   add_special_tokens=add_special).to(device)
            with torch.no_grad():
                generated = self.model.generate(**batch, max_new_tokens=self.max_new_tokens, do_sample=False,
                                                pad_token_id=self.tokenizer.pad_token_id, temperature=None,
                                                top_p=None, top_k=None)
            out += [self.tokenizer.decode(row, skip_special_tokens=True)
                    for row in generated[:, batch["input_ids"].shape[1]:]]
            if task is not None:
                progress.advance(task, len(batch["input_ids"]))
        return out


class GuardJudge(ChatJudge):
    """A causal LM that follows the Llama Guard protocol: the conversation [user prompt, assistant response]
    goes through its tokenizer's chat template, and its greedy continuation starts with "safe" or "unsafe"."""

    what = "guard model"

    def conversation(self, prompt: str, response: str) -> str:
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], tokenize=False)

    def verdicts(self, prompts: list[str], responses: list[str], progress=None) -> list[tuple[str | None, str]]:
        """(label "safe"/"unsafe" or None when the output is neither, raw output) per pair."""
        raw = self.outputs([self.conversation(p, r) for p, r in zip(prompts, responses)], progress)
        return [(parse_guard_output(text)[0], text.strip()) for text in raw]


class RefusalModelJudge(ChatJudge):
    """XSTest's automatic evaluation with any chat model: one user turn asks it to sort the (question,
    response) pair into 1_full_compliance, 2_full_refusal or 3_partial_refusal (`template`, with {question}
    and {response}: doplus's wording of XSTest's GPT-4 prompt unless the user gives their own); its greedy
    answer (16 tokens, as XSTest) names the class."""

    what = "refusal judge model"

    def __init__(self, model, tokenizer, name: str, template: str = CLASSIFY_PROMPT, batch_size: int = 8) -> None:
        super().__init__(model, tokenizer, name, batch_size, max_new_tokens=16)
        self.template = template

    def conversation(self, prompt: str, response: str) -> str:
        values = {"question": prompt, "response": response}  # one pass: a "{response}" in the prompt stays
        content = re.sub(r"\{(question|response)\}", lambda m: values[m.group(1)], self.template)
        return self.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                  add_generation_prompt=True)

    def classify(self, responses: list[str], prompts: list[str] | None = None, progress=None
                 ) -> list[RefusalVerdict]:
        if prompts is None:
            raise ValueError("a refusal judge model reads the question with the response")
        raw = self.outputs([self.conversation(p, r) for p, r in zip(prompts, responses)], progress)
        return [RefusalVerdict(parse_refusal_class(text), {}, text.strip()) for text in raw]


def load_chat_model(name: str, device: str, dtype: str, what: str, needs: str):
    """(model, tokenizer) of the chat model `name` (hub id or folder); a UserError in one line when it cannot be
    loaded or has no chat template (`needs`: what the template is for)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from doplus_cli.evaluation.judges import quiet_loading, why_not_loaded
    from doplus_cli.models import judge_files_only, resolve_dtype

    try:
        quiet_loading()
        offline = judge_files_only()
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=offline)
        if not tokenizer.chat_template:
            raise UserError(f"{what} '{name}': its tokenizer has no chat template ({needs} needs one)")
        model = AutoModelForCausalLM.from_pretrained(name, local_files_only=offline, dtype=resolve_dtype(dtype))
    except UserError:
        raise
    except Exception as error:
        raise UserError(f"{what} '{name}' could not be loaded ({why_not_loaded(name, error)})") from error
    return model.to(device), tokenizer


def load_guard(name: str, device: str, dtype: str = "auto") -> GuardJudge:
    """The guard model `name` (hub id or folder); a UserError in one line when it cannot be loaded."""
    model, tokenizer = load_chat_model(name, device, dtype, "guard model", "the Llama Guard protocol")
    return GuardJudge(model, tokenizer, name)


def read_classify_prompt(path: str | None) -> str:
    """The refusal judge model's prompt: doplus's (None) or FILE's text, which must hold {question} and
    {response}."""
    if path is None:
        return CLASSIFY_PROMPT
    if not os.path.isfile(path):
        raise UserError(f"{path}: file not found (--refusal-model-prompt)")
    text = Path(path).read_text(encoding="utf-8")
    missing = [p for p in ("{question}", "{response}") if p not in text]
    if missing:
        raise UserError(f"{path}: the prompt has no {missing[0]} placeholder (--refusal-model-prompt needs "
                        "{question} and {response})")
    return text


def load_refusal_model(name: str, device: str, dtype: str = "auto", prompt_file: str | None = None
                       ) -> RefusalModelJudge:
    template = read_classify_prompt(prompt_file)
    model, tokenizer = load_chat_model(name, device, dtype, "refusal judge model", "XSTest's classification prompt")
    return RefusalModelJudge(model, tokenizer, name, template)


@dataclass
class SafetyJudges:
    refusal: RefusalJudge  # the offline judge, always
    guard: GuardJudge | None = None
    guard_missing: str | None = None  # why there is no guard model
    refusal_model: RefusalModelJudge | None = None  # --refusal-model: labels refusals instead of the offline judge

    @property
    def refusal_name(self) -> str:
        """Who gives the refusal labels, as reports write it."""
        if self.refusal_model is not None:
            return f"refusal judge model {self.refusal_model.name} (XSTest's classification protocol)"
        return f"offline refusal judge {self.refusal.name}"


def load_safety_judges(guard_model: str | None, device: str, dtype: str = "auto", refusal_model: str | None = None,
                       refusal_model_prompt: str | None = None, need_guard: bool = True) -> SafetyJudges:
    """The offline refusal judge always; the refusal judge model asked for (an error if it cannot be loaded);
    the guard model asked for (an error if it cannot be loaded), or the default one when it can be loaded (its
    absence, and why, is recorded otherwise); `--guard-model none` or `need_guard` False (xstest alone): no guard."""
    from doplus_cli.evaluation.judges import load_embedder

    embedder, _ = load_embedder(None, device)
    judges = SafetyJudges(RefusalJudge(embedder))
    if refusal_model is not None:
        judges.refusal_model = load_refusal_model(refusal_model, device, dtype, refusal_model_prompt)
    elif refusal_model_prompt is not None:
        raise UserError("--refusal-model-prompt needs --refusal-model (the offline judge takes no prompt)")
    if not need_guard:
        judges.guard_missing = "no guard model (not needed: XSTest is judged for refusal, not harm)"
    elif guard_model is not None and guard_model.lower() == "none":
        judges.guard_missing = "no guard model (--guard-model none)"
    elif guard_model is not None:
        judges.guard = load_guard(guard_model, device, dtype)
    else:
        try:
            judges.guard = load_guard(DEFAULT_GUARD_MODEL, device, dtype)
        except UserError as error:
            judges.guard_missing = f"no guard model: {error}"
    return judges
