"""report.md of an evaluation, and `doplus evaluate --compare` tables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from doplus_cli.errors import UserError
from doplus_cli.evaluation.suites import INDICATORS

FORMULAS = {
    "rouge": "ROUGE-L recall (stemmed) of the greedy answer against the ground truth",
    "probability": "exp(-mean token NLL) of the answer; real authors / world facts: "
                   "p(true) / (p(true) + sum p(perturbed))",
    "truth_ratio": "r = exp(mean perturbed NLL - paraphrased NLL); forget: 1 - mean min(r, 1/r); "
                   "others: mean max(0, 1 - 1/r) (real authors / world facts: the answer stands in for the paraphrase)",
    "token_entropy": "entropy of the generated tokens' unigram distribution / log(token count)",
    "cosine_similarity": "cosine of sentence embeddings of generation and ground truth, floored at 0",
    "entailment": "fraction of pairs an NLI model labels entailment (ROUGE recall < 0.1 counts as not entailed)",
    "fluency_entropy": "forget generations' mean of ROME's n-gram entropy H2 / 3 + 2 H3 / 3 (bits of the word "
                       "bigram and trigram frequencies; RWKU's Flu): low when a generation repeats itself",
    "fluency": "forget generations' mean probability of the class clean that a gibberish classifier gives each, cut "
               "to 32 of its tokens (OpenUnlearning's forget_Q_A_gibberish)",
}


def _fmt(value: Any, percent: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{100 * value:.2f}" if percent else f"{value:.2f}"


def set_description(entry: dict[str, Any]) -> str:
    """`forget (300 rows scored of task 1's 400; forget10_perturbed.json, 3,600 rows)`: what one set scored."""
    task, file_rows = entry.get("task_id"), entry.get("file_rows")
    if task is not None:
        return f"{entry['name']} ({entry['n']} rows scored, task {task}; from {entry['source']}, {file_rows:,} rows)"
    whole = f" of {file_rows:,}" if file_rows is not None and file_rows != entry["n"] else ""
    return f"{entry['name']} ({entry['n']}{whole} rows scored from {entry['source']})"


def render_eval_markdown(record: dict[str, Any]) -> str:
    lines = [f"# doplus evaluate: {record['model']}", ""]
    judges = record["judges"]
    suites = {s["suite"] for s in record["sections"]}
    if suites & {"tofu", "real-world"}:
        embedder = judges["embedding_model"] or "missing: " + str(judges["embedding_missing"])
        lines.append(f"- embedding model: {embedder}")
        lines.append(f"- NLI model: {judges['nli_model'] or 'missing: ' + str(judges['nli_missing'])}")
    if suites & {"safety", "xstest"}:
        lines.append(f"- guard model: {judges.get('guard_model') or judges.get('guard_missing')}")
        lines.append(f"- refusal judge: {judges.get('refusal_judge')}")
    if "protocol" in record and suites != {"muse"}:  # MUSE fixes its own budgets and feeds raw text
        lines.append(f"- protocol {record['protocol']}")
    if record.get("prompt_template") and suites != {"muse"}:
        lines.append(f"- prompt template: {record['prompt_template']!r}")
    for section in record["sections"]:
        suite = section["suite"]
        if suite in ("safety", "xstest", "safety-overall"):
            from doplus_cli.evaluation.safety import render_markdown

            lines += render_markdown(section)
            continue
        if suite == "privacy":
            lines += ["", "## privacy (OpenUnlearning's metrics)", "", "Sets: " + ", ".join(
                set_description(s) for s in section["sets"]), ""]
            lines += _openunlearning_lines(section["openunlearning"])
            continue
        if suite == "muse":
            from doplus_cli.evaluation.muse import render_markdown as render_muse

            lines += render_muse(section)
            continue
        if suite == "wmdp":
            from doplus_cli.evaluation.wmdp import render_markdown as render_wmdp

            lines += render_wmdp(section)
            continue
        if suite == "lm-eval":
            lines += ["", f"## lm-eval (limit {section['limit']})", ""]
            lines += ["| task | metric | value |", "| --- | --- | ---: |"]
            for task, (metric, value) in section["headline"].items():
                lines.append(f"| {task} | {metric} | {_fmt(value, True)} |")
            continue
        sets = [s["name"] for s in section["sets"]]
        lines += ["", f"## {suite}", "", "Indicators in percent; sets: "
                  + ", ".join(set_description(s) for s in section["sets"]), ""]
        lines += ["Reference fields: " + "; ".join(
            f"{s['name']}: " + ", ".join(f"{indicator} <- {name}" for indicator, name in s["fields"].items())
            for s in section["sets"] if "fields" in s), ""]
        raw = section["values"]
        lines.append("| indicator | " + " | ".join(sets) + " |")
        lines.append("| --- |" + " ---: |" * len(sets))
        for indicator in INDICATORS:
            row = [_fmt(raw.get(f"{s}_{indicator}"), True) for s in sets]
            lines.append(f"| {indicator} | " + " | ".join(row) + " |")
        if "forget_idk_entailment" in raw:
            lines.append(f"| entailment with a rejection (TFE) | {_fmt(raw['forget_idk_entailment'], True)} |"
                         + " |" * (len(sets) - 1))
        lines += _fluency_rows(section, sets)
        lines += ["", "| aggregate | value (%) | coverage |", "| --- | ---: | --- |"]
        for agg in section["aggregates"]:
            note = f" ({agg['note']})" if agg["note"] else ""
            lines.append(f"| {agg['name']} | {_fmt(agg['value'], True)} | {note.strip(' ()') or 'complete'} |")
        if section.get("openunlearning"):
            lines += ["", "### OpenUnlearning's metrics", ""] + _openunlearning_lines(section["openunlearning"])
    if any(s["suite"] in ("tofu", "real-world") for s in record["sections"]):
        lines += ["", "## Formulas", ""]
        lines += [f"- {name}: {text}" for name, text in FORMULAS.items()]
        lines += ["- MU: harmonic mean of every non-forget indicator; UFE: 1 - mean(forget ROUGE, Probability, Truth "
                  "Ratio, Cosine Similarity, Entailment); TFE: harmonic mean(forget Token Entropy, entailment of "
                  "the generation with a rejection answer); OVR: 0.25 (TFE + UFE) + 0.5 MU (targeted), 0.5 (UFE + "
                  "MU) (untargeted)"]
    if record.get("attacks"):
        from doplus_cli.evaluation.attacks import render_attack_lines

        lines += render_attack_lines(record["attacks"])
    seconds = ", ".join(f"{k} {v:.1f} s" for k, v in record["seconds"].items())
    lines += ["", f"Time: {seconds} (total {record['wall_time_s']:.1f} s)."]
    per_set = [f"{s['name']} ({s['n']} questions): " + ", ".join(f"{k} {v:.1f} s" for k, v in s["seconds"].items())
               for section in record["sections"] for s in section.get("sets", []) if s.get("seconds")]
    if per_set:
        lines += ["", "Per set: " + "; ".join(per_set) + "."]
    if record.get("compute"):
        from doplus_cli.evaluation.compute import floor_line

        lines += ["", floor_line(record["compute"])]
    return "\n".join(lines) + "\n"


def _fluency_rows(section: dict[str, Any], sets: list[str]) -> list[str]:
    """The forget set's fluency as rows of the indicator table, in the forget column: the generation entropy (in
    bits, not percent) and the gibberish classifier's clean probability, or why that one is not available."""
    raw, fluency = section["values"], section.get("fluency")
    if fluency is None or "forget_fluency_entropy" not in raw:
        return []

    def row(name: str, cell: str) -> str:
        return f"| {name} | " + " | ".join(cell if s == "forget" else "" for s in sets) + " |"

    if raw.get("forget_fluency") is None:
        clean = row("fluency: clean probability", f"not available: {fluency['missing']}".replace("|", "\\|"))
    else:
        clean = row(f"fluency: clean probability ({fluency['model']}, class {fluency['clean_label']!r})",
                    _fmt(raw["forget_fluency"], True))
    return [row("fluency: generation entropy (bits, not %)", f"{raw['forget_fluency_entropy']:.2f}"), clean]


def _openunlearning_lines(block: dict[str, Any]) -> list[str]:
    """OpenUnlearning's metrics as a table with each one's formula (the docstring's first sentence)."""
    from doplus_cli.evaluation import openunlearning as ou

    formula_of = {"forget_quality": ou.forget_quality, "model_utility": ou.model_utility_ou,
                  "mia_loss": ou.loss_score, "mia_zlib": ou.zlib_score, "mia_min_k": ou.min_k_score,
                  "mia_min_k_plus_plus": ou.min_k_plus_plus_score, "privleak": ou.privleak,
                  "extraction_strength": ou.extraction_strength, "exact_memorization": ou.exact_memorization}
    lines = ["| metric | value | formula |", "| --- | ---: | --- |"]
    for key, value in block["values"].items():
        doc = " ".join((formula_of[key].__doc__ or "").split()) if key in formula_of else ""
        if key.startswith("mia_"):
            doc = "AUC (forget vs holdout) of the score " + doc
        lines.append(f"| {key} | {'n/a' if value is None else f'{value:.4g}'} | {doc.split('. ')[0]} |")
    return lines + [""] + [f"- {note}" for note in block.get("notes", [])]


def load_summary(folder: str) -> dict[str, Any]:
    path = Path(folder) / "SUMMARY.json"
    if not path.is_file():
        raise UserError(f"{folder}: no SUMMARY.json (not a `doplus evaluate` output folder)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise UserError(f"{path}:{error.lineno}: malformed JSON ({error.msg})") from None


def compare_table(folders: list[str]) -> str:
    """A markdown table: one column per evaluation folder, one row per summary key they share (aggregates first)."""
    summaries = [load_summary(f) for f in folders]
    # a `*_missing` key says in words why its metric is absent; the metric's own row shows n/a
    keys = [k for k in summaries[0] if all(k in s for s in summaries[1:]) and not k.endswith("_missing")]
    first = [k for k in ("MU", "UFE", "TFE", "OVR", "OVR_targeted", "OVR_untargeted", "SAFETY_OVR", "safety_judge",
                         "safety_rate_avg", "xstest_over_refusal", "xstest_unsafe_refusal") if k in keys]
    ordered = first + [k for k in keys if k not in first]
    lines = ["| metric | " + " | ".join(Path(f).name or f for f in folders) + " |",
             "| --- |" + " ---: |" * len(folders)]
    for key in ordered:
        row = []
        for s in summaries:
            value = s[key]
            row.append("n/a" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value))
        lines.append(f"| {key} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"
