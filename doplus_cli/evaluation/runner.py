"""`doplus evaluate`: run the chosen suites on one model and write the per-sample file, the summary and a
report; `--compare` puts several evaluation folders side by side.

The suites are registered by name in `SUITE_REGISTRY` (each declared in its own module: `suites.py` tofu,
real-world and privacy, `lm_eval_suite.py`, `safety.py` safety and xstest); `evaluate_model` loads the judges the
chosen suites need and runs each one's `run(context)` in the order given."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from doplus_cli import decoding, lifecycle, ownership
from doplus_cli.config import list_value
from doplus_cli.data.formatting import check_prompt_template
from doplus_cli.errors import UserError, writing
from doplus_cli.evaluation.attacks import ATTACKS, QA_SUITES, parse_attack_options, parse_attacks, parse_relearn_steps
from doplus_cli.evaluation.compute import compute_floor, linear_kernel, matmul_gflops, packed_linears, peak_memory_gb
from doplus_cli.evaluation.muse import check_muse_data
from doplus_cli.evaluation.privacy import read_holdout, read_retain_logs
from doplus_cli.evaluation.protocol import get_protocol
from doplus_cli.evaluation.safety import overall_section
from doplus_cli.evaluation.suite_api import EvalConfig, SuiteContext
from doplus_cli.evaluation.suite_registry import SUITE_REGISTRY, SUITES
from doplus_cli.evaluation.suites import (
    Judges,
    load_real_world_sets,
    load_tofu_sets,
)
from doplus_cli.files import atomic_write_text, write_json
from doplus_cli.losses import FORGET_LOSSES
from doplus_cli.optim import kernels
from doplus_cli.progress import counting_tokens, progress_bar

# What runs the attacks once the suites are done (`engine.attacks.attack_runner`): the relearning attacks train
# through the engine, a layer above, so the command hands it in.
AttackRunner = Callable[[SuiteContext, dict[str, Any]], dict[str, Any]]


def parse_suites(given: Sequence[str]) -> tuple[str, ...]:
    """`--suite`'s names, each a suite of `SUITES`; one line naming the first that is not."""
    suites = tuple(given)
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
    values["suites"] = parse_suites(list_value(values.pop("suite") or "", str, False, "--suite"))
    values["tasks"] = list_value(values.get("tasks") or "", str, False, "--tasks")
    values["attacks"] = parse_attacks(list_value(values.get("attacks") or "", str, False, "--attacks"),
                                      values["suites"])
    values["relearn_steps"] = parse_relearn_steps(values.get("relearn_steps"))
    values["attack_options"] = parse_attack_options(values.pop("attack_option", None), values["attacks"])
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


# The suites an evaluation has finished so far, with their results: what `--resume` keeps. Removed once eval.json,
# the finished evaluation, is written.
FINISHED_SUITES = "suites.partial.json"


EVALUATE = "doplus evaluate"  # the command an evaluation folder's record names (ownership.py)


def eval_outputs(suites: tuple[str, ...]) -> tuple[str, ...]:
    """The entries `doplus evaluate` of `suites` writes in its folder: recorded before it writes any of them."""
    names = [name for suite in suites if suite in SUITE_REGISTRY for name in SUITE_REGISTRY[suite].files]
    return (*names, "SUMMARY.json", "report.md", "eval.json", FINISHED_SUITES, "attacks")


def prepare_eval_dir(path: str, overwrite: bool, resume: bool = False, suites: tuple[str, ...] = (),
                     write: bool = True) -> Path:
    """Create `path`, or refuse one holding an evaluation unless `overwrite` (what that evaluation wrote is removed,
    nothing else) or `resume` (an interrupted one, continued); files of the user's that an evaluation of `suites`
    would write over are refused in one line. `write` False: the same checks, nothing created or removed."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UserError(f"{path}: --out exists and is a file, not a folder")
    if resume and overwrite:
        raise UserError("--resume and --overwrite: --resume continues the evaluation in --out, --overwrite "
                        "replaces it; give one of them")
    if write:
        with writing(out, "; choose another --out"):
            out.mkdir(parents=True, exist_ok=True)
    names = eval_outputs(suites)
    if resume and ownership.is_started(out, EVALUATE):
        if (out / "eval.json").is_file():
            raise UserError(f"{path}: holds a finished evaluation, nothing to resume (pass --overwrite instead of "
                            "--resume to run it again)")
        if write:
            ownership.claim(out, EVALUATE, names)
        return out
    then = ", or --resume to continue an interrupted one"
    if write:
        ownership.begin(out, EVALUATE, names, overwrite, then=then)
    else:
        ownership.check_start(out, EVALUATE, names, overwrite, then=then)
    return out


def _settings(config: EvalConfig, model_name: str, targeted: bool | None) -> dict[str, Any]:
    """What decides the suites' results: an interrupted evaluation's finished suites are kept only for these."""
    values = {k: v for k, v in asdict(config).items() if k not in ("extra", "overwrite", "resume", "out")}
    return json.loads(json.dumps({**values, "model": model_name, "targeted": targeted}, default=str))


def _finished_suites(out: Path, settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The suites an interrupted evaluation in `out` finished with the same settings; another setting is refused."""
    path = out / FINISHED_SUITES
    if not path.is_file():
        return {}
    saved = json.loads(path.read_text())
    changed = sorted(k for k in set(saved["settings"]) | set(settings)
                     if saved["settings"].get(k) != settings.get(k))
    if changed:
        raise UserError(f"{path}: the interrupted evaluation ran with other settings ({', '.join(changed)}); continue "
                        "it with the same ones, or pass --overwrite")
    return saved["suites"]


def evaluate_model(model, tokenizer, config: EvalConfig, out: Path, model_name: str, progress=None,
                   targeted: bool | None = None, judges: Judges | None = None,
                   command: dict[str, Any] | None = None, attacks: AttackRunner | None = None,
                   attack_when: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any]:
    """Run the suites on a loaded model and write the outputs into `out`; return the eval record.

    `judges` (the embedding and NLI models) can be passed in, so evaluations during training load them once.
    `command` ({"started": perf_counter at the command's start, "rates": `matmul_gflops`, "dtype"}), from `doplus
    evaluate`: the record gets the compute floor of the tokens the suites pushed through the model, over each
    kernel's faster rate of the command's start and the suites' end.
    `attacks` (`engine.attacks.attack_runner`, for `config.attacks`): once the suites are done, and outside their
    timing, it runs them again on attacked copies of the model and gives eval.json's "attacks" section.
    `attack_when(record)`: with it, the attacks run only when it holds for the suites' record (an evaluation
    during training that may turn out to be the run's last, `--stop-when`); the record then names no attacks when
    they did not run.
    """
    started = time.perf_counter()
    decode_calls = decoding.KERNEL.compiled_calls
    with counting_tokens() as tokens, packed_linears(model) as packed:
        record, context = _evaluate_model(model, tokenizer, config, out, model_name, progress, targeted, judges,
                                          started)
    if command is not None and model is not None:
        parameters = sum(p.numel() for p in model.parameters())
        # measured again at the end, each kernel's faster rate kept: one second of timings can read a rate a fifth
        # below the machine's (another process, frequency scaling), which would move the ratio as much with no
        # change in the evaluation's own speed
        parameter = next(model.parameters())
        measured = [command["rates"], matmul_gflops(parameter.dtype, parameter.device)]
        rates = {name: max(run[name] for run in measured) for name in measured[0]}
        record["compute"] = compute_floor(tokens, parameters, rates, time.perf_counter() - command["started"],
                                          command["dtype"], packed, decoding.KERNEL.compiled_calls - decode_calls,
                                          kernels.fallbacks(), linear_kernel(model))
        record["compute"]["kernel_gflops_measured"] = measured
        record["compute"]["peak_memory_gb"], record["compute"]["peak_memory_kind"] = peak_memory_gb(parameter.device)
    if config.attacks and attack_when is not None and not attack_when(record):
        record["config"]["attacks"] = None
    elif config.attacks:
        if attacks is None:
            raise RuntimeError("config.attacks needs an attack runner (engine.attacks.attack_runner)")
        lifecycle.stage("running the attacks")
        record["attacks"] = attacks(context, record)
    from doplus_cli.evaluation.report import render_eval_markdown

    atomic_write_text(out / "report.md", render_eval_markdown(record))
    write_json(out / "eval.json", record)  # last: an evaluation with eval.json is finished
    (out / FINISHED_SUITES).unlink(missing_ok=True)
    return record


def _evaluate_model(model, tokenizer, config: EvalConfig, out: Path, model_name: str, progress, targeted,
                    judges: Judges | None, started: float) -> tuple[dict[str, Any], SuiteContext]:
    from doplus_cli.data.formatting import PromptFormatter

    formatter = PromptFormatter(tokenizer, max_length=512, template=config.prompt_template) if tokenizer is not None \
        else None  # None: --responses
    protocol = get_protocol(config.protocol)
    device = str(next(model.parameters()).device) if model is not None else "cpu"
    chosen = [SUITE_REGISTRY[name] for name in config.suites]
    settings = _settings(config, model_name, targeted)
    finished = _finished_suites(out, settings) if config.resume else {}
    left = [suite for suite in chosen if suite.name not in finished]
    if judges is None:
        judges = load_judges(config, "cuda" if device.startswith("cuda") else "cpu",
                             any(suite.needs_judges for suite in left))
    safety_judges = None
    if any(suite.needs_safety_judges for suite in left):
        from doplus_cli.evaluation.safety_judges import load_safety_judges

        safety_judges = load_safety_judges(config.guard_model, device, config.dtype, config.refusal_model,
                                           config.refusal_model_prompt,
                                           need_guard=any(suite.needs_guard for suite in left))
    retain = read_retain_logs(config.retain_logs) if config.retain_logs else (None, None)
    context = SuiteContext(model, tokenizer, formatter, config, out, model_name, progress, targeted, judges,
                           safety_judges, retain)
    summary: dict[str, Any] = {}
    sections: list[dict[str, Any]] = []
    timings: dict[str, float] = {}
    utility_avg = None  # lm-eval's mean headline metric, for the safety OVR
    for suite in chosen:
        if suite.name not in finished:
            lifecycle.stage(f"running the {suite.name} suite")
            suite_started = time.perf_counter()
            result = suite.run(context)
            finished[suite.name] = {"summary": result.summary, "section": result.section,
                                    "utility_avg": result.utility_avg, "seconds": time.perf_counter() - suite_started}
            write_json(out / FINISHED_SUITES, {"settings": settings, "suites": finished})
        done = finished[suite.name]
        summary.update(done["summary"])
        sections.append(done["section"])
        if done["utility_avg"] is not None:
            utility_avg = done["utility_avg"]
        timings[suite.name] = done["seconds"]
    overall = overall_section(summary, utility_avg)  # None without both a safety AVG and an lm-eval utility AVG
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
    write_json(out / "SUMMARY.json", summary)
    return record, context


def check_responses(config: EvalConfig) -> None:
    """--responses: only the safety, xstest (and lm-eval, on --model) suites; the file is read before any model."""
    other = [s for s in config.suites if s not in ("safety", "xstest", "lm-eval")]
    if other or not any(s in ("safety", "xstest") for s in config.suites):
        raise UserError("--responses works with --suite safety and/or xstest (and lm-eval on --model), not "
                        + (other[0] if other else "lm-eval alone"))
    from doplus_cli.evaluation.safety import read_responses

    read_responses(config.responses)


def run_evaluate(config: EvalConfig, console: Console | None = None,
                 attacks: AttackRunner | None = None) -> dict[str, Any]:
    """Load the model, run the suites, write the outputs; return the eval record. The output folder is held, and
    SIGTERM and SIGINT end the evaluation at once (exit code 128 + the signal's number), from the start: `--resume`
    then keeps the suites it finished."""
    with lifecycle.run_guard():
        return _run_evaluate(config, console, attacks)


def check_attacks(config: EvalConfig) -> None:
    """The attacks' own inputs, before the model loads: the relearning file's rows, or a QA suite to take the
    default relearning rows from."""
    if config.attacks and config.responses:
        raise UserError("--attacks needs a model to attack: --responses scores responses already written")
    if not any(ATTACKS[name].kind == "relearn" for name in config.attacks):
        return
    if config.relearn_data is not None:
        from doplus_cli.data.sources import Keys, open_source

        open_source(config.relearn_data, "--relearn-data", Keys())
    elif not set(QA_SUITES) & set(config.suites):
        raise UserError("--attacks relearn needs --relearn-data FILE with --suite " + ",".join(config.suites)
                        + " (the default relearning rows are half of the tofu or real-world forget rows)")


def check_evaluation(config: EvalConfig) -> EvalConfig:
    """Every check an evaluation makes before its model loads (its files, their fields, the suites' options); the
    config with what it reads from a run's final/ (the forget task). A failed check is one line."""
    if config.max_samples is not None and config.max_samples < 1:
        raise UserError(f"--max-samples must be at least 1, got {config.max_samples}")
    if "real-world" in config.suites:  # a missing file or field stops here, before the model loads
        load_real_world_sets(config.forget, config.retain, config.max_samples)
    if "privacy" in config.suites and config.holdout is None:
        raise UserError("--suite privacy needs --holdout FILE (non-member rows, e.g. TOFU's holdout10)")
    if config.task_id is not None and config.task_id < 0:
        raise UserError(f"--task-id must be a whole number >= 0, got {config.task_id}")
    if config.task_id is None:  # a run's final/: the task it unlearned, as its template
        config = replace(config, task_id=task_from_run(config.model))
    if config.data_dir is not None and {"tofu", "privacy"} & set(config.suites):  # a bad file or task stops here
        load_tofu_sets(config.split, config.data_dir, config.max_samples, config.task_id,
                       get_protocol(config.protocol).max_rows)
    if config.retain_logs:
        read_retain_logs(config.retain_logs)  # a bad file stops here, before the model loads
    if config.holdout:
        read_holdout(config.holdout, config.max_samples)
    if "muse" in config.suites:  # a bad MUSE file or field stops here, before the model loads
        check_muse_data(config)
    if config.responses is not None:
        check_responses(config)
    check_attacks(config)
    return config


def _default_out() -> str:
    return "evals/" + time.strftime("%Y%m%d-%H%M%S")


def evaluate_dry_run(config: EvalConfig) -> str:
    """`doplus evaluate --dry-run`: `check_evaluation`, the model found (not loaded) and the output folder's
    checks, then what the evaluation would do, as text. Nothing loaded or written."""
    from doplus_cli.models import check_model

    config = check_evaluation(config)
    out = prepare_eval_dir(config.out or _default_out(), config.overwrite, config.resume, config.suites,
                           write=False)
    if config.responses is not None and "lm-eval" not in config.suites:
        model = f"none: scores the responses in {config.responses}"
    else:
        model = check_model(config.model)[0]
    attacks = f"; under attack: {', '.join(config.attacks)}" if config.attacks else ""
    action = ("continues the evaluation there" if config.resume and (out / ownership.RECORD_NAME).is_file()
              else "a new evaluation" if not out.is_dir() else "writes its files there")
    return "\n".join([
        "doplus evaluate --dry-run: every check made before the model loads passed; nothing was loaded or written",
        f"model: {model}",
        f"suites: {', '.join(config.suites)}{attacks}",
        f"out: {out}: {action} ({', '.join(n for n in eval_outputs(config.suites) if n != FINISHED_SUITES)})",
    ])


def _run_evaluate(config: EvalConfig, console: Console | None, attacks: AttackRunner | None) -> dict[str, Any]:
    from doplus_cli.models import load_model_and_tokenizer

    lifecycle.stage("checking the evaluation's files")
    started = time.perf_counter()
    console = console or Console(stderr=True)
    config = check_evaluation(config)
    out = lifecycle.hold(config.out or _default_out(), "doplus evaluate")
    out = prepare_eval_dir(str(out), config.overwrite, config.resume, config.suites)
    lifecycle.stage("loading the model")
    if config.responses is not None and "lm-eval" not in config.suites:  # nothing to generate: no model
        model, tokenizer, name = None, None, f"responses from {config.responses}"
    else:
        model, tokenizer, name = load_model_and_tokenizer(config.model, config.dtype, config.trust_remote_code)
    import torch

    if torch.cuda.is_available() and model is not None:
        model.to("cuda")
    targeted = config.targeted if config.targeted is not None else targeted_from_run(config.model)
    if config.prompt_template is None:
        config = replace(config, prompt_template=template_from_run(config.model))
    command = None
    if model is not None:  # the floor's matmul rate, in the model's dtype, on its device, in this run
        parameter = next(model.parameters())
        command = {"started": started, "dtype": str(parameter.dtype).removeprefix("torch."),
                   "rates": matmul_gflops(parameter.dtype, parameter.device)}
    progress = progress_bar(console)
    with progress:
        return evaluate_model(model, tokenizer, config, out, name, progress, targeted, command=command,
                              attacks=attacks)
