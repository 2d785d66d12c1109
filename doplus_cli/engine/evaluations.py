"""The evaluation a training command runs, mapped once from its config.

Each command's builder (`commands.unlearn.unlearn_evaluation`, `commands.align.align_evaluation`, reached as
`Command.evaluation(config)`) gives `doplus evaluate`'s option values (by option name, as the flags carry them), and
`Evaluation` makes from them both the `EvalConfig` the command evaluates with in its own process (unlearn during
training, align on final/) and the `doplus evaluate` flags its bench adapter runs as a process (`bench schemes`'
evaluation of final/ or of the starting model): one mapping, so the two cannot differ (tests/test_evaluations.py
parses the flags with `doplus evaluate`'s own options and compares).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from doplus_cli.config import list_value
from doplus_cli.evaluation.attacks import parse_attacks
from doplus_cli.evaluation.runner import parse_suites
from doplus_cli.evaluation.suite_api import EvalConfig
from doplus_cli.options import command_flags


@dataclass(frozen=True)
class Evaluation:
    """`doplus evaluate`'s options by name (`suite` comma-separated, as typed; None: not given), in the order the
    command line lists them, and whether the model's own code is trusted."""

    options: dict[str, Any]
    trust_remote_code: bool

    def config(self, model: str | None, out: str | None = None) -> EvalConfig:
        """The EvalConfig of `doplus evaluate --model MODEL` with these options (and `--out OUT --overwrite`)."""
        values = {name: value for name, value in self.options.items() if value is not None}
        suites = parse_suites(list_value(values.pop("suite"), str, False, "--suite"))
        if "attacks" in values:  # as typed (comma-separated), as `doplus evaluate --attacks` parses it
            values["attacks"] = parse_attacks(list_value(values["attacks"], str, False, "--attacks"), suites)
        return EvalConfig(model=model, suites=suites, out=out, overwrite=out is not None,
                          trust_remote_code=self.trust_remote_code, **values)

    def flags(self) -> list[tuple[str, Any]]:
        """(flag, value) of each option, for `bench.adapters.base.doplus_evaluate` (which leaves out the None values
        and adds --model, --trust-remote-code, --out and --overwrite)."""
        flags = command_flags("evaluate")
        return [(flags[name][0][0], value) for name, value in self.options.items()]

