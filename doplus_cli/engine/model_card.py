"""final/README.md: a model card in the Hugging Face layout (YAML front matter, then a short body).

It says what was forgotten and kept (each data file or hub set with the rows used and a sha256), how (command,
scheme, loss, optimizer, key hyper-parameters, precision), the evaluation when there was one, the doplus version
and a command line that reproduces the run's config.yaml. LoRA adapters (library peft) and merged or fully
trained models (transformers) alike; `huggingface_hub.ModelCard.load` reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from doplus_cli import __version__
from doplus_cli.config import default_of, recipe_form
from doplus_cli.engine.outputs import cell
from doplus_cli.engine.selection import best_lines, stop_lines
from doplus_cli.engine.tracking import numbers
from doplus_cli.files import atomic_write_text
from doplus_cli.options import command_flags

if TYPE_CHECKING:
    from doplus_cli.engine.objectives import Plan

EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the embedded default's weights (models.EMBEDDED_NAME)
# config.yaml keys that change nothing the run computes, or that a fresh run must not repeat
_NOT_IN_COMMAND = ("resume", "accept_changed", "accept_unverified", "overwrite", "description", "teach")
# report.json keys that are not results (how the run went, or said elsewhere in the card)
_NOT_RESULTS = ("config", "environment", "evals", "eval_curves", "samples", "final", "model", "status", "data",
                "steps_per_objective", "precision", "teach", "lora", "reference", "losses", "update_sizes",
                "wall_time_s", "peak_memory_gb", "peak_memory_kind", "optimizer_state_bytes", "warmup_steps", "steps")


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _sha256_rows(records) -> str:
    """A hub set's rows as canonical JSON lines (sorted keys), hashed: the same rows give the same digest."""
    digest = hashlib.sha256()
    for record in records:
        digest.update(json.dumps(record, sort_keys=True, default=str).encode() + b"\n")
    return digest.hexdigest()


def _leaf(source):
    """The file or hub source under row ranges and task subsets."""
    while hasattr(source, "source"):
        source = source.source
    return source


def data_entries(objectives: Sequence[Any]) -> list[dict[str, Any]]:
    """Per objective and per part of a mixture: its name, the source (file path or hf: spec), the rows used, the
    rows of the whole file or set, and a sha256 (of the file's bytes; of a hub set's rows as JSON lines)."""
    entries, digests = [], {}
    for objective in objectives:
        parts = getattr(objective.source, "sources", None) or [objective.source]
        for part in parts:
            leaf = _leaf(part)
            spec = str(getattr(leaf, "path", None) or leaf.name)
            if spec not in digests:
                if os.path.isfile(spec):
                    digests[spec] = sha256_file(spec)
                else:
                    data = getattr(leaf, "_data", None)
                    digests[spec] = _sha256_rows(data) if data is not None else None
            entries.append({"objective": objective.name, "name": part.name, "source": spec, "rows": len(part),
                            "source_rows": len(leaf), "sha256": digests[spec],
                            "hub": spec.startswith("hf:")})
    return entries


def hub_dataset(spec: str) -> str:
    from doplus_cli.data.sources import parse_hub_spec

    return parse_hub_spec(spec)[0]


def base_model(report: dict[str, Any]) -> str | None:
    """The hub id the run started from (None for a local folder or file: the hub knows nothing of it)."""
    model = report["config"].get("model")
    if model is None:
        return EMBEDDED_HUB_ID
    if os.path.exists(model) or model.endswith(".gguf"):
        return None
    return model


def command_line(plan: Plan, config: dict[str, Any], world_size: int = 1) -> tuple[str, dict[str, Any]]:
    """`doplus COMMAND --flag value ...` of `plan`'s command: every option of config.yaml that differs from its
    default in the command's config class, as the flag that sets it; and the options that have no flag (recipe
    keys only), with their values."""
    command, cls = plan.command, plan.config_class
    if cls is None:  # an engine caller with a Plan of its own: no command to write
        return "", dict(config)
    flag_table = command_flags(command)  # option name -> (its flags, a boolean's flags for false)
    words, recipe_only = ["doplus", command], {}
    for key, value in config.items():
        if key in _NOT_IN_COMMAND or key == "steps" and config.get("epochs") is not None:
            continue
        if key in ("continual", "task_ids") and config.get("continual"):
            continue  # one task of a continual run: that task's own run, from the previous task's model
        if key == "tasks":
            for task in value:
                extras = [f"{k}={v}" for k, v in task.items()
                          if k not in ("name", "data") and v is not None and v != _task_default(k)]
                words += ["--task", ",".join([f"{task['name']}={task['data']}", *extras])]
            continue
        default = recipe_form(key, default_of(key, cls), cls)  # as config.yaml records it
        if isinstance(default, tuple):
            default = list(default)
        if value == default:
            continue
        if key not in flag_table:
            recipe_only[key] = value
            continue
        setting, unsetting = flag_table[key]
        if isinstance(value, bool):
            flags = setting if value else unsetting
            if not flags:
                recipe_only[key] = value
                continue
            words.append(flags[0])
        else:
            text = ",".join(str(v) for v in value) if isinstance(value, list) else str(value)
            words += [setting[0], text]
    if world_size > 1:
        words += ["--num-processes", str(world_size)]
    return " ".join(shlex.quote(w) for w in words), recipe_only


def _task_default(key: str) -> Any:
    from doplus_cli.config import TASK_DEFAULTS

    return TASK_DEFAULTS[key]


def render_model_card(report: dict[str, Any], objectives: Sequence[Any], plan: Plan) -> str:
    """final/README.md of the run of `plan` (its command's name, title, method words and command line)."""
    cfg, env, command = report["config"], report["environment"], plan.command
    entries = data_entries(objectives)
    adapter = bool(report.get("lora")) and cfg.get("save_adapter_only")
    metadata: dict[str, Any] = {}
    base = base_model(report)
    if base:
        metadata["base_model"] = base
    metadata["library_name"] = "peft" if adapter else "transformers"
    metadata["tags"] = ["unlearning", "dualoptim-plus", f"doplus-{command}"] + (["lora"] if report.get("lora") else [])
    hub_sets = sorted({hub_dataset(e["source"]) for e in entries if e["hub"]})
    if hub_sets:
        metadata["datasets"] = hub_sets
    line, recipe_only = command_line(plan, cfg, env.get("world_size", 1))
    title = plan.card_title
    lines = ["---", yaml.safe_dump(metadata, sort_keys=False).strip(), "---", "",
             f"# {Path(cfg['out']).name}: {title} with doplus {command}", "",
             f"Started from {report['model']}"
             + (f" ({base})" if base and base not in report["model"] else "") + "; "
             + ("this folder holds the LoRA adapter only (load it on the base model with peft)." if adapter
                else "this folder holds the whole model (LoRA adapters merged)." if report.get("lora")
                else "this folder holds the whole model."), ""]
    lines += ["## Data", "", "| objective | set | source | rows used | rows in source | sha256 |",
              "| --- | --- | --- | ---: | ---: | --- |"]
    for e in entries:
        lines.append(f"| {e['objective']} | {cell(e['name'], 60)} | {cell(e['source'], 80)} | {e['rows']:,} "
                     f"| {e['source_rows']:,} | {e['sha256'] or 'n/a'} |")
    task = report.get("data", {}).get("task")
    if task:
        lines += ["", f"Forget task: task_id {task['task_id']}" + (f"; tasks unlearned so far "
                  f"{', '.join(map(str, task['unlearned']))}" if len(task.get("unlearned", [])) > 1 else "")]
    lines += ["", "## Training", "", *_training_lines(plan, cfg, report)]
    lines += _results_lines(report)
    lines += best_lines(report)
    lines += stop_lines(report)
    lines += ["", "## Reproduce", "", f"doplus {__version__}; {env.get('device')}, world size "
              f"{env.get('world_size')}, seed {env.get('seed')}."]
    if line:
        lines += ["", "```", line, "```"]
    if recipe_only:
        lines += ["", "with these recipe keys (no command-line flag): "
                  + ", ".join(f"{k}: {json.dumps(v, default=str)}" for k, v in recipe_only.items())]
    if cfg.get("teach"):
        lines += ["", f"The starting model above was taught first by the recipe {cfg['teach']} (option 'teach')."]
    return "\n".join(lines) + "\n"


def _training_lines(plan: Plan, cfg: dict[str, Any], report: dict[str, Any]) -> list[str]:
    precision = report.get("precision") or {}
    what = plan.card_method(cfg)
    rule = f", {cfg.get('doplus_rule')} rule" if cfg["scheme"] == "doplus" else ""
    lines = [f"- command `doplus {plan.command}`, scheme {cfg['scheme']}, {what}",
             f"- optimizer {cfg['optimizer']} ({cfg['state_bits']}-bit states{rule}), lr {cfg['lr']}"
             + (f" (forget {cfg['forget_lr']})" if cfg.get("forget_lr") is not None else "")
             + f", betas {tuple(cfg['betas'])}, weight decay {cfg['weight_decay']}, max grad norm "
             f"{cfg['max_grad_norm']}",
             f"- {report['steps']} steps, warmup {report['warmup_steps']}, batch {cfg['batch_size']} x grad accum "
             f"{cfg['grad_accum']} (effective {report['environment'].get('effective_batch')}), max length "
             f"{cfg['max_length']}",
             f"- precision {precision.get('mode', cfg.get('precision'))} (weights {precision.get('weights')}, compute "
             f"{precision.get('compute')}), saved as {precision.get('saved', cfg.get('save_dtype'))}"]
    loss = str(cfg.get("loss") or "")
    if loss.split("+")[0] in ("NPO", "DPO") or loss.endswith("+AP"):
        lines.append(f"- beta {cfg.get('beta')}")
    if report.get("lora"):
        lora = report["lora"]
        lines.append(f"- LoRA rank {lora['rank']}, alpha {lora['alpha']}, targets {lora['targets'] or 'default'}; "
                     f"final/: {lora['final']}")
    for objective, terms in (report.get("losses") or {}).items():
        ends = ", ".join(f"{term} {values['start']:.4f} -> {values['end']:.4f}" for term, values in terms.items()
                         if term != "steps")
        lines.append(f"- {objective} ({terms['steps']} steps): {ends}")
    return lines


def _results_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    evals = report.get("evals") or []
    if evals:
        names = list(dict.fromkeys(k for e in evals for k, v in e.items()
                                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)))
        lines += ["", "## Evaluation during training", "", "| step | " + " | ".join(names) + " |",
                  "| ---: |" + " ---: |" * len(names)]
        for e in evals:
            cells = ["n/a" if e.get(n) is None else f"{e[n]:.4g}" for n in names]
            lines.append(f"| {e['step']} | " + " | ".join(cells) + " |")
    results = numbers({k: v for k, v in report.items() if k not in _NOT_RESULTS}, "")
    if results:
        lines += ["", "## Results", "", "| measure | value |", "| --- | ---: |"]
        lines += [f"| {name.lstrip('/')} | {value:.4g} |" for name, value in list(results.items())[:40]]
    return lines


def write_model_card(final: Path, report: dict[str, Any], objectives: Sequence[Any], plan: Plan) -> Path:
    """final/README.md (peft's own card, if it wrote one, replaced)."""
    path = Path(final) / "README.md"
    atomic_write_text(path, render_model_card(report, objectives, plan))
    return path
