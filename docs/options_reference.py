"""Writes docs/options.md: every option of every command, panel by panel as its --help shows them, from the
declarations the CLI is built from (a config field's `option(...)`, options.py's table), so the page cannot drift
from --help.

    python docs/options_reference.py          # rewrite docs/options.md
    python docs/options_reference.py check    # exit 1 when docs/options.md is not what the declarations give
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from doplus_cli import options
from doplus_cli.cli import BENCH_DEFAULTS, EVALUATE_DEFAULTS
from doplus_cli.evaluation.runner import SUITE_REGISTRY
from doplus_cli.option import PANELS

PAGE = Path(__file__).parent / "options.md"
COMMANDS = ("unlearn", "multitask", "align", "evaluate", "bench optimizer", "bench precision", "bench schemes", "tune")
TYPES = {str: "TEXT", int: "INTEGER", float: "NUMBER", bool: "", list: "TEXT, repeatable"}


def cell(text: str) -> str:
    """A table cell: pipes escaped, one line."""
    return " ".join(str(text).split()).replace("|", "\\|")


def value_of(settings: dict[str, Any], many: bool) -> str:
    """What the option takes: its closed set, its type (and range), or nothing for a switch."""
    if settings["choices"]:
        return " | ".join(str(choice) for choice in settings["choices"]) + (", comma-separated" if many else "")
    kind = settings["type"]
    name = TYPES.get(getattr(kind, "__origin__", kind), "TEXT")
    if settings["min"] is not None:
        name += f" ≥ {settings['min']:g}"
    return name


def shown_defaults(command: str) -> dict[str, Any]:
    """The defaults click shows after a help text (evaluate's and the benches'; a training command's help texts
    say their own)."""
    if command == "evaluate":
        return EVALUATE_DEFAULTS
    return {name: value for name, value in BENCH_DEFAULTS.get(command, {}).items() if value is not ...}


def section(command: str) -> list[str]:
    names = {"suites": SUITE_REGISTRY.listing()}
    defaults = shown_defaults(command)
    lines = [f"## doplus {command}", ""]
    by_panel: dict[str, list[str]] = {}
    for name in options.in_panels(command):
        option = options.option_of(name, command)
        settings = option.settings_for(command)
        flags = " / ".join(f"`{flag.strip()}`" for flag in settings["flags"].split("/"))
        text = options.help_for(option, command, names)
        default = defaults.get(name)
        if default not in (None, False) and "[default:" not in text:
            text += f" [default: {options.shown(default)}]"
        by_panel.setdefault(settings["panel"], []).append(
            f"| {flags} | {cell(value_of(settings, option.many))} | {cell(text)} |")
    for panel in PANELS:
        if panel in by_panel:
            lines += [f"### {panel}", "", "| option | value | what it does |", "| --- | --- | --- |",
                      *by_panel[panel], ""]
    return lines


def render() -> str:
    lines = ["# Options", "",
             "Every option of every command, grouped as its `--help` groups them. This page is generated from the "
             "declarations `--help` is built from (`python docs/options_reference.py`; `tests/test_docs.py` checks "
             "it is current): a training command's options are its config class's fields, so a recipe key of the "
             "same name (`-` or `_`) sets each one.", ""]
    for command in COMMANDS:
        lines += section(command)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if argv[1:] == ["check"]:
        if PAGE.read_text() != text:
            print(f"{PAGE}: not what the option declarations give; run python docs/options_reference.py")
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
