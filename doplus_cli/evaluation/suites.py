"""The TOFU, real-world and privacy suites: load their sets, compute the six indicators per set, the aggregates
and OpenUnlearning's metrics, and write each suite's files.

A set is a list of `QASample`s. For each set: greedy generations in batches (ROUGE, Token Entropy,
Cosine Similarity, Entailment Score) and the mean token NLL of every true, paraphrased and perturbed answer
from its question's prompt encoded once (Probability, Truth Ratio). No per-sample Python loop runs the model.
The privacy suite scores TOFU's forget rows against holdout rows (`privacy.privacy_metrics`).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from doplus_cli.data.formatting import PromptFormatter
from doplus_cli.data.rejections import rejection_for
from doplus_cli.data.sources import check_file, read_json_lines, task_id_of
from doplus_cli.errors import UserError
from doplus_cli.evaluation import metrics
from doplus_cli.evaluation import openunlearning as ou
from doplus_cli.evaluation.fluency import DEFAULT_FLUENCY_MODEL, generation_entropy, load_fluency_judge
from doplus_cli.evaluation.privacy import (
    load_reference_model,
    paraphrase_metrics,
    privacy_aggregates,
    privacy_metrics,
    privacy_suite_notes,
    read_holdout,
)
from doplus_cli.evaluation.protocol import PROTOCOLS, Protocol, get_protocol
from doplus_cli.evaluation.scoring import shared_prefix_nlls
from doplus_cli.evaluation.suite_api import QA_ATTACKS, BenchColumn, EvalConfig, Suite, SuiteContext, SuiteResult
from doplus_cli.files import write_json
from doplus_cli.generation import greedy_generate
from doplus_cli.hub_errors import bound_hub_waits, dataset_error

INDICATORS = ("rouge", "probability", "truth_ratio", "token_entropy", "cosine_similarity", "entailment")


@dataclass
class QASample:
    """One question. `answer` feeds ROUGE, Probability (and the Truth Ratio's paraphrase when there is none);
    `cosine_reference` and `entailment_reference` feed the two judges (None: `answer`)."""

    question: str
    answer: str
    paraphrased: str | None
    perturbed: list[str]
    cosine_reference: str | None = None
    entailment_reference: str | None = None
    fields: dict[str, str] = field(default_factory=dict)  # indicator -> the row field that fed it
    extra: dict[str, Any] = field(default_factory=dict)
    paraphrased_question: str | None = None  # TOFU's own rephrasing of the question (the paraphrase probe)


@dataclass
class QASet:
    """One evaluation set and how its indicators are read."""

    name: str  # forget, retain, real_authors, world_facts, neighbour
    prefix: str  # OpenUnlearning's key prefix: forget, retain, ra, wf
    samples: list[QASample]
    source: str
    is_forget: bool = False
    choice_probability: bool = False  # p(true) / (p(true) + sum p(perturbed)) instead of exp(-NLL)
    premise_is_generation: bool = False  # Entailment: generation => truth (forget, real-world) or the reverse
    seconds: dict[str, float] = field(default_factory=dict)  # generation, scoring, judges (filled by evaluate)
    task_id: int | None = None  # the forget task whose rows these are (files whose rows carry task_id)
    file_rows: int | None = None  # rows in the whole file (None: from the hub)


@dataclass
class Judges:
    embedder: Any = None
    nli: Any = None
    embedder_reason: str | None = None
    nli_reason: str | None = None
    # the gibberish classifier of forget_fluency, loaded once by the first QA suite that scores a forget set
    fluency: Any = None
    fluency_reason: str | None = None
    fluency_name: str | None = None  # the classifier tried (None: none yet)


# ---- data ----

def _read_rows(path: str, need_paraphrase: bool, max_samples: int | None) -> list[QASample]:
    """Every row of a set (the real-world suite's files: a task_id there is kept as a field, not a filter)."""
    return _read_file(path, need_paraphrase, max_samples, None, by_task=False)[0]


def _read_file(path: str, need_paraphrase: bool, max_samples: int | None, task_id: int | None,
               by_task: bool = True) -> tuple[list[QASample], dict[str, Any]]:
    """A set's rows, and what was read: {"file_rows", "task_id", "tasks"}. With `by_task`, a file whose rows carry
    `task_id` (the DualOptim+ authors' TOFU forget files) gives the rows of one task (`task_id`, default 1); then
    the first `max_samples` of them."""
    check_file(path)
    samples, task_ids, wheres = [], [], []
    for line in read_json_lines(path):
        where = f"{path}:{line.number}"
        samples.append(_sample(line.record, where, need_paraphrase))
        task_ids.append(task_id_of(line.record, where))
        wheres.append(where)
    read = {"file_rows": len(samples), "task_id": None,
            "tasks": sorted({t for t in task_ids if t is not None}) if by_task else []}
    if read["tasks"] and None in task_ids:  # such a row belongs to no task: it would be left out without a word
        raise UserError(f"{wheres[task_ids.index(None)]}: missing field 'task_id', which the file's other rows carry "
                        f"(task ids {', '.join(map(str, read['tasks']))}): give every row of a file of forget tasks "
                        "its task_id")
    if read["tasks"]:
        chosen = 1 if task_id is None else task_id
        if chosen not in read["tasks"]:
            raise UserError(f"{path}: no rows with task_id {chosen} (its rows have task ids "
                            f"{', '.join(map(str, read['tasks']))})")
        samples = [sample for sample, task in zip(samples, task_ids) if task == chosen]
        read["task_id"] = chosen
    elif task_id is not None:
        raise UserError(f"{path}: its rows have no task_id, so task {task_id} (--task-id, or the task_id of the run "
                        "whose final/ is evaluated) cannot pick a forget task")
    if not samples:
        raise UserError(f"{path}: the set is empty")
    return (samples if max_samples is None else samples[:max_samples]), read


def _sample(row: Any, where: str, need_paraphrase: bool) -> QASample:
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a JSON object per line")
    required = ["question", "answer", "perturbed_answer"] + (["paraphrased_answer"] if need_paraphrase else [])
    for key in required:
        if key not in row:
            raise UserError(f"{where}: missing field '{key}'")
    perturbed = row["perturbed_answer"]
    if isinstance(perturbed, str):
        perturbed = [perturbed]
    if not isinstance(perturbed, list) or not perturbed or not all(isinstance(p, str) for p in perturbed):
        raise UserError(f"{where}: field 'perturbed_answer' must be a non-empty list of strings")
    for key in ("question", "answer"):
        if not isinstance(row[key], str):
            raise UserError(f"{where}: field '{key}' must be a string")
    extra = {k: row[k] for k in ("name", "task_id") if k in row}
    references = _references(row, where)
    answer = references.pop("answer", row["answer"])
    fields = references["fields"]
    paraphrase = "paraphrased_answer" if isinstance(row.get("paraphrased_answer"), str) else fields["rouge"]
    fields["truth_ratio"] = f"{paraphrase} vs perturbed_answer"
    paraphrased_question = row.get("paraphrased_question")
    return QASample(row["question"], answer, row.get("paraphrased_answer"), perturbed, extra=extra,
                    paraphrased_question=paraphrased_question if isinstance(paraphrased_question, str) else None,
                    **references)


def _references(row: dict, where: str) -> dict[str, Any]:
    """Which field feeds which indicator, as in the authors' evaluation code:
    - `golden_answer` (the DualOptim+ real-world files): ROUGE, Probability and Entailment against the short
      `golden_answer`, Cosine Similarity against the long `answer`;
    - `original_answer` (TOFU real authors / world facts): ROUGE and Probability against the short `answer`,
      Cosine Similarity and Entailment against the full-sentence `original_answer`;
    - neither: `answer` for all of them."""
    fields = {"rouge": "answer", "probability": "answer", "cosine_similarity": "answer", "entailment": "answer"}
    if "golden_answer" in row:
        if not isinstance(row["golden_answer"], str):
            raise UserError(f"{where}: field 'golden_answer' must be a string")
        fields.update(rouge="golden_answer", probability="golden_answer", entailment="golden_answer")
        return {"answer": row["golden_answer"], "cosine_reference": row["answer"], "fields": fields}
    original = row.get("original_answer")
    if isinstance(original, str):
        fields.update(cosine_similarity="original_answer", entailment="original_answer")
        return {"cosine_reference": original, "entailment_reference": original, "fields": fields}
    return {"fields": fields}


def field_sources(samples: list[QASample]) -> dict[str, str]:
    """indicator -> the field that fed it in this set ("golden_answer (7 of 10 rows; answer for the rest)")."""
    result = {}
    for indicator in ("rouge", "probability", "truth_ratio", "cosine_similarity", "entailment"):
        counts: dict[str, int] = {}
        for sample in samples:
            name = sample.fields.get(indicator, "answer")
            counts[name] = counts.get(name, 0) + 1
        top = max(counts, key=counts.get)
        rest = [name for name in counts if name != top]
        result[indicator] = top if not rest else (f"{top} ({counts[top]} of {len(samples)} rows; "
                                                  f"{', '.join(rest)} for the rest)")
    return result


def _hub_rows(config: str, need_paraphrase: bool, max_samples: int | None) -> tuple[list[QASample], str]:
    import datasets

    spec = f"hf:locuslab/TOFU:{config}"
    bound_hub_waits()
    try:
        data = datasets.load_dataset("locuslab/TOFU", config, split="train")
    except Exception as error:
        failure = dataset_error(spec, "locuslab/TOFU", error, "or pass --data-dir with the TOFU JSON-lines files")
        if failure is not None:
            raise failure from failure.__cause__  # what the hub answered, itself chained to `error`
        raise UserError(f"{spec}: cannot load the hub dataset ({str(error).splitlines()[0][:160]}); pass "
                        "--data-dir with the TOFU JSON-lines files instead") from error
    rows = data if max_samples is None else data.select(range(min(max_samples, len(data))))
    return [_sample(dict(r), f"{spec}[{i}]", need_paraphrase) for i, r in enumerate(rows)], spec


def load_tofu_sets(split: str, data_dir: str | None, max_samples: int | None, task_id: int | None = None,
                   max_rows: int | None = None) -> list[QASet]:
    """forget (`{split}_perturbed`), retain, real authors and world facts, from a folder or the hub.

    The forget set of a file whose rows carry `task_id` is one task's rows (`task_id`, default 1), as the
    DualOptim+ authors evaluate it; the hub's files have one forget set and no task_id. Every set is then cut to
    its first min(`max_samples`, `max_rows`) rows (`max_rows`: the protocol's cap, the authors' `ds_size: 300`)."""
    cap = min((n for n in (max_samples, max_rows) if n is not None), default=None)
    plan = [
        ("forget", "forget", f"{split}_perturbed", True),
        ("retain", "retain", "retain_perturbed", False),
        ("real_authors", "ra", "real_authors_perturbed", False),
        ("world_facts", "wf", "world_facts_perturbed", False),
    ]
    sets = []
    for name, prefix, config, is_forget in plan:
        need_paraphrase = name in ("forget", "retain")
        if data_dir is not None:
            candidates = [os.path.join(data_dir, config + ext) for ext in (".json", ".jsonl")]
            path = next((c for c in candidates if os.path.isfile(c)), candidates[0])
            samples, read = _read_file(path, need_paraphrase, cap, task_id if is_forget else None)
            source = path
        else:
            samples, source = _hub_rows(config, need_paraphrase, cap)
            read = {"file_rows": None, "task_id": None, "tasks": []}
        sets.append(QASet(name, prefix, samples, source, is_forget=is_forget,
                          choice_probability=name in ("real_authors", "world_facts"), premise_is_generation=is_forget,
                          task_id=read["task_id"], file_rows=read["file_rows"]))
    return sets


def load_real_world_sets(forget: str, retain: str, max_samples: int | None) -> list[QASet]:
    """The paper's real-world setting: forget people and neighbour people, JSON lines with `question`,
    `answer`, `paraphrased_answer`, `perturbed_answer` (list) and optional `name`, `task_id`."""
    if forget is None or retain is None:
        raise UserError("--suite real-world needs --forget FILE and --retain FILE (the neighbour set)")
    return [
        QASet("forget", "forget", _read_rows(forget, True, max_samples), forget, is_forget=True,
              premise_is_generation=True),
        QASet("neighbour", "neighbour", _read_rows(retain, True, max_samples), retain, premise_is_generation=True),
    ]


# ---- indicators of one set ----

def default_generation_batch(model, batch_size: int) -> int:
    """Prompts per generation batch when none is set: twice `batch_size` on the CPU, `batch_size` elsewhere.

    On the CPU a decoding step streams every weight from memory, so more rows per step run the products closer
    to the machine's rate: the paper protocol's forget10 generation took 13% less time at 128 prompts than at 64
    on a Zen 5 EPYC and 3-7% less on an older EPYC, with the same greedy answers. On a GPU the
    KV cache of a large model at twice the rows may not fit, so the setting stays as given."""
    device = next(model.parameters()).device
    return 2 * batch_size if device.type == "cpu" else batch_size


def evaluate_set(
    qa_set: QASet, model, formatter: PromptFormatter, judges: Judges, max_new_tokens: int, batch_size: int,
    seed: int = 0, progress=None, protocol: Protocol = PROTOCOLS["doplus"], timings: dict[str, float] | None = None,
    generation_batch_size: int | None = None,
) -> tuple[dict[str, float | None], list[dict[str, Any]]]:
    """The six indicators of one set (None where a judge model is missing) and the per-sample records.
    `timings`, when given, receives the seconds spent generating, scoring NLLs and running the judge models.
    `generation_batch_size`: prompts per generation batch (None: `default_generation_batch`)."""
    timings = {} if timings is None else timings
    started = time.perf_counter()
    samples = qa_set.samples
    questions = [s.question for s in samples]
    generations, tokens = greedy_generate(model, formatter, questions, max_new_tokens,
                                          generation_batch_size or default_generation_batch(model, batch_size),
                                          progress,
                                          f"generating ({qa_set.name})", max_total_tokens=protocol.max_total_tokens)
    if protocol.entropy_of_text:  # the authors' Token Entropy input: the text re-tokenised
        tokens = [formatter.tokenizer.tokenize(text) for text in generations]
    timings["generation"] = time.perf_counter() - started
    truth = [s.answer for s in samples]
    rouge = [metrics.rouge_l_recall(g, t) for g, t in zip(generations, truth)]
    # every answer of a question from its prompt encoded once: true, paraphrased (or true), perturbed
    groups = [[s.answer, s.paraphrased or s.answer, *s.perturbed] for s in samples]
    started = time.perf_counter()
    nlls = shared_prefix_nlls(model, formatter, questions, groups, batch_size, progress, f"scoring ({qa_set.name})")
    timings["scoring"] = time.perf_counter() - started
    started = time.perf_counter()
    nll_true, nll_para, nll_pert = [g[0] for g in nlls], [g[1] for g in nlls], [g[2:] for g in nlls]
    ratios = metrics.truth_ratios(nll_para, nll_pert)
    values: dict[str, float | None] = {
        "rouge": sum(rouge) / len(rouge),
        "probability": (metrics.choice_probability(nll_true, nll_pert) if qa_set.choice_probability
                        else metrics.probability(nll_true)),
        "truth_ratio": (metrics.truth_ratio_forget(ratios) if qa_set.is_forget else metrics.truth_ratio_other(ratios)),
        "token_entropy": metrics.mean_token_entropy(tokens),
        "cosine_similarity": None,
        "entailment": None,
    }
    cosine_references = [s.cosine_reference or s.answer for s in samples]
    references = [s.entailment_reference or s.answer for s in samples]
    cosines: list[float | None] = [None] * len(samples)
    if judges.embedder is not None:
        cosines = metrics.cosine_similarities(judges.embedder.encode(generations),
                                              judges.embedder.encode(cosine_references))
        values["cosine_similarity"] = sum(cosines) / len(cosines)
    labels: list[str | None] = [None] * len(samples)
    idk_labels: list[str | None] = [None] * len(samples)
    rejections = [rejection_for(i, seed) for i in range(len(samples))]
    idk_rouge = [metrics.rouge_l_recall(g, r) for g, r in zip(generations, rejections)]
    if judges.nli is not None:
        if qa_set.premise_is_generation:
            labels = judges.nli.labels(generations, references)
        else:
            labels = judges.nli.labels(references, generations)
        values["entailment"] = metrics.entailment_score(labels, rouge)
        if qa_set.is_forget:
            idk_labels = judges.nli.labels(generations, rejections)
            values["idk_entailment"] = metrics.entailment_score(idk_labels, idk_rouge)
    elif qa_set.is_forget:
        values["idk_entailment"] = None
    entropies: list[float | None] = [None] * len(samples)
    clean: list[float | None] = [None] * len(samples)
    if qa_set.is_forget:  # fluency: a forget set answered in gibberish is broken, not forgotten (fluency.py)
        entropies = [generation_entropy(g) for g in generations]
        values["fluency_entropy"] = sum(entropies) / len(entropies)
        values["fluency"] = None
        if judges.fluency is not None:
            clean = judges.fluency.clean_probabilities(generations)
            values["fluency"] = sum(clean) / len(clean)
    timings["judges"] = time.perf_counter() - started
    records = []
    for i, s in enumerate(samples):
        record = {
            "set": qa_set.name, "index": i, "question": s.question, "answer": s.answer, "generation": generations[i],
            "rouge_l_recall": rouge[i], "nll_answer": nll_true[i], "nll_paraphrased": nll_para[i],
            "nll_perturbed": nll_pert[i], "truth_ratio": ratios[i],
            "token_entropy": metrics.token_entropy(tokens[i]), "cosine_similarity": cosines[i],
            "entailment_label": labels[i],
        }
        if qa_set.is_forget:
            record.update({"rejection": rejections[i], "rejection_rouge_l_recall": idk_rouge[i],
                           "rejection_entailment_label": idk_labels[i], "fluency_entropy": entropies[i],
                           "fluency": clean[i]})
        record.update(s.extra)
        records.append(record)
    return values, records


# ---- the suites ----

def _missing_judge_reasons(judges: Judges) -> dict[str, str]:
    reasons = {}
    if judges.embedder is None:
        reasons["cosine_similarity"] = "no embedding model"
    if judges.nli is None:
        reasons["entailment"] = "no NLI model"
        reasons["idk_entailment"] = "no NLI model"
    return reasons


def _named(aggregate: metrics.Aggregate, name: str) -> metrics.Aggregate:
    aggregate.name = name
    return aggregate


def qa_suite(
    suite: Suite, sets: list[QASet], model, formatter, judges: Judges, config: EvalConfig, targeted: bool | None,
    progress=None,
) -> tuple[dict[str, Any], dict[str, list[dict]], list[metrics.Aggregate], dict[str, float | None]]:
    """Indicators of every set, the flat summary (fractions; aggregates in percent; keys named by the suite's
    `summary_key`) and the aggregates."""
    values: dict[str, float | None] = {}
    records: dict[str, list[dict]] = {}
    if any(qa_set.is_forget for qa_set in sets):
        load_fluency(judges, config, model)
    for qa_set in sets:
        qa_set.seconds = {}
        set_values, set_records = evaluate_set(qa_set, model, formatter, judges, config.max_new_tokens,
                                               config.batch_size, config.seed, progress,
                                               get_protocol(config.protocol), qa_set.seconds,
                                               config.generation_batch_size)
        records[qa_set.name] = set_records
        for indicator, value in set_values.items():
            values[f"{qa_set.name}_{indicator}"] = value
    reasons = _missing_judge_reasons(judges)
    if suite.name == "tofu":
        mu = metrics.model_utility(values, reasons)
    else:  # real-world: MU over the neighbour set's six indicators (Section 5.2)
        mu = metrics.model_utility(values, reasons, keys=[f"neighbour_{i}" for i in INDICATORS])
    ufe = metrics.untargeted_forget_efficacy(values, reasons)
    tfe = metrics.targeted_forget_efficacy(values, reasons)
    aggregates = [mu, ufe, tfe]
    if targeted is None:
        aggregates.append(_named(metrics.overall(tfe, ufe, mu, targeted=False), "OVR_untargeted"))
        aggregates.append(_named(metrics.overall(tfe, ufe, mu, targeted=True), "OVR_targeted"))
    else:
        aggregates.append(metrics.overall(tfe, ufe, mu, targeted=targeted))
    summary: dict[str, Any] = {}
    for qa_set in sets:
        for indicator in (*INDICATORS, "idk_entailment"):
            key = f"{qa_set.name}_{indicator}"
            if key not in values:
                continue
            summary[suite.summary_key(qa_set.prefix, indicator)] = values[key]
        if qa_set.is_forget:  # OpenUnlearning's forget_truth_ratio: mean of min(r, 1/r) (the paper uses 1 - that)
            ratios = [r["truth_ratio"] for r in records[qa_set.name]]
            summary[f"{qa_set.prefix}_truth_ratio"] = sum(min(r, 1 / r) for r in ratios) / len(ratios)
            summary[f"{qa_set.prefix}_fluency_entropy"] = values[f"{qa_set.name}_fluency_entropy"]
            summary[f"{qa_set.prefix}_fluency"] = values[f"{qa_set.name}_fluency"]  # OU's forget_Q_A_gibberish
            if values[f"{qa_set.name}_fluency"] is None:
                summary[f"{qa_set.prefix}_fluency_missing"] = f"not available: {judges.fluency_reason}"
    for aggregate in aggregates:
        summary[aggregate.name] = None if aggregate.value is None else 100 * aggregate.value
    return summary, records, aggregates, values


def load_fluency(judges: Judges, config: EvalConfig, model) -> None:
    """Load the gibberish classifier of `config.fluency_model` (None: OpenUnlearning's) into `judges`, once: the
    judges are shared by every evaluation of a run and by the attacked copies, and a classifier that did not load
    is not tried again (its reason stays)."""
    name = config.fluency_model or DEFAULT_FLUENCY_MODEL
    if judges.fluency_name == name:
        return
    device = next(model.parameters()).device
    judges.fluency, judges.fluency_reason = load_fluency_judge(name, "cuda" if device.type == "cuda" else "cpu")
    judges.fluency_name = name


def fluency_section(judges: Judges) -> dict[str, Any]:
    """The gibberish classifier of the report: its name and the label of the class it reads, or why it is
    missing."""
    judge = judges.fluency
    return {"model": getattr(judge, "name", None), "clean_label": getattr(judge, "clean_label", None),
            "missing": judges.fluency_reason}


def openunlearning_metrics(
    sets: list[QASet], records: dict[str, list[dict]], summary: dict[str, Any], model, formatter, config: EvalConfig,
    retain: tuple[list[float] | None, float | None],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """OpenUnlearning's metrics in the TOFU suite: ({"values": {key: value}, "notes": [...]}, logs for
    TOFU_EVAL.json in OpenUnlearning's layout)."""
    forget = records["forget"]
    scores = ou.truth_ratio_scores([r["nll_paraphrased"] for r in forget], [r["nll_perturbed"] for r in forget])
    logs: dict[str, Any] = {"forget_truth_ratio": {
        "agg_value": sum(min(t, 1 / (t + ou.EPS)) for t in scores) / len(scores),
        "value_by_index": {str(r["index"]): {"score": t} for r, t in zip(forget, scores)},
    }}
    if summary.get("forget_fluency") is not None:
        logs["forget_Q_A_gibberish"] = {"agg_value": summary["forget_fluency"], "value_by_index": {
            str(r["index"]): {"score": r["fluency"], "generation": r["generation"]} for r in forget}}
    values: dict[str, Any] = {"model_utility": ou.model_utility_ou(summary)}
    notes = ["model_utility: OpenUnlearning's harmonic mean of 9 values (" + ", ".join(ou.OU_MODEL_UTILITY_KEYS)
             + "); MU is the paper's, of 18"]
    retain_ratios, retain_auc = retain
    if retain_ratios:
        values["forget_quality"] = ou.forget_quality(scores, retain_ratios)
        notes.append(f"forget_quality: KS test against {len(retain_ratios)} truth ratios of {config.retain_logs}")
    else:
        values["forget_quality"] = None
        notes.append("forget_quality: absent, no --retain-logs (a retain model's TOFU_EVAL.json) to compare with"
                     if not config.retain_logs else f"forget_quality: absent, {config.retain_logs} has no forget "
                     "truth ratios")
    if config.holdout:
        forget_set = next(s for s in sets if s.is_forget)
        privacy_values, privacy_logs, privacy_notes = privacy_metrics(
            model, formatter, [(s.question, s.answer) for s in forget_set.samples],
            read_holdout(config.holdout, config.max_samples), config.batch_size, retain_auc)
        values.update(privacy_values)
        logs.update(privacy_logs)
        notes += privacy_notes
    else:
        notes.append("privacy (MIA AUCs, privleak, extraction strength, exact memorisation): no --holdout FILE")
    return {"values": values, "notes": notes}, logs


def _qa_section(suite: str, sets: list[QASet], summary: dict[str, Any], values: dict[str, float | None],
                openunlearning: dict[str, Any], aggregates: list[metrics.Aggregate],
                fluency: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"suite": suite, "sets": [{"name": s.name, "source": s.source, "n": len(s.samples), "task_id": s.task_id,
                                      "file_rows": s.file_rows, "fields": field_sources(s.samples),
                                      "seconds": s.seconds} for s in sets],
            "summary": summary, "values": values, "openunlearning": openunlearning,
            "aggregates": [asdict(a) for a in aggregates], "fluency": fluency}


def _tofu_sets(config: EvalConfig) -> list[QASet]:
    return load_tofu_sets(config.split, config.data_dir, config.max_samples, config.task_id,
                          get_protocol(config.protocol).max_rows)


def _forget_side(context: SuiteContext, sets: list[QASet]) -> list[QASet]:
    """The sets a QA suite scores: all of them, or the forget set alone where only its metrics are wanted."""
    return [s for s in sets if s.is_forget] if context.forget_only else sets


def run_tofu(context: SuiteContext) -> SuiteResult:
    """TOFU's forget, retain, real-authors and world-facts sets: the six indicators, MU, UFE, TFE, OVR and
    OpenUnlearning's metrics, into TOFU_EVAL.json and TOFU_SUMMARY.json."""
    config = context.config
    sets = _forget_side(context, _tofu_sets(config))
    summary, records, aggregates, values = qa_suite(TOFU_SUITE, sets, context.model, context.formatter,
                                                    context.judges, config, context.targeted, context.progress)
    openunlearning, logs = openunlearning_metrics(sets, records, summary, context.model, context.formatter, config,
                                                  context.retain)
    summary.update(openunlearning["values"])
    write_json(context.out / "TOFU_EVAL.json", {"model": context.model_name, "suite": "tofu", "sets": records, **logs})
    write_json(context.out / "TOFU_SUMMARY.json", summary)
    return SuiteResult(summary, _qa_section("tofu", sets, summary, values, openunlearning, aggregates,
                                            fluency_section(context.judges)))


def run_real_world(context: SuiteContext) -> SuiteResult:
    """The forget people and their neighbours (`--forget`, `--retain`): the six indicators, MU over the
    neighbours, UFE, TFE, OVR, into REAL_WORLD_EVAL.json and REAL_WORLD_SUMMARY.json (rw_ keys in SUMMARY.json)."""
    config = context.config
    sets = _forget_side(context, load_real_world_sets(config.forget, config.retain, config.max_samples))
    summary, records, aggregates, values = qa_suite(REAL_WORLD_SUITE, sets, context.model, context.formatter,
                                                    context.judges, config, context.targeted, context.progress)
    write_json(context.out / "REAL_WORLD_EVAL.json", {"model": context.model_name, "suite": "real-world",
                                                      "sets": records})
    write_json(context.out / "REAL_WORLD_SUMMARY.json", summary)
    return SuiteResult({f"rw_{k}": v for k, v in summary.items()},
                       _qa_section("real-world", sets, summary, values, {}, aggregates,
                                   fluency_section(context.judges)))


def run_privacy(context: SuiteContext) -> SuiteResult:
    """TOFU's forget rows (members) against `--holdout` rows (non-members): the MIA AUCs (LOSS, ZLib, Min-K%,
    Min-K%++, GradNorm, and the reference attack with --mia-reference), privleak, extraction strength, exact
    memorisation, the forget set's paraphrase probability and truth ratio, and OpenUnlearning's aggregates
    (`aggregates.py`), into PRIVACY_EVAL.json and PRIVACY_SUMMARY.json."""
    config = context.config
    forget_set = _tofu_sets(config)[0]
    forget = [(s.question, s.answer) for s in forget_set.samples]
    holdout = read_holdout(config.holdout, config.max_samples)
    reference, reference_name = (load_reference_model(config.mia_reference, context.model, context.tokenizer,
                                                      config.dtype, config.trust_remote_code)
                                 if config.mia_reference else (None, None))
    values, logs, notes = privacy_metrics(context.model, context.formatter, forget, holdout, config.batch_size,
                                          context.retain[1], gradnorm=True, reference=reference,
                                          progress=context.progress)
    del reference
    values.setdefault("mia_reference", None)
    notes += privacy_suite_notes(reference_name)
    values.update(paraphrase_metrics(context.model, context.formatter,
                                     [(s.question, s.paraphrased or s.answer, s.perturbed) for s in forget_set.samples],
                                     config.batch_size, context.progress))
    scores, retain_aucs, aggregate_notes = privacy_aggregates(values, config, context.out)
    values.update({key: score.value for key, score in scores.items()})
    notes += aggregate_notes
    write_json(context.out / "PRIVACY_EVAL.json", {"model": context.model_name, "suite": "privacy", **logs})
    write_json(context.out / "PRIVACY_SUMMARY.json", values)
    return SuiteResult(values, {"suite": "privacy", "openunlearning": {"values": values, "notes": notes},
                                "aggregates_openunlearning": {key: score._asdict() for key, score in scores.items()},
                                "retain_aucs": retain_aucs,
                                "sets": [{"name": "forget", "source": forget_set.source, "n": len(forget),
                                          "task_id": forget_set.task_id, "file_rows": forget_set.file_rows},
                                         {"name": "holdout", "source": config.holdout, "n": len(holdout)}]})


TOFU_SUITE = Suite(
    "tofu", run_tofu, files=("TOFU_EVAL.json", "TOFU_SUMMARY.json"), needs_judges=True,
    forget_metrics=(("forget_Q_A_ROUGE", 1), ("forget_Q_A_Prob", 1), ("forget_Truth_Ratio", 1), ("UFE", -1)),
    headline="UFE", forget_rows="TOFU_EVAL.json", utility="MU", attacks=QA_ATTACKS,
    # the paper's aggregates (percent) and OpenUnlearning's (fractions); whether forgetting ran its course, and
    # the taught retain answers were kept (ROUGE-L recall of greedy answers)
    bench_columns=(BenchColumn("UFE", "UFE", True), BenchColumn("TFE", "TFE", True), BenchColumn("MU", "MU", True),
                   BenchColumn("OVR", "OVR", True), BenchColumn("model_utility", "model_utility", True, ".3f"),
                   BenchColumn("forget_quality", "forget_quality", True, ".3g"),
                   BenchColumn("forget_Q_A_ROUGE", "forget ROUGE-L", False, ".3f"),
                   BenchColumn("retain_Q_A_ROUGE", "retain ROUGE-L", True, ".3f")),
    # the paper's names of the indicators; OpenUnlearning's key where it computes the same metric on that set
    paper_names=(("rouge", "ROUGE"), ("probability", "Probability"), ("truth_ratio", "Truth_Ratio"),
                 ("token_entropy", "Token_Entropy"), ("cosine_similarity", "Cosine_Similarity"),
                 ("entailment", "Entailment_Score"), ("idk_entailment", "IDK_Entailment_Score")),
    openunlearning_names=(
        (("forget", "rouge"), "forget_Q_A_ROUGE"), (("forget", "probability"), "forget_Q_A_Prob"),
        (("retain", "rouge"), "retain_Q_A_ROUGE"), (("retain", "probability"), "retain_Q_A_Prob"),
        (("retain", "truth_ratio"), "retain_Truth_Ratio"),
        (("ra", "rouge"), "ra_Q_A_ROUGE"), (("ra", "probability"), "ra_Q_A_Prob_normalised"),
        (("ra", "truth_ratio"), "ra_Truth_Ratio"),
        (("wf", "rouge"), "wf_Q_A_ROUGE"), (("wf", "probability"), "wf_Q_A_Prob_normalised"),
        (("wf", "truth_ratio"), "wf_Truth_Ratio")))
# Its forget set is named as TOFU's (SUMMARY.json adds rw_ to every key), its neighbour set by the paper's names.
REAL_WORLD_SUITE = Suite("real-world", run_real_world, files=("REAL_WORLD_EVAL.json", "REAL_WORLD_SUMMARY.json"),
                         needs_judges=True,
                         forget_metrics=(("rw_forget_Q_A_ROUGE", 1), ("rw_forget_Q_A_Prob", 1),
                                         ("rw_forget_Truth_Ratio", 1), ("rw_UFE", -1)),
                         headline="rw_UFE", forget_rows="REAL_WORLD_EVAL.json", utility="rw_MU",
                         attacks=QA_ATTACKS, paper_names=TOFU_SUITE.paper_names,
                         openunlearning_names=TOFU_SUITE.openunlearning_names)
PRIVACY_SUITE = Suite("privacy", run_privacy, files=("PRIVACY_EVAL.json", "PRIVACY_SUMMARY.json"))
