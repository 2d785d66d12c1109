"""A bench run's numbers under attack (`eval_attacks`, docs/attacks.md), read from its last evaluation's eval.json.

Three kinds of column, each a role of SCHEMES.json:

* ``attack``: the suite's headline forget metric on each attacked copy and its worst case, ``UFE after prune``,
  ``UFE worst attack`` (the main table);
* ``reading``: what a reading attack and the relearning attacks' held-out half measure on their own rows, beside the
  unattacked model's value on the same rows: ``logit-lens probability`` and ``logit-lens probability unattacked``,
  ``held-out rouge after relearn`` and ``held-out rouge unattacked``; for the probe also its accuracy on the
  starting model and on token embeddings alone, and the logit lens's best layer on the starting model;
* ``taken back``: how far each attack moved its metric toward knowing the forget set, d · (attacked − unattacked)
  with d = +1 where a higher value means known (ROUGE, Probability, probe accuracy) and −1 where lower does (UFE),
  so that a positive value is knowledge given back: ``UFE taken back by relearn-k50``, ``probability taken back by
  logit-lens``; for the probe also its accuracy minus the same probe's on the starting model (what the unlearning
  left of the starting model's separability).

The paired comparisons of `bench schemes` compare the ``taken back`` columns as they compare the scores.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from doplus_cli.bench.adapters import Metric
from doplus_cli.evaluation.attacks import ATTACKS
from doplus_cli.evaluation.runner import SUITE_REGISTRY

WORST = "worst attack"
HELD_OUT = " held-out half"  # the suite name of the relearning attacks' held-out rows in eval.json
# the values a reading attack's details add beside its metric: (attack, metric, path in details, column suffix)
READING_DETAILS = (
    ("linear-probe", "probe_accuracy", ("base", "probe_accuracy"), "on the starting model"),
    ("linear-probe", "probe_accuracy", ("embedding_probe_accuracy",), "on embeddings alone"),
    ("logit-lens", "probability", ("base", "probability"), "on the starting model"),
)
DESCRIPTIVE = (" unattacked", " on the starting model", " on embeddings alone")  # columns that mark no best
ROLES = ("attack", "reading", "taken back")


def _readers() -> tuple[str, ...]:
    return tuple(name for name, attack in ATTACKS.items() if attack.kind == "read")


def _taken(sign: int, change: Any) -> float | None:
    return None if change is None else sign * change


def _detail(details: dict[str, Any], path: tuple[str, ...]) -> Any:
    for part in path:
        details = details.get(part) if isinstance(details, dict) else None
    return details if isinstance(details, (int, float)) and not isinstance(details, bool) else None


def attack_values(evaluation: Path) -> dict[str, Any]:
    """Every attack column's value for one run (module docstring); {} when its evaluation ran no attack."""
    path = evaluation / "eval.json"
    section = json.loads(path.read_text()).get("attacks") if path.is_file() else None
    values: dict[str, Any] = {}
    if not section:
        return values
    attack_of = {run["id"]: run["attack"] for run in section.get("runs", [])}
    details = {(suite, run["id"]): entry.get("details", {}) for run in section.get("runs", [])
               for suite, entry in (run.get("reading") or {}).items()}
    for row in section.get("metrics", []):
        metric, sign = row["metric"], 1 if row["recovered_when"] == "higher" else -1
        suite = SUITE_REGISTRY.get(row["suite"])
        if suite is not None:
            if suite.headline != metric:
                continue
            for attack, cell in row["attacks"].items():
                values[f"{metric} after {attack}"] = cell["value"]
                values[f"{metric} taken back by {attack}"] = _taken(sign, cell["change"])
            values[f"{metric} {WORST}"] = row["worst"]["value"]
            values[f"{metric} taken back by the {WORST}"] = _taken(sign, row["worst"]["change"])
        elif row["suite"].endswith(HELD_OUT):
            values[f"held-out {metric} unattacked"] = row["unattacked"]
            for attack, cell in row["attacks"].items():
                values[f"held-out {metric} after {attack}"] = cell["value"]
                values[f"held-out {metric} taken back by {attack}"] = _taken(sign, cell["change"])
        else:  # a reading attack's own rows: "tofu forget rows 0 to 39"
            for attack, cell in row["attacks"].items():
                name = attack_of.get(attack, attack)
                values[f"{attack} {metric} unattacked"] = row["unattacked"]
                values[f"{attack} {metric}"] = cell["value"]
                values[f"{metric} taken back by {attack}"] = _taken(sign, cell["change"])
                found = next((d for (s, a), d in details.items() if a == attack and row["suite"].startswith(s)), {})
                for reader, detail_metric, where, suffix in READING_DETAILS:
                    if (reader, detail_metric) == (name, metric):
                        values[f"{attack} {metric} {suffix}"] = _detail(found, where)
                base = _detail(found, ("base", "probe_accuracy"))
                if name == "linear-probe" and cell["value"] is not None and base is not None:
                    values[f"{attack} {metric} minus the starting model's"] = cell["value"] - base
    return values


def _direction(key: str) -> int:
    """+1 when a higher value of the headline metric that starts `key` means the forget set is known, −1 when a
    lower one does (the suite's own direction)."""
    metric = key.split(" ")[0]
    return next(s.directions[metric] for s in SUITE_REGISTRY.values() if metric in s.directions)


def column_role(key: str) -> str | None:
    """Which kind of attack column `key` is (module docstring), None for any other value of a run."""
    if " taken back by " in key or key.endswith(" minus the starting model's"):
        return "taken back"
    first = key.split(" ")[0]
    if key.startswith("held-out ") or first in _readers():
        return "reading"
    if (" after " in key or key.endswith(WORST)) and any(first in s.directions for s in SUITE_REGISTRY.values()):
        return "attack"
    return None


def attack_columns(keys: list[str]) -> dict[str, list[Metric]]:
    """The columns of the runs' attack values (`keys`: every value key any run has), by role, in the order the
    runs give them, each role's worst-case column last; better is the way that means the forget set is not known
    (less taken back), and the unattacked, starting-model and embedding values mark no best."""
    by_role: dict[str, list[Metric]] = {role: [] for role in ROLES}
    for key in dict.fromkeys(keys):
        role = column_role(key)
        if role is None:
            continue
        if role == "taken back":
            better: bool | None = False
        elif key.endswith(DESCRIPTIVE):
            better = None
        elif role == "reading":
            better = False  # the held-out half's and the reading attacks' metrics: higher means known
        else:
            better = _direction(key) < 0
        by_role[role].append(Metric(key, key, better, ".3f" if role == "reading" else ".2f"))
    for role, columns in by_role.items():
        by_role[role] = [c for c in columns if WORST not in c.key] + [c for c in columns if WORST in c.key]
    return by_role


def split_key(key: str) -> tuple[str, str]:
    """A column under attack -> (attack, metric), the inverse of the names `attack_values` gives (docs/data's
    records keep them so): "UFE after prune" -> ("prune",
    "UFE"), "UFE worst attack" -> ("worst attack", "UFE"), "UFE taken back by the worst attack" -> ("worst attack",
    "UFE taken back"), "logit-lens probability unattacked" -> ("logit-lens", "probability unattacked"),
    "held-out rouge after relearn-k50" -> ("relearn-k50", "held-out rouge"), "held-out rouge unattacked" ->
    ("unattacked", "held-out rouge")."""
    if " taken back by " in key:
        metric, attack = key.split(" taken back by ", 1)
        return attack.removeprefix("the "), f"{metric} taken back"
    if key.startswith("held-out "):
        rest = key.removeprefix("held-out ")
        if rest.endswith(" unattacked"):
            return "unattacked", "held-out " + rest.removesuffix(" unattacked")
        metric, attack = rest.split(" after ", 1)
        return attack, f"held-out {metric}"
    if " after " in key:
        metric, attack = key.split(" after ", 1)
        return attack, metric
    if key.endswith(" worst attack"):
        return "worst attack", key.removesuffix(" worst attack")
    attack, metric = key.split(" ", 1)
    return attack, metric
