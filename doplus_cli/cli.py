"""The `doplus` command: one function per subcommand; each parses, builds a config and calls the engine."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

import typer
from rich.console import Console
from rich.text import Text

from doplus_cli.bench.schemes import DEFAULT_SCHEMES, DEFAULT_SEEDS, SCHEMES
from doplus_cli.config import default_of
from doplus_cli.data.formatting import TEMPLATE_HELP
from doplus_cli.errors import EXIT_FILE_VARIABLE, UserError, quiet_worker, worker_exit_code
from doplus_cli.evaluation.runner import EvalConfig, resolve_eval_config, run_evaluate

app = typer.Typer(
    name="doplus",
    help="Machine unlearning for LLMs with the DualOptim+ optimizer.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts show [default: ...] and hf:NAME[:CONFIG][@SPLIT] literally
)
bench_app = typer.Typer(help="Measure optimizer speed and memory; compare the update schemes end to end.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")
recipes_app = typer.Typer(help="The shipped recipes: list them, copy one (with its data files) to edit and run.",
                          no_args_is_help=True)
app.add_typer(recipes_app, name="recipes")

err_console = Console(stderr=True, highlight=False, soft_wrap=True)
_debug = {"on": False}
_argv: dict[str, list[str]] = {"value": []}  # the arguments main() parsed, for --num-processes relaunching


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks for errors."),
) -> None:
    _debug["on"] = debug


REPORT_TO_HELP = ("Experiment trackers through accelerate: none, or one or more of tensorboard, wandb, mlflow, "
                  "trackio, all (comma-separated; files under OUT/trackers/, W&B offline unless WANDB_MODE says "
                  "otherwise) [default: none]")
SIMILARITY_HELP = ("Record in metrics.jsonl the cosine similarity of the objectives' latest updates and gradients "
                   "(update_cosine, grad_cosine; the paper's Figure 2). Costs a copy of the weights per objective.")
PROTOCOL_HELP = ("Judges and generation budget: doplus (all-MiniLM-L6-v2, --max-new-tokens new tokens, Token "
                 "Entropy over the generated ids) or paper (the DualOptim+ code: paraphrase-MiniLM-L6-v2, 200 tokens "
                 "in total, Token Entropy over the re-tokenised text).")

PRECISION_HELP = ("Training precision: fp32 (float32 weights and compute), bf16-mixed (float32 master weights and "
                  "optimizer states, bf16 autocast compute) or bf16 (bf16 weights with a compensated update in every "
                  "optimizer); auto: bf16-mixed where the model loads in bf16 (CUDA), fp32 otherwise.")
SAVE_DTYPE_HELP = "final/'s dtype: float32 or bfloat16; auto: float32 under fp32, bfloat16 under the bf16 precisions."
DTYPE_HELP = ("Load dtype (the reference model of NPO/DPO/KL, LoRA's frozen base under bf16-mixed): auto (bf16 on "
              "CUDA, fp32 on CPU), float32, bfloat16.")


def _default(name: str) -> str:
    return f" [default: {default_of(name)}]"


@app.command()
def unlearn(
    recipe: str | None = typer.Option(None, "--recipe", help="YAML recipe; flags given here override its values."),
    model: str | None = typer.Option(
        None, "--model", help="Hub id, local model folder or .gguf file [default: embedded SmolLM2-135M-Instruct]"
    ),
    dtype: str | None = typer.Option(None, "--dtype", help=DTYPE_HELP + _default("dtype")),
    precision: str | None = typer.Option(None, "--precision", help=PRECISION_HELP + _default("precision")),
    save_dtype: str | None = typer.Option(None, "--save-dtype", help=SAVE_DTYPE_HELP + _default("save_dtype")),
    trust_remote_code: bool | None = typer.Option(
        None, "--trust-remote-code/--no-trust-remote-code", help="Allow the model's own code to run." + _default(
            "trust_remote_code")
    ),
    forget: str | None = typer.Option(None, "--forget", help="Forget set: FILE.jsonl or hf:NAME[:CONFIG][@SPLIT]."),
    retain: str | None = typer.Option(
        None, "--retain", help="Retain set: FILE.jsonl, hf:NAME[:CONFIG][@SPLIT], or tofu-authors (the DualOptim+ "
        "authors' retain set for --forget's file and task)."),
    task_id: int | None = typer.Option(None, "--task-id", help="Forget files whose rows carry task_id (the authors' "
                                       "TOFU files): the task to unlearn [default: 1]"),
    task_ids: str | None = typer.Option(None, "--task-ids", help="With --continual: the tasks, in order (1,2,3)."),
    continual: bool | None = typer.Option(None, "--continual/--no-continual", help="Unlearn --task-ids one after "
                                          "another, each from the previous task's final model." + _default(
                                              "continual")),
    question_key: str | None = typer.Option(None, "--question-key", help="Question field." + _default("question_key")),
    answer_key: str | None = typer.Option(None, "--answer-key", help="Answer field." + _default("answer_key")),
    max_length: int | None = typer.Option(None, "--max-length", help="Tokens per example." + _default("max_length")),
    prompt_template: str | None = typer.Option(None, "--prompt-template", help=TEMPLATE_HELP),
    answers_from_model: bool | None = typer.Option(
        None, "--answers-from-model/--no-answers-from-model",
        help="Use the starting model's own greedy answers as targets (real-world setting)." + _default(
            "answers_from_model"),
    ),
    max_new_tokens: int | None = typer.Option(
        None, "--max-new-tokens", help="Tokens generated per answer (targets, sample table)." + _default(
            "max_new_tokens")
    ),
    loss: str | None = typer.Option(
        None, "--loss", help="FORGET[+RETAIN]: FORGET in GA, NPO, DPO, ME, IDK, SimNPO, RMU, UNDIAL, WGA, SatImp, "
        "CE-U; RETAIN in GD, KL, AP, EMBED (RMU's activation term)." + _default("loss")
    ),
    beta: float | None = typer.Option(None, "--beta", help="Temperature of NPO, DPO and AP." + _default("beta")),
    simnpo_beta: float | None = typer.Option(None, "--simnpo-beta", help="SimNPO's beta." + _default("simnpo_beta")),
    simnpo_gamma: float | None = typer.Option(
        None, "--simnpo-gamma", help="SimNPO's reward margin gamma." + _default("simnpo_gamma")),
    undial_beta: float | None = typer.Option(
        None, "--undial-beta", help="UNDIAL's reduction of the true token's reference logit." + _default(
            "undial_beta")),
    wga_beta: float | None = typer.Option(None, "--wga-beta", help="WGA's exponent on p_t." + _default("wga_beta")),
    satimp_beta1: float | None = typer.Option(
        None, "--satimp-beta1", help="SatImp's exponent on p_t." + _default("satimp_beta1")),
    satimp_beta2: float | None = typer.Option(
        None, "--satimp-beta2", help="SatImp's exponent on 1 - p_t." + _default("satimp_beta2")),
    rmu_layer: int | None = typer.Option(
        None, "--rmu-layer", help="RMU/EMBED: the decoder layer whose output is steered or held [default: 7; "
        "7/32 of the depth of a model with 7 layers or fewer]"),
    rmu_coeff: float | None = typer.Option(
        None, "--rmu-coeff", help="RMU's steering coefficient c." + _default("rmu_coeff")),
    rmu_update_layers: str | None = typer.Option(
        None, "--rmu-update-layers", help="RMU: layers whose modules train, e.g. 5,6,7 [default: the RMU layer "
        "and the two before it]"),
    rmu_modules: str | None = typer.Option(
        None, "--rmu-modules", help="RMU: the modules of those layers that train, e.g. mlp.down_proj [default: "
        "the MLP's output projection]"),
    forget_coeff: float | None = typer.Option(None, "--forget-coeff", help="Weight of the forget loss." + _default(
        "forget_coeff")),
    retain_coeff: float | None = typer.Option(None, "--retain-coeff", help="Weight of the retain loss." + _default(
        "retain_coeff")),
    scheme: str | None = typer.Option(None, "--scheme", help="joint, alternate, dualoptim or doplus." + _default(
        "scheme")),
    optimizer: str | None = typer.Option(None, "--optimizer", help="adamw or muon (doplus)." + _default("optimizer")),
    state_bits: int | None = typer.Option(None, "--state-bits", help="32 or 8 (blockwise 8-bit states)." + _default(
        "state_bits")),
    doplus_rule: str | None = typer.Option(
        None, "--doplus-rule", help="DualOptim+'s AdamW rule: safeguarded (floor on the denominator, steps at most "
        "10 lr) or paper (exactly as published)." + _default("doplus_rule"),
    ),
    forget_freq: int | None = typer.Option(None, "--forget-freq", help="F_f: forget steps per cycle." + _default(
        "forget_freq")),
    retain_freq: int | None = typer.Option(None, "--retain-freq", help="F_r: retain steps per cycle." + _default(
        "retain_freq")),
    betas: str | None = typer.Option(None, "--betas", help="AdamW betas as B1,B2 [default: 0.9,0.95]"),
    steps: int | None = typer.Option(None, "--steps", help="Optimizer steps." + _default("steps")),
    lr: float | None = typer.Option(None, "--lr", help="Peak learning rate." + _default("lr")),
    forget_lr: float | None = typer.Option(None, "--forget-lr", help="Learning rate of forget steps [default: --lr]"),
    batch_size: int | None = typer.Option(None, "--batch-size", help="Examples per device per micro-step." + _default(
        "batch_size")),
    grad_accum: int | None = typer.Option(None, "--grad-accum", help="Micro-steps per optimizer step (averaged)."
                                          + _default("grad_accum")),
    warmup_steps: int | None = typer.Option(
        None, "--warmup-steps", help="Linear warmup, then linear decay to 0 [default: one pass over the forget set]"
    ),
    weight_decay: float | None = typer.Option(None, "--weight-decay", help="AdamW weight decay." + _default(
        "weight_decay")),
    max_grad_norm: float | None = typer.Option(None, "--max-grad-norm", help="Gradient clipping (0: off)." + _default(
        "max_grad_norm")),
    seed: int | None = typer.Option(None, "--seed", help="Seed for weights' RNG and data order." + _default("seed")),
    out: str | None = typer.Option(None, "--out", help="Output folder [default: runs/unlearn-DATE-TIME]"),
    overwrite: bool | None = typer.Option(None, "--overwrite/--no-overwrite", help="Replace the run in a non-empty"
                                          " --out folder." + _default("overwrite")),
    show_samples: int | None = typer.Option(
        None, "--show-samples", help="Questions per set shown before/after (0: none)." + _default("show_samples")
    ),
    lora_rank: int | None = typer.Option(None, "--lora-rank", help="Train LoRA adapters of rank R (peft) [default: "
                                         "0, every weight]"),
    lora_alpha: float | None = typer.Option(None, "--lora-alpha", help="LoRA alpha." + _default("lora_alpha")),
    lora_targets: str | None = typer.Option(
        None, "--lora-targets", help="Modules to adapt, comma-separated [default: peft's for the architecture]"
    ),
    lora_dropout: float | None = typer.Option(None, "--lora-dropout", help="LoRA dropout." + _default(
        "lora_dropout")),
    gradient_checkpointing: bool | None = typer.Option(
        None, "--gradient-checkpointing/--no-gradient-checkpointing",
        help="Recompute activations in backward (less memory)." + _default("gradient_checkpointing"),
    ),
    save_adapter_only: bool | None = typer.Option(
        None, "--save-adapter-only/--save-merged", help="final/ holds the LoRA adapter only [default: merged model]"
    ),
    ref_offload: str | None = typer.Option(
        None, "--ref-offload", help="cpu: keep the reference model (NPO, DPO, KL) on the CPU; 8bit: load it with "
        "LLM.int8 weights (bitsandbytes) on the device [default: a full copy on the device; its shards under FSDP]"
    ),
    fsdp: bool | None = typer.Option(
        None, "--fsdp/--no-fsdp", help="Shard weights, gradients and optimizer states across processes (FSDP2)."
    ),
    num_processes: int | None = typer.Option(
        None, "--num-processes", min=1,
        help="Run on N processes through `accelerate launch` (N GPUs, or N CPU processes over gloo).",
    ),
    save_every: int | None = typer.Option(
        None, "--save-every", help="Write checkpoints/step-N/ every N steps [default: never]"
    ),
    keep_last: int | None = typer.Option(None, "--keep-last", help="Keep the newest K checkpoints [default: all]"),
    resume: str | None = typer.Option(
        None, "--resume", help="Continue the run in --out: `--resume` alone takes its latest checkpoint, "
        "`--resume PATH` the checkpoint folder given.",
    ),
    eval_every: int | None = typer.Option(
        None, "--eval-every", help="Evaluate every N steps (and at the end) into OUT/evals/step-N/ [default: never]"
    ),
    eval_suite: str | None = typer.Option(None, "--eval-suite", help="Suite run during training." + _default(
        "eval_suite")),
    eval_split: str | None = typer.Option(None, "--eval-split", help="TOFU forget split." + _default("eval_split")),
    eval_data_dir: str | None = typer.Option(
        None, "--eval-data-dir", help="Folder of TOFU JSON-lines files [default: hf:locuslab/TOFU]"
    ),
    eval_max_samples: int | None = typer.Option(None, "--eval-max-samples", help="Questions per set [default: all]"),
    eval_max_new_tokens: int | None = typer.Option(
        None, "--eval-max-new-tokens", help="Greedy tokens per answer." + _default("eval_max_new_tokens")
    ),
    eval_batch_size: int | None = typer.Option(
        None, "--eval-batch-size", help="Prompts per batch of the evaluation during training [default: the larger of "
        "--batch-size and 8]"),
    eval_nli_model: str | None = typer.Option(
        None, "--eval-nli-model", help="NLI model [default: sileod/deberta-v3-base-tasksource-nli]"
    ),
    eval_embedding_model: str | None = typer.Option(
        None, "--eval-embedding-model", help="Embedding model [default: the protocol's]"
    ),
    eval_protocol: str | None = typer.Option(None, "--eval-protocol", help=PROTOCOL_HELP + _default("eval_protocol")),
    log_update_similarity: bool | None = typer.Option(None, "--log-update-similarity", help=SIMILARITY_HELP),
    report_to: str | None = typer.Option(None, "--report-to", help=REPORT_TO_HELP),
) -> None:
    """Unlearn a forget set while keeping a retain set; writes final/, metrics.jsonl and a report."""
    overrides = {name: value for name, value in locals().items() if name not in ("recipe", "num_processes")}
    from doplus_cli.config import resolve_config
    from doplus_cli.engine.teach import apply_teaching

    config = resolve_config(recipe, overrides)
    apply_teaching(config, err_console)  # before a launch of N processes, so that it runs once
    if num_processes is not None and num_processes > 1 and "LOCAL_RANK" not in os.environ:
        _relaunch_with_accelerate(num_processes)
    from doplus_cli.engine.unlearn import print_summary, run_unlearn

    if config.continual:
        from doplus_cli.engine.continual import print_continual, run_continual

        report = run_continual(config, err_console)
        if report:
            print_continual(report, Console(highlight=False))
        return
    report = run_unlearn(config, err_console)
    if report:
        print_summary(report, Console(highlight=False))


def _mt_default(name: str) -> str:
    from doplus_cli.config import MultitaskConfig

    return f" [default: {default_of(name, MultitaskConfig)}]"


@app.command()
def multitask(
    recipe: str | None = typer.Option(None, "--recipe", help="YAML recipe (a tasks: list); flags override it."),
    task: list[str] | None = typer.Option(
        None, "--task", help="NAME=SOURCE[,metric=exact|choice|edit_sim|rouge_l][,freq=F][,weight=W][,eval=FILE]"
        "[,lr_multiplier=X], SOURCE a JSON-lines file or hf:NAME[:CONFIG][@SPLIT]; once per task (replaces the "
        "recipe's tasks)",
    ),
    freq: str | None = typer.Option(None, "--freq", help="Each task's steps per cycle, in order: 1,2,1 [default: "
                                    "each task's freq, 1]"),
    prompt_key: str | None = typer.Option(None, "--prompt-key", help="Prompt field." + _mt_default("prompt_key")),
    answer_key: str | None = typer.Option(None, "--answer-key", help="Answer field." + _mt_default("answer_key")),
    eval_rows: int | None = typer.Option(
        None, "--eval-rows", help="Rows kept out of training for evaluation, per task without an eval file (0: none)."
        + _mt_default("eval_rows")),
    eval_every: int | None = typer.Option(
        None, "--eval-every", help="Score every task every N steps (and at the end) [default: never]"
    ),
    eval_batch_size: int | None = typer.Option(None, "--eval-batch-size", help="Prompts per generation batch."
                                               + _mt_default("eval_batch_size")),
    model: str | None = typer.Option(
        None, "--model", help="Hub id, local model folder or .gguf file [default: embedded SmolLM2-135M-Instruct]"
    ),
    dtype: str | None = typer.Option(None, "--dtype", help=DTYPE_HELP + _mt_default("dtype")),
    precision: str | None = typer.Option(None, "--precision", help=PRECISION_HELP + _mt_default("precision")),
    save_dtype: str | None = typer.Option(None, "--save-dtype", help=SAVE_DTYPE_HELP + _mt_default("save_dtype")),
    trust_remote_code: bool | None = typer.Option(
        None, "--trust-remote-code/--no-trust-remote-code", help="Allow the model's own code to run."
    ),
    max_length: int | None = typer.Option(None, "--max-length", help="Tokens per example." + _mt_default(
        "max_length")),
    max_new_tokens: int | None = typer.Option(None, "--max-new-tokens", help="Greedy tokens per evaluated answer."
                                              + _mt_default("max_new_tokens")),
    scheme: str | None = typer.Option(None, "--scheme", help="joint, alternate, dualoptim or doplus." + _mt_default(
        "scheme")),
    optimizer: str | None = typer.Option(None, "--optimizer", help="adamw or muon (doplus)." + _mt_default(
        "optimizer")),
    state_bits: int | None = typer.Option(None, "--state-bits", help="32 or 8 (blockwise 8-bit states)."
                                          + _mt_default("state_bits")),
    doplus_rule: str | None = typer.Option(
        None, "--doplus-rule", help="DualOptim+'s AdamW rule: safeguarded or paper (exactly as published)."
        + _mt_default("doplus_rule"),
    ),
    prompt_template: str | None = typer.Option(None, "--prompt-template", help=TEMPLATE_HELP),
    betas: str | None = typer.Option(None, "--betas", help="AdamW betas as B1,B2 [default: 0.9,0.95]"),
    steps: int | None = typer.Option(None, "--steps", help="Optimizer steps." + _mt_default("steps")),
    lr: float | None = typer.Option(None, "--lr", help="Peak learning rate." + _mt_default("lr")),
    batch_size: int | None = typer.Option(None, "--batch-size", help="Examples per device per micro-step."
                                          + _mt_default("batch_size")),
    grad_accum: int | None = typer.Option(None, "--grad-accum", help="Micro-steps per optimizer step (averaged)."
                                          + _mt_default("grad_accum")),
    warmup_steps: int | None = typer.Option(None, "--warmup-steps", help="Linear warmup, then linear decay to 0 "
                                            "[default: a tenth of the steps]"),
    weight_decay: float | None = typer.Option(None, "--weight-decay", help="AdamW weight decay." + _mt_default(
        "weight_decay")),
    max_grad_norm: float | None = typer.Option(None, "--max-grad-norm", help="Gradient clipping (0: off)."
                                               + _mt_default("max_grad_norm")),
    seed: int | None = typer.Option(None, "--seed", help="Seed for weights' RNG and data order." + _mt_default(
        "seed")),
    out: str | None = typer.Option(None, "--out", help="Output folder [default: runs/multitask-DATE-TIME]"),
    overwrite: bool | None = typer.Option(None, "--overwrite/--no-overwrite", help="Replace the run in a non-empty"
                                          " --out folder."),
    lora_rank: int | None = typer.Option(None, "--lora-rank", help="Train LoRA adapters of rank R [default: 0]"),
    lora_alpha: float | None = typer.Option(None, "--lora-alpha", help="LoRA alpha." + _mt_default("lora_alpha")),
    lora_targets: str | None = typer.Option(None, "--lora-targets", help="Modules to adapt, comma-separated."),
    gradient_checkpointing: bool | None = typer.Option(
        None, "--gradient-checkpointing/--no-gradient-checkpointing", help="Recompute activations in backward."
    ),
    save_adapter_only: bool | None = typer.Option(
        None, "--save-adapter-only/--save-merged", help="final/ holds the LoRA adapter only [default: merged model]"
    ),
    fsdp: bool | None = typer.Option(None, "--fsdp/--no-fsdp", help="Shard weights, gradients and optimizer states "
                                     "across processes (FSDP2)."),
    num_processes: int | None = typer.Option(
        None, "--num-processes", min=1, help="Run on N processes through `accelerate launch`.",
    ),
    save_every: int | None = typer.Option(None, "--save-every", help="Write checkpoints/step-N/ every N steps."),
    keep_last: int | None = typer.Option(None, "--keep-last", help="Keep the newest K checkpoints [default: all]"),
    resume: str | None = typer.Option(None, "--resume", help="Continue the run in --out (latest checkpoint, or "
                                      "the checkpoint folder given)."),
    log_update_similarity: bool | None = typer.Option(None, "--log-update-similarity", help=SIMILARITY_HELP),
    report_to: str | None = typer.Option(None, "--report-to", help=REPORT_TO_HELP),
) -> None:
    """Train on several tasks at once, one DualOptim+ delta state per task; scores each task before and after."""
    overrides = {name: value for name, value in locals().items()
                 if name not in ("recipe", "num_processes", "task")}
    from doplus_cli.config import MultitaskConfig, resolve_config, task_from_option
    from doplus_cli.engine.teach import apply_teaching

    if task:
        overrides["tasks"] = [task_from_option(text) for text in task]
    config = resolve_config(recipe, overrides, MultitaskConfig)
    apply_teaching(config, err_console)
    if num_processes is not None and num_processes > 1 and "LOCAL_RANK" not in os.environ:
        _relaunch_with_accelerate(num_processes)
    from doplus_cli.engine.multitask import print_summary, run_multitask

    report = run_multitask(config, err_console)
    if report:
        print_summary(report, Console(highlight=False))


def _al_default(name: str) -> str:
    from doplus_cli.config import AlignConfig

    return f" [default: {default_of(name, AlignConfig)}]"


SOURCE_HELP = "FILE.jsonl, FILE.json (one JSON array) or hf:NAME[:CONFIG][@SPLIT]; FILE[START:STOP] takes those rows."


@app.command()
def align(
    recipe: str | None = typer.Option(None, "--recipe", help="YAML recipe; flags given here override its values."),
    safety: str | None = typer.Option(None, "--safety", help="Harmful instructions with the safe response to learn: "
                                      + SOURCE_HELP),
    general: str | None = typer.Option(None, "--general", help="Benign instructions with their responses (Alpaca): "
                                       + SOURCE_HELP),
    instruction_key: str | None = typer.Option(None, "--instruction-key", help="Instruction field."
                                               + _al_default("instruction_key")),
    input_key: str | None = typer.Option(None, "--input-key", help="Optional input field, after the instruction and "
                                         "a blank line when not empty." + _al_default("input_key")),
    output_key: str | None = typer.Option(None, "--output-key", help="Response field." + _al_default("output_key")),
    freq: str | None = typer.Option(None, "--freq", help="F_s:F_g, safety steps then general steps per cycle."
                                    + _al_default("freq")),
    epochs: float | None = typer.Option(None, "--epochs", help="Passes over the general set, instead of --steps "
                                        "(warmup: the first epoch)."),
    held_out: int | None = typer.Option(None, "--held-out", help="Each set's last N rows, kept out of training and "
                                        "answered before and after (0: none)." + _al_default("held_out")),
    model: str | None = typer.Option(
        None, "--model", help="Hub id, local model folder or .gguf file [default: embedded SmolLM2-135M-Instruct]"
    ),
    dtype: str | None = typer.Option(None, "--dtype", help=DTYPE_HELP + _al_default("dtype")),
    precision: str | None = typer.Option(None, "--precision", help=PRECISION_HELP + _al_default("precision")),
    save_dtype: str | None = typer.Option(None, "--save-dtype", help=SAVE_DTYPE_HELP + _al_default("save_dtype")),
    trust_remote_code: bool | None = typer.Option(
        None, "--trust-remote-code/--no-trust-remote-code", help="Allow the model's own code to run."
    ),
    max_length: int | None = typer.Option(None, "--max-length", help="Tokens per example." + _al_default(
        "max_length")),
    max_new_tokens: int | None = typer.Option(None, "--max-new-tokens", help="Greedy tokens per held-out response."
                                              + _al_default("max_new_tokens")),
    prompt_template: str | None = typer.Option(None, "--prompt-template", help=TEMPLATE_HELP),
    scheme: str | None = typer.Option(None, "--scheme", help="joint (batches from the mixture of both sets), "
                                      "alternate, dualoptim or doplus." + _al_default("scheme")),
    optimizer: str | None = typer.Option(None, "--optimizer", help="adamw or muon (doplus)." + _al_default(
        "optimizer")),
    state_bits: int | None = typer.Option(None, "--state-bits", help="32 or 8 (blockwise 8-bit states)."
                                          + _al_default("state_bits")),
    doplus_rule: str | None = typer.Option(
        None, "--doplus-rule", help="DualOptim+'s AdamW rule: safeguarded or paper (exactly as published)."
        + _al_default("doplus_rule"),
    ),
    betas: str | None = typer.Option(None, "--betas", help="AdamW betas as B1,B2 [default: 0.9,0.95]"),
    steps: int | None = typer.Option(None, "--steps", help="Optimizer steps (or --epochs)." + _al_default("steps")),
    lr: float | None = typer.Option(None, "--lr", help="Peak learning rate." + _al_default("lr")),
    batch_size: int | None = typer.Option(None, "--batch-size", help="Examples per device per micro-step."
                                          + _al_default("batch_size")),
    grad_accum: int | None = typer.Option(None, "--grad-accum", help="Micro-steps per optimizer step (averaged)."
                                          + _al_default("grad_accum")),
    warmup_steps: int | None = typer.Option(None, "--warmup-steps", help="Linear warmup, then linear decay to 0 "
                                            "[default: the first epoch with --epochs, else a tenth of the steps]"),
    weight_decay: float | None = typer.Option(None, "--weight-decay", help="AdamW weight decay." + _al_default(
        "weight_decay")),
    max_grad_norm: float | None = typer.Option(None, "--max-grad-norm", help="Gradient clipping (0: off)."
                                               + _al_default("max_grad_norm")),
    seed: int | None = typer.Option(None, "--seed", help="Seed for weights' RNG and data order." + _al_default(
        "seed")),
    out: str | None = typer.Option(None, "--out", help="Output folder [default: runs/align-DATE-TIME]"),
    overwrite: bool | None = typer.Option(None, "--overwrite/--no-overwrite", help="Replace the run in a non-empty"
                                          " --out folder."),
    lora_rank: int | None = typer.Option(None, "--lora-rank", help="Train LoRA adapters of rank R [default: 0]"),
    lora_alpha: float | None = typer.Option(None, "--lora-alpha", help="LoRA alpha." + _al_default("lora_alpha")),
    lora_targets: str | None = typer.Option(None, "--lora-targets", help="Modules to adapt, comma-separated."),
    lora_dropout: float | None = typer.Option(None, "--lora-dropout", help="LoRA dropout." + _al_default(
        "lora_dropout")),
    gradient_checkpointing: bool | None = typer.Option(
        None, "--gradient-checkpointing/--no-gradient-checkpointing", help="Recompute activations in backward."
    ),
    save_adapter_only: bool | None = typer.Option(
        None, "--save-adapter-only/--save-merged", help="final/ holds the LoRA adapter only [default: merged model]"
    ),
    fsdp: bool | None = typer.Option(None, "--fsdp/--no-fsdp", help="Shard weights, gradients and optimizer states "
                                     "across processes (FSDP2)."),
    num_processes: int | None = typer.Option(
        None, "--num-processes", min=1, help="Run on N processes through `accelerate launch`.",
    ),
    save_every: int | None = typer.Option(None, "--save-every", help="Write checkpoints/step-N/ every N steps."),
    keep_last: int | None = typer.Option(None, "--keep-last", help="Keep the newest K checkpoints [default: all]"),
    resume: str | None = typer.Option(None, "--resume", help="Continue the run in --out (latest checkpoint, or "
                                      "the checkpoint folder given)."),
    log_update_similarity: bool | None = typer.Option(None, "--log-update-similarity", help=SIMILARITY_HELP),
    report_to: str | None = typer.Option(None, "--report-to", help=REPORT_TO_HELP),
    eval_batch_size: int | None = typer.Option(None, "--eval-batch-size", help="Prompts per generation batch."
                                               + _al_default("eval_batch_size")),
    eval_suite: str | None = typer.Option(None, "--eval-suite", help="After training, `doplus evaluate` final/ into "
                                          "OUT/eval/: safety, xstest or safety,xstest [default: none]"),
    eval_max_samples: int | None = typer.Option(None, "--eval-max-samples", help="The first N prompts of each set "
                                                "[default: all]"),
    eval_max_new_tokens: int | None = typer.Option(None, "--eval-max-new-tokens", help="Greedy tokens per answer."
                                                   + _al_default("eval_max_new_tokens")),
    eval_guard_model: str | None = typer.Option(
        None, "--eval-guard-model", help="A Llama Guard-protocol model, or none [default: "
        "meta-llama/Meta-Llama-Guard-2-8B if it loads, else the offline refusal judge]"),
    eval_refusal_model: str | None = typer.Option(
        None, "--eval-refusal-model", help="A chat model labelling refusals by XSTest's protocol [default: the "
        "offline refusal judge]"),
    eval_safety_data_dir: str | None = typer.Option(
        None, "--eval-safety-data-dir", help="Folder with I-*.json, Q-Harm.json, xstest_prompts.csv [default: "
        "download the releases' files]"),
) -> None:
    """Safety alignment as targeted unlearning: learn the safe responses, keep the general ones."""
    overrides = {name: value for name, value in locals().items() if name not in ("recipe", "num_processes")}
    from doplus_cli.config import AlignConfig, resolve_config
    from doplus_cli.engine.teach import apply_teaching

    config = resolve_config(recipe, overrides, AlignConfig)
    apply_teaching(config, err_console)
    if num_processes is not None and num_processes > 1 and "LOCAL_RANK" not in os.environ:
        _relaunch_with_accelerate(num_processes)
    from doplus_cli.engine.align import print_summary, run_align

    report = run_align(config, err_console)
    if report:
        print_summary(report, Console(highlight=False))


@app.command()
def evaluate(
    folders: list[str] | None = typer.Argument(None, help="With --compare: evaluation folders to compare."),
    compare: bool = typer.Option(False, "--compare", help="Print the given evaluation folders side by side."),
    model: str | None = typer.Option(
        None, "--model", help="Hub id, model folder (e.g. a run's final/) or .gguf [default: embedded SmolLM2]"
    ),
    suite: str = typer.Option(
        ",".join(EvalConfig.suites), "--suite",
        help="tofu, real-world, lm-eval, privacy, safety, xstest, or several comma-separated.",
    ),
    split: str = typer.Option(EvalConfig.split, "--split", help="TOFU forget split: forget01, forget05, forget10."),
    task_id: int | None = typer.Option(None, "--task-id", help="TOFU files whose rows carry task_id (the DualOptim+ "
                                       "authors'): the forget task scored [default: 1]"),
    data_dir: str | None = typer.Option(
        None, "--data-dir", help="Folder of TOFU JSON-lines files [default: hf:locuslab/TOFU from the hub]"
    ),
    forget: str | None = typer.Option(None, "--forget", help="real-world: forget-people JSON lines."),
    retain: str | None = typer.Option(None, "--retain", help="real-world: neighbour-people JSON lines."),
    out: str | None = typer.Option(None, "--out", help="Output folder [default: evals/DATE-TIME]"),
    max_samples: int | None = typer.Option(None, "--max-samples", help="At most N questions per set (quick looks)."),
    batch_size: int = typer.Option(EvalConfig.batch_size, "--batch-size", min=1, help="Prompts per generation batch; "
                                   "NLL batches hold about 48 tokens per unit."),
    max_new_tokens: int = typer.Option(EvalConfig.max_new_tokens, "--max-new-tokens", min=1,
                                       help="Greedy tokens per answer."),
    embedding_model: str | None = typer.Option(
        None, "--embedding-model",
        help="Sentence-transformers model for Cosine Similarity [default: the protocol's: doplus all-MiniLM-L6-v2, "
        "paper paraphrase-MiniLM-L6-v2]",
    ),
    nli_model: str | None = typer.Option(
        None, "--nli-model", help="NLI model for the Entailment Score [default: sileod/deberta-v3-base-tasksource-nli]"
    ),
    targeted: bool | None = typer.Option(
        None, "--targeted/--untargeted",
        help="OVR formula (IDK/DPO are targeted) [default: from the run's loss, else both]",
    ),
    tasks: str = typer.Option(",".join(EvalConfig.tasks), "--tasks", help="lm-eval tasks, comma-separated."),
    limit: float | None = typer.Option(None, "--limit", help="lm-eval: samples per task (or a fraction < 1)."),
    lm_eval_include: str | None = typer.Option(None, "--lm-eval-include", help="Folder of extra lm-eval task YAMLs."),
    dtype: str = typer.Option(EvalConfig.dtype, "--dtype", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16."),
    trust_remote_code: bool = typer.Option(EvalConfig.trust_remote_code, "--trust-remote-code",
                                           help="Allow the model's own code to run."),
    overwrite: bool = typer.Option(EvalConfig.overwrite, "--overwrite", help="Replace an evaluation already in --out."),
    seed: int = typer.Option(EvalConfig.seed, "--seed", help="Seed (rejection answers drawn for TFE)."),
    prompt_template: str | None = typer.Option(
        None, "--prompt-template", help=TEMPLATE_HELP.replace("[default: ", "[default: a run's own template; else ")
    ),
    protocol: str = typer.Option(EvalConfig.protocol, "--protocol", help=PROTOCOL_HELP),
    retain_logs: str | None = typer.Option(
        None, "--retain-logs", help="A retain model's TOFU_EVAL.json (doplus's or OpenUnlearning's): forget_quality "
        "and privleak's reference AUC.",
    ),
    holdout: str | None = typer.Option(
        None, "--holdout", help="Non-member rows (JSON lines with question, answer; TOFU's holdout10): the privacy "
        "suite, and privacy metrics in the TOFU suite.",
    ),
    guard_model: str | None = typer.Option(
        None, "--guard-model", help="safety: a Llama Guard-protocol model (hub id or folder), or none [default: "
        "meta-llama/Meta-Llama-Guard-2-8B if it loads, else the offline refusal judge, said in the report]"
    ),
    refusal_model: str | None = typer.Option(
        None, "--refusal-model", help="safety, xstest: a chat model (hub id or folder) that labels refusals by "
        "XSTest's classification protocol instead of the offline refusal judge"
    ),
    refusal_model_prompt: str | None = typer.Option(
        None, "--refusal-model-prompt", help="Its prompt: a text file with {question} and {response} [default: "
        "doplus's wording of XSTest's GPT-4 prompt]"
    ),
    safety_data_dir: str | None = typer.Option(
        None, "--safety-data-dir", help="safety, xstest: folder with I-*.json, Q-Harm.json, xstest_prompts.csv "
        "[default: download the releases' files]"
    ),
    responses: str | None = typer.Option(
        None, "--responses", help="safety, xstest: judge the (prompt, response) rows of FILE.jsonl|csv instead of "
        "generating"
    ),
) -> None:
    """Evaluate a model: TOFU/real-world indicators and MU/UFE/TFE/OVR, lm-eval, safety and XSTest."""
    from doplus_cli.evaluation.report import compare_table

    if compare:
        if not folders or len(folders) < 2:
            raise UserError("--compare needs at least two evaluation folders: doplus evaluate --compare DIR1 DIR2")
        Console(highlight=False).print(compare_table(folders), markup=False)
        return
    if folders:
        raise UserError(f"unexpected argument '{folders[0]}' (folders are only taken with --compare)")
    from doplus_cli.evaluation.summary import print_summary

    values = dict(
        model=model, suite=suite, split=split, task_id=task_id, data_dir=data_dir, forget=forget, retain=retain,
        out=out, max_samples=max_samples, batch_size=batch_size, max_new_tokens=max_new_tokens,
        embedding_model=embedding_model, nli_model=nli_model, targeted=targeted, tasks=tasks, limit=limit,
        lm_eval_include=lm_eval_include, dtype=dtype, trust_remote_code=trust_remote_code, overwrite=overwrite,
        seed=seed, prompt_template=prompt_template, protocol=protocol, retain_logs=retain_logs, holdout=holdout,
        guard_model=guard_model, refusal_model=refusal_model, refusal_model_prompt=refusal_model_prompt,
        safety_data_dir=safety_data_dir, responses=responses,
    )
    config = resolve_eval_config(values)
    record = run_evaluate(config, err_console)
    print_summary(record, Console(highlight=False))


@bench_app.command("optimizer")
def bench_optimizer(
    params: str = typer.Option("50M", "--params", help="Synthetic parameter count: 50M, 1.5G, 200k, 123456."),
    dtype: str = typer.Option("float32", "--dtype", help="Parameter dtype: float32 or bfloat16."),
    device: str = typer.Option("auto", "--device", help="auto (cuda if available), cpu or cuda."),
    steps: int = typer.Option(7, "--steps", min=5, help="Timed steps per optimizer (median is reported)."),
    warmup: int = typer.Option(2, "--warmup", min=1, help="Untimed steps first (compilation happens here)."),
    only: str | None = typer.Option(
        None, "--only", help="Comma-separated subset of rows, e.g. adamw,doplus,doplus-8bit."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout instead of a table."),
    seed: int = typer.Option(0, "--seed"),
    stability: bool = typer.Option(
        False, "--stability",
        help="Instead of speed: the paper's and the safeguarded DualOptim+ rule on the synthetic two-objective "
        "problem of issue #16 (largest step, float32 against float64, 8-bit against 32-bit).",
    ),
) -> None:
    """Step time, state bytes and bandwidth of DualOptim+ against torch AdamW on synthetic parameters."""
    from doplus_cli.bench.optimizer import BenchConfig, print_table, run_optimizer_bench

    if stability:
        from doplus_cli.bench.stability import print_stability, stability_rows

        rows = stability_rows(seed, progress=None if as_json else err_console.print)
        if as_json:
            import json

            sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        else:
            print_stability(rows)
        return

    config = BenchConfig.from_cli(
        params=params, dtype=dtype, device=device, steps=steps, warmup=warmup, only=only, seed=seed
    )
    result = run_optimizer_bench(config, progress=not as_json)
    if as_json:
        import json

        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        print_table(result)


@bench_app.command("precision")
def bench_precision(
    model: str | None = typer.Option(
        None, "--model", help="Hub id, local model folder or .gguf file [default: embedded SmolLM2-135M-Instruct]"
    ),
    out: str = typer.Option("bench/precision", "--out", help="Output folder (one run per mode, precision.json)."),
    steps: int = typer.Option(20, "--steps", min=3, help="Steps per run (IDK+GD, DualOptim+)."),
    lr: float = typer.Option(1e-5, "--lr", help="Peak learning rate, decaying linearly to 0."),
    modes: str = typer.Option("fp32,bf16-mixed,bf16,bf16-uncompensated", "--modes",
                              help="Comma-separated: fp32, bf16-mixed, bf16, bf16-uncompensated (fp32 is the "
                              "reference of the distances)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout instead of a table."),
) -> None:
    """Each --precision (and bf16 without compensation) on the same short unlearning run: weight elements
    changed, distance travelled against fp32, bytes per parameter, step time."""
    from doplus_cli.bench.precision import MODES, print_table, run_precision_bench

    chosen = tuple(m.strip() for m in modes.split(",") if m.strip())
    unknown = [m for m in chosen if m not in MODES]
    if unknown or not chosen:
        raise UserError(f"--modes {modes}: choose from {', '.join(MODES)}")
    _quiet_libraries()
    result = run_precision_bench(model, out, steps, lr, chosen, say=lambda line: err_console.print(Text(line)))
    if as_json:
        import json

        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        print_table(result, Console(highlight=False, width=None if sys.stdout.isatty() else 200))


@bench_app.command("schemes")
def bench_schemes(
    recipe: str = typer.Option(..., "--recipe", help="An unlearn recipe (with eval_suite), a multitask recipe "
                               "(a tasks: list with held-out rows) or an align recipe (safety: ...)."),
    schemes: str = typer.Option(
        DEFAULT_SCHEMES, "--schemes", help="Comma-separated: " + ", ".join(SCHEMES) + "."
    ),
    seeds: str = typer.Option(DEFAULT_SEEDS, "--seeds", help="Comma-separated seeds; each scheme runs once per seed."),
    task_ids: str | None = typer.Option(None, "--task-ids", help="unlearn recipes on files whose rows carry task_id: "
                                        "the forget tasks (1,2,3,4,5), an axis beside the seeds; tables pool them."),
    out: str | None = typer.Option(None, "--out", help="Output folder [default: bench/RECIPE-NAME]"),
    set_options: list[str] | None = typer.Option(
        None, "--set", help="KEY=VALUE: a recipe value for every run (repeatable)."
    ),
    sweep: str | None = typer.Option(None, "--sweep", help="KEY=V1,V2,...: run every scheme and seed at each value."),
    log_update_similarity: bool = typer.Option(
        False, "--log-update-similarity", help="Record update_cosine/grad_cosine in every run and compare them."
    ),
    num_processes: int | None = typer.Option(None, "--num-processes", min=1, help="Processes per run."),
    fsdp: bool = typer.Option(False, "--fsdp", help="Run every run with FSDP2 (with --num-processes)."),
    keep_checkpoints: bool = typer.Option(
        False, "--keep-checkpoints", help="Keep each run's checkpoints once it is evaluated (by default they are "
        "removed, so the bench needs the disk of one run's checkpoints plus every run's final/)."
    ),
) -> None:
    """Every scheme x seed on one recipe as ordinary runs, evaluated; mean ± std tables and plots."""
    from doplus_cli.bench.schemes import print_summary, run_schemes_bench

    summary = run_schemes_bench(recipe, schemes, seeds, out, list(set_options or []), sweep, log_update_similarity,
                                num_processes, fsdp, say=lambda line: err_console.print(Text(line)),
                                task_ids=task_ids, keep_checkpoints=keep_checkpoints)
    # Without a terminal (a batch job's log) rich would fold the table into 80 columns.
    print_summary(summary, Console(highlight=False, width=None if sys.stdout.isatty() else 200))


def _quiet_libraries() -> None:
    """Keep library chatter out of the run's output: weight-loading progress bars, bitsandbytes' notice
    about an optional CPU kernel package. Warnings that matter still show."""
    import logging
    import os

    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass


def _relaunch_with_accelerate(num_processes: int) -> None:
    """`doplus unlearn --num-processes N ...` = `accelerate launch --num_processes N -m doplus_cli unlearn ...`.

    accelerate's multi-process launcher (torchrun underneath) is used on CPU too: without CUDA the engine asks
    accelerate for CPU processes, which then form a gloo group.
    """
    import signal
    import subprocess

    args, skip = [], False
    for arg in _argv["value"]:
        if skip:
            skip = False
            continue
        if arg == "--num-processes":
            skip = True
            continue
        if arg.startswith("--num-processes="):
            continue
        args.append(arg)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
               str(num_processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "-m", "doplus_cli", *args]
    err_console.print(Text(f"launching {num_processes} processes: accelerate launch ... -m doplus_cli "
                           + " ".join(args)))
    with tempfile.TemporaryDirectory(prefix="doplus-launch-") as folder:
        exit_file = os.path.join(folder, "exit")
        # Its own session: Ctrl-C in the terminal reaches this process only, which hands it to the workers.
        process = subprocess.Popen(command, env={**os.environ, EXIT_FILE_VARIABLE: exit_file}, start_new_session=True)

        def forward(received, _frame) -> None:
            """SIGTERM/SIGINT go to the workers, not to torchrun (which would answer with a traceback): they
            finish the step, write a checkpoint and exit 0, leaving 128 + signal for this process."""
            import psutil

            for worker in psutil.Process(process.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    worker.send_signal(received)

        for number in (signal.SIGTERM, signal.SIGINT):  # a preempted job's signal reaches every process
            signal.signal(number, forward)
        code = process.wait()
        left = {int(name.rsplit("rank", 1)[1]): int(open(os.path.join(folder, name)).read() or 1)
                for name in os.listdir(folder) if name.startswith("exit.rank")}
        if left:  # a user error, a stop by signal: the first worker's code (it printed the line)
            code = left.get(0, max(left.values()))
    sys.exit(code)


def _resume_defaults_to_latest(argv: list[str]) -> list[str]:
    """`--resume` without a value (last, or followed by another option) means `--resume latest`."""
    result = []
    for i, arg in enumerate(argv):
        result.append(arg)
        if arg == "--resume" and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            result.append("latest")
    return result


@recipes_app.command("list")
def recipes_list() -> None:
    """Every shipped recipe: its name (for `doplus recipes copy`), the command it is for, its description."""
    from doplus_cli.recipes import list_recipes, recipes_root

    recipes = list_recipes()
    console = Console(highlight=False)
    if console.is_terminal:
        from rich.table import Table

        table = Table(title=f"recipes in {recipes_root()}", title_justify="left")
        table.add_column("name", no_wrap=True)
        table.add_column("command", no_wrap=True)
        table.add_column("description")
        for recipe in recipes:
            table.add_row(recipe.name, recipe.command, recipe.description)
        console.print(table)
        return
    # no terminal (a batch log, a pipe): one plain line per recipe, nothing wrapped
    name_width = max(len(r.name) for r in recipes)
    command_width = max(len(r.command) for r in recipes)
    print(f"recipes in {recipes_root()}")
    print(f"{'name':<{name_width}}  {'command':<{command_width}}  description")
    for recipe in recipes:
        print(f"{recipe.name:<{name_width}}  {recipe.command:<{command_width}}  {recipe.description}")


@recipes_app.command("copy")
def recipes_copy(
    name: str = typer.Argument(..., help="A recipe's name as `doplus recipes list` shows it (quickstart, "
                               "tofu/phi-1.5/idk_gd, bench/mini_tofu)."),
    dest: str = typer.Argument(..., help="A file to write, or an existing folder to copy the recipe into."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace files that exist at DEST."),
) -> None:
    """Copy a recipe with the data files and teaching recipe it names that ship with doplus; list the files it
    names that do not ship (TOFU, the safety sets, TRACE), which you provide."""
    from doplus_cli.recipes import copy_recipe

    result = copy_recipe(name, dest, overwrite=overwrite)
    for path in result.copied:
        print(f"wrote {path}")
    for line in result.missing:
        print(f"not copied: {line}")
    if result.command in ("unlearn", "multitask", "align"):
        print(f"run it with: doplus {result.command} --recipe {result.recipe}")


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: every user error is one line on stderr and exit code 2.

    Usage errors (unknown option, bad value) come from click; they are printed as one line too, with a
    pointer to `--help`. `--debug` re-raises instead, with the full traceback.
    """
    from typer._click.exceptions import ClickException, NoArgsIsHelpError

    _quiet_libraries()
    argv = _resume_defaults_to_latest(list(sys.argv[1:] if argv is None else argv))
    _argv["value"] = argv
    try:
        code = app(args=argv, standalone_mode=False)
    except NoArgsIsHelpError as error:
        error.show()
        sys.exit(error.exit_code)
    except ClickException as error:
        if _debug["on"]:
            raise
        command = error.ctx.command_path if getattr(error, "ctx", None) is not None else "doplus"
        err_console.print(
            Text("error: ", style="bold red") + Text(f"{error.format_message()} (see `{command} --help`)")
        )
        sys.exit(getattr(error, "exit_code", 2))
    except UserError as error:
        if _debug["on"]:
            raise
        if not quiet_worker():
            err_console.print(Text("error: ", style="bold red") + Text(str(error)))
        sys.exit(worker_exit_code(error.exit_code))
    except OSError as error:  # a place no check named before (an unwritable --out's parent, say): still one line
        if _debug["on"] or not error.filename:
            raise
        if not quiet_worker():
            err_console.print(Text("error: ", style="bold red") + Text(f"{error.filename}: {error.strerror}"))
        sys.exit(worker_exit_code(2))
    _leave_process_group()
    if isinstance(code, int) and code != 0:
        sys.exit(code)


def _leave_process_group() -> None:
    """After a command that ran as one of several processes and finished: destroy the process group, as PyTorch
    asks (without it NCCL warns at exit, and a rank can abort in interpreter finalization while gloo's worker
    threads still hold tensors, pytorch/pytorch#179291). A failed process exits without it: torchrun stops the
    others, and a destroy that waits on a dead peer could hang."""
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
