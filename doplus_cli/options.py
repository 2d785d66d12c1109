"""The options of the commands that take a recipe (`doplus unlearn`, `multitask`, `align`, `evaluate`), each
declared once.

Every option is an `Annotated` type: its flags and its help text. A training command's help reads its
`[default: ...]` from the config dataclass field (config.py holds every default; the flag's own default is None,
"not given", so a recipe's value stands unless a flag replaces it). `doplus evaluate`'s defaults are EvalConfig's
(evaluation/, a layer above): cli.py hands them to `takes`, click shows them, and `with_recipe` asks click's
parameter source which options the command line gave. `COMMAND_OPTIONS` lists each command's options (name ->
type): `takes` makes them the signature of the command's function in cli.py, and the model card writes its command
line from them (engine/model_card.py).

Where the commands word an option differently, the variant is named after its command (`UnlearnOut`); where they
share the wording of an option that means the same (a training command's `--eval-nli-model`, evaluate's
`--nli-model`), the shared words are one constant and the difference is the flag and the words around it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Annotated, Any, get_args

import typer
from typer._click.core import ParameterSource
from typer._click.globals import get_current_context
from typer.models import ArgumentInfo

from doplus_cli.config import AlignConfig, MultitaskConfig, TrainConfig, UnlearnConfig, default_of, recipe_options
from doplus_cli.data.formatting import TEMPLATE_HELP
from doplus_cli.errors import UserError


def shown_default(name: str, config_class: type[TrainConfig] = TrainConfig) -> str:
    """` [default: VALUE]` for a help text: the config field's default, so no help text repeats a default."""
    return f" [default: {default_of(name, config_class)}]"


REPORT_TO_HELP = ("Experiment trackers through accelerate: none, or one or more of tensorboard, wandb, mlflow, "
                  "trackio, all (comma-separated; files under OUT/trackers/, W&B offline unless WANDB_MODE says "
                  "otherwise)" + shown_default("report_to"))
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
SOURCE_HELP = "FILE.jsonl, FILE.json (one JSON array) or hf:NAME[:CONFIG][@SPLIT]; FILE[START:STOP] takes those rows."
# Worded alike by `doplus evaluate` and the training commands' evaluation options (--eval-*).
ANSWER_TOKENS_HELP = "Greedy tokens per answer."
TOFU_FOLDER_HELP = "Folder of TOFU JSON-lines files [default: hf:locuslab/TOFU"
NLI_DEFAULT = "[default: sileod/deberta-v3-base-tasksource-nli]"
SAFETY_FILES_HELP = "with I-*.json, Q-Harm.json, xstest_prompts.csv [default: download the releases' files]"
GUARD_DEFAULT = "[default: meta-llama/Meta-Llama-Guard-2-8B if it loads, else the offline refusal judge"

# --- Every training command, the same on each ---------------------------------------------------------------------
Recipe = Annotated[str | None, typer.Option("--recipe", help="YAML recipe; flags given here override its values.")]
Model = Annotated[str | None, typer.Option(
    "--model", help="Hub id, local model folder or .gguf file [default: embedded SmolLM2-135M-Instruct]")]
Dtype = Annotated[str | None, typer.Option("--dtype", help=DTYPE_HELP + shown_default("dtype"))]
Precision = Annotated[str | None, typer.Option("--precision", help=PRECISION_HELP + shown_default("precision"))]
SaveDtype = Annotated[str | None, typer.Option("--save-dtype", help=SAVE_DTYPE_HELP + shown_default("save_dtype"))]
MaxLength = Annotated[int | None, typer.Option("--max-length", help="Tokens per example." + shown_default(
    "max_length"))]
PromptTemplate = Annotated[str | None, typer.Option("--prompt-template", help=TEMPLATE_HELP)]
Optimizer = Annotated[str | None, typer.Option("--optimizer", help="adamw or muon (doplus)." + shown_default(
    "optimizer"))]
StateBits = Annotated[int | None, typer.Option("--state-bits", help="32 or 8 (blockwise 8-bit states)."
                                               + shown_default("state_bits"))]
Betas = Annotated[str | None, typer.Option("--betas", help="AdamW betas as B1,B2 [default: 0.9,0.95]")]
Lr = Annotated[float | None, typer.Option("--lr", help="Peak learning rate." + shown_default("lr"))]
BatchSize = Annotated[int | None, typer.Option("--batch-size", help="Examples per device per micro-step."
                                               + shown_default("batch_size"))]
GradAccum = Annotated[int | None, typer.Option("--grad-accum", help="Micro-steps per optimizer step (averaged)."
                                               + shown_default("grad_accum"))]
WeightDecay = Annotated[float | None, typer.Option("--weight-decay", help="AdamW weight decay." + shown_default(
    "weight_decay"))]
MaxGradNorm = Annotated[float | None, typer.Option("--max-grad-norm", help="Gradient clipping (0: off)."
                                                   + shown_default("max_grad_norm"))]
Seed = Annotated[int | None, typer.Option("--seed", help="Seed for weights' RNG and data order." + shown_default(
    "seed"))]
LoraAlpha = Annotated[float | None, typer.Option("--lora-alpha", help="LoRA alpha." + shown_default("lora_alpha"))]
LoraDropout = Annotated[float | None, typer.Option("--lora-dropout", help="LoRA dropout." + shown_default(
    "lora_dropout"))]
SaveAdapterOnly = Annotated[bool | None, typer.Option(
    "--save-adapter-only/--save-merged", help="final/ holds the LoRA adapter only [default: merged model]")]
Fsdp = Annotated[bool | None, typer.Option(
    "--fsdp/--no-fsdp", help="Shard weights, gradients and optimizer states across processes (FSDP2).")]
KeepLast = Annotated[int | None, typer.Option("--keep-last", help="Keep the newest K checkpoints [default: all]")]
LogUpdateSimilarity = Annotated[bool | None, typer.Option("--log-update-similarity", help=SIMILARITY_HELP)]
ReportTo = Annotated[str | None, typer.Option("--report-to", help=REPORT_TO_HELP)]
BaseUpdate = Annotated[str | None, typer.Option(
    "--base-update", help="DualOptim+'s base state takes the gradient after-param (the rule), before-delta or "
    "after-delta (the paper's ablation)." + shown_default("base_update"))]
VFloor = Annotated[float | None, typer.Option(
    "--v-floor", help="DualOptim+'s safeguarded rule: the floor rho on its denominator, as a fraction of "
    "v_B + |v_k|, in [0, 1) (0: the clamp at 10 lr alone)." + shown_default("v_floor"))]
BaseSource = Annotated[str | None, typer.Option(
    "--base-source", help="DualOptim+'s base state takes grad (the rule) or grad-minus-delta, g minus the delta "
    "(the paper's ablation)." + shown_default("base_source"))]

# --- Worded the same by multitask and align (unlearn's own wording below) -----------------------------------------
TrustRemoteCode = Annotated[bool | None, typer.Option(
    "--trust-remote-code/--no-trust-remote-code", help="Allow the model's own code to run.")]
DoplusRule = Annotated[str | None, typer.Option(
    "--doplus-rule", help="DualOptim+'s AdamW rule: safeguarded or paper (exactly as published)."
    + shown_default("doplus_rule"))]
Overwrite = Annotated[bool | None, typer.Option("--overwrite/--no-overwrite",
                                                help="Replace the run in a non-empty --out folder.")]
LoraRank = Annotated[int | None, typer.Option("--lora-rank", help="Train LoRA adapters of rank R" + shown_default(
    "lora_rank"))]
LoraTargets = Annotated[str | None, typer.Option("--lora-targets", help="Modules to adapt, comma-separated.")]
GradientCheckpointing = Annotated[bool | None, typer.Option(
    "--gradient-checkpointing/--no-gradient-checkpointing", help="Recompute activations in backward.")]
NumProcesses = Annotated[int | None, typer.Option("--num-processes", min=1,
                                                  help="Run on N processes through `accelerate launch`.")]
SaveEvery = Annotated[int | None, typer.Option("--save-every", help="Write checkpoints/step-N/ every N steps.")]
DryRun = Annotated[bool | None, typer.Option(
    "--dry-run", help="Print the run's memory plan (parameters; bytes of weights, gradients, optimizer states, "
    "activations; the total per process under DDP and FSDP for --num-processes) from the model's config alone, "
    "and exit without training or writing anything.")]
GpuMemory = Annotated[float | None, typer.Option(
    "--gpu-memory", min=0, help="With --dry-run: the GPU memory (GiB) the plan is checked against [default: the "
    "visible GPU's]")]
Resume = Annotated[str | None, typer.Option(
    "--resume", help="Continue the run in --out (latest checkpoint, or the checkpoint folder given).")]

# --- Worded the same by unlearn and multitask (align's own wording below) -----------------------------------------
Scheme = Annotated[str | None, typer.Option(
    "--scheme", help="joint, alternate, dualoptim, doplus, or the paper's federated-learning baselines scaffold, "
    "fedcm, local-adam." + shown_default("scheme"))]
Steps = Annotated[int | None, typer.Option("--steps", help="Optimizer steps." + shown_default("steps"))]

# --- doplus unlearn ---------------------------------------------------------------------------------------------
UnlearnTrustRemoteCode = Annotated[bool | None, typer.Option(
    "--trust-remote-code/--no-trust-remote-code", help="Allow the model's own code to run." + shown_default(
        "trust_remote_code"))]
Forget = Annotated[str | None, typer.Option("--forget", help="Forget set: FILE.jsonl or hf:NAME[:CONFIG][@SPLIT].")]
Retain = Annotated[str | None, typer.Option(
    "--retain", help="Retain set: FILE.jsonl, hf:NAME[:CONFIG][@SPLIT], or tofu-authors (the DualOptim+ authors' "
    "retain set for --forget's file and task).")]
TaskId = Annotated[int | None, typer.Option(
    "--task-id", help="Forget files whose rows carry task_id (the authors' TOFU files): the task to unlearn "
    "[default: 1]")]
TaskIds = Annotated[str | None, typer.Option("--task-ids", help="With --continual: the tasks, in order (1,2,3).")]
Continual = Annotated[bool | None, typer.Option(
    "--continual/--no-continual", help="Unlearn --task-ids one after another, each from the previous task's final "
    "model." + shown_default("continual", UnlearnConfig))]
QuestionKey = Annotated[str | None, typer.Option("--question-key", help="Question field." + shown_default(
    "question_key", UnlearnConfig))]
UnlearnAnswerKey = Annotated[str | None, typer.Option("--answer-key", help="Answer field." + shown_default(
    "answer_key", UnlearnConfig))]
AnswersFromModel = Annotated[bool | None, typer.Option(
    "--answers-from-model/--no-answers-from-model",
    help="Use the starting model's own greedy answers as targets (real-world setting)." + shown_default(
        "answers_from_model", UnlearnConfig))]
TextWindow = Annotated[int | None, typer.Option(
    "--text-window", help="Join the text rows of the forget and retain sets and cut them into windows of N tokens, "
    "as MUSE trains (N=2048, with --max-length 2048) [default: each text row is one example]")]
UnlearnMaxNewTokens = Annotated[int | None, typer.Option(
    "--max-new-tokens", help="Tokens generated per answer (targets, sample table)." + shown_default("max_new_tokens"))]
Loss = Annotated[str | None, typer.Option(
    "--loss", help="FORGET[+RETAIN]: FORGET in GA, NPO, DPO, ME, IDK, SimNPO, RMU, UNDIAL, WGA, SatImp, CE-U; RETAIN "
    "in GD, KL, AP, EMBED (RMU's activation term)." + shown_default("loss", UnlearnConfig))]
Beta = Annotated[float | None, typer.Option("--beta", help="Temperature of NPO, DPO and AP." + shown_default(
    "beta", UnlearnConfig))]
SimnpoBeta = Annotated[float | None, typer.Option("--simnpo-beta", help="SimNPO's beta." + shown_default(
    "simnpo_beta", UnlearnConfig))]
SimnpoGamma = Annotated[float | None, typer.Option("--simnpo-gamma", help="SimNPO's reward margin gamma."
                                                   + shown_default("simnpo_gamma", UnlearnConfig))]
UndialBeta = Annotated[float | None, typer.Option(
    "--undial-beta", help="UNDIAL's reduction of the true token's reference logit." + shown_default(
        "undial_beta", UnlearnConfig))]
WgaBeta = Annotated[float | None, typer.Option("--wga-beta", help="WGA's exponent on p_t." + shown_default(
    "wga_beta", UnlearnConfig))]
SatimpBeta1 = Annotated[float | None, typer.Option("--satimp-beta1", help="SatImp's exponent on p_t." + shown_default(
    "satimp_beta1", UnlearnConfig))]
SatimpBeta2 = Annotated[float | None, typer.Option("--satimp-beta2", help="SatImp's exponent on 1 - p_t."
                                                   + shown_default("satimp_beta2", UnlearnConfig))]
RmuLayer = Annotated[int | None, typer.Option(
    "--rmu-layer", help="RMU/EMBED: the decoder layer whose output is steered or held [default: 7; 7/32 of the "
    "depth of a model with 7 layers or fewer]")]
RmuCoeff = Annotated[float | None, typer.Option("--rmu-coeff", help="RMU's steering coefficient c." + shown_default(
    "rmu_coeff", UnlearnConfig))]
RmuUpdateLayers = Annotated[str | None, typer.Option(
    "--rmu-update-layers", help="RMU: layers whose modules train, e.g. 5,6,7 [default: the RMU layer and the two "
    "before it]")]
RmuModules = Annotated[str | None, typer.Option(
    "--rmu-modules", help="RMU: the modules of those layers that train, e.g. mlp.down_proj [default: the MLP's "
    "output projection]")]
ForgetCoeff = Annotated[float | None, typer.Option("--forget-coeff", help="Weight of the forget loss." + shown_default(
    "forget_coeff", UnlearnConfig))]
RetainCoeff = Annotated[float | None, typer.Option("--retain-coeff", help="Weight of the retain loss." + shown_default(
    "retain_coeff", UnlearnConfig))]
UnlearnDoplusRule = Annotated[str | None, typer.Option(
    "--doplus-rule", help="DualOptim+'s AdamW rule: safeguarded (floor on the denominator, steps at most 10 lr) or "
    "paper (exactly as published)." + shown_default("doplus_rule"))]
ForgetFreq = Annotated[int | None, typer.Option("--forget-freq", help="F_f: forget steps per cycle." + shown_default(
    "forget_freq", UnlearnConfig))]
RetainFreq = Annotated[int | None, typer.Option("--retain-freq", help="F_r: retain steps per cycle." + shown_default(
    "retain_freq", UnlearnConfig))]
ForgetLr = Annotated[float | None, typer.Option("--forget-lr",
                                                help="Learning rate of forget steps [default: --lr]")]
UnlearnWarmupSteps = Annotated[int | None, typer.Option(
    "--warmup-steps", help="Linear warmup, then linear decay to 0 [default: one pass over the forget set]")]
UnlearnOut = Annotated[str | None, typer.Option("--out", help="Output folder [default: runs/unlearn-DATE-TIME]")]
UnlearnOverwrite = Annotated[bool | None, typer.Option(
    "--overwrite/--no-overwrite", help="Replace the run in a non-empty --out folder." + shown_default("overwrite"))]
ShowSamples = Annotated[int | None, typer.Option(
    "--show-samples", help="Questions per set shown before/after (0: none)." + shown_default(
        "show_samples", UnlearnConfig))]
UnlearnLoraRank = Annotated[int | None, typer.Option(
    "--lora-rank", help="Train LoRA adapters of rank R (peft) [default: 0, every weight]")]
UnlearnLoraTargets = Annotated[str | None, typer.Option(
    "--lora-targets", help="Modules to adapt, comma-separated [default: peft's for the architecture]")]
UnlearnGradientCheckpointing = Annotated[bool | None, typer.Option(
    "--gradient-checkpointing/--no-gradient-checkpointing",
    help="Recompute activations in backward (less memory)." + shown_default("gradient_checkpointing"))]
RefOffload = Annotated[str | None, typer.Option(
    "--ref-offload", help="cpu: keep the reference model (NPO, DPO, KL) on the CPU; 8bit: load it with LLM.int8 "
    "weights (bitsandbytes) on the device [default: a full copy on the device; its shards under FSDP]")]
UnlearnNumProcesses = Annotated[int | None, typer.Option(
    "--num-processes", min=1,
    help="Run on N processes through `accelerate launch` (N GPUs, or N CPU processes over gloo).")]
UnlearnSaveEvery = Annotated[int | None, typer.Option(
    "--save-every", help="Write checkpoints/step-N/ every N steps [default: never]")]
UnlearnResume = Annotated[str | None, typer.Option(
    "--resume", help="Continue the run in --out: `--resume` alone takes its latest checkpoint, `--resume PATH` the "
    "checkpoint folder given.")]
AcceptChanged = Annotated[str | None, typer.Option(
    "--accept-changed", help="With --resume: go on although these inputs changed since the run started: data, "
    "model, software (comma-separated, or all). Without it such a resumption is refused, naming what changed.")]
UnlearnEvalEvery = Annotated[int | None, typer.Option(
    "--eval-every", help="Evaluate every N steps (and at the end) into OUT/evals/step-N/ [default: never]")]
UnlearnSelectBy = Annotated[str | None, typer.Option(
    "--select-by", help="Keep the evaluated step that is best by METRIC as OUT/best/ beside final/: MU, UFE, TFE or "
    "OVR (higher is better); METRIC:max or METRIC:min sets the direction [default: keep none]")]
UnlearnEvalSuite = Annotated[str | None, typer.Option("--eval-suite", help="Suite run during training."
                                                      + shown_default("eval_suite", UnlearnConfig))]
EvalSplit = Annotated[str | None, typer.Option("--eval-split", help="TOFU forget split." + shown_default(
    "eval_split", UnlearnConfig))]
EvalDataDir = Annotated[str | None, typer.Option("--eval-data-dir", help=TOFU_FOLDER_HELP + "]")]
UnlearnEvalMaxSamples = Annotated[int | None, typer.Option("--eval-max-samples",
                                                           help="Questions per set [default: all]")]
UnlearnEvalMaxNewTokens = Annotated[int | None, typer.Option(
    "--eval-max-new-tokens", help=ANSWER_TOKENS_HELP + shown_default("eval_max_new_tokens", UnlearnConfig))]
UnlearnEvalBatchSize = Annotated[int | None, typer.Option(
    "--eval-batch-size", help="Prompts per batch of the evaluation during training [default: the larger of "
    "--batch-size and 8]")]
EvalNliModel = Annotated[str | None, typer.Option("--eval-nli-model", help="NLI model " + NLI_DEFAULT)]
EvalEmbeddingModel = Annotated[str | None, typer.Option(
    "--eval-embedding-model", help="Embedding model [default: the protocol's]")]
EvalProtocol = Annotated[str | None, typer.Option("--eval-protocol", help=PROTOCOL_HELP + shown_default(
    "eval_protocol", UnlearnConfig))]
EvalAttacks = Annotated[str | None, typer.Option(
    "--eval-attacks", help="The last evaluation (--eval-every) also runs on attacked copies of the final weights: "
    "relearn, relearn-lora, quant-8bit, quant-4bit, probe or all, comma-separated (docs/attacks.md) "
    "[default: none]")]

# --- doplus multitask -------------------------------------------------------------------------------------------
MultitaskRecipe = Annotated[str | None, typer.Option("--recipe",
                                                     help="YAML recipe (a tasks: list); flags override it.")]
Task = Annotated[list[str] | None, typer.Option(
    "--task", help="NAME=SOURCE[,metric=exact|choice|edit_sim|rouge_l][,freq=F][,weight=W][,eval=FILE]"
    "[,lr_multiplier=X], SOURCE a JSON-lines file or hf:NAME[:CONFIG][@SPLIT]; once per task (replaces the "
    "recipe's tasks)")]
MultitaskFreq = Annotated[str | None, typer.Option(
    "--freq", help="Each task's steps per cycle, in order: 1,2,1 [default: each task's freq, 1]")]
PromptKey = Annotated[str | None, typer.Option("--prompt-key", help="Prompt field." + shown_default(
    "prompt_key", MultitaskConfig))]
MultitaskAnswerKey = Annotated[str | None, typer.Option("--answer-key", help="Answer field." + shown_default(
    "answer_key", MultitaskConfig))]
EvalRows = Annotated[int | None, typer.Option(
    "--eval-rows", help="Rows kept out of training for evaluation, per task without an eval file (0: none)."
    + shown_default("eval_rows", MultitaskConfig))]
MultitaskEvalEvery = Annotated[int | None, typer.Option(
    "--eval-every", help="Score every task every N steps (and at the end) [default: never]")]
MultitaskSelectBy = Annotated[str | None, typer.Option(
    "--select-by", help="Keep the evaluated step that is best by METRIC as OUT/best/ beside final/: a task's name "
    "or average (higher is better); METRIC:max or METRIC:min sets the direction [default: keep none]")]
MultitaskMaxNewTokens = Annotated[int | None, typer.Option(
    "--max-new-tokens", help="Greedy tokens per evaluated answer." + shown_default("max_new_tokens"))]
MultitaskEvalBatchSize = Annotated[int | None, typer.Option(
    "--eval-batch-size", help="Prompts per generation batch." + shown_default("eval_batch_size", MultitaskConfig))]
MultitaskWarmupSteps = Annotated[int | None, typer.Option(
    "--warmup-steps", help="Linear warmup, then linear decay to 0 [default: a tenth of the steps]")]
MultitaskOut = Annotated[str | None, typer.Option("--out", help="Output folder [default: runs/multitask-DATE-TIME]")]

# --- doplus align -----------------------------------------------------------------------------------------------
Safety = Annotated[str | None, typer.Option(
    "--safety", help="Harmful instructions with the safe response to learn: " + SOURCE_HELP)]
General = Annotated[str | None, typer.Option(
    "--general", help="Benign instructions with their responses (Alpaca): " + SOURCE_HELP)]
InstructionKey = Annotated[str | None, typer.Option("--instruction-key", help="Instruction field." + shown_default(
    "instruction_key", AlignConfig))]
InputKey = Annotated[str | None, typer.Option(
    "--input-key", help="Optional input field, after the instruction and a blank line when not empty."
    + shown_default("input_key", AlignConfig))]
OutputKey = Annotated[str | None, typer.Option("--output-key", help="Response field." + shown_default(
    "output_key", AlignConfig))]
AlignFreq = Annotated[str | None, typer.Option(
    "--freq", help="F_s:F_g, safety steps then general steps per cycle." + shown_default("freq", AlignConfig))]
Epochs = Annotated[float | None, typer.Option(
    "--epochs", help="Passes over the general set, instead of --steps (warmup: the first epoch).")]
HeldOut = Annotated[int | None, typer.Option(
    "--held-out", help="Each set's last N rows, kept out of training and answered before and after (0: none)."
    + shown_default("held_out", AlignConfig))]
AlignMaxNewTokens = Annotated[int | None, typer.Option(
    "--max-new-tokens", help="Greedy tokens per held-out response." + shown_default("max_new_tokens"))]
AlignScheme = Annotated[str | None, typer.Option(
    "--scheme", help="joint (batches from the mixture of both sets), alternate, dualoptim, doplus, scaffold, fedcm "
    "or local-adam."
    + shown_default("scheme"))]
AlignSteps = Annotated[int | None, typer.Option("--steps", help="Optimizer steps (or --epochs)." + shown_default(
    "steps"))]
AlignWarmupSteps = Annotated[int | None, typer.Option(
    "--warmup-steps", help="Linear warmup, then linear decay to 0 [default: the first epoch with --epochs, else a "
    "tenth of the steps]")]
AlignOut = Annotated[str | None, typer.Option("--out", help="Output folder [default: runs/align-DATE-TIME]")]
AlignEvalBatchSize = Annotated[int | None, typer.Option(
    "--eval-batch-size", help="Prompts per generation batch." + shown_default("eval_batch_size", AlignConfig))]
AlignEvalSuite = Annotated[str | None, typer.Option(
    "--eval-suite", help="After training, `doplus evaluate` final/ into OUT/eval/: safety, xstest or safety,xstest "
    "[default: none]")]
AlignEvalMaxSamples = Annotated[int | None, typer.Option(
    "--eval-max-samples", help="The first N prompts of each set [default: all]")]
AlignEvalMaxNewTokens = Annotated[int | None, typer.Option(
    "--eval-max-new-tokens", help=ANSWER_TOKENS_HELP + shown_default("eval_max_new_tokens", AlignConfig))]
EvalGuardModel = Annotated[str | None, typer.Option(
    "--eval-guard-model", help="A Llama Guard-protocol model, or none " + GUARD_DEFAULT + "]")]
EvalRefusalModel = Annotated[str | None, typer.Option(
    "--eval-refusal-model", help="A chat model labelling refusals by XSTest's protocol [default: the offline "
    "refusal judge]")]
EvalSafetyDataDir = Annotated[str | None, typer.Option("--eval-safety-data-dir",
                                                       help="Folder " + SAFETY_FILES_HELP)]

# --- doplus evaluate ------------------------------------------------------------------------------------------
Folders = Annotated[list[str] | None, typer.Argument(help="With --compare: evaluation folders to compare.")]
Compare = Annotated[bool | None, typer.Option("--compare", help="Print the given evaluation folders side by side.")]
EvaluateModel = Annotated[str | None, typer.Option(
    "--model", help="Hub id, model folder (e.g. a run's final/) or .gguf [default: embedded SmolLM2]")]
Suite = Annotated[str | None, typer.Option(
    "--suite", help="tofu, real-world, lm-eval, privacy, safety, xstest, muse, or several comma-separated.")]
Split = Annotated[str | None, typer.Option("--split", help="TOFU forget split: forget01, forget05, forget10.")]
EvaluateTaskId = Annotated[int | None, typer.Option(
    "--task-id", help="TOFU files whose rows carry task_id (the DualOptim+ authors'): the forget task scored "
    "[default: 1]")]
DataDir = Annotated[str | None, typer.Option("--data-dir", help=TOFU_FOLDER_HELP + " from the hub]")]
EvaluateForget = Annotated[str | None, typer.Option("--forget", help="real-world: forget-people JSON lines.")]
EvaluateRetain = Annotated[str | None, typer.Option("--retain", help="real-world: neighbour-people JSON lines.")]
EvaluateOut = Annotated[str | None, typer.Option("--out", help="Output folder [default: evals/DATE-TIME]")]
MaxSamples = Annotated[int | None, typer.Option("--max-samples",
                                                help="At most N questions per set (quick looks).")]
EvaluateBatchSize = Annotated[int | None, typer.Option(
    "--batch-size", min=1, help="Prompts per generation batch; NLL batches hold about 48 tokens per unit.")]
GenerationBatchSize = Annotated[int | None, typer.Option(
    "--generation-batch-size", min=1, help="Prompts per generation batch of the TOFU and real-world suites, apart "
    "from the NLL batches' unit [default: twice --batch-size on the CPU, --batch-size on a GPU]")]
EvaluateMaxNewTokens = Annotated[int | None, typer.Option("--max-new-tokens", min=1, help=ANSWER_TOKENS_HELP)]
EmbeddingModel = Annotated[str | None, typer.Option(
    "--embedding-model", help="Sentence-transformers model for Cosine Similarity [default: the protocol's: doplus "
    "all-MiniLM-L6-v2, paper paraphrase-MiniLM-L6-v2]")]
NliModel = Annotated[str | None, typer.Option("--nli-model",
                                              help="NLI model for the Entailment Score " + NLI_DEFAULT)]
Targeted = Annotated[bool | None, typer.Option(
    "--targeted/--untargeted", help="OVR formula (IDK/DPO are targeted) [default: from the run's loss, else both]")]
Tasks = Annotated[str | None, typer.Option("--tasks", help="lm-eval tasks, comma-separated.")]
Limit = Annotated[float | None, typer.Option("--limit", help="lm-eval: samples per task (or a fraction < 1).")]
LmEvalInclude = Annotated[str | None, typer.Option("--lm-eval-include",
                                                   help="Folder of extra lm-eval task YAMLs.")]
EvaluateDtype = Annotated[str | None, typer.Option("--dtype",
                                                   help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16.")]
EvaluateTrustRemoteCode = Annotated[bool | None, typer.Option("--trust-remote-code",
                                                              help="Allow the model's own code to run.")]
EvaluateOverwrite = Annotated[bool | None, typer.Option("--overwrite",
                                                        help="Replace an evaluation already in --out.")]
EvaluateResume = Annotated[bool | None, typer.Option(
    "--resume", help="Continue an interrupted evaluation in --out: the suites it finished are kept, the others run.")]
EvaluateSeed = Annotated[int | None, typer.Option("--seed", help="Seed (rejection answers drawn for TFE).")]
EvaluatePromptTemplate = Annotated[str | None, typer.Option(
    "--prompt-template", help=TEMPLATE_HELP.replace("[default: ", "[default: a run's own template; else "))]
Protocol = Annotated[str | None, typer.Option("--protocol", help=PROTOCOL_HELP)]
RetainLogs = Annotated[str | None, typer.Option(
    "--retain-logs", help="A retain model's TOFU_EVAL.json (doplus's or OpenUnlearning's): forget_quality and "
    "privleak's reference AUC; muse: a retrained model's MUSE_EVAL.json.")]
Holdout = Annotated[str | None, typer.Option(
    "--holdout", help="Non-member rows (JSON lines with question, answer; TOFU's holdout10): the privacy suite, and "
    "privacy metrics in the TOFU suite.")]
GuardModel = Annotated[str | None, typer.Option(
    "--guard-model", help="safety: a Llama Guard-protocol model (hub id or folder), or none " + GUARD_DEFAULT
    + ", said in the report]")]
RefusalModel = Annotated[str | None, typer.Option(
    "--refusal-model", help="safety, xstest: a chat model (hub id or folder) that labels refusals by XSTest's "
    "classification protocol instead of the offline refusal judge")]
RefusalModelPrompt = Annotated[str | None, typer.Option(
    "--refusal-model-prompt", help="Its prompt: a text file with {question} and {response} [default: doplus's "
    "wording of XSTest's GPT-4 prompt]")]
SafetyDataDir = Annotated[str | None, typer.Option("--safety-data-dir",
                                                   help="safety, xstest: folder " + SAFETY_FILES_HELP)]
Responses = Annotated[str | None, typer.Option(
    "--responses", help="safety, xstest: judge the (prompt, response) rows of FILE.jsonl|csv instead of "
    "generating")]
MuseCorpus = Annotated[str | None, typer.Option("--muse-corpus", help="muse: news or books.")]
MuseData = Annotated[str | None, typer.Option(
    "--muse-data", help="muse: a folder in MUSE's layout (<config>/<split>.jsonl) or hf:NAME [default: "
    "hf:muse-bench/MUSE-News or MUSE-Books]")]
MuseRetrained = Annotated[str | None, typer.Option(
    "--muse-retrained", help="muse: a retrained model (hub id or folder) whose Min-40% AUC is privleak's reference "
    "[default: --retain-logs, else MUSE's published retrained AUC]")]
Attacks = Annotated[str | None, typer.Option(
    "--attacks", help="Run the forget suites again on attacked copies of the model and report the change: relearn, "
    "relearn-lora, quant-8bit, quant-4bit, probe (probe-prefix, probe-roleplay, probe-incontext, probe-paraphrase) "
    "or all, comma-separated (docs/attacks.md). The model on disk is never changed.")]
RelearnData = Annotated[str | None, typer.Option(
    "--relearn-data", help="Relearning attacks: JSON lines with question, answer to fine-tune on [default: the "
    "first half of the forget rows; the other half is reported apart]")]
RelearnSteps = Annotated[str | None, typer.Option(
    "--relearn-steps", help="Relearning attacks: K optimizer steps, or several comma-separated (one relearned copy "
    "each; the published presets are 50, 100, 150) [default: 50]")]
# evaluate's options that name a file, a folder or a model: in a recipe, a relative one is looked up next to the
# recipe first, as config.PATH_KEYS are in a training recipe.
EVALUATE_PATH_KEYS = ("model", "data_dir", "forget", "retain", "lm_eval_include", "retain_logs", "holdout",
                      "guard_model", "refusal_model", "refusal_model_prompt", "safety_data_dir", "responses",
                      "muse_data", "muse_retrained", "relearn_data")

# Each command's options, by parameter name (a training command's config key, but for recipe, num_processes,
# dry_run, gpu_memory and multitask's task; evaluate's EvalConfig fields, `suite` setting `suites`), in the order of
# its help; cli.py's signatures take the same (tests/test_cli.py checks).
COMMAND_OPTIONS: dict[str, dict[str, Any]] = {
    "unlearn": {
        "recipe": Recipe, "model": Model, "dtype": Dtype, "precision": Precision, "save_dtype": SaveDtype,
        "trust_remote_code": UnlearnTrustRemoteCode, "forget": Forget, "retain": Retain, "task_id": TaskId,
        "task_ids": TaskIds, "continual": Continual, "question_key": QuestionKey, "answer_key": UnlearnAnswerKey,
        "max_length": MaxLength, "text_window": TextWindow, "prompt_template": PromptTemplate,
        "answers_from_model": AnswersFromModel, "max_new_tokens": UnlearnMaxNewTokens, "loss": Loss, "beta": Beta,
        "simnpo_beta": SimnpoBeta,
        "simnpo_gamma": SimnpoGamma, "undial_beta": UndialBeta, "wga_beta": WgaBeta, "satimp_beta1": SatimpBeta1,
        "satimp_beta2": SatimpBeta2, "rmu_layer": RmuLayer, "rmu_coeff": RmuCoeff,
        "rmu_update_layers": RmuUpdateLayers, "rmu_modules": RmuModules, "forget_coeff": ForgetCoeff,
        "retain_coeff": RetainCoeff, "scheme": Scheme, "optimizer": Optimizer, "state_bits": StateBits,
        "doplus_rule": UnlearnDoplusRule, "v_floor": VFloor, "base_update": BaseUpdate,
        "base_source": BaseSource, "forget_freq": ForgetFreq, "retain_freq": RetainFreq, "betas": Betas,
        "steps": Steps, "lr": Lr, "forget_lr": ForgetLr, "batch_size": BatchSize, "grad_accum": GradAccum,
        "warmup_steps": UnlearnWarmupSteps, "weight_decay": WeightDecay, "max_grad_norm": MaxGradNorm, "seed": Seed,
        "out": UnlearnOut, "overwrite": UnlearnOverwrite, "show_samples": ShowSamples, "lora_rank": UnlearnLoraRank,
        "lora_alpha": LoraAlpha, "lora_targets": UnlearnLoraTargets, "lora_dropout": LoraDropout,
        "gradient_checkpointing": UnlearnGradientCheckpointing, "save_adapter_only": SaveAdapterOnly,
        "ref_offload": RefOffload, "fsdp": Fsdp, "num_processes": UnlearnNumProcesses, "dry_run": DryRun,
        "gpu_memory": GpuMemory, "save_every": UnlearnSaveEvery,
        "keep_last": KeepLast, "resume": UnlearnResume, "accept_changed": AcceptChanged,
        "eval_every": UnlearnEvalEvery, "select_by": UnlearnSelectBy,
        "eval_suite": UnlearnEvalSuite, "eval_split": EvalSplit, "eval_data_dir": EvalDataDir,
        "eval_max_samples": UnlearnEvalMaxSamples, "eval_max_new_tokens": UnlearnEvalMaxNewTokens,
        "eval_batch_size": UnlearnEvalBatchSize, "eval_nli_model": EvalNliModel,
        "eval_embedding_model": EvalEmbeddingModel, "eval_protocol": EvalProtocol, "eval_attacks": EvalAttacks,
        "log_update_similarity": LogUpdateSimilarity, "report_to": ReportTo,
    },
    "multitask": {
        "recipe": MultitaskRecipe, "task": Task, "freq": MultitaskFreq, "prompt_key": PromptKey,
        "answer_key": MultitaskAnswerKey, "eval_rows": EvalRows, "eval_every": MultitaskEvalEvery,
        "select_by": MultitaskSelectBy,
        "eval_batch_size": MultitaskEvalBatchSize, "model": Model, "dtype": Dtype, "precision": Precision,
        "save_dtype": SaveDtype, "trust_remote_code": TrustRemoteCode, "max_length": MaxLength,
        "max_new_tokens": MultitaskMaxNewTokens, "scheme": Scheme, "optimizer": Optimizer, "state_bits": StateBits,
        "doplus_rule": DoplusRule, "v_floor": VFloor, "base_update": BaseUpdate, "base_source": BaseSource,
        "prompt_template": PromptTemplate, "betas": Betas, "steps": Steps, "lr": Lr,
        "batch_size": BatchSize, "grad_accum": GradAccum, "warmup_steps": MultitaskWarmupSteps,
        "weight_decay": WeightDecay, "max_grad_norm": MaxGradNorm, "seed": Seed, "out": MultitaskOut,
        "overwrite": Overwrite, "lora_rank": LoraRank, "lora_alpha": LoraAlpha, "lora_targets": LoraTargets,
        "lora_dropout": LoraDropout, "gradient_checkpointing": GradientCheckpointing,
        "save_adapter_only": SaveAdapterOnly, "fsdp": Fsdp, "num_processes": NumProcesses, "dry_run": DryRun,
        "gpu_memory": GpuMemory, "save_every": SaveEvery,
        "keep_last": KeepLast, "resume": Resume, "accept_changed": AcceptChanged,
        "log_update_similarity": LogUpdateSimilarity, "report_to": ReportTo,
    },
    "align": {
        "recipe": Recipe, "safety": Safety, "general": General, "instruction_key": InstructionKey,
        "input_key": InputKey, "output_key": OutputKey, "freq": AlignFreq, "epochs": Epochs, "held_out": HeldOut,
        "model": Model, "dtype": Dtype, "precision": Precision, "save_dtype": SaveDtype,
        "trust_remote_code": TrustRemoteCode, "max_length": MaxLength, "max_new_tokens": AlignMaxNewTokens,
        "prompt_template": PromptTemplate, "scheme": AlignScheme, "optimizer": Optimizer, "state_bits": StateBits,
        "doplus_rule": DoplusRule, "v_floor": VFloor, "base_update": BaseUpdate, "base_source": BaseSource,
        "betas": Betas,
        "steps": AlignSteps, "lr": Lr, "batch_size": BatchSize,
        "grad_accum": GradAccum, "warmup_steps": AlignWarmupSteps, "weight_decay": WeightDecay,
        "max_grad_norm": MaxGradNorm, "seed": Seed, "out": AlignOut, "overwrite": Overwrite, "lora_rank": LoraRank,
        "lora_alpha": LoraAlpha, "lora_targets": LoraTargets, "lora_dropout": LoraDropout,
        "gradient_checkpointing": GradientCheckpointing, "save_adapter_only": SaveAdapterOnly, "fsdp": Fsdp,
        "num_processes": NumProcesses, "dry_run": DryRun, "gpu_memory": GpuMemory, "save_every": SaveEvery,
        "keep_last": KeepLast, "resume": Resume,
        "accept_changed": AcceptChanged,
        "log_update_similarity": LogUpdateSimilarity, "report_to": ReportTo, "eval_batch_size": AlignEvalBatchSize,
        "eval_suite": AlignEvalSuite, "eval_max_samples": AlignEvalMaxSamples,
        "eval_max_new_tokens": AlignEvalMaxNewTokens, "eval_guard_model": EvalGuardModel,
        "eval_refusal_model": EvalRefusalModel, "eval_safety_data_dir": EvalSafetyDataDir,
    },
    "evaluate": {
        "folders": Folders, "compare": Compare, "recipe": Recipe, "model": EvaluateModel, "suite": Suite,
        "split": Split, "task_id": EvaluateTaskId, "data_dir": DataDir, "forget": EvaluateForget,
        "retain": EvaluateRetain, "out": EvaluateOut, "max_samples": MaxSamples, "batch_size": EvaluateBatchSize,
        "generation_batch_size": GenerationBatchSize, "max_new_tokens": EvaluateMaxNewTokens,
        "embedding_model": EmbeddingModel, "nli_model": NliModel, "targeted": Targeted, "tasks": Tasks,
        "limit": Limit, "lm_eval_include": LmEvalInclude, "dtype": EvaluateDtype,
        "trust_remote_code": EvaluateTrustRemoteCode, "overwrite": EvaluateOverwrite, "resume": EvaluateResume,
        "seed": EvaluateSeed, "prompt_template": EvaluatePromptTemplate, "protocol": Protocol,
        "retain_logs": RetainLogs, "holdout": Holdout, "guard_model": GuardModel, "refusal_model": RefusalModel,
        "refusal_model_prompt": RefusalModelPrompt, "safety_data_dir": SafetyDataDir, "responses": Responses,
        "muse_corpus": MuseCorpus, "muse_data": MuseData, "muse_retrained": MuseRetrained, "attacks": Attacks,
        "relearn_data": RelearnData, "relearn_steps": RelearnSteps,
    },
}


def takes(command: str, defaults: dict[str, Any] | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command function (`def unlearn(**values)`) the options `COMMAND_OPTIONS` lists for `command`, in that
    order, each defaulting to its value in `defaults`, else None ("not given"): typer reads them from the
    signature (click shows a default that is not None after the help text), and the function receives them by
    name, the names of the config fields they set."""
    defaults = defaults or {}

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        function.__signature__ = inspect.Signature([
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=defaults.get(name), annotation=option)
            for name, option in COMMAND_OPTIONS[command].items()], return_annotation=None)
        return function
    return decorate


def with_recipe(recipe: str | None, values: dict[str, Any], path_keys: tuple[str, ...]) -> dict[str, Any]:
    """A command's option values (as its function received them) with a recipe under them: an option the command
    line gave keeps its value (click's parameter source tells it from its default), any other the recipe sets takes
    the recipe's. The recipe's keys are the names in `values` (config.recipe_options checks them and finds a
    relative path under `path_keys` next to the recipe; the caller leaves out what a recipe does not set, such as
    evaluate's --compare); each value is read as its flag's text would be (the option's type, with its range and
    its words for true and false), a list as its items comma-separated."""
    if recipe is None:
        return values
    context = get_current_context()
    params = {param.name: param for param in context.command.params if param.name in values}
    resolved = dict(values)
    for key, value in recipe_options(recipe, list(params), path_keys).items():
        if context.get_parameter_source(key) is not ParameterSource.COMMANDLINE:
            resolved[key] = recipe_value(params[key], value, f"{recipe}: option '{key}'", context)
    return resolved


def recipe_value(param: Any, value: Any, where: str, context: Any) -> Any:
    """A recipe's value for one option, converted as the command line converts the flag's text (the option's type,
    its range); one line if it cannot be."""
    if value is None:
        if param.default is not None:
            raise UserError(f"{where} cannot be empty")
        return None
    if isinstance(value, list) and all(isinstance(item, (str, int, float)) for item in value):
        value = ",".join(str(item) for item in value)
    if isinstance(value, (dict, list)):
        raise UserError(f"{where} must be one value, got {value!r}")
    text = value if isinstance(value, bool) and param.is_flag else str(value)  # as typed: 2.5 is no integer
    try:
        return param.process_value(context, text)
    except typer.BadParameter as error:
        message = error.message[:1].lower() + error.message[1:]
        raise UserError(f"{where}: {message}, got {value!r}") from None


def flags_of(option: Any) -> tuple[list[str], list[str]]:
    """An option type's flags: those that set it (for a boolean, to true) and those that set a boolean to false
    (`--fsdp/--no-fsdp` -> ["--fsdp"], ["--no-fsdp"]), split as click splits its declarations."""
    info = get_args(option)[1]
    on, off = [], []
    # Inside Annotated, typer.Option's first argument is the first declaration (typer keeps it in `.default`).
    for declaration in (info.default, *(info.param_decls or ())):
        first, _, second = declaration.partition("/")
        on.append(first.strip())
        if second.strip():
            off.append(second.strip())
    return on, off


def command_flags(command: str) -> dict[str, tuple[list[str], list[str]]]:
    """A command's options by name, each with its flags (see `flags_of`), its arguments left out; {} for a command
    without a `COMMAND_OPTIONS` entry."""
    return {name: flags_of(option) for name, option in COMMAND_OPTIONS.get(command, {}).items()
            if not isinstance(get_args(option)[1], ArgumentInfo)}
