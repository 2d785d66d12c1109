"""The options of every command: the CLI's signatures, --help, recipe values and the model card's command line are
built here from their declarations.

An option is declared once. A training command's options are the fields of its config class declared with
`option.option(...)` (config.py, and each command's own config class): the field holds its default, its help, its
panel and its choices, so adding an option shared by every training command is one field of TrainConfig. A
command's config class words a shared option its own way in `option_words` (align's --steps says "or --epochs").
`doplus evaluate`'s options and the benches' (which set no training field) are declared in `OPTIONS` below, with
the same `Option`; where they share a training field's option (a bench's --steps, evaluate's --model), the
difference is data on that one declaration (`words`: a command's own help; `variant`: its own flags, type or
range). A help text shows a training command's default as `{default}`, read from that command's config class
(`COMMAND_CONFIGS`), and names the command as `{command}`. The flag's own default is None, "not given", so a
recipe's value stands unless a flag replaces it. `doplus evaluate`'s defaults are EvalConfig's (evaluation/, a layer
above), the benches' those their code runs with: cli.py hands them to `takes`, click shows them, and `with_recipe`
asks click's parameter source which options the command line gave.

`COMMAND_OPTIONS` lists each command's options by name, in the order of its help: `takes` makes them the signature
of the command's function in cli.py (`option_type` builds each one's typer type for that command), and the model
card writes its command line from `command_flags` (engine/model_card.py).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import typer
from rich import markup

from doplus_cli import errors
from doplus_cli.config import (
    SCHEMES,
    TrainConfig,
    default_of,
    recipe_options,
)
from doplus_cli.errors import UserError
from doplus_cli.option import (
    COMPARE,
    DISTRIBUTED,
    MEASURE,
    MODEL_DATA,
    OUTPUT,
    PANELS,
    RUNS,
    SEARCH,
    Option,
    field_options,
)
from doplus_cli.registry import Registry

# The config class whose fields declare a command's options (a training command's, evaluate's EvalConfig) and
# give its shown defaults, and those options (in the command's own words), as the command declares them (`declare`:
# commands/base.py's `register`, evaluation/suite_api.py; both a layer above).
COMMAND_CONFIGS: dict[str, type] = {}
COMMAND_FIELDS: dict[str, dict[str, Option]] = {}


def option_of(name: str, command: str) -> Option:
    """Option `name` as `command` declares it: its config class's field, else the table's."""
    own = COMMAND_FIELDS.get(command, {})
    return own[name] if name in own else OPTIONS[name]


def help_for(option: Option, command: str, names: Mapping[str, str] | None = None) -> str:
    """The help text `command` shows for `option`: its own words or the shared ones, its default and its name filled
    in, and each `{key}` of `names` (lists a layer above hands in, such as evaluate's `{suites}`)."""
    text = option.words.get(command, option.help).replace("{command}", command)
    for key, listed in (names or {}).items():
        text = text.replace("{" + key + "}", listed)
    if "{default}" in text:
        text = text.replace("{default}", shown(default_of(option.name, COMMAND_CONFIGS[command])))
    return text


def shown(value: Any) -> str:
    """A default as a help text shows it: as its flag is typed (a tuple comma-separated)."""
    return ",".join(str(item) for item in value) if isinstance(value, tuple) else str(value)


# The options no training field declares, and TrainConfig's fields' (which the benches and evaluate share by name).
TABLE: tuple[Option, ...] = (
    # --- Every command -----------------------------------------------------------------------------------------
    Option("--recipe", str, "YAML recipe; flags given here override its values.",
           words={"bench schemes": "An unlearn recipe (with eval_suite), a multitask recipe (a tasks: list with "
                                   "held-out rows) or an align recipe (safety: ...).",
                  "tune": "The recipe every trial runs (an unlearn recipe with eval_suite, a multitask or an align "
                          "recipe), with the trial's values over it."},
           variant={"bench optimizer": {"panel": MEASURE}}, panel=MODEL_DATA),

    # --- Every training command --------------------------------------------------------------------------------
    Option("--num-processes", int, "Run on N processes through `accelerate launch` (N GPUs, or N CPU processes "
           "over gloo).", min=1, words={"bench schemes": "Processes per run."}, panel=DISTRIBUTED),
    Option("--dry-run", bool, "Make every check the run makes before its model loads (recipe, data files and the "
           "fields the loss needs, the model found, the output folder, a resumption's checkpoint) and print what it "
           "would do (data, steps, what happens to --out, the memory plan per process under DDP and FSDP for "
           "--num-processes); then exit, having loaded, trained and written nothing. A failed check is the run's "
           "own one line (exit code 2).",
           words={"evaluate": "Make every check the evaluation makes before its model loads (recipe, data files and "
                              "fields, the model found, the output folder) and print what it would do; then exit, "
                              "having loaded and written nothing. A failed check is its own one line (exit code 2).",
                  "bench schemes": "Make every check the bench makes (recipe, schemes, evaluation suite, output "
                                   "folder; each forget task's data and the model, as its runs would) and print its "
                                   "runs; then exit, having run and written nothing.",
                  "tune": "Make every check the study makes (recipe, space at its bounds, objective and "
                          "constraints against the suite, storage, folder; the data and the model, as a trial "
                          "would) and print the study; then exit, having run and written nothing.",
                  "bench optimizer": "Check the options and print what would be timed; then exit, having timed "
                                     "nothing.",
                  "bench precision": "Check the options, the model and the output folder and print the runs; then "
                                     "exit, having trained and written nothing."}, panel=OUTPUT),
    Option("--gpu-memory", float, "With --dry-run: the GPU memory (GiB) the plan is checked against [default: the "
           "visible GPU's]", min=0, panel=DISTRIBUTED),

    # --- doplus multitask ------------------------------------------------------------------------------------------
    Option("--task", list[str], "NAME=SOURCE[,metric=exact|choice|edit_sim|rouge_l][,freq=F][,weight=W][,eval=FILE]"
           "[,lr_multiplier=X], SOURCE a JSON-lines file or hf:NAME[:CONFIG][@SPLIT]; once per task (replaces the "
           "recipe's tasks)", panel=MODEL_DATA),

    # --- doplus evaluate -------------------------------------------------------------------------------------------
    Option("folders", list[str], "With --compare: evaluation folders to compare.", argument=True, panel=COMPARE),
    Option("--compare", bool, "Print the given evaluation folders side by side.", panel=COMPARE),

    # --- doplus bench optimizer, precision and schemes --------------------------------------------------------------
    Option("--json", bool, "Print the result as JSON on stdout instead of a table.",
           words={"bench schemes": "With --list-runs: the grid as JSON, with each run's folder and command."},
           panel=OUTPUT),
    Option("--params", str, "Synthetic parameter count: 50M, 1.5G, 1B, 200k, 123456.", panel=MEASURE),
    Option("--device", str, "auto (cuda if available), cpu or cuda.", panel=MEASURE, choices=("auto", "cpu", "cuda")),
    Option("--warmup", int, "Untimed steps first (compilation happens here).", min=1, panel=MEASURE),
    Option("--only", str, "Comma-separated subset of rows, e.g. adamw,doplus,doplus-8bit.", panel=MEASURE),
    Option("--stability", bool, "Instead of speed: the paper's and the safeguarded DualOptim+ rule on a synthetic "
           "two-objective problem where v̂_B + v̂_k passes through zero (largest step, float32 against float64, "
           "8-bit against 32-bit).", panel=MEASURE),
    Option("--modes", str, "Comma-separated: fp32, bf16-mixed, bf16, bf16-uncompensated (fp32 is the reference of "
           "the distances).", panel=MEASURE),
    Option("--task-ids", str, "unlearn recipes on files whose rows carry task_id: the forget tasks (1,2,3,4,5), an "
           "axis beside the seeds; tables pool them.", panel=COMPARE),
    Option("--schemes", str, "Comma-separated: " + SCHEMES.listing() + ".", panel=COMPARE),
    Option("--seeds", str, "Comma-separated seeds; each scheme runs once per seed.", panel=COMPARE),
    Option("--set", list[str], "KEY=VALUE: a recipe value for every run (repeatable).",
           words={"tune": "KEY=VALUE: a recipe value for every trial, not searched (repeatable)."},
           variant={"tune": {"panel": SEARCH}}, panel=COMPARE),
    Option("--sweep", str, "KEY=V1,V2,...: run every scheme and seed at each value.", panel=COMPARE),
    Option("--keep-checkpoints", bool, "Keep each run's checkpoints once it is evaluated (by default they are "
           "removed, so the bench needs the disk of one run's checkpoints plus every run's final/).", panel=RUNS),
    Option("--remove-final", bool, "Remove each run's final/ once it is evaluated (the tables read its evaluation), "
           "so that a sweep whose models would not fit together runs in the disk of one run's checkpoints.",
           panel=RUNS),
    Option("--summarize-from", str, "Score each run by its final model, or by its best step (best: the runs "
           "evaluate during training and keep their best step, --set select_by=METRIC --set eval_every=N).",
           panel=RUNS, choices=("final", "best")),
    Option("--list-runs", bool, "Print the grid (index, scheme, seed, task, sweep value, state: pending, running, "
           "done or failed) and run nothing.", panel=RUNS),
    Option("--indexes", str, "With --list-runs: only the indexes of the runs in these states (e.g. pending,failed) "
           "as SLURM's --array takes them (0-3,5); nothing when there are none.", panel=RUNS),
    Option("--run-index", int, "Run only run K of the grid (--list-runs numbers them from 0) into the same --out: "
           "one task of a job array. Many may run at once; the one that ends the grid writes the tables.", panel=RUNS),
    Option("--summarize", bool, "Write the tables and figures from the runs that are done, and run nothing else.",
           panel=RUNS),
    Option("--parallel", int, "Run up to N runs at once on this machine, each in its own processes, in the grid's "
           "order: a GPU that one small run leaves idle takes several. They split the CPU cores between them, and "
           "with several GPUs visible each run gets one in turn. --dry-run says how many runs at once the disk "
           "takes.", min=1, panel=RUNS),

    Option("--tune", list[str], "KEY=SPEC: before the bench, tune this option for each scheme with doplus tune "
           "(repeatable, as tune's --space), every scheme at the same budget (--tune-trials) on --tune-task; the "
           "grid then runs each scheme at its best values.", panel=SEARCH),
    Option("--tune-trials", int, "Trials of each scheme's study (--tune).", min=1, panel=SEARCH),
    Option("--tune-objective", str, "The metric each scheme's study optimises (--tune; as tune's --objective).",
           panel=SEARCH),
    Option("--tune-constraint", list[str], "A bound each study's best trial must meet (--tune; as tune's "
           "--constraint, repeatable).", panel=SEARCH),
    Option("--tune-task", int, "The forget task the studies tune on (--tune), left out of --task-ids.", panel=SEARCH),

    # --- doplus tune ---------------------------------------------------------------------------------------------
    Option("--space", list[str], "KEY=SPEC: a recipe option to search (repeatable): lr=log:1e-6:1e-3 (log-uniform), "
           "beta=0.05:0.5 (uniform), retain_freq=int:1:5, loss=IDK+GD|NPO+GD (choices); or a YAML file of "
           "KEY: SPEC lines (docs/tune.md).", panel=SEARCH),
    Option("--objective", str, "The metric to optimise, one the recipe's evaluation suite gives (OVR, MU, UFE, "
           "forget_quality, model_utility, forget_rouge, ...), in its better direction; METRIC:max or METRIC:min "
           "sets the direction.", panel=SEARCH),
    Option("--constraint", list[str], "A bound the best trial must meet (repeatable): METRIC>=VALUE, "
           "METRIC<=VALUE, or METRIC>=F*start (F times the starting model's value, evaluated once).", panel=SEARCH),
    Option("--trials", int, "The study's budget: finished trials (complete, pruned or failed) over every worker on "
           "its storage.", min=1, panel=SEARCH),
    Option("--pruner", str, "median (stop a trial whose evaluation during training is below the median of the "
           "trials before it at that step), hyperband, or none. Needs eval_every in the recipe.", panel=SEARCH,
           choices=("median", "hyperband", "none")),
    Option("--storage", str, "Where the study lives: a journal file's path (works on a shared file system, no "
           "server) or a database URL (sqlite:///study.db, postgresql://...) [default: DIR/study.journal]",
           panel=SEARCH),
)
OPTIONS: Registry[Option] = Registry("option", Option, [*((option.name, option) for option in TABLE),
                                                        *field_options(TrainConfig).items()])


# evaluate's options that name a file, a folder or a model: in a recipe, a relative one is looked up next to the
# recipe first, as config.PATH_KEYS are in a training recipe.
EVALUATE_PATH_KEYS = ("model", "data_dir", "forget", "retain", "lm_eval_include", "retain_logs", "holdout",
                      "guard_model", "refusal_model", "refusal_model_prompt", "safety_data_dir", "responses",
                      "muse_data", "muse_retrained", "relearn_data", "base_model", "mia_reference", "fluency_model")

# Each command's options, by name (a training command's config key, but for recipe, num_processes, dry_run,
# gpu_memory and multitask's task; evaluate's EvalConfig fields, `suite` setting `suites`; a bench's parameters), in
# the order of its help; cli.py's signatures take the same (tests/test_cli.py, tests/test_options_once.py check).
# A training command's list is its command object's `options`, added here when the command is registered;
# evaluate's is made from EvalConfig's fields where the evaluation layer declares EvalConfig (`declare`).
COMMAND_OPTIONS: dict[str, tuple[str, ...]] = {
    "bench optimizer": (
        "recipe", "params", "dtype", "device", "steps", "warmup", "only", "json", "seed", "stability", "v_floor",
        "dry_run",
    ),
    "bench precision": ("recipe", "model", "out", "steps", "lr", "modes", "json", "dry_run"),
    "bench schemes": (
        "recipe", "schemes", "seeds", "task_ids", "out", "set", "sweep", "log_update_similarity", "num_processes",
        "fsdp", "keep_checkpoints", "remove_final", "summarize_from", "list_runs", "json", "indexes", "run_index",
        "summarize", "parallel", "tune", "tune_trials", "tune_objective", "tune_constraint", "tune_task", "dry_run",
    ),
    "tune": ("recipe", "space", "objective", "constraint", "trials", "out", "set", "pruner", "storage", "seed",
             "dry_run"),
}


# What launches or plans a training run rather than configures it: options with no config field.
LAUNCH_OPTIONS = ("num_processes", "dry_run", "gpu_memory")


def training_options(config_class: type[TrainConfig], extra: tuple[str, ...] = (),
                     without: tuple[str, ...] = ()) -> tuple[str, ...]:
    """A training command's options, from its config class: `--recipe`; `extra` (flags that read differently from
    their field, as multitask's repeated --task for `tasks`); the fields the class adds to TrainConfig's, in their
    order (what the command is about: its data, its loss); TrainConfig's fields, in their order; the launch options.
    Only fields declared with `option(...)` are options (the others are recipe keys), less `without` (fields every
    training command has that this one has no flag for). --help keeps this order within each panel (`in_panels`),
    so a field added to TrainConfig with `option(...)` is an option of every training command, shown where the
    field sits."""
    declared = field_options(config_class)
    shared = {f.name for f in dataclasses.fields(TrainConfig)}
    ordered = [*extra, *(n for n in declared if n not in shared), *(n for n in declared if n in shared)]
    names = [n for n in ordered if n not in without]
    return ("recipe", *dict.fromkeys(names), *LAUNCH_OPTIONS)


def declare(command: str, config_class: type | None, names: tuple[str, ...]) -> None:
    """Add a command's options (by name, in the order of its help) and the config class whose fields declare them
    and give their shown defaults (the help in the class's `option_words` where it has its own); a name neither
    the class nor the table declares, or a command declared twice, is refused."""
    if command in COMMAND_OPTIONS:
        raise ValueError(f"the options of '{command}' are declared already")
    own = {} if config_class is None else field_options(config_class)
    if config_class is not None:
        words = getattr(config_class, "option_words", {})  # EvalConfig has none
        own |= {name: dataclasses.replace(own.get(name) or OPTIONS[name], help=text) for name, text in words.items()}
    unknown = [name for name in names if name not in own and name not in OPTIONS]
    if unknown:
        raise ValueError(f"'{command}' takes options that no field or table declares: {', '.join(unknown)}")
    COMMAND_OPTIONS[command] = tuple(names)
    if config_class is not None:
        COMMAND_CONFIGS[command] = config_class
        COMMAND_FIELDS[command] = own


def option_type(name: str, command: str, names: Mapping[str, str] | None = None, show_default: bool = True) -> Any:
    """The typer type of option `name` as `command` declares it: `Annotated[type | None, typer.Option(...)]` with
    that command's flags, help text (its default, name and `names` filled in), range and panel. `show_default`:
    typer shows the flag's default after the help text (off for a default of None, "not given", which the help
    text words itself)."""
    option = option_of(name, command)
    settings = option.settings_for(command)
    text = help_for(option, command, names)
    finite = finite_number if settings["type"] is float else None
    metavar, text = choices_shown(settings["choices"], option.many, text)
    text = markup.escape(text)  # shown as written: [default: ...], hf:NAME[:CONFIG][@SPLIT] are no rich markup
    info = (typer.Argument(help=text, show_default=show_default) if option.argument  # a panel of typer's own
            else typer.Option(settings["flags"], help=text, min=settings["min"], callback=finite,
                              rich_help_panel=settings["panel"], show_default=show_default, metavar=metavar))
    return Annotated[settings["type"] | None, info]


METAVAR_WIDTH = 20  # a longer list of choices goes into the help text, which wraps, not the type column, which cuts


def choices_shown(choices: tuple[Any, ...], many: bool, text: str) -> tuple[str | None, str]:
    """(the type column's text, the help text) for an option with a closed set of values: `[a|b|c]` in the type
    column when it fits, else `[choices: a, b, c]` after the help text unless the text already names each one."""
    if not choices:
        return None, text
    names = [str(c) for c in choices]
    metavar = "[" + "|".join(names) + "]" + (",..." if many else "")
    if len(metavar) <= METAVAR_WIDTH:
        return metavar, text
    if all(name in text for name in names):
        return None, text
    return None, f"{text} [choices: {', '.join(names)}{', comma-separated' if many else ''}]"


def finite_number(value: float | None) -> float | None:
    """Every float option's check, as given on the command line or in a recipe (`recipe_value`): inf and nan are
    refused (a learning rate, weight or beta of inf or nan makes every update inf or nan)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter("input should be a finite number (not inf or nan)")
    return value


def takes(command: str, defaults: dict[str, Any] | None = None, context: bool = False,
          names: Mapping[str, str] | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command function (`def unlearn(**values)`) the options `COMMAND_OPTIONS` lists for `command`, in that
    order, each defaulting to its value in `defaults`, else None ("not given"): typer reads them from the
    signature (click shows a default that is not None after the help text), and the function receives them by
    name, the names of the config fields they set. `context`: the function also receives typer's context as
    `context` (typer's documented way to reach it), which `with_recipe` asks where each value came from. `names`
    fills each `{key}` of the help texts (`help_for`)."""
    defaults = defaults or {}

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        own = [inspect.Parameter("context", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)]
        function.__signature__ = inspect.Signature((own if context else []) + [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=defaults.get(name),
                              annotation=option_type(name, command, names,
                                                      defaults.get(name) not in (None, ...)))
            for name in in_panels(command)], return_annotation=None)
        return function
    return decorate


def examples(lines: tuple[str, ...]) -> str | None:
    """A command's examples as the foot of its --help (typer's epilog: paragraphs, rich markup escaped)."""
    return "\n\n".join(["Examples:", *(markup.escape(line) for line in lines)]) if lines else None


def in_panels(command: str) -> list[str]:
    """`command`'s options as its --help shows them: panel by panel in the order of PANELS, each panel's in the
    command's order (typer shows the panels in the order their first option comes)."""
    names = COMMAND_OPTIONS[command]
    return sorted(names, key=lambda name: PANELS.index(option_of(name, command).settings_for(command)["panel"]))


def with_recipe(context: typer.Context, recipe: str | None, values: dict[str, Any], path_keys: tuple[str, ...]
                ) -> dict[str, Any]:
    """A command's option values (as its function received them, with its `context`: `takes(..., context=True)`)
    with a recipe under them: an option the command line gave keeps its value (click's parameter source tells it
    from its default), any other the recipe sets takes the recipe's. The recipe's keys are the names in `values`
    (config.recipe_options checks them and finds a relative path under `path_keys` next to the recipe; the caller
    leaves out what a recipe does not set, such as evaluate's --compare); each value is read as its flag's text
    would be (the option's type, with its range and its words for true and false), a list as its items
    comma-separated. The values come back in the order given."""
    if recipe is None:
        return values
    params = {param.name: param for param in context.command.params if param.name in values}
    resolved = dict(values)
    for key, value in recipe_options(recipe, list(params), path_keys).items():
        if not given_on_the_command_line(context, key):
            resolved[key] = recipe_value(params[key], value, f"{recipe}: option '{key}'", context)
    return resolved


def given_on_the_command_line(context: typer.Context, name: str) -> bool:
    """Whether the command line gave option `name` (not its default, an environment variable or a prompt), by the
    public `Context.get_parameter_source`. Its enum is read by member name: typer before 0.26 returns click's
    `ParameterSource`, typer 0.26 and later that of the click it carries inside, which it does not export."""
    source = context.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def recipe_value(param: Any, value: Any, where: str, context: Any) -> Any:
    """A recipe's value for one option, converted as the command line converts the flag's text (the option's type,
    its range); one line if it cannot be."""
    if value is None:
        if param.default is not None:
            raise UserError(f"{where} cannot be empty")
        return None
    if isinstance(value, list) and all(isinstance(item, (str, int, float)) for item in value):
        value = ",".join(str(item) for item in value)
    if isinstance(value, (dict, list)):
        raise UserError(f"{where} must be one value, got {errors.shown(value)}")
    text = value if isinstance(value, bool) and param.is_flag else str(value)  # as typed: 2.5 is no integer
    try:
        return param.process_value(context, text)
    except typer.BadParameter as error:
        message = error.message[:1].lower() + error.message[1:]
        raise UserError(f"{where}: {message}, got {errors.shown(value)}") from None


def split_flags(declaration: str) -> tuple[list[str], list[str]]:
    """A declaration's flags: those that set the option (for a boolean, to true) and those that set a boolean to
    false (`--fsdp/--no-fsdp` -> ["--fsdp"], ["--no-fsdp"]), split as click splits it."""
    first, _, second = declaration.partition("/")
    return [first.strip()], [second.strip()] if second.strip() else []


def command_flags(command: str) -> dict[str, tuple[list[str], list[str]]]:
    """A command's options by name, each with its flags (see `split_flags`), its arguments left out; {} for a
    command without a `COMMAND_OPTIONS` entry."""
    return {name: split_flags(option_of(name, command).settings_for(command)["flags"])
            for name in COMMAND_OPTIONS.get(command, ()) if not option_of(name, command).argument}
