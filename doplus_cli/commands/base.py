"""What every training command is, and the registry the CLI and the recipes look commands up in.

A command (`doplus unlearn`, `doplus multitask`, `doplus align`) is one object of one module: its name, its config
class, the recipe key that marks it, the hooks the one training loop calls (`engine.objectives.Plan`: its data, its
objectives, what it measures before, during and after training, its report), its entry point `run`, the summary it
prints and the evaluation it runs. The object in the registry carries no config; `run` makes one that does for the
run (`bound`), which is what the loop is handed. What only `doplus bench schemes` asks of a command lives with the
bench, in its adapter (bench/adapters/).

Adding a command is one module with its config class, its `Command` subclass and one `register` line in
commands/__init__.py: its options are the fields of its config class declared with `option(...)`
(`options.training_options`), it names its help, and cli.py makes `doplus NAME` of every registered command. A
command module imports no other command module.

A command module imports the engine at its top: the engine's own imports of the heavy packages (transformers,
accelerate, peft, matplotlib, ...) sit inside its functions, so looking a command up (for a recipe's command, a help
text, the bench's tables) loads none of them.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from doplus_cli import options
from doplus_cli.config import TrainConfig
from doplus_cli.engine.loop import run_training
from doplus_cli.engine.objectives import Plan
from doplus_cli.registry import Registry

if TYPE_CHECKING:
    from rich.console import Console

    from doplus_cli.engine.evaluations import Evaluation


class Command(Plan):
    """One training command: the loop's hooks (`Plan`) and what the CLI runs and prints.

    `Command()` is the command as registered (no config); `Command(config)` (`bound`) is one run of it, the object
    the loop calls back."""

    marker = ""  # a recipe (or --set) key that only this command has
    config_class: type[TrainConfig] = TrainConfig
    help = ""  # the command's line in `doplus --help`, and the first line of its own --help
    # Its options by name, in the order of its --help (each declared on its config field, or in options.py's table
    # for those that set no field): by default those of its config class (`options.training_options`), with
    # `extra_options` (flags that are no field of their own name) and less `without_flags` (TrainConfig fields the
    # command has no flag for: its validation refuses a value for them).
    options: tuple[str, ...] = ()
    extra_options: tuple[str, ...] = ()
    without_flags: tuple[str, ...] = ()
    examples: tuple[str, ...] = ()  # command lines shown at the foot of its --help, each one the docs run as written

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "options" not in cls.__dict__ and cls.config_class is not TrainConfig:
            cls.options = options.training_options(cls.config_class, cls.extra_options, cls.without_flags)

    def __init__(self, config: TrainConfig | None = None) -> None:
        self.config = config

    def bound(self, config: TrainConfig) -> Command:
        """This command for one run of `config`: the object whose hooks the loop calls."""
        return type(self)(config)

    def run(self, config: TrainConfig, console: Console | None = None) -> dict[str, Any]:
        """Train (and evaluate) as configured; return the report (also written to `config.out`)."""
        return run_training(config, self.bound(config), console)

    def dry_run(self, config: TrainConfig, processes: int | None, gpu_memory: float | None,
                teaching: tuple[str, str | None] | None = None) -> str:
        """`--dry-run`: every check a run of `config` makes before the model loads, and what it would do, as text
        (`teaching`: its teaching stage's, `engine.teach.teaching_plan`); a failed check is the run's own one line.
        Nothing loaded, trained or written."""
        from doplus_cli.engine.dry_run import training_plan

        return training_plan(self, config, processes, gpu_memory, teaching)

    def from_options(self, values: dict[str, Any]) -> dict[str, Any]:
        """The values of its options as config fields (a command whose flag reads differently from its recipe key,
        such as multitask's repeated --task, converts it here)."""
        return values

    def print_summary(self, report: dict[str, Any], console: Console) -> None:
        """The report's summary on the console, and where the outputs are."""
        raise NotImplementedError

    def evaluation(self, config: TrainConfig) -> Evaluation | None:
        """The `doplus evaluate` run that evaluates a run of `config` (engine/evaluations.py: its `EvalConfig` in
        this process and its flags for a process of its own); None: the command evaluates itself only."""
        return None


# ---- the registry -------------------------------------------------------------------------------------------

COMMANDS: Registry[Command] = Registry("command", Command)  # by name, in the order they were registered


def register(command: Command) -> Command:
    """The command under its name, and its options declared to options.py from its config class (the CLI builds
    `doplus NAME` from both)."""
    COMMANDS.register(command.command, command)
    options.declare(command.command, command.config_class, command.options)
    return command


def command_named(name: str) -> Command:
    return COMMANDS[name]


def command_for(config: TrainConfig) -> Command:
    """The registered command whose config class `config` is, bound to it (one run of it)."""
    for command in COMMANDS.values():
        if type(config) is command.config_class:
            return command.bound(config)
    raise KeyError(f"no command takes a {type(config).__name__}")


def command_marked(keys: Collection[str]) -> Command | None:
    """The command of a recipe with these keys: the first registered command whose marker it sets; None when
    none."""
    return next((command for command in COMMANDS.values() if command.marker in keys), None)
