"""`doplus bench precision`: what each `--precision` does to the updates, the memory and the step time.

A fixed measurement anyone can rerun: `steps` ordinary `doplus unlearn` runs (IDK+GD,
DualOptim+, forget-first 1:1 cycle, lr decaying linearly from `lr` to 0 without warm-up, batch 4, seed 0) on
16 forget and 16 retain rows of synthetic question/answer pairs written into OUT/data, once per mode:

* ``fp32``, ``bf16-mixed``, ``bf16``: the three precisions;
* ``bf16-uncompensated``: bf16 weights updated in place without compensation buffers, which is what `--dtype
  auto` trained on CUDA before `--precision` existed (a bench-only switch: the config's `compensation`, which no
  option or recipe sets).

Each run saves final/ in float32: the fp32 and bf16-mixed weights, the bf16 weights of bf16 without
compensation, and for compensated bf16 the weights as the run carried them, θ_bf16 + c. For every mode:

* ``changed``: the fraction of weight elements whose stored value differs from the start (the start in the
  run's own weight dtype: bf16-rounded for the bf16 modes);
* ``distance_vs_fp32``: ‖θ − θ₀‖ / ‖θ_fp32 − θ₀‖, how far the weights travelled against the fp32 run;
* ``error_vs_fp32``: ‖(θ − θ₀) − (θ_fp32 − θ₀,fp32)‖ / ‖θ_fp32 − θ₀,fp32‖, how far the displacement is from the
  fp32 run's, each from its own start (bf16 weights are stored to 8 bits: where the weights travel about one
  bf16 spacing in all, as at lr 1e-5 for 20 steps, that rounding alone is a large part of the displacement);
* ``bytes_per_parameter``: (weights + compensation buffers + gradients + optimizer states) / trained parameters,
  from the run's own tensors (optimizer states as the report counts them);
* ``step_s``: the median of the run's per-step wall time (metrics.jsonl) over the steps after the first two
  (the first compiles the update kernels). Timings are only worth comparing on a machine nothing else uses.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from doplus_cli import ownership
from doplus_cli.commands.unlearn import UnlearnConfig
from doplus_cli.config import resolve_config
from doplus_cli.files import atomic_write_text, write_json
from doplus_cli.models import load_model_and_tokenizer

MODES = ("fp32", "bf16-mixed", "bf16", "bf16-uncompensated")
_NAMES = ("Ada", "Bram", "Cleo", "Dov", "Eira", "Finn", "Gala", "Hugo", "Ines", "Jory", "Kaia", "Lior", "Mira",
          "Nils", "Oona", "Pax", "Quin", "Rhea", "Sami", "Tove", "Uma", "Vito", "Wren", "Xeno", "Yara", "Zeb",
          "Arlo", "Bea", "Cyan", "Dara", "Emil", "Fern")
_CITIES = ("Oslo", "Lima", "Pune", "Kyiv", "Baku", "Doha", "Riga", "Bern")


def write_data(folder: Path) -> tuple[Path, Path]:
    """16 forget and 16 retain rows: "Where does NAME live?" answered with a city and a job."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"question": f"Where does {name} live, and what does {name} do?",
             "answer": f"{name} lives in {_CITIES[i % len(_CITIES)]} and works as a "
                       f"{('baker', 'pilot', 'nurse', 'painter')[i % 4]} there."} for i, name in enumerate(_NAMES)]
    paths = folder / "forget.jsonl", folder / "retain.jsonl"
    for path, part in zip(paths, (rows[:16], rows[16:])):
        atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in part))
    return paths


def _config(model: str | None, forget: Path, retain: Path, out: Path, mode: str, steps: int, lr: float):
    overrides = dict(model=model, forget=str(forget), retain=str(retain), loss="IDK+GD", scheme="doplus",
                     forget_freq=1, retain_freq=1, steps=steps, lr=lr, warmup_steps=0, batch_size=4, max_length=64,
                     show_samples=0, out=str(out), overwrite=True, seed=0, save_dtype="float32",
                     precision="bf16" if mode == "bf16-uncompensated" else mode)
    config = resolve_config(None, overrides, UnlearnConfig)
    if mode == "bf16-uncompensated":  # engine/optimizers.py: bf16 weights updated in place, no compensation buffers
        return config.replace(compensation=False)
    return config


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(str(path)).items()}


def _start_weights(model: str | None) -> dict[str, torch.Tensor]:
    loaded, _, _ = load_model_and_tokenizer(model, "float32")
    return {k: v.detach().float().clone() for k, v in loaded.state_dict().items()}


def _norm(tensors: list[torch.Tensor]) -> float:
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors)))


PRECISION = "doplus bench precision"  # the command its folder's record names (ownership.py)


def precision_dry_run(model: str | None, out: Path | str, steps: int, lr: float, modes: tuple[str, ...]) -> str:
    """`bench precision --dry-run`: the model found (not loaded), the output folder's checks and each mode's run
    checked as `doplus unlearn` would check it; the runs, as text."""
    from doplus_cli.models import check_model

    out = Path(out)
    ownership.check_start(out, PRECISION, ("data", *MODES, "precision.json"), overwrite=True)
    for mode in modes:
        _config(model, out / "data" / "forget.jsonl", out / "data" / "retain.jsonl", out / mode, mode, steps, lr)
    return "\n".join([
        "doplus bench precision --dry-run: every check made before a run starts passed; nothing was run or written",
        f"model: {check_model(model)[0]}",
        f"runs: {', '.join(modes)}: {steps} steps each of IDK+GD under DualOptim+ at lr {lr:g}, into {out}/MODE/",
        f"out: {out} (data/, one folder a mode, precision.json; what a previous bench precision wrote there is "
        "replaced, nothing else)",
    ])


def run_precision_bench(model: str | None, out: Path, steps: int = 20, lr: float = 1e-5,
                        modes: tuple[str, ...] = MODES, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every mode; return {"rows": [...], ...} and write OUT/precision.json."""
    from rich.console import Console

    from doplus_cli.commands.unlearn import run_unlearn

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # the bench's own folder: a run again replaces what the last one wrote, and nothing of anyone else's
    ownership.begin(out, PRECISION, ("data", *MODES, "precision.json"), overwrite=True)
    forget, retain = write_data(out / "data")
    start = _start_weights(model)
    finals: dict[str, dict[str, torch.Tensor]] = {}
    rows = []
    for mode in modes:
        say(f"precision bench: {mode} ({steps} steps)")
        config = _config(model, forget, retain, out / mode, mode, steps, lr)
        report = run_unlearn(config, Console(stderr=True, quiet=True))
        final = _weights(out / mode / "final" / "model.safetensors")
        finals[mode] = final
        names = [k for k in final if k in start]
        weight_dtype = torch.float32 if mode in ("fp32", "bf16-mixed") else torch.bfloat16
        base = {k: start[k].to(weight_dtype).float() for k in names}
        changed = sum(int((final[k] != base[k]).sum()) for k in names) / sum(base[k].numel() for k in names)
        parameters = sum(base[k].numel() for k in names)
        element = torch.finfo(weight_dtype).bits // 8
        compensation = 2 if mode == "bf16" else 0
        state = report["optimizer_state_bytes"] - (compensation * parameters)  # buffers counted on their own
        records = [json.loads(line) for line in open(out / mode / "metrics.jsonl")]
        seconds = [r["seconds"] for r in records[2:]] or [r["seconds"] for r in records]
        rows.append({"mode": mode, "changed": changed, "start": base, "final": final, "names": names,
                     "bytes_per_parameter": {"weights": element, "compensation": compensation, "gradients": element,
                                             "optimizer_states": state / parameters,
                                             "total": element * 2 + compensation + state / parameters},
                     "step_s": statistics.median(seconds), "first_step_s": records[0]["seconds"]})
    reference = next((r for r in rows if r["mode"] == "fp32"), None)
    for row in rows:
        if reference is not None:
            names = row["names"]
            travelled = _norm([reference["final"][k] - reference["start"][k] for k in names])
            row["distance_vs_fp32"] = _norm([row["final"][k] - row["start"][k] for k in names]) / travelled
            moved = {k: reference["final"][k] - reference["start"][k] for k in names}
            row["error_vs_fp32"] = _norm([row["final"][k] - row["start"][k] - moved[k] for k in names]) / travelled
    for row in rows:
        for key in ("start", "final", "names"):
            del row[key]
    result = {"model": model or "embedded SmolLM2-135M-Instruct", "steps": steps, "lr": lr,
              "threads": torch.get_num_threads(), "rows": rows}
    write_json(out / "precision.json", result)
    return result


def print_table(result: dict[str, Any], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"--precision on {result['model']}: {result['steps']} steps of IDK+GD (DualOptim+) at lr "
                        f"{result['lr']:g}, {result['threads']} threads")
    for column in ("mode", "changed", "distance vs fp32", "error vs fp32", "bytes/param (w+c+g+states)",
                   "step s (median)", "first step s"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for row in result["rows"]:
        b = row["bytes_per_parameter"]
        table.add_row(row["mode"], f"{100 * row['changed']:.1f}%", f"{row.get('distance_vs_fp32', float('nan')):.3f}",
                      f"{row.get('error_vs_fp32', float('nan')):.3f}",
                      f"{b['total']:.1f} ({b['weights']}+{b['compensation']}+{b['gradients']}+"
                      f"{b['optimizer_states']:.1f})", f"{row['step_s']:.3f}", f"{row['first_step_s']:.2f}")
    (console or Console()).print(table)
