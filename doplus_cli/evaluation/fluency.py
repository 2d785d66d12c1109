"""Fluency of the forget generations, so that a model that forgot can be told from one that broke: an
over-unlearned model also scores low on the forget set's ROUGE, by answering in gibberish.

Two measures:

* the generation entropy of ROME (Meng et al. 2022, `n_gram_entropy` in its
  experiments/py/eval_utils_counterfact.py), which RWKU (Jin et al. 2024) reports as "Flu": per generation,
  (2/3 H2 + 4/3 H3) / 2 = H2 / 3 + 2 H3 / 3, with Hn the Shannon entropy in bits of the generation's word n-gram
  frequencies; a text that repeats itself scores low. Offline, no model.
* OpenUnlearning's gibberish rate (`forget_Q_A_gibberish`, its `classifier_prob` metric): the mean softmax
  probability of class 0 ("clean") that a text classifier, by default madhurjindal/autonlp-Gibberish-Detector-
  492513457, gives each generation cut to 32 of its tokens. Optional: the classifier comes from the hub or a
  local folder; when it cannot be loaded the value is absent and the reason is said, never a number.

Words: ROME splits a text with nltk's `word_tokenize`, which first cuts it into sentences with the Punkt model
(the `punkt_tab` data, a separate download) and then applies nltk's Treebank-style word tokenizer to each. Here
the same word tokenizer (`NLTKWordTokenizer`) runs on sentences cut by a fixed rule instead, so that the value
needs no download and does not depend on what data a machine has: a cut after ".", "!" or "?" followed by white
space (a closing quote or bracket may come between) and an upper-case letter or an opening quote or bracket.
Punkt's learned abbreviations are not used, so "Dr. Smith" gives "Dr", ".", "Smith" where ROME has "Dr.",
"Smith"; a sentence that starts with a digit is not cut from the one before ("in 1990. 2001 was" keeps "1990."
whole where Punkt cuts).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

DEFAULT_FLUENCY_MODEL = "madhurjindal/autonlp-Gibberish-Detector-492513457"
CLEAN_CLASS = 0  # OpenUnlearning's class_id: the detector's "clean" label
MAX_LENGTH = 32  # OpenUnlearning's max_length for forget_Q_A_gibberish (classifier tokens, special ones included)
BATCH_SIZE = 32  # OpenUnlearning's batch_size
NGRAM_WEIGHTS = {2: 2 / 3, 3: 4 / 3}  # ROME's ns and weights, averaged: (2/3 H2 + 4/3 H3) / 2

# A sentence ends at ".", "!" or "?" (and a closing quote or bracket) followed by white space and an upper-case
# letter, an opening quote or bracket.
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"'”’)\]]))\s+(?=[\"'“‘(\[A-Z])")
_WORD_TOKENIZER: Any = None


def word_tokens(text: str) -> list[str]:
    """The words and punctuation of `text`: nltk's Treebank-style word tokenizer on each sentence (the module
    docstring says how sentences are cut and how that differs from ROME's `nltk.word_tokenize`)."""
    global _WORD_TOKENIZER
    if _WORD_TOKENIZER is None:
        from nltk.tokenize import NLTKWordTokenizer

        _WORD_TOKENIZER = NLTKWordTokenizer()
    return [token for sentence in _SENTENCE_END.split(text) for token in _WORD_TOKENIZER.tokenize(sentence)]


def ngram_entropy(tokens: Sequence[str], n: int) -> float:
    """H_n = -sum_g p(g) log2 p(g) over the distinct n-grams g of `tokens`, p(g) = count(g) / number of n-grams;
    0 when there is no n-gram (fewer than n tokens), as ROME's empty frequency array sums to 0."""
    counts = Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))
    total = sum(counts.values())
    return -sum(c / total * math.log2(c / total) for c in counts.values()) if total else 0.0


def generation_entropy(text: str) -> float:
    """ROME's `compute_n_gram_entropy` of one text: mean over n in {2, 3} of w_n H_n (w_2 = 2/3, w_3 = 4/3), in
    bits, that is H2 / 3 + 2 H3 / 3 over `word_tokens(text)`."""
    tokens = word_tokens(text)
    return sum(weight * ngram_entropy(tokens, n) for n, weight in NGRAM_WEIGHTS.items()) / len(NGRAM_WEIGHTS)


def mean_generation_entropy(texts: Sequence[str]) -> float | None:
    """ROME's `n_gram_entropy` (arithmetic mean of `generation_entropy` over the texts); None for no text."""
    return sum(generation_entropy(t) for t in texts) / len(texts) if texts else None


class NotAClassifier(ValueError):
    """A sequence-classification model with fewer than two labels: its softmax is 1 whatever the text."""


class GibberishJudge:
    """A text classifier: texts -> the softmax probability of `clean_class`, each text cut to `max_length` of the
    classifier's tokens (OpenUnlearning's `classifier_prob`)."""

    def __init__(self, model, tokenizer, name: str, clean_class: int = CLEAN_CLASS,
                 max_length: int = MAX_LENGTH) -> None:
        labels = int(model.config.num_labels)
        if labels < 2:
            raise NotAClassifier(f"it has {labels} label, so its softmax is 1 for every text")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.clean_class = clean_class
        self.max_length = max_length
        self.clean_label = str((model.config.id2label or {}).get(clean_class, clean_class))

    @torch.no_grad()
    def clean_probabilities(self, texts: Sequence[str], batch_size: int = BATCH_SIZE) -> list[float]:
        """p(clean | text) = softmax(logits)[clean_class] for each text, in batches padded to their longest."""
        device = next(self.model.parameters()).device
        out: list[float] = []
        for start in range(0, len(texts), batch_size):
            inputs = self.tokenizer(list(texts[start:start + batch_size]), return_tensors="pt", padding=True,
                                    truncation=True, max_length=self.max_length).to(device)
            logits = self.model(**inputs).logits.float()
            out += torch.softmax(logits, dim=-1)[:, self.clean_class].tolist()
        return out


def load_fluency_judge(name: str | None = None, device: str = "cpu") -> tuple[GibberishJudge | None, str | None]:
    """(GibberishJudge, None) for `name` (None: DEFAULT_FLUENCY_MODEL; else a hub id or a local folder), or
    (None, one-line reason) on any failure; with no network or HF_HUB_OFFLINE set it looks in the local cache
    only, so a missing model fails at once."""
    from doplus_cli.evaluation.judges import load_classifier, why_not_loaded

    name = name or DEFAULT_FLUENCY_MODEL
    try:
        judge = load_classifier(name, device, GibberishJudge)
    except NotAClassifier as error:
        return None, f"'{name}' is not a text classifier ({error})"
    except Exception as error:  # any failure becomes a reason: the value is left out, not the run
        return None, f"'{name}' could not be loaded ({why_not_loaded(name, error)})"
    return judge, None
