"""Per-task metrics of `doplus multitask`'s held-out evaluation, one function each, looked up by name.

Each metric scores one greedy generation against its reference answer with a number in [0, 1]; a task's
score is the mean over its held-out rows (reports multiply by 100, as the paper's Table 4 does).
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from doplus_cli.config import TASK_METRIC_NAMES
from doplus_cli.evaluation import metrics
from doplus_cli.registry import Registry


@dataclass(frozen=True)
class TaskMetric:
    name: str
    fn: Callable[[str, str], float]
    formula: str  # the first line of the function's docstring, named in the report


# Over config.TASK_METRIC_NAMES, the names a recipe's `metric:` is checked against before this module is imported.
TASK_METRICS: Registry[TaskMetric] = Registry("task metric", TaskMetric, names=TASK_METRIC_NAMES)


def _register(name: str):
    """Registers the decorated function under `name`, its formula the first line of its docstring."""
    return TASK_METRICS.register(
        name, build=lambda fn: TaskMetric(name, fn, (fn.__doc__ or "").strip().splitlines()[0]))


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation) - {".", "-"}  # kept: they belong to numbers (-3.5)
_NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


def normalize_answer(text: str) -> str:
    """Lower case; punctuation other than '.' and '-' removed; the articles a/an/the removed; whitespace
    collapsed; a final '.' dropped; a number written in its shortest form (5.0 -> 5, 2.50 -> 2.5)."""
    text = "".join(c for c in text.lower() if c not in _PUNCTUATION)
    text = " ".join(_ARTICLES.sub(" ", text).split()).removesuffix(".").strip()
    if _NUMBER.match(text.replace(",", "")):
        value = float(text.replace(",", ""))
        text = str(int(value)) if value == int(value) else repr(value)
    return text


@_register("exact")
def exact_match(prediction: str, reference: str) -> float:
    """exact = 1 if normalize(prediction) == normalize(reference) else 0 (NumGLUE-style normalised exact match)."""
    return float(normalize_answer(prediction) == normalize_answer(reference))


_OPTION_LETTER = re.compile(r"(?<![A-Za-z])([A-Z])(?![A-Za-z])")


def option_letter(text: str) -> str | None:
    """The first capital letter that stands alone (not inside a word): 'B', '(B) 42', 'Answer: B.' -> 'B'."""
    found = _OPTION_LETTER.search(text)
    return found.group(1) if found else None


@_register("choice")
def choice_match(prediction: str, reference: str) -> float:
    """choice = 1 if the first option letter of the prediction is the reference's, else 0 (ScienceQA-style)."""
    letter = option_letter(prediction)
    return float(letter is not None and letter == option_letter(reference))


@_register("edit_sim")
def edit_similarity(prediction: str, reference: str) -> float:
    """edit_sim = 1 - Indel(p, r) / (|p| + |r|) on the stripped strings, Indel the insert/delete edit distance
    (rapidfuzz `fuzz.ratio` / 100, the fuzzywuzzy ratio of CodeXGLUE's Py150 code completion)."""
    from rapidfuzz import fuzz

    return fuzz.ratio(prediction.strip(), reference.strip()) / 100.0


@_register("rouge_l")
def rouge_l_f1(prediction: str, reference: str) -> float:
    """rouge_l = F1 of ROUGE-L: 2PR / (P + R), P = LCS / |prediction|, R = LCS / |reference| in stemmed words."""
    return metrics.rouge_l_f1(prediction, reference)


TASK_METRICS.check_complete()

def task_score(metric: str, predictions: Sequence[str], references: Sequence[str]) -> float:
    """The mean of `metric` over the rows."""
    if len(predictions) != len(references) or not predictions:
        raise ValueError(f"{metric}: {len(predictions)} predictions for {len(references)} references")
    fn = TASK_METRICS[metric].fn
    return sum(fn(p, r) for p, r in zip(predictions, references)) / len(predictions)
