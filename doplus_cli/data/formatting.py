"""Turn rows into token ids and labels: a prompt template (the chat template or a named/custom plain one),
prompt tokens masked out.

The prompt and the answer are tokenized separately and concatenated, so the label mask is exact: every
prompt token has label -100, and the answer tokens and the one end-of-turn/EOS token after them are targets
(nothing a chat template writes after its end-of-turn token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from doplus_cli.errors import UserError
from doplus_cli.registry import Registry

IGNORE_INDEX = -100
PLAIN_PROMPT = "Question: {question}\nAnswer:"


@dataclass(frozen=True)
class PromptTemplate:
    """A plain prompt format: `prompt` (with `{question}`), then `answer_prefix + answer + EOS`."""

    name: str
    prompt: str
    answer_prefix: str = ""


CHAT = "chat"  # the tokenizer's own chat template
# Named presets of --prompt-template (besides "chat"); a string with "{question}" is a custom one.
PROMPT_TEMPLATES: Registry[PromptTemplate] = Registry("prompt template", PromptTemplate, {
    "question-answer": PromptTemplate("question-answer", PLAIN_PROMPT, " "),
    # The DualOptim+/TOFU code's Phi-1.5 format: question_start_tag "<|user|>\n", question_end_tag
    # "<|end|>\n<|assistant|>\n", answer_tag "".
    "phi-tofu": PromptTemplate("phi-tofu", "<|user|>\n{question}<|end|>\n<|assistant|>\n", ""),
    # The TOFU code's Llama-2 format: question_start_tag "[INST] ", question_end_tag " [/INST]", answer_tag "".
    "llama2": PromptTemplate("llama2", "[INST] {question} [/INST]", ""),
})
TEMPLATE_NAMES = (CHAT, *PROMPT_TEMPLATES)
TEMPLATE_HELP = ("Prompt format: chat (the tokenizer's chat template), question-answer ('Question: q\\nAnswer:'), "
                 "phi-tofu (the DualOptim+/TOFU Phi-1.5 format), llama2 ('[INST] q [/INST]'), or a string with "
                 "{question} [default: chat when the tokenizer has a chat template, else question-answer]")


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]


def check_prompt_template(template: str | None) -> None:
    """A UserError unless `template` is None, a preset name or a custom string holding "{question}"."""
    if template is None or template in TEMPLATE_NAMES:
        return
    if "{question}" not in template:
        raise UserError(f"unknown --prompt-template '{template}': choose {', '.join(TEMPLATE_NAMES)} or give a "
                        "string with {question} in it")
    try:
        template.format(question="")
    except (IndexError, KeyError, ValueError) as error:
        raise UserError(f"--prompt-template '{template}': only {{question}} may be in braces (write {{{{ and }}}} "
                        f"for literal braces): {error}") from None


def resolve_template(tokenizer, template: str | None) -> PromptTemplate | None:
    """The plain template to use, or None for the tokenizer's chat template.

    None (the default) means the chat template when the tokenizer has one, else `question-answer`.
    """
    check_prompt_template(template)
    has_chat = bool(getattr(tokenizer, "chat_template", None))
    if template is None:
        return None if has_chat else PROMPT_TEMPLATES["question-answer"]
    if template == CHAT:
        if not has_chat:
            raise UserError("--prompt-template chat: this tokenizer has no chat template; choose "
                            + PROMPT_TEMPLATES.listing() + " or a string with {question}")
        return None
    if template in PROMPT_TEMPLATES:
        return PROMPT_TEMPLATES[template]
    return PromptTemplate("custom", template, "")


class PromptFormatter:
    """Encodes (question, answer) pairs and plain texts for one tokenizer and one prompt template.

    With the chat template the prompt is the template applied to one user turn with the generation prompt
    appended, and the answer is what the template writes after it for the assistant turn, cut after its
    end-of-turn token (ChatML's newline after `<|im_end|>` is not scored). With a plain template (see
    PROMPT_TEMPLATES): the template's prompt, then `answer_prefix + answer` and the EOS token. Either way the
    scored tokens are the answer and its end token, as in the TOFU/DualOptim+ code.
    """

    def __init__(self, tokenizer, max_length: int = 256, template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.template = resolve_template(tokenizer, template)
        self.chat = self.template is None

    @property
    def template_name(self) -> str:
        """The preset's name, or the custom template string itself."""
        if self.template is None:
            return CHAT
        return self.template.prompt if self.template.name == "custom" else self.template.name

    def prompt_text(self, question: str) -> str:
        if self.chat:
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
            )
        return self.template.prompt.replace("{question}", question)

    def answer_text(self, question: str, answer: str) -> str:
        """The answer as the model should write it, up to and including its end-of-turn token."""
        if self.chat:
            prompt = self.prompt_text(question)
            full = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": question}, {"role": "assistant", "content": answer}], tokenize=False
            )
            if full.startswith(prompt):
                return self._through_end_of_turn(full[len(prompt):], answer)
            return answer + (self.tokenizer.eos_token or "")
        return self.template.answer_prefix + answer + (self.tokenizer.eos_token or "")

    def _through_end_of_turn(self, text: str, answer: str) -> str:
        """`text` cut after the first special token that follows the answer (the end-of-turn token); without
        one, the answer then the EOS token."""
        content_end = text.find(answer) + len(answer) if answer and answer in text else 0
        tail = text[content_end:]
        specials = {t for t in getattr(self.tokenizer, "all_special_tokens", []) if t}
        found = [(tail.find(t), -len(t), t) for t in specials if t in tail]
        if not found:
            return text[:content_end] + (self.tokenizer.eos_token or "")
        position, _, token = min(found)
        return text[:content_end + position + len(token)]

    def prompt_ids(self, question: str) -> list[int]:
        """Token ids of the prompt alone, as the model sees it before generating an answer."""
        if self.chat:
            return self.tokenizer(self.prompt_text(question), add_special_tokens=False)["input_ids"]
        return self.tokenizer(self.prompt_text(question), add_special_tokens=True)["input_ids"]

    def answer_ids(self, question: str, answer: str) -> list[int]:
        """Token ids of the scored part: the answer and its end token, nothing after it."""
        ids = self.tokenizer(self.answer_text(question, answer), add_special_tokens=False)["input_ids"]
        eos = self.tokenizer.eos_token_id
        if not self.chat and eos is not None and (not ids or ids[-1] != eos):
            ids = ids + [eos]
        return ids

    def encode(self, question: str, answer: str) -> Encoded:
        """Prompt then answer; truncated to `max_length` keeping at least half of it for the answer."""
        prompt = self.prompt_ids(question)
        answer_ids = self.answer_ids(question, answer)
        room_for_prompt = max(self.max_length - len(answer_ids), self.max_length // 2)
        prompt = prompt[-room_for_prompt:] if len(prompt) > room_for_prompt else prompt
        ids = (prompt + answer_ids)[: self.max_length]
        labels = ([IGNORE_INDEX] * len(prompt) + answer_ids)[: self.max_length]
        return Encoded(ids, labels)

    def encode_text(self, text: str) -> Encoded:
        """An untargeted text: every token is a target."""
        ids = self.tokenizer(text, add_special_tokens=True)["input_ids"][: self.max_length]
        return Encoded(ids, list(ids))


def collate(examples: list[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask and labels (padding is -100 in the labels)."""
    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        input_ids[row, :n] = torch.tensor(example.input_ids)
        labels[row, :n] = torch.tensor(example.labels)
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def left_padded_prompts(formatter: PromptFormatter, questions: list[str]) -> dict[str, torch.Tensor]:
    """A batch of prompts padded on the left, ready for `generate`."""
    ids = [formatter.prompt_ids(q)[-formatter.max_length:] for q in questions]
    width = max(len(i) for i in ids)
    pad_id = formatter.tokenizer.pad_token_id
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, seq in enumerate(ids):
        input_ids[row, width - len(seq):] = torch.tensor(seq)
        attention_mask[row, width - len(seq):] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}
