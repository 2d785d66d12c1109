"""What a run writes under `--out`: config.yaml, metrics.jsonl, final/, report.json and report.md.

`final/` and `report.json` are written only when the run has succeeded, each under a temporary name and
then renamed, so an interrupted run never leaves a folder that looks finished.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import yaml

from doplus_cli.errors import writing
from doplus_cli.evaluation import compute
from doplus_cli.files import atomic_write_text, follow_umask
from doplus_cli.optim import kernels, multi_tensor

# what a run that failed to write says next (errors.WriteError)
AGAIN = "; free space (or fix the permission), then run the same command again: --resume goes on from the newest " \
        "checkpoint, if one was written"


def write_config(out: Path, resolved: dict[str, Any]) -> None:
    atomic_write_text(out / "config.yaml", yaml.safe_dump(resolved, sort_keys=False))


class MetricsWriter:
    """metrics.jsonl: one JSON object per optimizer step, flushed as it is written."""

    def __init__(self, path: Path, records: list[dict[str, Any]] | None = None) -> None:
        """Start the file afresh, or with `records` (the steps a resumed run already took)."""
        self.records: list[dict[str, Any]] = list(records or [])
        self.path = path
        with writing(path):
            self._handle = open(path, "w")
            self._handle.writelines(json.dumps(r) + "\n" for r in self.records)
            self._handle.flush()

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        # a failed line is no loss: a resumed run rewrites the file from its checkpoint's records
        with writing(self.path, AGAIN):
            self._handle.write(json.dumps(record) + "\n")
            self._handle.flush()

    def close(self) -> None:
        self._handle.close()


def save_final(model: torch.nn.Module, tokenizer, out: Path, state_dict: dict | None = None,
               name: str = "final") -> Path:
    """final/ (or `name`/: best/ of --select-by): the model (safetensors) and tokenizer, written to NAME.tmp and
    renamed. `state_dict`: the weights to write instead of the model's own (a sharded model's, gathered)."""
    tmp, final = out / f"{name}.tmp", out / name
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with writing(final, AGAIN):
            model.save_pretrained(tmp, safe_serialization=True, **({"state_dict": state_dict} if state_dict else {}))
            tokenizer.save_pretrained(tmp)
            follow_umask(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment(device: torch.device, world_size: int, effective_batch: int, seed: int, dtype: str) -> dict[str, Any]:
    packages = ("doplus-cli", "torch", "transformers", "accelerate", "bitsandbytes", "datasets", "peft")
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        threads = torch.get_num_threads()
        device_name = (f"CPU ({platform.processor() or platform.machine()}, {threads} "
                       f"thread{'s' if threads != 1 else ''})")
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": {name: _version(name) for name in packages},
        "device": device_name,
        "world_size": world_size,
        "effective_batch": effective_batch,
        "seed": seed,
        "dtype": dtype,
    }


def loss_summary(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per objective: step count and, for each loss term, its value at the first and last step of that
    objective where it was logged and the mean over its last (up to) 10 such steps (a mixture's per-part
    terms are null in a step that drew no row of that part)."""
    summary: dict[str, dict[str, Any]] = {}
    for objective in dict.fromkeys(r["objective"] for r in records):
        rows = [r for r in records if r["objective"] == objective]
        terms = dict.fromkeys(k for r in rows for k in r if k.endswith("_loss"))
        summary[objective] = {"steps": len(rows)}
        for term in terms:
            values = [r[term] for r in rows if r.get(term) is not None]
            if values:
                tail = values[-10:]
                summary[objective][term] = {"start": values[0], "end": values[-1], "end_mean10": sum(tail) / len(tail)}
    return summary


def update_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Over the run, per objective and in all: the largest single-element step in learning rates
    (`max_update`), the median over steps of each step's largest, the steps with any element above 10η and
    how many element-steps that was (the step diagnostics; AdamW's steps stay near 1); under DualOptim+'s
    safeguarded rule also the mean and largest per-step fractions of elements where its floor and clamp acted."""
    rows = [r for r in records if "max_update" in r]
    if not rows:
        return {}

    def summarise(part: list[dict[str, Any]]) -> dict[str, Any]:
        largest = sorted(r["max_update"] for r in part)
        summary = {"steps": len(part), "max_update": largest[-1],
                   "median_step_max_update": largest[len(largest) // 2],
                   "steps_over_10lr": sum(1 for r in part if r["big_updates"] > 0),
                   "updates_over_10lr": sum(r["big_updates"] for r in part)}
        for name in ("floor", "clamp"):
            fractions = [r[f"{name}_fraction"] for r in part if r.get(f"{name}_fraction") is not None]
            if fractions:
                summary[f"mean_{name}_fraction"] = sum(fractions) / len(fractions)
                summary[f"max_{name}_fraction"] = max(fractions)
        return summary

    summary = {"all": summarise(rows)}
    for objective in dict.fromkeys(r["objective"] for r in rows):
        summary[objective] = summarise([r for r in rows if r["objective"] == objective])
    return summary


# The warning is for runaway steps (the paper rule's reach hundreds of learning rates). The safeguarded rule's clamp
# stops the adaptive step at exactly 10η, and decoupled weight decay adds η·λ·|θ| to the recorded |Δθ| (0.01·|θ|
# for λ = 0.01): a clamped element records a little over 10 without being a step the clamp failed to bound.
WARN_ABOVE_LR = 10.5


def update_warning(summary: dict[str, Any]) -> str | None:
    """One sentence when some step moved an element by more than 10 learning rates (by more than the clamp plus
    weight decay: the largest above `WARN_ABOVE_LR`), else None."""
    total = summary.get("all")
    if not total or total["steps_over_10lr"] == 0 or total["max_update"] <= WARN_ABOVE_LR:
        return None
    return (f"warning: {total['steps_over_10lr']} of {total['steps']} optimizer steps moved some weights by more than "
            f"10 learning rates ({total['updates_over_10lr']:,} element-steps in all; the largest "
            f"{total['max_update']:,.0f} lr). AdamW's steps stay near 1 lr; such steps throw single weights far "
            "off. With --scheme doplus this is the paper rule's division by a near-zero v̂_B + v̂_k: "
            "--doplus-rule safeguarded bounds it (docs/optimizers.md).")


def cell(text: str, limit: int = 90) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def lora_lines(lora: dict[str, Any] | None) -> list[str]:
    if not lora:
        return []
    norms = lora["adapter_norms"]
    return [f"- LoRA rank {lora['rank']}, alpha {lora['alpha']}, targets {lora['targets'] or 'default'}: "
            f"{norms['modules']} adapted modules, adapter norm {norms['total']:.4g}, "
            f"||scale B A|| {norms['delta_total']:.4g}; final/: {lora['final']}"]


def print_update_warning(report: dict[str, Any], console) -> None:
    warning = update_warning(report.get("update_sizes") or {})
    if warning:
        console.print(warning, style="bold yellow", markup=False, highlight=False)


def update_lines(summary: dict[str, Any]) -> list[str]:
    if not summary:
        return []
    lines = ["", "## Update sizes", "",
             "Largest single-element step |Δθ| of an optimizer step, in learning rates (AdamW's stay near 1).", "",
             "| objective | steps | largest | median of per-step largest | steps with any > 10 lr "
             "| element-steps > 10 lr |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['steps']} | {s['max_update']:.3g} | {s['median_step_max_update']:.3g} "
                     f"| {s['steps_over_10lr']} | {s['updates_over_10lr']:,} |")
    if any("mean_floor_fraction" in s for s in summary.values()):
        lines += ["", "Where DualOptim+'s safeguard acted: the share of elements per step whose denominator the floor "
                  "raised and whose step the clamp bounded (docs/optimizers.md).", "",
                  "| objective | floor acted, mean | floor acted, largest | clamp acted, mean | clamp acted, largest |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        lines += [f"| {name} | {s['mean_floor_fraction']:.3%} | {s['max_floor_fraction']:.3%} "
                  f"| {s['mean_clamp_fraction']:.3%} | {s['max_clamp_fraction']:.3%} |"
                  for name, s in summary.items() if "mean_floor_fraction" in s]
    warning = update_warning(summary)
    return lines + ([f"\n**{warning}**"] if warning else [])


def teach_note(teach: dict[str, Any] | None) -> str:
    """`; taught first by RECIPE (cached ...)` for a run with a teaching stage."""
    if not teach:
        return ""
    how = "reused from" if teach.get("reused") else "taught now, cached in"
    return f"; taught first by {teach['recipe']} ({how} {teach['cache']})"


def environment_lines(env: dict[str, Any]) -> list[str]:
    """The report's closing section: device, world size, dtype and package versions."""
    eager = env.get("eager_fallbacks") or {}
    return ["", "## Environment", "",
            f"- device: {env['device']}, world size {env['world_size']}, dtype {env['dtype']}"
            + (f", precision {env['precision']}" if env.get("precision") else ""),
            "- " + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v) + f", python {env['python']}",
            *(f"- the {name} kernel failed to compile and "
              f"{'the per-tensor kernels ran' if name == multi_tensor.NAME else 'ran as eager code'} (same results, "
              f"slower): {reason}" for name, reason in eager.items()),
            *(f"- evaluations ran {dtype} linear layers as {compute.TORCH_LINEAR} (same results within rounding, "
              f"slower): {reason}" for dtype, reason in (env.get("linear_fallbacks") or {}).items())]


def complete_environment(report: dict[str, Any]) -> None:
    """The report's environment records the compiled kernels that fell back to eager code in this process, and the
    dtypes whose linear layers evaluations could not run on oneDNN's packed product on this CPU."""
    failed = {**kernels.fallbacks(), **multi_tensor.fallbacks()}
    if "environment" in report and failed:
        report["environment"]["eager_fallbacks"] = failed
    unpacked = {str(dtype).removeprefix("torch."): reason for dtype, reason in compute.PACKING_VERDICTS.items()
                if reason is not None}
    if "environment" in report and unpacked:
        report["environment"]["linear_fallbacks"] = unpacked


def write_report(out: Path, report: dict[str, Any], render: Callable[[dict[str, Any]], str]) -> None:
    """report.md (written by `render`, the command's own), then report.json, last: a folder with report.json holds
    a finished run (`complete_environment` first)."""
    complete_environment(report)
    atomic_write_text(out / "report.md", render(report))
    atomic_write_text(out / "report.json", json.dumps(report, indent=2) + "\n")
