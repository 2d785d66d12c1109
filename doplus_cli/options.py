"""The options of the training commands (`doplus unlearn`, `multitask`, `align`), each declared once.

Every option is an `Annotated` type: its flags and its help text, the help's `[default: ...]` read from the config
dataclass field (config.py holds every default; the flag's own default is None, "not given", so a recipe's value
stands unless a flag replaces it). `COMMAND_OPTIONS` lists each command's options (name -> type): `takes` makes
them the signature of the command's function in cli.py, and the model card writes its command line from them
(engine/model_card.py).

Where the three commands word an option differently, the variant is named after its command (`UnlearnOut`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Annotated, Any, get_args

import typer

from doplus_cli.config import AlignConfig, MultitaskConfig, TrainConfig, UnlearnConfig, default_of
from doplus_cli.data.formatting import TEMPLATE_HELP


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
EvalDataDir = Annotated[str | None, typer.Option(
    "--eval-data-dir", help="Folder of TOFU JSON-lines files [default: hf:locuslab/TOFU]")]
UnlearnEvalMaxSamples = Annotated[int | None, typer.Option("--eval-max-samples",
                                                           help="Questions per set [default: all]")]
UnlearnEvalMaxNewTokens = Annotated[int | None, typer.Option(
    "--eval-max-new-tokens", help="Greedy tokens per answer." + shown_default("eval_max_new_tokens", UnlearnConfig))]
UnlearnEvalBatchSize = Annotated[int | None, typer.Option(
    "--eval-batch-size", help="Prompts per batch of the evaluation during training [default: the larger of "
    "--batch-size and 8]")]
EvalNliModel = Annotated[str | None, typer.Option(
    "--eval-nli-model", help="NLI model [default: sileod/deberta-v3-base-tasksource-nli]")]
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
    "--eval-max-new-tokens", help="Greedy tokens per answer." + shown_default("eval_max_new_tokens", AlignConfig))]
EvalGuardModel = Annotated[str | None, typer.Option(
    "--eval-guard-model", help="A Llama Guard-protocol model, or none [default: meta-llama/Meta-Llama-Guard-2-8B if "
    "it loads, else the offline refusal judge]")]
EvalRefusalModel = Annotated[str | None, typer.Option(
    "--eval-refusal-model", help="A chat model labelling refusals by XSTest's protocol [default: the offline "
    "refusal judge]")]
EvalSafetyDataDir = Annotated[str | None, typer.Option(
    "--eval-safety-data-dir", help="Folder with I-*.json, Q-Harm.json, xstest_prompts.csv [default: download the "
    "releases' files]")]

# Each training command's options, by parameter name (a config key, but for recipe, num_processes, dry_run,
# gpu_memory and multitask's task), in the order of its help; cli.py's signatures take the same (tests/test_cli.py
# checks).
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
}


def takes(command: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command function (`def unlearn(**values)`) the options `COMMAND_OPTIONS` lists for `command`, in that
    order, each defaulting to None ("not given"): typer reads them from the signature, and the function receives
    them by name, the names of the config fields they set."""
    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        function.__signature__ = inspect.Signature([
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=option)
            for name, option in COMMAND_OPTIONS[command].items()], return_annotation=None)
        return function
    return decorate


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
    """A training command's options by name, each with its flags (see `flags_of`); {} for another command."""
    return {name: flags_of(option) for name, option in COMMAND_OPTIONS.get(command, {}).items()}
