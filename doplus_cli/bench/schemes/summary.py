"""The numbers: each finished and evaluated run's scores and resources, per scheme (and sweep value) their mean and
sample standard deviation over seeds, the caption and column definitions, as SCHEMES.json, SCHEMES.md and a console
table."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from doplus_cli.bench.adapters import Metric
from doplus_cli.bench.paired import comparisons
from doplus_cli.bench.paired import render as render_paired
from doplus_cli.bench.schemes.attacked import attack_columns, attack_values
from doplus_cli.bench.schemes.planning import Bench, completed_report, plain, start_point
from doplus_cli.bench.sensitivity import render as render_sensitivity
from doplus_cli.bench.sensitivity import sensitivity
from doplus_cli.bench.tradeoff import dominance_between, ordered, summarise_tradeoff
from doplus_cli.bench.tradeoff import render as render_tradeoff
from doplus_cli.config import SCHEMES
from doplus_cli.errors import UserError

UPDATE_COSINE = Metric("update_cosine", "update cos (mean over the 2nd half of steps)", None, ".3f")
# The paper's memory and running-time table (Appendix): time and memory (the optimizer-state column's unit is
# chosen per table, see _state_metric).
RESOURCE_METRICS = (
    Metric("train_time_s", "train time (s)", False, ".1f"), Metric("peak_memory_gb", "peak memory (GB)", False),
)


@dataclass
class Result:
    """One finished and evaluated run's numbers."""

    name: str
    scheme: str
    seed: int
    sweep_value: Any
    values: dict[str, Any]  # every column's value for this run (None: not available)
    notes: dict[str, str]  # aggregate -> what it covers, when partial
    evals: list[dict[str, Any]]  # the report's evaluations during training
    update_cosines: list[tuple[int, float]]  # (step, update_cosine) where recorded
    facts: dict[str, Any]  # model, steps, device, world size, evaluation folder
    task_id: int | None = None  # --task-ids: the run's forget task
    start: dict[str, Any] | None = None  # the starting model's evaluation as a step-0 curve point (unlearn, tofu)

    @property
    def curve(self) -> list[dict[str, Any]]:
        """The evaluations in step order, the starting model's first when it was evaluated."""
        return ordered(self.start, self.evals)


SUMMARIZE_FROM = ("final", "best")


def check_summarize_from(bench: Bench, value: str) -> str:
    """`--summarize-from final|best`: best needs a kind that evaluates during training and runs that keep their
    best step (`select_by` in the recipe or --set); one line otherwise."""
    if value not in SUMMARIZE_FROM:
        raise UserError(f"--summarize-from {value}: choose final or best")
    if value == "best":
        if not bench.adapter.keeps_best:
            raise UserError(f"--summarize-from best: doplus {bench.adapter.command} does not evaluate during training, "
                            "so its runs keep no best step")
        if not all(run.config.select_by and run.config.eval_every for run in bench.runs):
            raise UserError("--summarize-from best: the runs keep no best step; set select_by and eval_every in the "
                            "recipe or with --set select_by=METRIC --set eval_every=N")
    return value


def collect(bench: Bench, index: dict[str, Any]) -> tuple[list[Result], list[str]]:
    """(results of every finished and evaluated run in OUT, names of its other runs)."""
    results, unfinished = [], []
    for name, entry in index["runs"].items():
        folder = bench.out / "runs" / name
        report = completed_report(folder)
        evaluation = None
        if report is not None and bench.summarize_from == "best":
            report, evaluation = bench.adapter.at_best(folder, report) or (report, None)
        elif report is not None:
            evaluation = bench.adapter.evaluation(folder, report)
        if report is None or evaluation is None:
            unfinished.append(name)
            continue
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
        scores, notes = bench.adapter.scores(report, evaluation)
        values = {**scores, **resources(report, records), **attack_values(evaluation)}
        cosines = [(r["step"], r["update_cosine"]) for r in records if r.get("update_cosine") is not None]
        values[UPDATE_COSINE.key] = second_half_mean(cosines, report["steps"])
        env = report.get("environment", {})
        facts = {"model": report.get("model"), "steps": report["steps"], "device": env.get("device"),
                 "world_size": env.get("world_size", 1), "peak_memory_kind": report.get("peak_memory_kind"),
                 "evaluation": str(evaluation.relative_to(bench.out)), "wall_time_s": report.get("wall_time_s"),
                 "evaluated_during_training": evaluation.parent.name == "evals"}
        sizes = (report.get("update_sizes") or {}).get("all")
        if sizes:  # the step diagnostics over every objective (engine/outputs.update_summary)
            facts["update_sizes"] = sizes
        before = bench.adapter.scores_before(report)
        if before is not None:
            facts["before"] = before
        results.append(Result(name, entry["scheme"], entry["seed"], entry["sweep_value"], values, notes,
                              report.get("evals") or [], cosines, facts, entry.get("task_id"),
                              start_point(bench, entry.get("task_id"))))
    return results, unfinished


def resources(report: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """As the paper's memory and running-time table (Appendix): training time (the sum of the optimizer steps'
    seconds, so a resumed run counts every step once and evaluation and loading are left out), peak memory over the
    steps, optimizer-state bytes."""
    seconds = [r["seconds"] for r in records if "seconds" in r]
    peaks = [r["peak_memory_gb"] for r in records if r.get("peak_memory_gb") is not None]
    return {"train_time_s": sum(seconds) if seconds else None,
            "peak_memory_gb": max(peaks) if peaks else report.get("peak_memory_gb"),
            "optimizer_state_bytes": report.get("optimizer_state_bytes")}


ENVELOPE_AREA = "envelope_area"  # per run: the area its (UFE, MU) envelope dominates (bench/tradeoff.py)


def second_half_mean(points: list[tuple[int, float]], steps: int) -> float | None:
    """Mean of the values recorded at steps after the first half of the run; None when there are none (joint
    steps, or runs without --log-update-similarity)."""
    tail = [value for step, value in points if step > steps / 2]
    return statistics.mean(tail) if tail else None


def mean_std(values: list[Any]) -> dict[str, Any]:
    """Mean and sample standard deviation (ddof = 1) of the available values; std None below two."""
    present = [v for v in values if v is not None]
    return {"mean": statistics.mean(present) if present else None,
            "std": statistics.stdev(present) if len(present) > 1 else None, "n": len(present)}


def _state_metric(results: list[Result]) -> tuple[Metric, float]:
    """The optimizer-state column and its unit in bytes: MB, or GB when some run holds a GB or more."""
    largest = max((r.values.get("optimizer_state_bytes") or 0 for r in results), default=0)
    unit = 1e9 if largest >= 1e9 else 1e6
    return Metric("optimizer_state_bytes", f"optimizer states ({'GB' if unit == 1e9 else 'MB'})", False), unit


def summarise(bench: Bench, results: list[Result], unfinished: list[str]) -> dict[str, Any]:
    """SCHEMES.json: per scheme and sweep value, every column's mean ± std over seeds, the best marked."""
    scores = [m for m in bench.adapter.metric_list(bench.runs[0].config)
              if any(r.values.get(m.key) is not None for r in results)]
    state, unit = _state_metric(results)
    by_role = attack_columns([key for r in results for key in r.values])
    attacked = by_role["attack"]
    columns = [*scores, *attacked, *RESOURCE_METRICS, state, *by_role["reading"], *by_role["taken back"]]
    roles = {**{m.key: "score" for m in scores}, **{m.key: role for role, ms in by_role.items() for m in ms},
             **{m.key: "resource" for m in (*RESOURCE_METRICS, state)}}
    if bench.log_update_similarity or any(r.values.get(UPDATE_COSINE.key) is not None for r in results):
        columns.append(UPDATE_COSINE)
        roles[UPDATE_COSINE.key] = "similarity"
    sweep_order = [json.dumps(v) for v in _sweep_values_seen(bench, results)]
    groups: dict[tuple[str, str], list[Result]] = {}
    for result in sorted(results, key=lambda r: (list(SCHEMES).index(r.scheme),
                                                 sweep_order.index(json.dumps(r.sweep_value)),
                                                 -1 if r.task_id is None else r.task_id, r.seed)):
        groups.setdefault((result.scheme, json.dumps(result.sweep_value)), []).append(result)
    rows = []
    for (scheme, _), members in groups.items():
        row_metrics = {}
        for column in columns:
            scale = unit if column is state else 1.0
            per_run = [None if r.values.get(column.key) is None else r.values[column.key] / scale for r in members]
            row_metrics[column.key] = {**mean_std(per_run), "values": per_run}
        rows.append({"scheme": scheme, "label": SCHEMES[scheme].label, "sweep_value": members[0].sweep_value,
                     "seeds": [r.seed for r in members], "runs": [r.name for r in members], "metrics": row_metrics,
                     "tasks": [r.task_id for r in members] if any(r.task_id is not None for r in members) else None})
    _mark_best(rows, columns)
    sweep = {"key": bench.sweep_key, "values": _sweep_values_seen(bench, results)} if bench.sweep_key else None
    tradeoff = None
    if bench.adapter.matched_tradeoff:
        by_name = {r.name: {"start": r.start, "evals": r.evals} for r in results}
        tradeoff = summarise_tradeoff(by_name, [(row_label(row, sweep), row["runs"]) for row in rows])
    partial: dict[str, list[dict[str, Any]]] = {}  # column -> each note on what it covers, with its run count
    for column in columns:
        counts: dict[str, int] = {}
        for result in results:
            note = result.notes.get(column.key)
            if note:
                counts[note] = counts.get(note, 0) + 1
        if counts:
            partial[column.key] = [{"note": note, "runs": n} for note, n in counts.items()]
    runs = {r.name: {"scheme": r.scheme, "seed": r.seed, "sweep_value": r.sweep_value, "task_id": r.task_id,
                     **r.facts, "values": r.values, "notes": r.notes} for r in results}
    whole_curve = []  # the area each run's envelope dominates, compared pair by pair as the score metrics are
    if tradeoff is not None:
        for name, area in tradeoff["areas"].items():
            runs[name]["values"] = {**runs[name]["values"], ENVELOPE_AREA: area}
        tradeoff["dominance"] = dominance_between(rows, runs, tradeoff["curves"])
        whole_curve = [(ENVELOPE_AREA, "the area the (UFE, MU) envelope dominates", True)]
    return {
        "caption": caption(bench, results),
        "kind": bench.adapter.command,
        "recipe": str(bench.recipe),
        "set": plain(bench.set_values),
        "sweep": sweep,
        "columns": [{"key": c.key, "label": c.label, "role": roles[c.key], "format": c.spec,
                     "better": {True: "higher", False: "lower", None: None}[c.higher_is_better]} for c in columns],
        "rows": rows,
        "partial": partial,
        "runs_total": len(results),
        "unfinished": unfinished,
        "definitions": definitions(bench, results, UPDATE_COSINE in columns) + (
            ["METRIC after ATTACK: the forget metric of the run's last evaluation on the attacked copy "
             "(`eval_attacks`, docs/attacks.md); METRIC worst attack: the attack that moved it furthest toward "
             "knowing the forget set, per run."] if attacked else []) + (
            ["Reading attacks (logit lens, probe, soft prompt) and the relearning attack's held-out half: each value "
             "on the attack's own rows beside the unattacked model's on the same rows (METRIC unattacked); the probe "
             "also on the starting model and on token embeddings alone."] if by_role["reading"] else []) + (
            ["METRIC taken back by ATTACK: how far the attack moved the metric toward knowing the forget set, "
             "d · (attacked − unattacked) with d = +1 where higher means known and −1 where lower does (UFE); the "
             "probe's accuracy minus the starting model's: what the unlearning left of its separability."]
            if by_role["taken back"] else []),
        "tradeoff": tradeoff,
        "sensitivity": sensitivity(rows, runs, [(m.key, m.label, m.higher_is_better) for m in scores],
                                   {row["scheme"]: row["label"] for row in rows})
        if bench.sweep_key and len(sweep["values"]) > 1 else None,
        "paired": comparisons(rows, runs, [(m.key, m.label, m.higher_is_better) for m in scores] + whole_curve
                              + [(m.key, m.label, m.higher_is_better) for m in by_role["taken back"]]),
        "over": over(results),
        "runs": runs,
    }


def _sweep_values_seen(bench: Bench, results: list[Result]) -> list[Any]:
    """The sweep values of the runs in OUT (as in JSON): in increasing order when they are all numbers, else in
    the order they were first given."""
    seen = {json.dumps(r.sweep_value): r.sweep_value for r in results}
    values = list(seen.values())
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        values.sort()
    return values


def _mark_best(rows: list[dict[str, Any]], columns: list[Metric]) -> None:
    """Each row's `best`: the columns where its mean is the best of the rows with the same sweep value (as shown,
    so ties at the shown precision are all marked); nothing is marked where every row shows the same."""
    for row in rows:
        row["best"] = []
    by_value: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_value.setdefault(json.dumps(row["sweep_value"]), []).append(row)
    for group in by_value.values():
        for column in columns:
            if column.higher_is_better is None:
                continue
            shown = [(row, format(row["metrics"][column.key]["mean"], column.spec)) for row in group
                     if row["metrics"][column.key]["mean"] is not None]
            if len({text for _, text in shown}) < 2:  # a lone row, or every row the same: no best
                continue
            pick = max if column.higher_is_better else min
            best = pick(row["metrics"][column.key]["mean"] for row, _ in shown)
            best_text = format(best, column.spec)
            for row, text in shown:
                if text == best_text:
                    row["best"].append(column.key)


def _distinct(values: list[Any]) -> str:
    return ", ".join(str(v) for v in dict.fromkeys(values))


def over(results: list[Result]) -> str:
    """What a row's mean and std run over: "seeds", or "forget tasks and seeds" with --task-ids."""
    tasks = any(r.task_id is not None for r in results)
    seeds = len({r.seed for r in results}) > 1
    return "forget tasks and seeds" if tasks and seeds else "forget tasks" if tasks else "seeds"


def caption(bench: Bench, results: list[Result]) -> str:
    """Recipe, what it trains, model, steps, seeds, device: the table's caption."""
    config = bench.runs[0].config
    seeds = sorted({r.seed for r in results})
    tasks = sorted({r.task_id for r in results if r.task_id is not None})
    devices = _distinct([f"{r.facts['device']}" + (f" x {r.facts['world_size']} processes"
                                                   if r.facts["world_size"] > 1 else "") for r in results])
    what = bench.adapter.describe(config, bench.sweep_key)
    return (f"Update schemes on {bench.recipe.name} (doplus {bench.adapter.command}{', ' + what if what else ''}): "
            f"model {_distinct([r.facts['model'] for r in results])}, {_distinct([r.facts['steps'] for r in results])}"
            f" steps, " + (f"forget tasks {', '.join(map(str, tasks))} (task_id), " if tasks else "")
            + f"seeds {', '.join(map(str, seeds))}, {devices}"
            + (f"; --set {', '.join(f'{k}={v}' for k, v in bench.set_values.items())}" if bench.set_values else "")
            + (f". Mean ± sample standard deviation over {over(results)}, every run of a scheme pooled (n/a: one run)"
               if tasks else ". Mean ± sample standard deviation over seeds (n/a: one seed)")
            + "; best per column in bold"
            + (f" among the schemes at the same {bench.sweep_key}" if bench.sweep_key else "") + ".")


def definitions(bench: Bench, results: list[Result], update_cosine: bool) -> list[str]:
    """What each column is, for the lines under the table."""
    config = bench.runs[0].config
    memory_kinds = _distinct([r.facts["peak_memory_kind"] for r in results])
    lines = bench.adapter.score_definitions(config, [r.facts for r in results])
    lines += [
        "train time: the sum of the optimizer steps' seconds in metrics.jsonl (a resumed run counts each step "
        "once; loading and evaluation left out).",
        f"peak memory: the largest peak_memory_gb of the steps ({memory_kinds}).",
        "optimizer states: bytes of every optimizer-state tensor (numel x element size; 8-bit states: codes and "
        "block scales), on one process.",
    ]
    if update_cosine:
        lines.append("update cos: cosine similarity between the latest updates of the objectives (mean over "
                     "objective pairs), averaged over the steps in the second half of the run, then over seeds; "
                     "n/a for joint (no separate objective steps) and for runs that did not record it.")
    return lines


def row_label(row: dict[str, Any], sweep: dict[str, Any] | None) -> str:
    return row["label"] + (f" {sweep['key']}={row['sweep_value']}" if sweep else "")


# ---- SCHEMES.md ---------------------------------------------------------------------------------------------


def _cell(stats: dict[str, Any], spec: str, bold: bool) -> str:
    if stats["mean"] is None:
        return "n/a"
    std = "n/a" if stats["std"] is None else format(stats["std"], spec)
    text = f"{format(stats['mean'], spec)} ± {std}"
    return f"**{text}**" if bold else text


EXTRA_TABLES = {"reading": "Reading attacks and the relearning attack's held-out half, each on its own rows",
                "taken back": "What each attack takes back (toward knowing the forget set; 0: nothing)"}


def _table(summary: dict[str, Any], columns: list[dict[str, Any]]) -> list[str]:
    sweep = summary["sweep"]
    arrow = {"higher": " ↑", "lower": " ↓", None: ""}
    with_tasks = any(row.get("tasks") for row in summary["rows"])
    headers = ["Method", *([sweep["key"]] if sweep else []), *[c["label"] + arrow[c["better"]] for c in columns],
               "tasks x seeds" if with_tasks else "seeds"]
    lines = ["| " + " | ".join(headers) + " |",
             "| --- |" + (" ---: |" if sweep else "") + " ---: |" * len(columns) + " ---: |"]
    for row in summary["rows"]:
        cells = [row["label"], *([str(row["sweep_value"])] if sweep else [])]
        cells += [_cell(row["metrics"][c["key"]], c["format"], c["key"] in row["best"]) for c in columns]
        cells.append(f"{len(set(row['tasks']))} x {len(set(row['seeds']))}" if row.get("tasks")
                     else str(len(row["seeds"])))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render_markdown(summary: dict[str, Any], figures: list[str]) -> str:
    columns = summary["columns"]
    main = [c for c in columns if c["role"] not in EXTRA_TABLES]
    lines = [f"**Table.** {summary['caption']}", "", *_table(summary, main)]
    for role, title in EXTRA_TABLES.items():
        extra = [c for c in columns if c["role"] == role]
        if extra:
            lines += ["", f"**{title}.**", "", *_table(summary, extra)]
    lines.append("")
    if summary["partial"]:
        lines.append("Partial aggregates (a judge model was missing where these runs were evaluated):")
        labels = {c["key"]: c["label"] for c in columns}
        for key, notes in summary["partial"].items():
            for entry in notes:
                lines.append(f"- {labels[key]}: {entry['note']} ({entry['runs']} of {summary['runs_total']} runs)")
        lines.append("")
    lines += [f"- {line}" for line in summary["definitions"]]
    if summary.get("tuned"):
        lines += [f"- Tuned: {summary['tuned']['how']}; each scheme's values: " + "; ".join(
            f"{SCHEMES[scheme].label}: " + ", ".join(f"{k} = {v:.3g}" if isinstance(v, float) else f"{k} = {v}"
                                                     for k, v in values.items())
            for scheme, values in summary["tuned"]["values"].items()) + "."]
    if summary.get("paired"):
        labels = {c["key"]: c["label"] for c in columns} | {ENVELOPE_AREA: "envelope area (UFE·MU)"}
        sweep = summary["sweep"]
        lines += [""] + render_paired(summary["paired"], labels, sweep["key"] if sweep else None)
    if summary.get("sensitivity"):
        lines += render_sensitivity(summary["sensitivity"], summary["sweep"]["key"])
    if summary.get("tradeoff"):
        lines += [""] + render_tradeoff(summary["tradeoff"], summary.get("over", "seeds"))
    if summary["unfinished"]:
        lines += ["", f"Not included (not finished or not evaluated): {', '.join(summary['unfinished'])}."]
    if figures:
        lines += [""] + [f"![{Path(f).stem}]({f})" for f in figures]
    return "\n".join(lines) + "\n"


def print_summary(summary: dict[str, Any], console: Console) -> None:
    """The means (± std) as a table on the console."""
    table = Table(title=f"bench schemes: mean ± std over {summary.get('over', 'seeds')}", title_justify="left")
    sweep = summary["sweep"]
    table.add_column("scheme")
    if sweep:
        table.add_column(sweep["key"], justify="right")
    shown = [c for c in summary["columns"] if c["role"] not in EXTRA_TABLES]  # the others: SCHEMES.md
    for column in shown:
        table.add_column(column["label"].replace(" (mean over the 2nd half of steps)", ""), justify="right")
    for row in summary["rows"]:
        cells = [row["label"], *([str(row["sweep_value"])] if sweep else [])]
        cells += [_cell(row["metrics"][c["key"]], c["format"], False) for c in shown]
        table.add_row(*cells)
    console.print(table)
