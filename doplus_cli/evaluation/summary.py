"""What `doplus evaluate` prints: one block per section of the record `run_evaluate` returns, chosen by its suite,
then the report's path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table

from doplus_cli.evaluation.muse import print_section as print_muse_section
from doplus_cli.evaluation.safety import console_lines
from doplus_cli.evaluation.suites import INDICATORS
from doplus_cli.evaluation.wmdp import print_section as print_wmdp_section
from doplus_cli.registry import Registry


def print_summary(record: dict[str, Any], console: Console) -> None:
    """Each section's table or lines (TOFU and real-world indicators with MU/UFE/TFE/OVR, lm-eval's headline
    metrics, the safety and XSTest judges' lines), then where the report is."""
    for section in record["sections"]:
        SECTION_PRINTERS.get(section["suite"], _print_qa_section)(section, console)
    console.print(f"report: {record['out']}/report.md  ({record['wall_time_s']:.0f} s)", markup=False)


def _print_qa_section(section: dict[str, Any], console: Console) -> None:
    """TOFU, real-world: the indicators of each set, the aggregates, OpenUnlearning's values."""
    _print_indicators(section, console)
    _print_openunlearning_values(section, console)


def _print_indicators(section: dict[str, Any], console: Console) -> None:
    table = Table(title=f"{section['suite']}: indicators (%)")
    sets = [s["name"] for s in section["sets"]]
    table.add_column("indicator")
    for name in sets:
        table.add_column(name, justify="right")
    for indicator in INDICATORS:
        cells = [section["values"].get(f"{s}_{indicator}") for s in sets]
        table.add_row(indicator, *["n/a" if v is None else f"{100 * v:.2f}" for v in cells])
    console.print(table)
    for aggregate in section["aggregates"]:
        value = "n/a" if aggregate["value"] is None else f"{100 * aggregate['value']:.2f}"
        console.print(f"{aggregate['name']}: {value}" + (f"  ({aggregate['note']})" if aggregate["note"] else ""),
                      markup=False)


def _print_openunlearning_values(section: dict[str, Any], console: Console) -> None:
    """The section's OpenUnlearning metrics (forget_quality, privleak, ...), one per line; the privacy suite's only
    block."""
    block = section.get("openunlearning") or {}
    for key, value in block.get("values", {}).items():
        console.print(f"{key}: {'n/a' if value is None else f'{value:.4g}'}", markup=False)


def _print_lm_eval_section(section: dict[str, Any], console: Console) -> None:
    table = Table(title=f"lm-eval (limit {section['limit']})")
    table.add_column("task")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for task, (metric, value) in section["headline"].items():
        table.add_row(task, metric, "n/a" if value is None else f"{100 * value:.2f}")
    console.print(table)


def _print_safety_section(section: dict[str, Any], console: Console) -> None:
    console.print("\n".join(console_lines(section)), markup=False)


# A section's printer by its suite; any other suite (tofu, real-world) prints as `_print_qa_section`.
SECTION_PRINTERS: Registry[Callable[[dict[str, Any], Console], None]] = Registry("section printer", Callable, {
    "lm-eval": _print_lm_eval_section,
    "privacy": _print_openunlearning_values,
    "safety": _print_safety_section,
    "xstest": _print_safety_section,
    "safety-overall": _print_safety_section,
    "wmdp": print_wmdp_section,
    "muse": print_muse_section,
})
