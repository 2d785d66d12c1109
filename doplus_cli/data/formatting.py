"""Turn rows into token ids and labels: chat template (or a plain template), prompt tokens masked out.

The prompt and the answer are tokenized separately and concatenated, so the label mask is exact: every
prompt token has label -100 and every answer token (and the end-of-turn/EOS tokens after it) is a target.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100
PLAIN_PROMPT = "Question: {question}\nAnswer:"


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]


class PromptFormatter:
    """Encodes (question, answer) pairs and plain texts for one tokenizer.

    With a chat template the prompt is the template applied to one user turn with the generation prompt
    appended, and the answer is whatever the template writes after it for the assistant turn (so its
    end-of-turn token is learned too). Without one: `Question: ... Answer:` then ` answer</s>`.
    """

    def __init__(self, tokenizer, max_length: int = 256) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.chat = bool(getattr(tokenizer, "chat_template", None))

    def prompt_text(self, question: str) -> str:
        if self.chat:
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
            )
        return PLAIN_PROMPT.format(question=question)

    def answer_text(self, question: str, answer: str) -> str:
        if self.chat:
            prompt = self.prompt_text(question)
            full = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": question}, {"role": "assistant", "content": answer}], tokenize=False
            )
            if full.startswith(prompt):
                return full[len(prompt):]
            return answer + (self.tokenizer.eos_token or "")
        return " " + answer + (self.tokenizer.eos_token or "")

    def prompt_ids(self, question: str) -> list[int]:
        """Token ids of the prompt alone, as the model sees it before generating an answer."""
        if self.chat:
            return self.tokenizer(self.prompt_text(question), add_special_tokens=False)["input_ids"]
        return self.tokenizer(self.prompt_text(question), add_special_tokens=True)["input_ids"]

    def encode(self, question: str, answer: str) -> Encoded:
        """Prompt then answer; truncated to `max_length` keeping at least half of it for the answer."""
        prompt = self.prompt_ids(question)
        answer_ids = self.tokenizer(self.answer_text(question, answer), add_special_tokens=False)["input_ids"]
        if not self.chat and self.tokenizer.eos_token_id is not None and (
            not answer_ids or answer_ids[-1] != self.tokenizer.eos_token_id
        ):
            answer_ids = answer_ids + [self.tokenizer.eos_token_id]
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
