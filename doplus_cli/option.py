"""An option's declaration, made on the config field it sets.

A field of a command's config class becomes an option of that command by declaring it with `option(...)` in place of
a plain default: its help text, its titled panel of --help, its closed set of values, its range, and, where its flag
is not `--` + the field's name, its flags. The value's type comes from the field's annotation (a list option's
tuple is typed as one comma-separated text, parsed by config.list_value). So an option is one edit: the field, with
everything the CLI, the recipes, --help, the docs' option tables and the shown default read from it
(options.py builds them). Options that set no config field (the recipe, the launch options, the benches'
parameters) are declared in options.py's table, with the same `Option`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# A help text's place for the config field's default, and for the command's name.
DEFAULT = " [default: {default}]"

# The titled panels of --help, in the order a command shows those it has: what the run works on, what it compares or
# searches, how it trains, how it is scored, and then where its files go.
MODEL_DATA, COMPARE, MEASURE, SEARCH = "Model and data", "What to compare", "What to measure", "Tuning"
METHOD, TRAINING, EVALUATION = "Method and scheme", "Training", "Evaluation"
RUNS, CHECKPOINTS, DISTRIBUTED = "The bench's runs", "Checkpoints and resume", "Distributed"
OUTPUT = "Logging and output"
PANELS = (MODEL_DATA, COMPARE, MEASURE, SEARCH, METHOD, TRAINING, EVALUATION, RUNS, CHECKPOINTS, DISTRIBUTED, OUTPUT)


@dataclass(frozen=True)
class Option:
    """One option. `flags` is click's declaration (`--lr`, `--fsdp/--no-fsdp`; an argument's parameter name), and
    its first flag names the option: the config field it sets (`--forget-lr`: `forget_lr`). `help` may hold
    `{default}` (the command's config default) and `{command}` (the command's name). `words` maps a command to its
    own help text; `variant` maps a command to its own `flags`, `type`, `min`, `panel` (the titled group of --help
    the option is shown in, one of PANELS) or `choices`; both name commands that share an option declared once
    (a bench's --steps is a training field's)."""

    flags: str
    type: Any
    help: str
    min: float | None = None
    argument: bool = False
    words: Mapping[str, str] = field(default_factory=dict)
    variant: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    panel: str = OUTPUT
    # A closed set of values, shown in --help in place of the type ([a|b|c]); `many`: a comma-separated list of
    # them. The commands check the values themselves, with their own one-line errors.
    choices: tuple[Any, ...] = ()
    many: bool = False

    @property
    def name(self) -> str:
        return self.flags.split("/")[0].removeprefix("--").replace("-", "_")

    def settings_for(self, command: str) -> dict[str, Any]:
        """`flags`, `type`, `min`, `panel` and `choices` as `command` declares them."""
        return {"flags": self.flags, "type": self.type, "min": self.min, "panel": self.panel,
                "choices": self.choices, **self.variant.get(command, {})}


def option(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = dataclasses.MISSING,
           flags: str = "", type: Any = None, **settings: Any) -> Any:
    """A config field that is an option: `default` (or `factory`, a default_factory) as `dataclasses.field` takes
    it, and the option's declaration (`Option`'s help and settings; `flags` and `type` only where the field's name
    and annotation do not give them) in the field's metadata, where `field_options` reads it."""
    return field(default=default, default_factory=factory, metadata={"option": (flags, type, help, settings)})


def flag_type(annotation: Any) -> Any:
    """The type a flag's text is converted to, from a field's annotation (a string under `from __future__ import
    annotations`): `int`, `float`, `bool`, and `str` for text and for a list (one comma-separated text)."""
    text = str(annotation).replace(" ", "")
    for suffix in ("|None", "None|"):
        text = text.replace(suffix, "")
    return {"int": int, "float": float, "bool": bool}.get(text, str)


def field_options(cls: type) -> dict[str, Option]:
    """The options a config class's fields declare (`option`), by option name (the field's, unless its flag names
    it otherwise: evaluate's `suites` is `--suite`), in the fields' order."""
    found = {}
    for f in dataclasses.fields(cls):
        declared = f.metadata.get("option")
        if declared is None:
            continue
        flags, kind, text, settings = declared
        made = Option(flags or "--" + f.name.replace("_", "-"), kind or flag_type(f.type), text, **settings)
        found[made.name] = made
    return found
