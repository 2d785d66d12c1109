"""What `doplus tune` leaves for the user to act on, written from every trial in the study by the worker that ends:
TUNE.json (every trial, the best one, the importances), TUNE.md (the same as tables), best.yaml (the best
feasible trial's recipe), best_model_card.md (its run's model card) and objective.png (the objective against each
parameter: complete trials filled, pruned ones hollow at their last reported value, infeasible ones grey)."""

from __future__ import annotations

import json
import math
import shutil
from typing import TYPE_CHECKING, Any

import yaml

from doplus_cli.files import atomic_write_text, save_figure
from doplus_cli.tune.trials import recipe_path, trial_name

if TYPE_CHECKING:
    from doplus_cli.tune import Tune


def trial_rows(tune: Tune, study: Any) -> list[dict[str, Any]]:
    """One row per trial in the study, in order."""
    from doplus_cli.tune.study import interrupted

    gone = interrupted(study)
    rows = []
    for trial in study.get_trials(deepcopy=False):
        state = trial.state.name.lower()
        if state == "fail":
            state = "interrupted" if trial.number in gone else "failed"
        violations = trial.user_attrs.get("violations")
        last = max(trial.intermediate_values) if trial.intermediate_values else None
        rows.append({
            "number": trial.number, "state": state, "params": dict(trial.params),
            "value": trial.value if state == "complete" else None,
            "feasible": (state == "complete" and all(v <= 0 for v in violations or [])) if tune.constraints
            else state == "complete",
            "scores": trial.user_attrs.get("scores"), "violations": violations,
            "intermediate": {str(step): value for step, value in sorted(trial.intermediate_values.items())},
            "last_reported": None if last is None else {"step": last, "value": trial.intermediate_values[last]},
            "pruned_step": trial.user_attrs.get("pruned_step"), "seconds": trial.user_attrs.get("seconds"),
            "error": trial.user_attrs.get("error"), "retry_of": trial.user_attrs.get("retry_of"),
            "folder": str(tune.out / "trials" / trial_name(trial.number)),
        })
    return rows


def best_row(tune: Tune, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The best feasible complete trial (the lowest number among equals), or None."""
    feasible = [row for row in rows if row["feasible"] and row["value"] is not None and math.isfinite(row["value"])]
    if not feasible:
        return None
    sign = -1 if tune.objective.maximize else 1
    return min(feasible, key=lambda row: (sign * row["value"], row["number"]))


def importances(study: Any, tune: Tune) -> dict[str, float] | str:
    """Optuna's fANOVA importance of each parameter for the objective over the complete trials, or why there is
    none."""
    from optuna.importance import get_param_importances
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if len(tune.space) < 2:
        return "one parameter: nothing to apportion"
    if len(complete) < 2:
        return f"{len(complete)} complete trial(s): at least 2 are needed"
    try:
        return {key: float(value) for key, value in get_param_importances(study, normalize=True).items()}
    except (RuntimeError, ValueError) as error:  # e.g. every complete trial at one value
        return f"not computed ({error})"


def write_outputs(tune: Tune, study: Any) -> dict[str, Any]:
    from doplus_cli.tune.study import counts

    rows = trial_rows(tune, study)
    best = best_row(tune, rows)
    summary: dict[str, Any] = {
        "settings": tune.settings(), "counts": counts(study), "trials": rows,
        "best": None, "importances": importances(study, tune), "figures": [],
    }
    start = tune.out / "start" / "SUMMARY.json"
    if start.is_file():
        summary["start"] = json.loads(start.read_text())
    if best is not None:
        recipe = tune.out / "best.yaml"
        atomic_write_text(recipe, best_recipe_text(tune, best["number"], best["value"]))
        card = tune.out / "trials" / trial_name(best["number"]) / "final" / "README.md"
        copied = None
        if card.is_file():
            copied = tune.out / "best_model_card.md"
            shutil.copyfile(card, copied.with_name(copied.name + ".tmp"))
            copied.with_name(copied.name + ".tmp").replace(copied)
        summary["best"] = {**best, "recipe": str(recipe), "model_card": None if copied is None else str(copied)}
    figure = plot_objective(tune, rows)
    if figure:
        summary["figures"].append(figure)
    atomic_write_text(tune.out / "TUNE.json", json.dumps(summary, indent=2, default=str) + "\n")
    atomic_write_text(tune.out / "TUNE.md", render_markdown(tune, summary))
    return summary


def _value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def render_markdown(tune: Tune, summary: dict[str, Any]) -> str:
    settings, count = summary["settings"], summary["counts"]
    goal = f"{tune.objective.describe()}" + (
        f" subject to {', '.join(c.text() for c in tune.constraints)}" if tune.constraints else "")
    lines = [f"# doplus tune: {tune.recipe.name}", "",
             f"{goal}; {settings['trials']} trials of doplus {settings['kind']} (TPE sampler, seed {tune.seed}, "
             f"{tune.startup_trials} random trials first; pruner: {tune.pruner}). Trials: {count['complete']} "
             f"complete, {count['pruned']} pruned, {count['failed']} failed"
             + (f", {count['interrupted']} interrupted and run again" if count["interrupted"] else "")
             + (f", {count['running']} running" if count["running"] else "") + ".", "",
             "Space: " + "; ".join(p.describe() for p in tune.space) + ".", ""]
    best = summary["best"]
    if best is None:
        lines += ["No feasible complete trial yet.", ""]
    else:
        lines += [f"## Best trial: {trial_name(best['number'])}", "",
                  f"{tune.objective.metric} = {best['value']:.6g} with "
                  + ", ".join(f"{k} = {_value(v)}" for k, v in best["params"].items())
                  + f". Recipe: `best.yaml` (`doplus {settings['kind']} --recipe best.yaml` runs it again); "
                  f"model card: {'`best_model_card.md`' if best['model_card'] else 'none written'}.", "",
                  "| metric | value |" + (" starting model |" if "start" in summary else ""),
                  "| --- | ---: |" + (" ---: |" if "start" in summary else "")]
        for key, value in (best["scores"] or {}).items():
            row = f"| {key} | {_value(value)} |"
            if "start" in summary:
                row += f" {_value(summary['start'].get(key))} |"
            lines.append(row)
        lines.append("")
    imp = summary["importances"]
    lines += ["## Parameter importance (fANOVA, over the complete trials)", ""]
    lines += [f"- {key}: {value:.3f}" for key, value in imp.items()] if isinstance(imp, dict) else [f"- {imp}"]
    keys = [p.key for p in tune.space]
    lines += ["", "## Trials", "",
              "| trial | state | " + " | ".join(keys) + f" | {tune.objective.metric} | feasible | s |",
              "| --- | --- | " + " | ".join("---:" for _ in keys) + " | ---: | --- | ---: |"]
    for row in summary["trials"]:
        state = row["state"] + (f" at step {row['pruned_step']}" if row["pruned_step"] is not None else "")
        value = row["value"] if row["value"] is not None else (row["last_reported"] or {}).get("value")
        shown = _value(value) + (" (last reported)" if row["value"] is None and value is not None else "")
        feasible = ("yes" if row["feasible"] else "no") if row["state"] == "complete" else ""
        lines.append(f"| {trial_name(row['number'])} | {state} | "
                     + " | ".join(_value(row["params"].get(k)) for k in keys)
                     + f" | {shown} | {feasible} | {_value(row['seconds'])} |")
    for figure in summary["figures"]:
        lines += ["", f"![{figure}]({figure})"]
    return "\n".join(lines) + "\n"


def plot_objective(tune: Tune, rows: list[dict[str, Any]]) -> str | None:
    """objective.png: the objective against each parameter; None when no trial has a value to plot."""
    points = [row for row in rows if row["value"] is not None or row["last_reported"]]
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(tune.space), figsize=(4 * len(tune.space), 3.4), squeeze=False)
    for axis, param in zip(axes[0], tune.space):
        for row in points:
            if param.key not in row["params"]:
                continue
            x = row["params"][param.key]
            if row["value"] is not None:
                axis.scatter([x], [row["value"]], color="C0" if row["feasible"] else "0.6", zorder=3)
            else:
                axis.scatter([x], [row["last_reported"]["value"]], facecolors="none", edgecolors="C3", zorder=2)
        if param.kind == "log":
            axis.set_xscale("log")
        axis.set_xlabel(param.key)
        axis.set_ylabel(tune.objective.metric)
        axis.grid(alpha=0.3)
    figure.suptitle(f"{tune.objective.describe()}: filled complete, grey infeasible, hollow pruned")
    figure.tight_layout()
    save_figure(figure, tune.out / "objective.png")
    plt.close(figure)
    return "objective.png"


def best_recipe_text(tune: Tune, number: int, value: float) -> str:
    """best.yaml: the best trial's recipe as it ran, with a header saying where it comes from."""
    recipe = yaml.safe_load(recipe_path(tune, number).read_text())
    header = (f"# doplus tune: the best trial ({trial_name(number)}, {tune.objective.metric} = {value:.6g}) of "
              f"{tune.out}\n# run it again: doplus {tune.adapter.command} --recipe best.yaml --out DIR\n")
    return header + yaml.safe_dump(recipe, sort_keys=False)
