"""The one training loop, for any list of objectives, in three parts read top to bottom as a torchtune recipe:

setup: the accelerator, the run's folder, the model, the command's objectives (`Plan`), the reference model,
LoRA, the shards, the scheme's optimizer and its LR schedule, a resumed run's state, the trackers: one `Run`;
train: for each step pick the objective, draw its batch, compute its loss, backward, clip,
`optimizer.step(objective=...)`, log; finish: final/, the report, the model card. `doplus unlearn` and `doplus
multitask` only build the objective list and say what to measure (commands/unlearn.py, commands/multitask.py).
Accelerate holds the device and process details, so the same loop runs on one CPU or many GPUs.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from doplus_cli import lifecycle, ownership
from doplus_cli.config import StopRule, TrainConfig, chosen_trackers, recorded
from doplus_cli.data.batches import IndexStream
from doplus_cli.data.formatting import PromptFormatter
from doplus_cli.data.sources import MixtureSource
from doplus_cli.engine import checkpoint, inputs, model_card, outputs, sharding, tracking, training_precision
from doplus_cli.engine.objectives import Objective, Plan, frequencies, lr_multipliers
from doplus_cli.engine.optimizers import OptimizerSettings, build_optimizer, safeguard_fractions
from doplus_cli.engine.schedule import JOINT, linear_warmup_schedule, objective_at, steps_per_objective
from doplus_cli.engine.selection import BEST, Selection, selection_for, stop_rule_for
from doplus_cli.engine.similarity import UpdateSimilarity
from doplus_cli.errors import RunError, UserError, worker_exit_code
from doplus_cli.evaluation.compute import peak_memory_gb
from doplus_cli.files import save_figure
from doplus_cli.lifecycle import StopRequest
from doplus_cli.lora import LoraSettings, adapter_norms, apply_lora, final_model
from doplus_cli.losses import LossContext, PartTally, local_token_count
from doplus_cli.models import load_model_8bit, load_model_and_tokenizer, resolve_dtype
from doplus_cli.optim import quant
from doplus_cli.optim.adamw import compensation_buffers
from doplus_cli.optim.distributed import local_shard
from doplus_cli.progress import LoggedProgress

if TYPE_CHECKING:
    from accelerate import Accelerator


def default_out_dir(command: str) -> str:
    return os.path.join("runs", f"{command}-" + datetime.now().strftime("%Y%m%d-%H%M%S"))


def _shared_default_out(accelerator, command: str) -> str:
    """The main process's default folder name, on every process (their clocks may differ by a second)."""
    from accelerate.utils import broadcast_object_list

    name = [default_out_dir(command)]
    if accelerator.num_processes > 1:
        broadcast_object_list(name)
    return name[0]


def wants_fsdp(config: TrainConfig, accelerator) -> bool:
    """--fsdp, or `accelerate launch` with an FSDP configuration: the run's `Opened.fsdp` (sharded when it runs
    on more than one process). A command's hooks, which hold the config as validated, read it here."""
    return bool(config.fsdp or sharding.launched_with_fsdp(accelerator))


def _progress(console: Console, enabled: bool) -> Progress:
    """A bar on a terminal; in a batch log, plain lines for the evaluations and generations inside the run (the
    steps print their own lines)."""
    return LoggedProgress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled,
        transient=False,
    )


@dataclass(frozen=True)
class Opened:
    """What a run derives when it opens, from its config, its data and how it was launched; the validated config
    stays as it was given (it is final), and the run trains with `Opened.applied_to(config)`. These are the
    values that the run records as resolved: config.yaml, the checkpoints (which --resume compares), report.json
    and the model card hold them in place of what was asked (`auto`, none, the default folder)."""

    fsdp: bool  # --fsdp, or `accelerate launch` with an FSDP configuration
    precision: str  # fp32, bf16-mixed or bf16: --precision auto settled by the load dtype (training_precision.py)
    save_dtype: str  # float32 or bfloat16
    steps: int  # --steps, or the command's count from its data (align's --epochs)
    warmup_steps: int  # --warmup-steps or the command's default, at most `steps`
    out: str  # --out, or runs/COMMAND-DATE-TIME

    def applied_to(self, config: TrainConfig) -> TrainConfig:
        """The config the run trains with: `config` with these values, a new final config."""
        return config.replace(**asdict(self))


@dataclass
class Run:
    """What `setup` builds and `train` and `finish` read."""

    accelerator: Accelerator
    config: TrainConfig  # the command's config with the values derived when the run opened (`Opened`)
    opened: Opened
    out: Path
    model: torch.nn.Module  # as trained: wrapped by accelerate, or holding this process's FSDP shards
    tokenizer: Any
    model_name: str  # the model `--model` named, as the report says it
    formatter: PromptFormatter
    progress: Progress
    objectives: list[Objective]
    before: Any  # the plan's measurements of the starting model
    reference: torch.nn.Module | None  # the frozen starting model of NPO, DPO and KL
    lora: LoraSettings | None
    optimizer: Any  # stepped with an objective: `optimizer.step(objective=...)`
    torch_optimizer: Optimizer  # the torch Optimizer inside `optimizer`, the one the LR scheduler drives
    scheduler: LRScheduler
    context: LossContext  # what every loss reads besides its batch
    checkpoints: checkpoint.CheckpointWriter
    tracker: tracking.RunTracker  # --report-to
    metrics: outputs.MetricsWriter | None  # metrics.jsonl, on the main process
    similarity: UpdateSimilarity | None  # --log-update-similarity
    sharded: bool  # FSDP across several processes
    effective_batch: int  # rows per optimizer step over every process
    start_step: int = 0  # a resumed run's checkpoint step
    evals: list[dict[str, Any]] = field(default_factory=list)  # the evaluations during training so far
    stopped: dict[str, Any] | None = None  # --stop-when: the rule and the step whose evaluation met it

    @property
    def steps_done(self) -> int:
        """The steps the run trains: --steps, or the step whose evaluation met --stop-when."""
        return self.stopped["step"] if self.stopped and self.stopped["step"] else self.config.steps

    def save_checkpoint(self, step: int) -> Path:
        """checkpoints/step-{step}: every process takes part."""
        return self.checkpoints.save(step, self.metrics.records if self.metrics else [],
                                     {"before": self.before, "evals": self.evals, "trackers": self.tracker.ids})


def run_training(config: TrainConfig, plan: Plan, console: Console | None = None) -> dict[str, Any]:
    """Train on `plan`'s objectives as configured; return the report (also written to `config.out`)."""
    console = console or Console(stderr=True)
    started = time.perf_counter()
    # From the run's first second: before the first step a signal ends the run at once (nothing needs saving, and
    # --resume starts it again); from the first step to the report it is deferred, and the loop stops after the
    # current step with a checkpoint, so a signal never kills the run mid-write.
    with lifecycle.run_guard() as stop:
        # the progress display is live inside the block
        with setup(config, plan, console) as run, stop.deferred():
            config = run.config  # from here on, with the values the run derived when it opened
            train(run, config, plan, console, stop)
            unwrapped = run.accelerator.unwrap_model(run.model)
            lifecycle.stage("evaluating after training")
            measured_after = plan.after(unwrapped, run.formatter, run.progress, run.accelerator, run.before)
            # a signal during that evaluation: the last step's checkpoint, and a resume redoes only what follows
            _stop_with_checkpoint(run, stop, run.steps_done)
            full_weights = sharding.full_state_dict(run.model) if run.sharded else None  # every process takes part
        with stop.deferred():
            run.accelerator.wait_for_everyone()
            if not run.accelerator.is_main_process:
                return {}
            report = finish(run, config, plan, measured_after, full_weights, started)
    if stop.signal_name is not None:  # it came while final/ and the report were written: they were finished
        console.print(f"{stop.signal_name} arrived while the final model and report were written; the run completed")
    return report


def derive(config: TrainConfig, plan: Plan, world: int, fsdp: bool, out: str) -> Opened:
    """What a run of `config` on `world` processes derives when it opens (its data opened by `plan.open()`):
    the precision, the steps, the warm-up; --fsdp on one process is refused."""
    if config.fsdp and world == 1:
        raise UserError("--fsdp shards the model across processes and this run has one: add --num-processes N "
                        "(N >= 2, or start it with accelerate launch), or leave out --fsdp")
    # before the resume check: a checkpoint's config names the precision it used
    run_precision, save_dtype = training_precision.resolve(config.precision, config.dtype, config.save_dtype)
    effective_batch = config.batch_size * config.grad_accum * world
    derived_steps = plan.total_steps(effective_batch)
    steps = config.steps if derived_steps is None else derived_steps
    warmup_steps = plan.default_warmup(effective_batch) if config.warmup_steps is None else config.warmup_steps
    return Opened(fsdp=fsdp, precision=run_precision, save_dtype=save_dtype, steps=steps,
                  warmup_steps=min(warmup_steps, steps), out=out)


def out_folder_plan(resolved: TrainConfig, plan: Plan, world: int) -> str:
    """What the run of `resolved` (its derived values applied) would do with its --out, checked as `_open_run`
    checks it and said in words, without writing anything: `--dry-run`."""
    out, command, names = Path(resolved.out), f"doplus {plan.command}", run_outputs(resolved, plan)
    if resolved.resume:
        legacy = _check_resumable(resolved, out, command, names, main=False)
        if _interrupted_before_a_checkpoint(resolved, out):
            return f"{out}: starts the run there again from the beginning (it stopped before its first checkpoint)"
        processes = checkpoint.Processes(sharded=resolved.fsdp and world > 1, world=world)
        path, saved = checkpoint.checked_resume(resolved.resume, out, resolved.to_dict(), processes,
                                                resolved.accept_changed, resolved.accept_unverified, write=False)
        taken_on = " (a run of an older doplus: its entries would be recorded)" if legacy else ""
        return f"{out}: resumes from {path} at step {saved['step']}{taken_on}"
    removed = ownership.check_start(out, command, names, resolved.overwrite, then=", or --resume to continue it")
    if removed:
        return f"{out}: replaces the run recorded there (removes {', '.join(removed)})"
    if out.is_dir() and lifecycle.folder_entries(out):
        return f"{out}: writes beside the files there, none of which it touches ({', '.join(names)})"
    return f"{out}: a new run ({', '.join(names)})"


def _open_run(config: TrainConfig, plan: Plan, console: Console
              ) -> tuple[Accelerator, Opened, Path | None, dict[str, Any] | None]:
    """(the accelerator, what the run derives as it opens (FSDP, precision, steps, warm-up, out), the checkpoint to
    resume from and its saved state, or None, None), with the folder locked and prepared. `config` is left as it
    is: the checks and records here read `opened.applied_to(config)`."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    lifecycle.stage("opening the run")

    # cpu=True without CUDA: several processes started by `accelerate launch --multi_gpu` or torchrun then
    # form a gloo group on CPU (accelerate's own `--cpu` launcher needs MPI for more than one process).
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_plugin=_accumulation(config),
                              **tracking.accelerator_options(config.report_to))
    set_seed(config.seed)
    plan.open()  # every data file is checked before anything is written
    world = accelerator.num_processes
    fsdp = wants_fsdp(config, accelerator)
    processes = checkpoint.Processes(sharded=fsdp and world > 1)
    opened = derive(config, plan, world, fsdp, config.out or _shared_default_out(accelerator, plan.command))
    resolved = opened.applied_to(config)
    lifecycle.hold(opened.out, f"doplus {plan.command}")  # before anything in the folder is read or written
    out, main = Path(opened.out), accelerator.is_main_process
    command, names = f"doplus {plan.command}", run_outputs(resolved, plan)
    if resolved.resume:
        legacy = _check_resumable(resolved, out, command, names, main)
        if _interrupted_before_a_checkpoint(resolved, out):
            if main:
                console.print(f"{out}: no checkpoint was written before the run stopped; starting it again from "
                              "the beginning", highlight=False)
                ownership.begin(out, command, names, overwrite=True)
                inputs.record(out, resolved.to_dict())
            accelerator.wait_for_everyone()
            return accelerator, opened, None, None
        resume_from, saved = checkpoint.open_resume(resolved.resume, out, resolved.to_dict(), processes,
                                                    resolved.accept_changed, resolved.accept_unverified)
        if main and legacy:
            ownership.adopt(out, command, names)
            console.print(f"{out}: a run written before doplus recorded its files; its entries ({', '.join(names)}) "
                          f"are now recorded in {ownership.RECORD_NAME}", highlight=False)
        elif main:
            ownership.claim(out, command, names)  # what the run writes now and did not before (--report-to)
        return accelerator, opened, resume_from, saved
    if main:
        ownership.begin(out, command, names, resolved.overwrite, then=", or --resume to continue it")
        inputs.record(out, resolved.to_dict())  # what a resumption compares the data, model and software with
    return accelerator, opened, None, None


def run_outputs(config: TrainConfig, plan: Plan) -> tuple[str, ...]:
    """The entries a run of `config` writes directly in OUT: recorded in OUT's record before the run writes any of
    them (ownership.py), so that `--overwrite` replaces exactly these and a user's own files are never touched."""
    names = ["config.yaml", inputs.INPUTS_FILE, "metrics.jsonl", "checkpoints", "final", "report.json", "report.md"]
    if config.select_by:
        names.append(BEST)
    if config.eval_every:
        names.append("evals")  # evals/step-N/, evals/curves.png
    if chosen_trackers(config.report_to) and config.tracker_dir is None:
        names.append("trackers")
    return (*names, *plan.outputs(config))


def _check_resumable(config: TrainConfig, out: Path, command: str, names: tuple[str, ...], main: bool) -> bool:
    """`--resume` needs a started run of the command in OUT that has not finished. True: OUT holds a run written by
    a doplus that kept no record of its files (its checkpoints and config.yaml show it), which the resumption takes
    on once its checkpoint is accepted."""
    if (out / "report.json").is_file():
        raise UserError(f"{out}: the run there has finished ({out / 'report.json'}); nothing to resume (pass "
                        "--overwrite instead of --resume to run it again)")
    if ownership.is_started(out, command):
        return False
    if checkpoint.list_checkpoints(out / "checkpoints") and (out / "config.yaml").is_file():
        return True
    if config.resume == "latest":
        raise UserError(f"{out}: no `{command}` was started here (no {ownership.RECORD_NAME}), so there is nothing "
                        "to resume; start it without --resume")
    if main:  # a checkpoint of another folder, continued in this one
        ownership.begin(out, command, names, overwrite=False)
    return False


def _interrupted_before_a_checkpoint(config: TrainConfig, out: Path) -> bool:
    """`--resume latest` on a started run without a checkpoint: it stopped before its first one and starts again
    from the beginning with the same configuration; another configuration is refused."""
    if config.resume != "latest" or checkpoint.list_checkpoints(out / "checkpoints"):
        return False
    saved = out / "config.yaml"
    if saved.is_file():
        import yaml

        now = json.loads(json.dumps(config.to_dict(), default=str))
        keys = checkpoint.differing_keys(yaml.safe_load(saved.read_text()) or {}, now)
        if keys:
            raise UserError(f"{saved}: the run in this folder was started with another configuration "
                            f"({', '.join(keys)}); resume with the same options, or pass --overwrite")
    return True


@contextmanager
def setup(config: TrainConfig, plan: Plan, console: Console) -> Iterator[Run]:
    """Build everything the loop steps with: the accelerator and the run's folder, the model, then (with the
    progress display live until the block ends) the plan's objectives, the reference model, LoRA, the shards,
    the optimizer and its LR schedule, a resumed run's state, the trackers and metrics.jsonl."""
    accelerator, opened, resume_from, saved = _open_run(config, plan, console)
    config = opened.applied_to(config)  # the run's own config; the caller's is left as it was validated
    out = Path(opened.out)
    main_process, world = accelerator.is_main_process, accelerator.num_processes
    sharded = config.fsdp and world > 1
    lora = _lora_settings(config)
    weights_dtype = training_precision.weights_dtype(config.precision, config.dtype, lora=lora is not None)
    lifecycle.stage("loading the model")
    model, tokenizer, model_name = load_model_and_tokenizer(config.model, weights_dtype, config.trust_remote_code)
    formatter = PromptFormatter(tokenizer, config.max_length, config.prompt_template)
    if main_process:
        outputs.write_config(out, {**config.to_dict(), "out": str(out)})
    model.to(accelerator.device)
    with _progress(console, main_process) as progress:
        lifecycle.stage("preparing the data (with answers_from_model: the model's own answers)")
        objectives = plan.objectives(model, formatter, out, progress, accelerator, resumed=resume_from is not None)
        lifecycle.stage("evaluating before training")
        before = plan.before(model, formatter, progress, accelerator,
                             saved["extra"].get("before", []) if saved is not None else None)
        lifecycle.stage("preparing the reference model, the optimizer and the checkpoint")
        reference = None
        if any(o.loss.needs_reference for o in objectives):
            reference = _reference_model(config, model, accelerator, sharded)
        model = _trainable_model(model, lora, config.gradient_checkpointing)  # after the reference copy
        plan.prepare_model(model)  # e.g. RMU: only its chosen modules stay trainable
        for index, objective in enumerate(objectives):
            objective.stream = IndexStream(len(objective.source), config.batch_size, config.seed + index,
                                           accelerator.process_index, world)
        model.train()
        if sharded:  # before the optimizer, which then keeps states for this process's shards only
            model = sharding.shard_model(accelerator, model, mixed_precision=config.precision == "bf16-mixed")
        names = tuple(o.name for o in objectives)
        optimizer, torch_optimizer = build_optimizer(model, names, lr_multipliers(objectives),
                                                     optimizer_settings(config), sharded=sharded,
                                                     frequencies=frequencies(objectives))
        scheduler = linear_warmup_schedule(torch_optimizer, config.warmup_steps, config.steps)
        streams = {o.name: o.stream for o in objectives}
        processes = checkpoint.Processes(sharded=sharded)
        start_step, records, evals = 0, [], []
        if resume_from is not None:
            state = checkpoint.load_checkpoint(resume_from, model, optimizer, scheduler, streams, processes)
            start_step, records = state["step"], checkpoint.saved_records(resume_from)
            evals = state["extra"].get("evals", [])
            console.print(f"resuming from {resume_from} at step {start_step}", highlight=False)
        if not sharded:
            model = accelerator.prepare(model)
        yield Run(
            accelerator=accelerator, config=config, opened=opened, out=out, model=model, tokenizer=tokenizer,
            model_name=model_name, formatter=formatter, progress=progress, objectives=objectives, before=before,
            reference=reference, lora=lora, optimizer=optimizer, torch_optimizer=torch_optimizer, scheduler=scheduler,
            context=LossContext(model, reference, plan.beta, _token_count(accelerator), params=plan.loss_params),
            checkpoints=checkpoint.CheckpointWriter(out, accelerator.unwrap_model(model), optimizer, scheduler,
                                                    streams, config.to_dict(), config.keep_last, processes),
            tracker=tracking.RunTracker(accelerator, out, tracker_settings(config, out, plan.command),
                                        saved.get("extra", {}).get("trackers", {}) if saved is not None else None,
                                        start_step),
            metrics=outputs.MetricsWriter(out / "metrics.jsonl", records) if main_process else None,
            similarity=(UpdateSimilarity(model.parameters(), names, _sum_over_shards if sharded else None)
                        if config.log_update_similarity else None),
            sharded=sharded, effective_batch=config.batch_size * config.grad_accum * world, start_step=start_step,
            evals=evals,
        )


def train(run: Run, config: TrainConfig, plan: Plan, console: Console, stop: StopRequest) -> None:
    """Steps `run.start_step` to `config.steps`: pick the step's objective, backward its loss over `grad_accum`
    micro-batches, clip, `optimizer.step(objective=...)`, log; evaluate and checkpoint every N steps; SIGTERM or
    Ctrl-C ends the run after the current step, the last one included, with a checkpoint. `stop`: the
    command's handler (`lifecycle.run_guard`), which the caller keeps deferred from here to the report."""
    cycle = frequencies(run.objectives)
    log = StepLog(run, plan.activity, config.steps, console)
    weights = [p for _, p in checkpoint.trainable_weights(run.accelerator.unwrap_model(run.model))]
    selection = selection_for(config, run.evals)  # a resumed run's best so far, from its recorded evaluations
    rule = stop_rule_for(config)
    run.stopped = None if rule is None else {"rule": rule.text(), "metric": rule.metric, "step": None,
                                             "value": None, "planned_steps": config.steps}
    saved_at = _clock()  # --save-minutes counts from the start (or the resumption) and from each checkpoint
    try:
        stop.install()
        for step in range(run.start_step, config.steps):
            step_started = time.perf_counter()
            objective = objective_at(step, config.scheme, cycle)
            terms = _accumulate_gradients(objective, run, config)
            grad_norm = _clip_gradients(run, config.max_grad_norm)
            _stop_if_not_finite(step + 1, terms, grad_norm, run.out, plan.lr_options)
            lr = run.scheduler.get_last_lr()[0] * getattr(run.optimizer, "lr_multipliers", {}).get(objective, 1.0)
            if run.similarity is not None:
                run.similarity.before_step(objective)
            run.optimizer.step(objective=objective)
            _stop_if_weights_not_finite(run, step + 1, weights)
            update = _step_diagnostics(run, objective)
            run.scheduler.step()
            run.optimizer.zero_grad(set_to_none=True)
            peak, _ = peak_memory_gb(run.accelerator.device)
            record = {"step": step + 1, "objective": objective, **terms, "lr": lr, "grad_norm": grad_norm,
                      **update, "seconds": time.perf_counter() - step_started, "peak_memory_gb": peak}
            log.step(record)
            if config.eval_every and ((step + 1) % config.eval_every == 0 or step + 1 == config.steps):
                run.evals.append(plan.evaluate(step + 1, run.model, run.tokenizer, run.formatter, run.out,
                                               run.progress, run.accelerator))
                run.tracker.evaluation(run.evals[-1])
                if selection is not None and _new_best(run, selection):
                    _save_best(run, config)
                if rule is not None and _met(run, rule):
                    run.stopped.update(step=step + 1, value=run.evals[-1].get(rule.metric))
            log.line(record)
            if run.stopped and run.stopped["step"]:
                if step + 1 < config.steps and run.accelerator.is_main_process:
                    console.print(f"step {step + 1}: {rule.metric} {run.stopped['value']:.4g} meets --stop-when "
                                  f"{rule.text()}; the run ends here ({config.steps} steps planned)")
                break
            if step + 1 < config.steps and _save_due(run, config, step + 1, saved_at):
                run.save_checkpoint(step + 1)
                saved_at = _clock()
            _stop_with_checkpoint(run, stop, step + 1)
        _stop_if_states_not_finite(run, run.steps_done)
    except BaseException:
        run.tracker.close()  # flushed; the checkpoint keeps the tracker run ids for --resume
        raise
    finally:
        if run.metrics is not None:
            run.metrics.close()


_clock = time.monotonic  # --save-minutes' clock (a test drives its own)


def _save_due(run: Run, config: TrainConfig, step: int, saved_at: float) -> bool:
    """Whether a checkpoint is due after `step`: every --save-every steps, or once --save-minutes have passed since
    the last checkpoint (or the start), by the main process's clock; every process takes its decision."""
    if config.save_every and step % config.save_every == 0:
        return True
    if not config.save_minutes:
        return False
    due = _clock() - saved_at >= 60 * config.save_minutes
    if run.accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        (due,) = broadcast_object_list([due])
    return bool(due)


def _new_best(run: Run, selection: Selection) -> bool:
    """Whether the latest evaluation is the best so far by --select-by, as the main process finds it (it alone
    holds every evaluation's values); every process takes its decision."""
    improved = selection.offer(run.evals[-1])
    if run.accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        decision = broadcast_object_list([improved, selection.step, selection.value])
        improved, selection.step, selection.value = decision
    return bool(improved)


def _met(run: Run, rule: StopRule) -> bool:
    """Whether the latest evaluation meets --stop-when, as the main process finds it (it alone holds every
    evaluation's values); every process takes its decision."""
    met = rule.holds(run.evals[-1])
    if run.accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        met, value = broadcast_object_list([met, run.evals[-1].get(rule.metric)])
        run.evals[-1][rule.metric] = value
    return bool(met)


def _save_best(run: Run, config: TrainConfig) -> None:
    """OUT/best/: the model after this step, in --save-dtype (the LoRA adapter alone under LoRA). Every process
    takes part in gathering a sharded model's weights; the main process writes."""
    full_weights = sharding.full_state_dict(run.model) if run.sharded else None
    if run.accelerator.is_main_process:
        model = run.accelerator.unwrap_model(run.model)
        dtype = resolve_dtype(config.save_dtype)
        state = full_weights if full_weights is not None else model.state_dict()
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        outputs.save_final(model, run.tokenizer, run.out, state, name=BEST)
    run.accelerator.wait_for_everyone()


def _stop_with_checkpoint(run: Run, stop: StopRequest, step: int) -> None:
    """If any process was signalled: checkpoints/step-{step} (every process takes part), then end the run saying
    how to resume (the main process; the others exit with the same code)."""
    if not stop.requested(run.accelerator):
        return
    path = run.save_checkpoint(step)
    run.tracker.close()  # flushed; the checkpoint keeps the tracker run ids for --resume
    if not run.accelerator.is_main_process:  # the main process says what happened and how to resume
        raise SystemExit(worker_exit_code(128 + stop.signal_number))
    raise RunInterrupted(stop, step, path, run.accelerator.num_processes)


def finish(run: Run, config: TrainConfig, plan: Plan, measured_after: dict[str, Any],
           full_weights: dict[str, torch.Tensor] | None, started: float) -> dict[str, Any]:
    """On the main process: final/, report.json and report.md, the model card and the trackers' final values."""
    inputs.check_data_unchanged(run.out, config.to_dict(), "before writing final/")
    final, trained_dtype, lora_report = _save_final(run, config, full_weights)
    cycle = frequencies(run.objectives)
    records = run.metrics.records
    peak, peak_kind = peak_memory_gb(run.accelerator.device)
    world = run.accelerator.num_processes
    report = {
        "status": "completed",
        "model": run.model_name,
        "final": str(final),
        "config": {**config.to_dict(), "out": str(run.out)},
        "data": plan.data_report(),
        "steps": run.steps_done,
        "warmup_steps": config.warmup_steps,
        "steps_per_objective": steps_per_objective(run.steps_done, config.scheme, cycle),
        "losses": outputs.loss_summary(records),
        "update_sizes": outputs.update_summary(records),
        "wall_time_s": time.perf_counter() - started,
        "peak_memory_gb": peak,
        "peak_memory_kind": peak_kind,
        # this process's (its shards under FSDP): numel x element size of every state tensor, 8-bit codes and
        # block scales included (paper, Table 8)
        "optimizer_state_bytes": quant.optimizer_state_bytes(run.torch_optimizer),
        "precision": training_precision.describe(config.precision, config.save_dtype),
        "environment": {**outputs.environment(run.accelerator.device, world, run.effective_batch, config.seed,
                                              trained_dtype), "precision": config.precision},
        **({"teach": config.taught} if config.taught else {}),
        **measured_after,
        **lora_report,
        **_reference_report(run.reference, config.ref_offload, run.sharded),
    }
    if run.evals:
        report["evals"] = run.evals
        report["eval_curves"] = _plot_curves(run.evals, run.out, plan.curve_names(config))
    if config.select_by:
        report["best"] = selection_for(config, run.evals).report(run.out)
    if run.stopped is not None:
        report["stopped"] = run.stopped
    outputs.complete_environment(report)
    model_card.write_model_card(final, report, run.objectives, plan)  # before report.json, the last file
    outputs.write_report(run.out, report, plan.render_report)
    run.tracker.finish(report, run.steps_done)
    return report


def _save_final(run: Run, config: TrainConfig, full_weights: dict[str, torch.Tensor] | None
                ) -> tuple[Path, str, dict[str, Any]]:
    """final/ in --save-dtype (with LoRA: the adapters alone or merged); return (its path, the dtype the model
    trained in, the report's `lora` entry)."""
    model = run.accelerator.unwrap_model(run.model)
    lora_report = {}
    if run.lora is not None:
        if full_weights is not None:  # FSDP: the adapters' full weights on an unsharded copy of the model
            model, full_weights = _unsharded_lora_model(config, run.lora, full_weights), None
        lora_report = {"lora": {"rank": config.lora_rank, "alpha": config.lora_alpha,
                                "targets": recorded(config.lora_targets), "adapter_norms": adapter_norms(model),
                                "final": "adapter only" if config.save_adapter_only else "merged model"}}
        model = final_model(model, config.save_adapter_only)
    trained_dtype = str(model.dtype).removeprefix("torch.")
    save_dtype = resolve_dtype(config.save_dtype)
    model, full_weights = _in_save_dtype(model, full_weights, save_dtype)
    if config.precision == "bf16" and save_dtype == torch.float32 and full_weights is None:
        _add_compensation(model, run.optimizer)
    return outputs.save_final(model, run.tokenizer, run.out, full_weights), trained_dtype, lora_report


class StepLog:
    """Where each step's record goes: metrics.jsonl, the trackers, the progress bar's status and, in a batch job's
    log (no terminal, where a live bar draws nothing), a plain line now and then."""

    def __init__(self, run: Run, activity: str, steps: int, console: Console) -> None:
        self.metrics, self.tracker, self.progress, self.console, self.steps = (
            run.metrics, run.tracker, run.progress, console, steps)
        self.task = run.progress.add_task(activity, total=steps, completed=run.start_step, status="", log=False)
        self.lines = not console.is_terminal and run.accelerator.is_main_process
        self.every = max(1, steps // 20)
        self.last_losses = {f"{o.name}_loss": float("nan") for o in run.objectives}  # latest value of each term
        self.width = max(len(name) for name in (*(o.name for o in run.objectives), JOINT))
        self.status = ""

    def step(self, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(record)
        self.tracker.step(record)
        self.last_losses.update({k: v for k, v in record.items()
                                 if k.endswith("_loss") and k != "total_loss" and v is not None})
        shown = " ".join(f"{k.removesuffix('_loss')} {v:.4f}" for k, v in self.last_losses.items())
        self.status = f"{record['objective']:<{self.width}} {shown}"
        self.progress.update(self.task, advance=1,
                             status=self.status + f"  {1 / max(record['seconds'], 1e-9):.2f} step/s")

    def line(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if self.lines and (step % self.every == 0 or step == self.steps):
            self.console.print(f"step {step}/{self.steps} {self.status} lr {record['lr']:.3g} "
                               f"grad_norm {record['grad_norm']:.3g} {record['seconds']:.2f} s/step", highlight=False)


def optimizer_settings(config: TrainConfig) -> OptimizerSettings:
    """The optimizer's values from the resolved configuration; compensation buffers under --precision bf16,
    unless `doplus bench precision` switched them off to show what bf16 weights updated in place lose."""
    return OptimizerSettings(
        scheme=config.scheme, optimizer=config.optimizer, lr=config.lr, betas=tuple(config.betas),
        weight_decay=config.weight_decay, state_bits=config.state_bits, rule=config.doplus_rule,
        v_floor=config.v_floor,
        compensated=config.precision == "bf16" and config.compensation,
        base_update=config.base_update, base_source=config.base_source,
    )


def tracker_settings(config: TrainConfig, out: Path, command: str) -> tracking.TrackerSettings:
    """The trackers' folder, project, run name, group, tags and hyper-parameters from the resolved configuration."""
    task_id = getattr(config, "task_id", None)  # unlearn's TOFU task
    tags = {"command": command, "scheme": config.scheme, "seed": str(config.seed),
            **({"group": config.tracker_group} if config.tracker_group else {}),
            **({"task_id": str(task_id)} if task_id is not None else {})}
    return tracking.TrackerSettings(
        folder=Path(config.tracker_dir or out / "trackers").resolve(),
        project=config.tracker_project or f"doplus-{command}",
        run_name=config.tracker_run_name or Path(out).resolve().name,
        group=config.tracker_group,
        tags=tags,
        resolved_config={**config.to_dict(), "out": str(out), "command": command},
    )


def _lora_settings(config: TrainConfig) -> LoraSettings | None:
    if config.lora_rank <= 0:
        return None
    return LoraSettings(rank=config.lora_rank, alpha=config.lora_alpha, targets=config.lora_targets,
                        dropout=config.lora_dropout, gradient_checkpointing=config.gradient_checkpointing)


def _trainable_model(model: torch.nn.Module, lora: LoraSettings | None, gradient_checkpointing: bool
                     ) -> torch.nn.Module:
    """The model with LoRA adapters (only they train), or with activation checkpointing where asked."""
    if lora is not None:
        return apply_lora(model, lora)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model


def _reference_model(config: TrainConfig, model: torch.nn.Module, accelerator, sharded: bool) -> torch.nn.Module:
    """The frozen starting model that NPO, DPO and KL compare against: a copy on the device (sharded like the
    model under FSDP), on the CPU (`--ref-offload cpu`), or reloaded with LLM.int8 weights (`8bit`)."""
    if config.ref_offload == "8bit":
        return load_model_8bit(config.model, config.dtype, config.trust_remote_code, accelerator.device)
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    reference = reference.to(training_precision.reference_dtype(config.precision, config.dtype))
    if config.ref_offload == "cpu":
        return reference.to("cpu")
    if sharded:
        return sharding.shard_model(accelerator, reference, mixed_precision=config.precision == "bf16-mixed")
    return reference


def _unsharded_lora_model(config: TrainConfig, lora: LoraSettings, full_weights: dict[str, torch.Tensor]
                          ) -> torch.nn.Module:
    """The starting model with the same adapters, holding the gathered weights of a sharded LoRA run."""
    weights_dtype = training_precision.weights_dtype(config.precision, config.dtype, lora=True)
    base, _, _ = load_model_and_tokenizer(config.model, weights_dtype, config.trust_remote_code)
    model = apply_lora(base, lora)
    model.load_state_dict(full_weights)
    return model


def _reference_report(reference: torch.nn.Module | None, offload: str | None, sharded: bool) -> dict[str, Any]:
    """Where the reference model was and what its weights took on this process."""
    if reference is None:
        return {}
    tensors = [local_shard(t) for t in (*reference.parameters(), *reference.buffers())]
    placement = {"cpu": "CPU", "8bit": "LLM.int8 on the device"}.get(offload or "", "sharded" if sharded else "device")
    return {"reference": {"placement": placement,
                          "memory_gb": sum(t.numel() * t.element_size() for t in tensors) / 1e9}}


def _clip_gradients(run: Run, max_grad_norm: float) -> float:
    """Clip the gradients to `max_grad_norm` in total (none: 0); return their total norm before clipping."""
    max_norm = max_grad_norm if max_grad_norm > 0 else float("inf")
    if run.sharded:
        return sharding.clip_grad_norm(run.model, max_norm)
    return float(run.accelerator.clip_grad_norm_(run.model.parameters(), max_norm))


def _step_diagnostics(run: Run, objective: str) -> dict[str, float | None]:
    """The step just taken: its largest |Δθ|/η and elements above 10η, under DualOptim+'s safeguarded rule the
    fractions of elements where its floor and clamp acted, with --log-update-similarity the cosine of the
    objectives' latest updates and gradients; over every process's shards under FSDP."""
    update = run.optimizer.step_diagnostics()
    if run.similarity is not None:
        update.update(run.similarity.after_step(objective))
    if run.sharded:
        # DualOptim+'s rule is a param group's setting; the groups are the same on every process
        safeguarded = any(group.get("rule") == "safeguarded" for group in run.optimizer.param_groups)
        counts = run.optimizer.safeguard_counts() if safeguarded else None
        update = sharding.gather_step_diagnostics(update, run.accelerator.device)
        if safeguarded:
            update.update(safeguard_fractions(counts, run.accelerator.device))
    return update


def _in_save_dtype(model: torch.nn.Module, full_weights: dict[str, torch.Tensor] | None, dtype: torch.dtype):
    """final/'s model (and a sharded run's gathered weights) in `--save-dtype`; integer tensors unchanged."""
    if full_weights is not None:
        full_weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in full_weights.items()}
    return model.to(dtype), full_weights


def _add_compensation(model: torch.nn.Module, optimizer) -> None:
    """A float32 final/ of a `bf16` run holds each weight as the run carried it, θ_bf16 + c (the buffers of
    `optim/kernels.py`). `model.to(float32)` keeps the parameter objects, which key the optimizer's buffers."""
    buffers = compensation_buffers(optimizer)
    with torch.no_grad():
        for param in model.parameters():
            if param in buffers:
                param.add_(buffers[param].to(param.dtype))


class RunInterrupted(lifecycle.Resumable, UserError):
    """SIGTERM or Ctrl-C: a checkpoint was written; `continued(command_line)` says how to resume. Exit code 128 +
    signal number."""

    lead = "resume with"

    def __init__(self, stop: StopRequest, step: int, path: Path | None, processes: int = 1) -> None:
        super().__init__(f"stopped by {stop.signal_name} after step {step}; checkpoint {path}")
        self.processes = processes
        self.exit_code = 128 + stop.signal_number


def _stop_if_not_finite(step: int, terms: dict[str, float | None], grad_norm: float, out: Path,
                        lr_options: str) -> None:
    """A NaN or infinite loss or gradient ends the run before it reaches the weights."""
    bad = {k: v for k, v in terms.items() if v is not None and not math.isfinite(v)}
    if not math.isfinite(grad_norm):
        bad["grad_norm"] = grad_norm
    if bad:
        found = checkpoint.list_checkpoints(out / "checkpoints")
        kept = f"the last good checkpoint is {found[-1]}" if found else "no checkpoint was written (--save-every)"
        what = ", ".join(f"{k} = {v}" for k, v in bad.items())
        raise RunError(f"step {step}: non-finite {what}; stopped before the optimizer step; {kept}; "
                       f"try a lower {lr_options}, or --precision fp32")


def _stop_if_weights_not_finite(run: Run, step: int, weights: list[torch.nn.Parameter]) -> None:
    """After the optimizer step: a NaN or an infinity in the weights ends the run before anything saves them. One
    reduction over every weight and one host synchronisation (with FSDP, one all-reduce of it); the tensor is
    looked for only once that finds something."""
    local = [local_shard(p.detach()) for p in weights]
    probe = checkpoint.finite_probe(local)
    if run.sharded:
        probe = run.accelerator.reduce(probe.to(run.accelerator.device), reduction="sum")
    if bool(torch.isfinite(probe).item()):
        return
    names = [name for name, _ in checkpoint.trainable_weights(run.accelerator.unwrap_model(run.model))]
    found = checkpoint.first_non_finite([(f"weight {n}", t) for n, t in zip(names, local)])
    if run.sharded:  # every process stops, or none (an overflowing sum of finite weights)
        anywhere = run.accelerator.reduce(torch.tensor([float(found is not None)], device=run.accelerator.device),
                                          reduction="sum")
        if anywhere.item() == 0:
            return
    elif found is None:
        return
    raise checkpoint.NonFiniteState(step, found, run.out / "checkpoints")


def _stop_if_states_not_finite(run: Run, step: int) -> None:
    """After the last step, before final/: the optimizer's states too (each checkpoint checks them as it saves)."""
    found = checkpoint.non_finite_in(run.accelerator.unwrap_model(run.model), run.optimizer)
    flags = [found is not None]
    if run.accelerator.num_processes > 1:
        flags = run.accelerator.gather(torch.tensor([float(found is not None)], device=run.accelerator.device)).tolist()
    if any(flags):
        raise checkpoint.NonFiniteState(step, found, run.out / "checkpoints")


def _plot_curves(evals: list[dict[str, Any]], out: Path, names: Sequence[str]) -> str | None:
    """evals/curves.png: the evaluation values `names` against the step (None when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in names:
        points = [(e["step"], e[name]) for e in evals if e.get(name) is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("%")  # evaluation values are percentages
    ax.legend()
    ax.grid(alpha=0.3)
    path = out / "evals" / "curves.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    try:
        save_figure(fig, path)
    finally:
        plt.close(fig)
    return str(path)


def _sum_over_shards(values: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def _token_count(accelerator):
    """The denominator of token-mean losses: this batch's answer tokens on one process; on N processes the
    global count / N (DDP averages gradients, so each rank's share of the global mean comes out right)."""
    if accelerator.num_processes == 1:
        return local_token_count

    def global_count(mask: torch.Tensor) -> torch.Tensor:
        total = accelerator.reduce(mask.sum().detach().float(), reduction="sum")
        return (total / accelerator.num_processes).clamp_min(1e-6)

    return global_count


def _accumulation(config: TrainConfig):
    """accelerate's gradient accumulation over `--grad-accum` micro-batches a step (passed as a plugin, which an
    `ACCELERATE_GRADIENT_ACCUMULATION_STEPS` in the environment does not override): `accelerator.backward` divides
    each loss by their number and `accelerator.accumulate` skips the gradient reduction (DDP's `no_sync`) on every
    one but the last of a step. Under FSDP every micro-batch reduces its gradients (`sync_each_batch`): each
    process then holds only its shard of them between micro-batches, where FSDP2's skipped reduction would hold
    unsharded ones. The count follows the loop's own steps, never a data loader's end (doplus prepares none;
    `sync_with_dataloader` off)."""
    from accelerate.utils import GradientAccumulationPlugin

    return GradientAccumulationPlugin(num_steps=config.grad_accum, sync_with_dataloader=False,
                                      sync_each_batch=bool(config.fsdp) or sharding.launcher_says_fsdp())


def _accumulate_gradients(objective: str, run: Run, config: TrainConfig) -> dict[str, float | None]:
    """Backward `grad_accum` micro-batches of this step's objective (gradients averaged: `_accumulation`); return
    the mean of each loss term. A joint step sums every objective's weighted loss on one batch of each. An objective
    over a `MixtureSource` also logs each part's loss and rows (`PartTally`)."""
    objectives, context, formatter, accelerator = run.objectives, run.context, run.formatter, run.accelerator
    parts = list(objectives) if objective == JOINT else [o for o in objectives if o.name == objective]
    sums = {f"{part.name}_loss": 0.0 for part in parts}
    model = context.model
    mixed = tuple(n for part in parts if isinstance(part.source, MixtureSource) for n in part.source.part_names)
    context.tally = PartTally(mixed, accelerator.device) if mixed else None
    for _ in range(config.grad_accum):
        with accelerator.accumulate(model):
            total = 0.0
            for part in parts:
                batch = part.next_batch(formatter, accelerator.device, config.seed)
                with training_precision.autocast(config.precision, accelerator.device):  # bf16 forward under bf16-mixed
                    value = part.loss.fn(context, batch)
                sums[f"{part.name}_loss"] += value.item() / config.grad_accum
                total = total + part.weight * value
            accelerator.backward(total)  # divided by grad_accum there (`_accumulation`)
    if accelerator.num_processes > 1:  # log the global batch's loss, as one process would see it
        names = list(sums)
        mean = accelerator.reduce(torch.tensor([sums[n] for n in names], device=accelerator.device), "mean")
        sums = dict(zip(names, mean.tolist()))
    if objective == JOINT:
        sums["total_loss"] = sum(part.weight * sums[f"{part.name}_loss"] for part in parts)
    if context.tally is not None:
        if accelerator.num_processes > 1:  # every process's rows: the global batch's per-part losses
            context.tally.sums = accelerator.reduce(context.tally.sums, "sum")
        sums.update(context.tally.terms())
        context.tally = None
    return sums
