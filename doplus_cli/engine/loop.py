"""The one training loop, for any list of objectives, top to bottom.

load model -> the command's objectives (`Plan`) -> build the scheme's optimizer -> for each step: pick the
objective, draw its batch, compute its loss, backward, clip, `optimizer.step(objective=...)`, log -> save
final/ and the report. `doplus unlearn` and `doplus multitask` only build the objective list and say what
to measure (engine/unlearn.py, engine/multitask.py). Accelerate holds the device and process details, so
the same loop runs on one CPU or many GPUs.
"""

from __future__ import annotations

import copy
import math
import os
import shlex
import shutil
import signal
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import nullcontext
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from doplus_cli.config import TrainConfig
from doplus_cli.data.batches import IndexStream
from doplus_cli.data.formatting import PromptFormatter
from doplus_cli.data.sources import MixtureSource
from doplus_cli.engine import checkpoint, model_card, outputs, precision, sharding, tracking
from doplus_cli.engine.objectives import Objective, Plan, frequencies, lr_multipliers
from doplus_cli.engine.optimizers import build_optimizer
from doplus_cli.engine.schedule import JOINT, objective_at, steps_per_objective
from doplus_cli.engine.similarity import UpdateSimilarity
from doplus_cli.errors import RunError, UserError, worker_exit_code, write_failure
from doplus_cli.lora import LoraSettings, adapter_norms, apply_lora, final_model
from doplus_cli.losses import LossContext, PartTally, local_token_count
from doplus_cli.models import load_model_8bit, load_model_and_tokenizer
from doplus_cli.optim import quant
from doplus_cli.optim.adamw import compensation_buffers
from doplus_cli.optim.distributed import local_shard
from doplus_cli.progress import LoggedProgress


def default_out_dir(command: str = "unlearn") -> str:
    return os.path.join("runs", f"{command}-" + datetime.now().strftime("%Y%m%d-%H%M%S"))


def _shared_default_out(accelerator, command: str) -> str:
    """The main process's default folder name, on every process (their clocks may differ by a second)."""
    from accelerate.utils import broadcast_object_list

    name = [default_out_dir(command)]
    if accelerator.num_processes > 1:
        broadcast_object_list(name)
    return name[0]


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


def _reference_model(config: TrainConfig, model: torch.nn.Module, accelerator, fsdp: bool) -> torch.nn.Module:
    """The frozen starting model that NPO, DPO and KL compare against: a copy on the device (sharded like the
    model under FSDP), on the CPU (`--ref-offload cpu`), or reloaded with LLM.int8 weights (`8bit`)."""
    if config.ref_offload == "8bit":
        return load_model_8bit(config.model, config.dtype, config.trust_remote_code, accelerator.device)
    reference = copy.deepcopy(model).eval().requires_grad_(False).to(precision.reference_dtype(config))
    if config.ref_offload == "cpu":
        return reference.to("cpu")
    if fsdp:
        return sharding.shard_model(accelerator, reference, config.precision == "bf16-mixed")
    return reference


def _unsharded_lora_model(config: TrainConfig, lora, full_weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The starting model with the same adapters, holding the gathered weights of a sharded LoRA run."""
    base, _, _ = load_model_and_tokenizer(config.model, precision.weights_dtype(config), config.trust_remote_code)
    model = apply_lora(base, lora)
    model.load_state_dict(full_weights)
    return model


def _reference_report(reference, config: TrainConfig, fsdp: bool) -> dict[str, Any]:
    """Where the reference model was and what its weights took on this process."""
    if reference is None:
        return {}
    tensors = [local_shard(t) for t in (*reference.parameters(), *reference.buffers())]
    placement = {"cpu": "CPU", "8bit": "LLM.int8 on the device"}.get(config.ref_offload or "",
                                                                   "sharded" if fsdp else "device")
    return {"reference": {"placement": placement,
                          "memory_gb": sum(t.numel() * t.element_size() for t in tensors) / 1e9}}


def _lora_settings(config: TrainConfig):
    if config.lora_rank <= 0:
        return None
    targets = tuple(t.strip() for t in config.lora_targets.split(",") if t.strip()) if config.lora_targets else None
    return LoraSettings(rank=config.lora_rank, alpha=config.lora_alpha, targets=targets,
                        dropout=config.lora_dropout, gradient_checkpointing=config.gradient_checkpointing)


def run_training(config: TrainConfig, plan: Plan, console: Console | None = None) -> dict[str, Any]:
    """Train on `plan`'s objectives as configured; return the report (also written to `config.out`)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import get_linear_schedule_with_warmup

    console = console or Console(stderr=True)
    started = time.perf_counter()
    # cpu=True without CUDA: several processes started by `accelerate launch --multi_gpu` or torchrun then
    # form a gloo group on CPU (accelerate's own `--cpu` launcher needs MPI for more than one process).
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), **tracking.accelerator_options(config))
    main_process = accelerator.is_main_process
    set_seed(config.seed)

    plan.open()  # every data file is checked before anything is written
    world = accelerator.num_processes
    config.fsdp = bool(config.fsdp or sharding.launched_with_fsdp(accelerator))
    fsdp = config.fsdp and world > 1
    precision.resolve(config)  # before the resume check: a checkpoint's config names the precision it used
    processes = checkpoint.Processes(accelerator, sharded=fsdp)
    effective_batch = config.batch_size * config.grad_accum * world
    derived_steps = plan.total_steps(effective_batch)
    if derived_steps is not None:
        config.steps = derived_steps
    if config.warmup_steps is None:
        config.warmup_steps = plan.default_warmup(effective_batch)
    config.warmup_steps = min(config.warmup_steps, config.steps)
    config.out = config.out or _shared_default_out(accelerator, plan.command)
    resume_from, saved = None, None
    if config.resume:
        resume_from = checkpoint.find_checkpoint(config.resume, Path(config.out))
        saved = checkpoint.read_state(resume_from)
        checkpoint.check_processes(resume_from, saved, processes)
        _refuse_changed_config(resume_from, saved["config"], config.to_dict())
        out = Path(config.out)
    else:
        out = outputs.prepare_out_dir(config.out, config.overwrite) if main_process else Path(config.out)

    model, tokenizer, model_name = load_model_and_tokenizer(config.model, precision.weights_dtype(config),
                                                            config.trust_remote_code)
    formatter = PromptFormatter(tokenizer, config.max_length, config.prompt_template)
    if main_process:
        outputs.write_config(out, {**config.to_dict(), "out": str(out)})
    model.to(accelerator.device)
    progress = _progress(console, main_process)

    with progress:
        objectives = plan.objectives(model, formatter, out, progress, accelerator, resumed=resume_from is not None)
        before = plan.before(model, formatter, progress, accelerator,
                             saved["extra"].get("before", []) if saved is not None else None)

        reference = None
        if any(o.loss.needs_reference for o in objectives):
            reference = _reference_model(config, model, accelerator, fsdp)
        lora = _lora_settings(config)
        if lora is not None:  # after the reference copy, so the reference stays the plain starting model
            model = apply_lora(model, lora)
        elif config.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        plan.prepare_model(model)  # e.g. RMU: only its chosen modules stay trainable

        for index, objective in enumerate(objectives):
            objective.stream = IndexStream(len(objective.source), config.batch_size, config.seed + index,
                                           accelerator.process_index, world)

        model.train()
        if fsdp:  # before the optimizer, which then keeps states for this process's shards only
            model = sharding.shard_model(accelerator, model, config.precision == "bf16-mixed")
        names = tuple(o.name for o in objectives)
        optimizer, scheduled = build_optimizer(config, model, names, lr_multipliers(objectives), sharded=fsdp)
        scheduler = get_linear_schedule_with_warmup(scheduled, config.warmup_steps, config.steps)
        streams = {o.name: o.stream for o in objectives}
        cycle = frequencies(objectives)
        start_step, records, evals = 0, [], []
        if resume_from is not None:
            state = checkpoint.load_checkpoint(resume_from, model, optimizer, scheduler, streams, processes)
            start_step, records = state["step"], checkpoint.saved_records(resume_from)
            evals = state["extra"].get("evals", [])
            console.print(f"resuming from {resume_from} at step {start_step}", highlight=False)
        if not fsdp:
            model = accelerator.prepare(model)
        context = LossContext(model, reference, plan.beta, _token_count(accelerator), params=plan.loss_params)
        tracker = tracking.RunTracker(accelerator, config, out, plan.command, saved, start_step)  # --report-to
        metrics = outputs.MetricsWriter(out / "metrics.jsonl", records) if main_process else None
        task = progress.add_task(plan.activity, total=config.steps, completed=start_step, status="", log=False)
        # In a batch job's log (no terminal) a live bar draws nothing; print a plain line now and then.
        log_lines, log_every = not console.is_terminal, max(1, config.steps // 20)
        last_losses = {f"{o.name}_loss": float("nan") for o in objectives}  # latest value of each term
        width = max(len(name) for name in (*names, JOINT))
        stop = StopRequest()
        similarity = (UpdateSimilarity(model.parameters(), names, _sum_over_shards if fsdp else None)
                      if config.log_update_similarity else None)

        def save(step_done: int) -> Path:  # every process takes part
            try:
                return checkpoint.save_checkpoint(
                    out / "checkpoints", step_done, accelerator.unwrap_model(model), optimizer, scheduler, streams,
                    config.to_dict(), metrics.records if metrics else [],
                    {"before": before, "evals": evals, "trackers": tracker.ids},
                    config.keep_last, processes,
                )
            except Exception as error:  # disk full, no permission: one line, the half-written step removed
                failure = write_failure(out / "checkpoints" / f"step-{step_done}", error, _newest(out))
                if failure is None:
                    raise
                for partial in (out / "checkpoints").glob(f".step-{step_done}.tmp"):
                    shutil.rmtree(partial, ignore_errors=True)
                raise failure from error

        try:
            stop.install()
            for step in range(start_step, config.steps):
                step_started = time.perf_counter()
                objective = objective_at(step, config.scheme, cycle)
                terms = _accumulate_gradients(objective, objectives, context, formatter, config, accelerator)
                max_norm = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
                if fsdp:
                    grad_norm = sharding.clip_grad_norm(model, max_norm)
                else:
                    grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), max_norm))
                _stop_if_not_finite(step + 1, terms, grad_norm, out, plan.lr_options)
                lr = scheduler.get_last_lr()[0] * getattr(optimizer, "lr_multipliers", {}).get(objective, 1.0)
                if similarity is not None:
                    similarity.before_step(objective)
                optimizer.step(objective=objective)
                update = optimizer.step_diagnostics()  # largest |Δθ|/η, elements above 10η
                if similarity is not None:  # cosine of the objectives' latest updates and gradients
                    update.update(similarity.after_step(objective))
                if fsdp:
                    update = sharding.gather_step_diagnostics(update, accelerator.device)
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                peak, _ = outputs.peak_memory_gb(accelerator.device)
                record = {"step": step + 1, "objective": objective, **terms, "lr": lr, "grad_norm": grad_norm,
                          **update, "seconds": time.perf_counter() - step_started, "peak_memory_gb": peak}
                if metrics is not None:
                    metrics.write(record)
                tracker.step(record)
                last_losses.update({k: v for k, v in terms.items()
                                    if k.endswith("_loss") and k != "total_loss" and v is not None})
                shown = " ".join(f"{k.removesuffix('_loss')} {v:.4f}" for k, v in last_losses.items())
                status = f"{objective:<{width}} {shown}"
                progress.update(task, advance=1, status=status + f"  {1 / max(record['seconds'], 1e-9):.2f} step/s")
                if config.eval_every and ((step + 1) % config.eval_every == 0 or step + 1 == config.steps):
                    evals.append(plan.evaluate(step + 1, model, tokenizer, formatter, out, progress, accelerator))
                    tracker.evaluation(evals[-1])
                if log_lines and main_process and ((step + 1) % log_every == 0 or step + 1 == config.steps):
                    console.print(f"step {step + 1}/{config.steps} {status} lr {lr:.3g} grad_norm {grad_norm:.3g} "
                                  f"{record['seconds']:.2f} s/step", highlight=False)
                if config.save_every and (step + 1) % config.save_every == 0 and step + 1 < config.steps:
                    save(step + 1)
                if stop.requested(accelerator) and step + 1 < config.steps:
                    path = save(step + 1)
                    if not main_process:  # the main process says what happened and how to resume
                        raise SystemExit(worker_exit_code(128 + stop.signal_number))
                    raise RunInterrupted(stop, step + 1, path, world)
        except BaseException:
            tracker.close()  # flushed; the checkpoint keeps the tracker run ids for --resume
            raise
        finally:
            stop.restore()
            if metrics is not None:
                metrics.close()

        unwrapped = accelerator.unwrap_model(model)
        measured_after = plan.after(unwrapped, formatter, progress, accelerator, before)
        full_weights = sharding.full_state_dict(model) if fsdp else None  # every process takes part

    accelerator.wait_for_everyone()
    if not main_process:
        return {}
    lora_report = {}
    if lora is not None:
        if full_weights is not None:  # FSDP: the adapters' full weights on an unsharded copy of the model
            unwrapped, full_weights = _unsharded_lora_model(config, lora, full_weights), None

        lora_report = {"lora": {"rank": config.lora_rank, "alpha": config.lora_alpha, "targets": config.lora_targets,
                                "adapter_norms": adapter_norms(unwrapped),
                                "final": "adapter only" if config.save_adapter_only else "merged model"}}
        unwrapped = final_model(unwrapped, config.save_adapter_only)
    trained_dtype = str(unwrapped.dtype).removeprefix("torch.")
    unwrapped, full_weights = _in_save_dtype(unwrapped, full_weights, precision.save_dtype(config))
    if config.precision == "bf16" and precision.save_dtype(config) == torch.float32 and full_weights is None:
        _add_compensation(unwrapped, optimizer)
    final = outputs.save_final(unwrapped, tokenizer, out, full_weights)
    peak, peak_kind = outputs.peak_memory_gb(accelerator.device)
    report = {
        "status": "completed",
        "model": model_name,
        "final": str(final),
        "config": {**config.to_dict(), "out": str(out)},
        "data": plan.data_report(),
        "steps": config.steps,
        "warmup_steps": config.warmup_steps,
        "steps_per_objective": steps_per_objective(config.steps, config.scheme, cycle),
        "losses": outputs.loss_summary(metrics.records),
        "update_sizes": outputs.update_summary(metrics.records),
        "wall_time_s": time.perf_counter() - started,
        "peak_memory_gb": peak,
        "peak_memory_kind": peak_kind,
        # this process's (its shards under FSDP): numel x element size of every state tensor, 8-bit codes and
        # block scales included (paper, Table 8)
        "optimizer_state_bytes": quant.optimizer_state_bytes(scheduled),
        "precision": precision.describe(config),
        "environment": {**outputs.environment(accelerator.device, world, effective_batch, config.seed, trained_dtype),
                        "precision": config.precision},
        **({"teach": config.extra["taught"]} if config.extra.get("taught") else {}),
        **measured_after,
        **lora_report,
        **_reference_report(reference, config, fsdp),
    }
    if evals:
        report["evals"] = evals
        report["eval_curves"] = _plot_curves(evals, out, plan.curve_names)
    outputs.write_report(out, report, plan.render_markdown)
    model_card.write_model_card(final, report, objectives, plan.command)
    tracker.finish(report, config.steps)
    return report


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


class RunInterrupted(UserError):
    """SIGTERM or Ctrl-C: a checkpoint was written; say how to resume. Exit code 128 + signal number."""

    def __init__(self, stop: StopRequest, step: int, path: Path | None, processes: int = 1) -> None:
        argv = [a for a in sys.argv[1:] if a != "--overwrite"]
        if "--resume" not in argv:
            argv.append("--resume")
        if processes > 1 and not any(a.startswith("--num-processes") for a in argv):
            argv += ["--num-processes", str(processes)]
        command = "doplus " + " ".join(shlex.quote(a) for a in argv)
        super().__init__(f"stopped by {stop.signal_name} after step {step}; checkpoint {path}; resume with: {command}")
        self.exit_code = 128 + stop.signal_number


class StopRequest:
    """SIGTERM (a cluster preempting the job) and SIGINT (Ctrl-C) end the run after the current step, with a
    checkpoint, instead of killing it mid-step."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.signal_number = 0
        self._previous: dict[int, Any] = {}

    def _handle(self, number, frame) -> None:
        self.signal_number, self.signal_name = number, signal.Signals(number).name

    def requested(self, accelerator) -> bool:
        """Whether any process was signalled: all processes stop after the same step."""
        if accelerator.num_processes == 1:
            return self.signal_name is not None
        flag = torch.tensor([float(self.signal_name is not None)], device=accelerator.device)
        if accelerator.reduce(flag, reduction="sum").item() > 0:
            if self.signal_name is None:
                self.signal_number, self.signal_name = int(signal.SIGTERM), "SIGTERM (on another process)"
            return True
        return False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for number in (signal.SIGTERM, signal.SIGINT):
            self._previous[number] = signal.signal(number, self._handle)

    def restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()


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


def _newest(out: Path) -> str:
    """What a run whose checkpoint write failed says next: how to go on, from which checkpoint."""
    found = checkpoint.list_checkpoints(out / "checkpoints")
    if not found:
        return "; the run stopped before its first checkpoint: free space (or fix the permission) and start it again"
    return (f"; the run stopped, its newest complete checkpoint is {found[-1]}: free space (or fix the permission), "
            "then run the same command with --resume")


def _refuse_changed_config(path: Path, saved: dict[str, Any], current: dict[str, Any]) -> None:
    keys = checkpoint.differing_keys(saved, current)
    if keys:
        changes = ", ".join(f"{k} ({saved.get(k)!r} -> {current.get(k)!r})" for k in keys)
        raise UserError(f"{path}: cannot resume with a different configuration: {changes}")


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
    fig.savefig(path, dpi=120)
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


def _accumulate_gradients(
    objective: str, objectives: Sequence[Objective], context: LossContext, formatter: PromptFormatter,
    config: TrainConfig, accelerator,
) -> dict[str, float | None]:
    """Backward `grad_accum` micro-batches of this step's objective (gradients averaged); return the mean
    of each loss term. A joint step sums every objective's weighted loss on one batch of each. An objective
    over a `MixtureSource` also logs each part's loss and rows (`PartTally`)."""
    parts = list(objectives) if objective == JOINT else [o for o in objectives if o.name == objective]
    sums = {f"{part.name}_loss": 0.0 for part in parts}
    model = context.model
    mixed = tuple(n for part in parts if isinstance(part.source, MixtureSource) for n in part.source.part_names)
    context.tally = PartTally(mixed, accelerator.device) if mixed else None
    for micro in range(config.grad_accum):
        last = micro == config.grad_accum - 1
        with nullcontext() if last or config.fsdp else accelerator.no_sync(model):
            total = 0.0
            for part in parts:
                batch = part.next_batch(formatter, accelerator.device, config.seed)
                with precision.autocast(config, accelerator.device):  # bf16 forward under bf16-mixed
                    value = part.loss.fn(context, batch)
                sums[f"{part.name}_loss"] += value.item() / config.grad_accum
                total = total + part.weight * value
            accelerator.backward(total / config.grad_accum)
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
