"""A tiny random Llama with a real (BPE, byte-level) tokenizer trained here on TOFU text."""

from __future__ import annotations

import json
import os
from pathlib import Path

SHARED = Path(os.environ.get("DOPLUS_SHARED", Path(__file__).resolve().parents[2] / "shared"))
TOFU = SHARED / "data" / "tofu"

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def tofu_texts(limit: int = 2000) -> list[str]:
    texts = []
    for name in ("forget10.json", "retain90.json"):
        with open(TOFU / name) as handle:
            for line in handle:
                row = json.loads(line)
                texts += [row["question"], row["answer"]]
                if len(texts) >= limit:
                    break
    return texts


def build_tiny_llama(folder: Path, chat: bool = False, vocab_size: int = 600, seed: int = 0) -> Path:
    """Write a 2-layer, 32-wide Llama and its tokenizer to `folder`; return it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(tofu_texts(), trainer)
    bos = ("<s>", tok.token_to_id("<s>"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[bos])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder
