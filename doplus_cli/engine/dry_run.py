"""`--dry-run` of a training command: every check the run makes before its first heavy step, then what it would do.

The same functions the run calls check the same things, in the same order: the recipe and the options (already
resolved by the caller), the data files with the fields the chosen loss and evaluation need (`plan.open()`), the
model (found locally, in the hub's cache, or on the hub; offline, a hub id not in the cache is said to be not
checked), the steps and the warm-up the run derives, and its output folder (what it would refuse, resume or
replace: `loop.out_folder_plan`). Nothing is loaded beyond the model's config.json, nothing trained and nothing
written; a check that fails is the run's own one line (exit code 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from doplus_cli.config import TrainConfig
from doplus_cli.engine.loop import default_out_dir, derive, out_folder_plan
from doplus_cli.engine.objectives import Plan
from doplus_cli.models import check_model


def training_plan(command: Plan, config: TrainConfig, processes: int | None, gpu_memory: float | None,
                  teaching: tuple[str, str | None] | None = None) -> str:
    """The dry run of `command` (a registered training command) on `config`, as text. `teaching`: (what the
    teaching stage would do, the model it starts from), when the recipe has one: the run then starts from the
    taught model, whose architecture is that model's."""
    world = processes or 1
    lines = [f"doplus {command.command} --dry-run: every check made before the model loads passed; nothing was "
             "loaded, trained or written"]
    model = config.model
    if teaching is not None:
        lines.append(f"teaching stage: {teaching[0]}")
        model = teaching[1]
    model_line, readable = check_model(model)
    lines.append(f"model: {model_line}")
    plan = command.bound(config)
    plan.open()
    opened = derive(config, plan, world, config.fsdp, config.out or default_out_dir(plan.command))
    resolved = opened.applied_to(config)
    lines.append("data: " + _data_line(plan.data_report()))
    lines.append(f"steps: {opened.steps} ({config.scheme}, effective batch "
                 f"{config.batch_size * config.grad_accum * world} on {world} process{'es' if world > 1 else ''}), "
                 f"warm-up {opened.warmup_steps}")
    lines.append(plan.planned_out(resolved, Path(opened.out)) or "out: " + out_folder_plan(resolved, plan, world))
    if readable:
        from doplus_cli.engine.memory_plan import dry_run as memory_plan

        lines.append(memory_plan(config if model == config.model else config.replace(model=model), plan, processes,
                                 gpu_memory, steps=opened.steps, out=Path(opened.out)))
    else:
        lines.append("memory plan: not worked out (it needs the model's config.json, which is not here)")
    return "\n".join(lines)


def _data_line(report: dict[str, Any]) -> str:
    """The data the run would train on, from its command's data report: row counts, each task's."""
    parts = []
    for key, value in report.items():
        if key == "task" and isinstance(value, dict):
            parts.append(f"forget task {value.get('task_id')} of the file's {len(value.get('file_tasks') or [])}")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and value is not None:
            parts.append(f"{key.replace('_', ' ')} {value:,}")
        elif isinstance(value, dict) and all(isinstance(v, int) for v in value.values()):
            parts.append(f"{key}: " + ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in value.items()))
    return "; ".join(parts) or "checked"
