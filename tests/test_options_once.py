"""Each option of the commands that take a recipe and of the benches is declared once (doplus_cli/options.py): one
entry per flag, the commands' differences as data in that entry, every default a help text shows read from the
config that sets it (the benches': the one their code runs with), and every training command's help listing exactly
the options its config lets a recipe set plus the few that are not config."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest
import typer.main
from rich.markup import escape
from typer.testing import CliRunner

from doplus_cli import options
from doplus_cli.cli import app
from doplus_cli.commands.align import AlignConfig
from doplus_cli.commands.multitask import MultitaskConfig
from doplus_cli.commands.unlearn import UnlearnConfig
from doplus_cli.config import TASK_DEFAULTS, TrainConfig, field_names, resolve_config
from doplus_cli.errors import UserError
from doplus_cli.evaluation.runner import EvalConfig
from doplus_cli.option import field_options
from tests.helpers import HELP_ENV, PAGES, documented_commands, help_flags_of, help_panels

CONFIGS = {"unlearn": UnlearnConfig, "multitask": MultitaskConfig, "align": AlignConfig}
BENCHES = ("bench optimizer", "bench precision", "bench schemes")
STUDIES = (*BENCHES, "tune")  # the commands whose options are all the table's, declared in cli.py by name alone
# Config fields a recipe sets that have no flag: a recipe's description, its teaching recipe, the trackers' names and
# folder, multitask's tasks (given one by one with --task).
RECIPE_ONLY = {"description", "teach", "tracker_project", "tracker_run_name", "tracker_group", "tracker_dir", "tasks"}
# Options that are no config field: the recipe itself, how the run is launched or planned, multitask's --task.
NOT_CONFIG = {"--recipe", "--num-processes", "--dry-run", "--gpu-memory", "--help"}
# Fields of the options every training command shares that a command has no flag for, because they mean nothing
# there: the reference model's placement where the one loss (CE) has no reference model, and evaluation during
# training in align, which evaluates after training only. The fields stay in the command's config (the loop reads
# them on every config), so a recipe key names them, but that command's validation refuses a value for them
# (checked below; tests/test_refused_keys.py has the messages).
WITHOUT_FLAG = {"unlearn": set(), "multitask": {"ref_offload"},
                "align": {"ref_offload", "eval_every", "select_by", "stop_when"}}
# A value for each that the commands that use the field take.
SET_VALUES = {"ref_offload": "cpu", "eval_every": 2, "select_by": "MU", "stop_when": "MU>=1"}
REQUIRED = {"unlearn": {"forget": "f.jsonl", "retain": "r.jsonl"}, "align": {"safety": "s.jsonl", "general": "g.jsonl"},
            "multitask": {"tasks": [{**TASK_DEFAULTS, "name": "a", "data": "a.jsonl"}]}}
# Defaults the help says in words, for what the value means.
DEFAULTS_IN_WORDS = {"keep_last": (0, "all"), "save_every": (0, "never"), "save_minutes": (0, "never"),
                     "eval_every": (0, "never"),
                     "save_adapter_only": (False, "merged model")}
SHOWN = re.compile(r"\[default: ([^\]]*)\]$")


def shown(value):
    """A default as typed on the command line: a tuple or list comma-separated."""
    return ",".join(str(item) for item in value) if isinstance(value, (tuple, list)) else str(value)


def field_default(field):
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


@pytest.fixture(scope="module")
def commands():
    group = typer.main.get_command(app)
    return {name: group.commands[name] for name in (*CONFIGS, "evaluate")}


@pytest.fixture(scope="module")
def help_flags():
    """The first flag of each option row of each command's --help, as a user reads it."""
    found = {}
    for command in (*CONFIGS, "evaluate"):
        result = CliRunner().invoke(app, [command, "--help"], env=HELP_ENV)
        assert result.exit_code == 0, result.output
        found[command] = help_flags_of(result.output)
    return found


def test_each_flag_belongs_to_one_option_and_each_option_to_a_command():
    owner: dict[str, str] = {}
    for command in options.COMMAND_OPTIONS:
        for name, (on, off) in options.command_flags(command).items():
            for flag in on + off:
                assert owner.setdefault(flag, name) == name, f"{flag}: {owner[flag]} and {name}"
    taken = {name for names in options.COMMAND_OPTIONS.values() for name in names}
    declared = set(options.OPTIONS) | {name for own in options.COMMAND_FIELDS.values() for name in own}
    assert declared == taken  # no declaration that no command takes


def test_each_option_is_declared_once_on_its_field_or_in_the_table():
    """A training command's option is its config field's declaration (`option(...)`), in the command's own words
    where its class has them; only options that set no field of the command come from the table, and no table
    entry repeats a field every training command shares."""
    table = {option.name for option in options.TABLE}
    assert not table & set(field_options(TrainConfig))
    for command, config_class in CONFIGS.items():
        fields = field_options(config_class)
        words = getattr(config_class, "option_words", {})
        for name in options.COMMAND_OPTIONS[command]:
            option = options.option_of(name, command)
            shared = fields[name] if name in fields else options.OPTIONS[name]
            assert name in fields or name in table, (command, name)
            assert option == dataclasses.replace(shared, help=words.get(name, shared.help)), (command, name)
        for name, text in words.items():  # a command's own words differ from the shared ones
            assert text != (fields[name] if name in fields else options.OPTIONS[name]).help, (command, name)


def test_a_commands_own_words_are_data_on_the_one_entry_not_a_copy():
    helps = [option.help for option in options.OPTIONS.values()]
    assert len(helps) == len(set(helps)), "two entries share their help text"
    for name, option in options.OPTIONS.items():
        takers = {command for command, names in options.COMMAND_OPTIONS.items() if name in names}
        assert set(option.words) | set(option.variant) <= takers, name
        assert takers - set(option.words), f"{name}: no command shows its shared help"
        for command, words in option.words.items():
            assert words != option.help, f"{name}: {command}'s words repeat the shared ones"
        for settings in option.variant.values():
            assert settings and all(getattr(option, key) != value for key, value in settings.items()), name


def test_no_two_options_of_a_command_show_the_same_help(commands):
    for command, click_command in commands.items():
        helps = [param.help for param in click_command.params]
        assert len(helps) == len(set(helps)), command


@pytest.mark.parametrize("command", list(CONFIGS))
def test_each_default_a_training_command_shows_is_its_configs(commands, command):
    fields = {field.name: field for field in dataclasses.fields(CONFIGS[command])}
    checked = 0
    for param in commands[command].params:
        assert param.default is None  # "not given": the recipe's value stands unless the flag replaces it
        if param.name not in fields:
            continue
        default = field_default(fields[param.name])
        match = SHOWN.search(param.help)
        if default is None:
            continue  # None means a choice made where the value is used; the help says which in words
        if match is None:
            assert isinstance(default, bool), f"{command} --{param.name}: no default shown, config has {default!r}"
            continue
        words = match.group(1)
        expected = shown(default)
        assert (words == expected or words.startswith(expected + ", ")
                or DEFAULTS_IN_WORDS.get(param.name) == (default, words)), \
            f"{command} --{param.name}: help shows {words!r}, config's default is {expected!r}"
        checked += 1
    assert checked >= 25


def test_each_default_evaluate_shows_is_eval_configs(commands):
    fields = {field.name: field_default(field) for field in dataclasses.fields(EvalConfig)}
    checked = 0
    for param in commands["evaluate"].params:
        name = "suites" if param.name == "suite" else param.name
        if name not in fields or fields[name] in (None, ()):
            continue
        match = SHOWN.search(param.help or "")
        words = shown(param.default) if param.default is not None else match and match.group(1)
        assert words == shown(fields[name]), f"evaluate --{param.name}: shows {words!r}, EvalConfig: {fields[name]!r}"
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("command", list(CONFIGS))
def test_a_training_commands_help_lists_exactly_its_recipe_fields_and_the_launch_options(help_flags, command):
    expected = {"--" + name.replace("_", "-") for name in field_names(CONFIGS[command])
                if name not in RECIPE_ONLY | WITHOUT_FLAG[command]}
    expected |= NOT_CONFIG | ({"--task"} if command == "multitask" else set())
    listed = help_flags[command]
    assert len(listed) == len(set(listed))
    assert set(listed) == expected, (sorted(set(listed) - expected), sorted(expected - set(listed)))


@pytest.mark.parametrize("command,key", [(c, k) for c, keys in WITHOUT_FLAG.items() for k in sorted(keys)])
def test_a_field_a_command_has_no_flag_for_is_refused_by_it_not_ignored(command, key):
    with pytest.raises(UserError, match=rf"^{key} {SET_VALUES[key]}: doplus {command} "):
        resolve_config(None, {**REQUIRED[command], key: SET_VALUES[key]}, CONFIGS[command])
    resolve_config(None, REQUIRED[command], CONFIGS[command])  # and without it the same config is valid


def test_evaluates_help_lists_exactly_eval_configs_fields_and_compare(help_flags):
    singular = {"suites": "suite", "attack_options": "attack_option"}  # a repeatable or comma-separated flag's field
    expected = {"--" + singular.get(field.name, field.name).replace("_", "-")
                for field in dataclasses.fields(EvalConfig)} | {"--compare", "--recipe", "--dry-run", "--help"}
    assert set(help_flags["evaluate"]) == expected, (sorted(set(help_flags["evaluate"]) - expected),
                                                     sorted(expected - set(help_flags["evaluate"])))


def test_the_options_read_each_commands_defaults_from_the_config_class_it_runs_with():
    """options.py cannot import the command modules (a layer above), so it pairs command and config class itself:
    the same pairs as the command registry, for every command that runs training."""
    from doplus_cli.commands import COMMANDS

    assert {**{name: command.config_class for name, command in COMMANDS.items()},
            "evaluate": EvalConfig} == options.COMMAND_CONFIGS
    assert set(COMMANDS) | {"evaluate", *STUDIES} == set(options.COMMAND_OPTIONS)


@pytest.mark.parametrize("command", STUDIES)
def test_a_benchs_options_are_the_tables_in_its_order_and_its_help_lists_them(command):
    """The benches and doplus tune declare no option of their own in cli.py: each parameter is the table's entry,
    with the flags, help and range the table gives that command."""
    group = typer.main.get_command(app)
    for word in command.split():
        group = group.commands[word]
    bench = group
    parsed = {param.name: (param.opts, param.secondary_opts) for param in bench.params}
    flags = options.command_flags(command)
    assert list(parsed.items()) == [(name, flags[name]) for name in options.in_panels(command)]
    for param in bench.params:  # rich markup escaped: a help text shows as written
        declared = options.option_of(param.name, command)
        assert (param.help or "") == escape(options.help_for(declared, command)), param.name
    helps = [param.help for param in bench.params]
    assert len(helps) == len(set(helps))
    result = CliRunner().invoke(app, [*command.split(), "--help"], env=HELP_ENV)
    assert result.exit_code == 0, result.output
    assert help_flags_of(result.output) == ["--help"] + [
        options.split_flags(options.option_of(name, command).settings_for(command)["flags"])[0][0]
        for name in options.in_panels(command)]


def test_each_default_a_bench_shows_is_the_one_its_code_runs_with():
    """The defaults click shows for the benches (cli.BENCH_DEFAULTS) against the defaults of the functions that run
    them, read from their signatures here."""
    import inspect

    from doplus_cli.bench.optimizer import BenchConfig
    from doplus_cli.bench.precision import MODES, run_precision_bench

    group = typer.main.get_command(app).commands["bench"]
    shown_defaults = {command: {param.name: param.default for param in group.commands[command].params}
                      for command in ("optimizer", "precision", "schemes")}
    for name, parameter in inspect.signature(BenchConfig.from_cli).parameters.items():
        if parameter.default is not inspect.Parameter.empty:
            assert shown_defaults["optimizer"][name] == parameter.default, name
    assert shown_defaults["optimizer"]["params"] == "50M"
    for name in ("steps", "lr"):
        assert shown_defaults["precision"][name] == inspect.signature(run_precision_bench).parameters[name].default
    assert shown_defaults["precision"]["modes"] == ",".join(MODES)
    assert shown_defaults["schemes"]["recipe"] is None and group.commands["schemes"].params[0].required
    for command in shown_defaults:
        for name in ("json", "stability", "list_runs", "summarize", "keep_checkpoints", "fsdp"):
            assert shown_defaults[command].get(name, False) is False  # a switch is off unless given


HELP_COMMANDS = (*CONFIGS, "evaluate", *STUDIES)


def command_help(command: str, columns: int = 160) -> str:
    result = CliRunner().invoke(app, [*command.split(), "--help"], env={**HELP_ENV, "COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("command", HELP_COMMANDS)
def test_a_commands_help_groups_its_options_in_titled_panels_in_a_users_order(command):
    """Each option in one panel of PANELS (typer's own "Options" holds --help alone, its "Arguments" evaluate's
    folders), each panel once, in the order of PANELS: what the run works on first, where its files go last."""
    panels = help_panels(command_help(command))
    titles = [title for title, _ in panels if title not in ("Options", "Arguments")]
    assert dict(panels).get("Options") == ["--help"]
    assert set(titles) <= set(options.PANELS) and len(titles) == len(set(titles)) >= 2, titles
    assert titles == sorted(titles, key=options.PANELS.index)
    shown = {flag: title for title, flags in panels for flag in flags}
    for name in options.COMMAND_OPTIONS[command]:
        option = options.option_of(name, command)
        if not option.argument:
            flag = options.split_flags(option.settings_for(command)["flags"])[0][0]
            assert shown[flag] == option.settings_for(command)["panel"], (command, flag)


def test_unlearns_options_sit_where_a_user_looks_for_them():
    shown = {flag: title for title, flags in help_panels(command_help("unlearn")) for flag in flags}
    assert {flag: shown[flag] for flag in ("--model", "--forget", "--scheme", "--loss", "--lr", "--steps",
                                            "--eval-every", "--resume", "--save-every", "--num-processes", "--out",
                                            "--dry-run")} == {
        "--model": "Model and data", "--forget": "Model and data", "--scheme": "Method and scheme",
        "--loss": "Method and scheme", "--lr": "Training", "--steps": "Training", "--eval-every": "Evaluation",
        "--resume": "Checkpoints and resume", "--save-every": "Checkpoints and resume",
        "--num-processes": "Distributed", "--out": "Logging and output", "--dry-run": "Logging and output"}


def test_the_closed_sets_are_listed_in_the_help():
    """Every value of a closed set is named where a user chooses it: the schemes, the losses, the precisions, the
    suites and the attacks."""
    from doplus_cli.config import FORGET_LOSS_NAMES, PRECISIONS, RETAIN_LOSS_NAMES, SCHEMES, UPDATE_SCHEMES
    from doplus_cli.evaluation.attacks import ATTACKS
    from doplus_cli.evaluation.runner import SUITE_REGISTRY

    def help_of(name, command):
        return options.help_for(options.option_of(name, command), command, {"suites": SUITE_REGISTRY.listing()})

    for command in CONFIGS:
        assert all(scheme in help_of("scheme", command) for scheme in UPDATE_SCHEMES), command
        assert all(precision in help_of("precision", command) for precision in PRECISIONS if precision != "auto")
    assert all(loss in help_of("loss", "unlearn") for loss in (*FORGET_LOSS_NAMES, *RETAIN_LOSS_NAMES))
    assert all(scheme in help_of("schemes", "bench schemes") for scheme in SCHEMES)
    assert all(suite in help_of("suite", "evaluate") for suite in SUITE_REGISTRY)
    attacks = help_of("attacks", "evaluate")
    assert all(attack in attacks for attack in ATTACKS), [a for a in ATTACKS if a not in attacks]


def test_an_options_choices_are_its_type_column_or_end_its_help():
    """An option with a closed set (`Option.choices`, per command) shows each value: in the type column as [a|b]
    when that fits, else after its help text, unless the text already names every one."""
    from doplus_cli.evaluation.runner import SUITE_REGISTRY

    seen = 0
    for command, names in options.COMMAND_OPTIONS.items():
        for name in names:
            choices = options.option_of(name, command).settings_for(command)["choices"]
            if not choices:
                continue
            seen += 1
            info = options.option_type(name, command, {"suites": SUITE_REGISTRY.listing()}).__metadata__[0]
            shown = (info.metavar or "") + " " + info.help
            assert all(str(choice) in shown for choice in choices), (command, name, shown)
            assert info.metavar is None or len(info.metavar) <= options.METAVAR_WIDTH
    assert seen >= 20
    assert options.choices_shown(("a", "b"), False, "Pick.") == ("[a|b]", "Pick.")
    assert options.choices_shown(("a", "b"), True, "Pick.") == ("[a|b],...", "Pick.")
    long = ("first-choice", "second-choice")
    assert options.choices_shown(long, False, "Pick.") == (None, "Pick. [choices: first-choice, second-choice]")
    assert options.choices_shown(long, False, "first-choice or second-choice.") == (
        None, "first-choice or second-choice.")
    assert options.choices_shown((), False, "Any.") == (None, "Any.")


@pytest.mark.parametrize("command", HELP_COMMANDS)
def test_the_examples_at_the_foot_of_a_help_are_commands_the_docs_run(command):
    """Each command's --help ends with examples, and each is a command of the README or docs/, which
    tests/test_documented_commands.py runs as written."""
    from doplus_cli.cli import EXAMPLES
    from doplus_cli.commands import COMMANDS

    examples = COMMANDS[command].examples if command in COMMANDS else EXAMPLES[command]
    documented = {" ".join(text.split()) for page in PAGES for _, text in documented_commands(page)}
    assert examples and [example for example in examples if example not in documented] == []
    foot = " ".join(command_help(command).split("Examples:")[-1].split())
    assert all(example in foot for example in examples)


def test_the_help_takes_the_terminals_width():
    for columns in (80, 132):
        lines = command_help("unlearn", columns).splitlines()
        assert max(len(line) for line in lines) == columns


# Run on a copy of the package with one field added to TrainConfig: what each command then takes, where, with which
# help and default, and what a recipe and a flag set.
ADDED_FIELD_PROBE = """
import json, typer.main
from typer.testing import CliRunner
from doplus_cli import options
from doplus_cli.cli import app
from doplus_cli.commands import COMMANDS
from doplus_cli.config import resolve_config
group = typer.main.get_command(app)
unlearn = {param.name: param for param in group.commands["unlearn"].params}
config = resolve_config(None, {"forget": "f.jsonl", "retain": "r.jsonl", "tracker_notes": "kept"},
                        COMMANDS["unlearn"].config_class)
shown = CliRunner().invoke(app, ["multitask", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"}).output
import importlib.util, sys
spec = importlib.util.spec_from_file_location("options_reference", sys.argv[1])
reference = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reference)
page = [line for line in reference.render().splitlines() if line.startswith("| `--tracker-notes`")]
print(json.dumps({"options": {command: list(names) for command, names in options.COMMAND_OPTIONS.items()},
                  "help": unlearn["tracker_notes"].help, "value": config.tracker_notes,
                  "recorded": config.to_dict()["tracker_notes"], "shown": "--tracker-notes" in shown,
                  "page": page}))
"""


def test_one_field_added_to_trainconfig_is_an_option_of_every_training_command_and_nowhere_else(tmp_path):
    """Adding an option every training command shares is one edit: a TrainConfig field declared with `option(...)`.
    On a copy of the package with that one line added, the flag is an option of unlearn, multitask and align (after
    the field before it, report_to), shows its help and the field's default, sets the config as a recipe key does,
    is an option of no other command, and docs/options.md, regenerated, lists it for the three."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import doplus_cli
    from doplus_cli.commands import COMMANDS

    copy = tmp_path / "doplus_cli"
    shutil.copytree(Path(doplus_cli.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    config = copy / "config.py"
    anchor = "    tracker_project: str | None = None"
    assert config.read_text().count(anchor) == 1
    config.write_text(config.read_text().replace(anchor, '    tracker_notes: str = option("none", "Notes the '
                                                 'trackers keep." + DEFAULT, panel=OUTPUT)\n' + anchor))
    reference = Path(doplus_cli.__file__).parents[1] / "docs" / "options_reference.py"
    result = subprocess.run([sys.executable, "-c", ADDED_FIELD_PROBE, str(reference)], capture_output=True, text=True,
                            timeout=300,
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-2000:]
    probe = json.loads(result.stdout.splitlines()[-1])
    for command, names in probe["options"].items():
        before = list(options.COMMAND_OPTIONS[command])
        if command in COMMANDS:
            assert names.index("tracker_notes") == names.index("report_to") + 1, command
            assert [name for name in names if name != "tracker_notes"] == before, command
        else:
            assert names == before, command
    assert probe["help"] == escape("Notes the trackers keep. [default: none]") and probe["shown"]
    assert probe["value"] == probe["recorded"] == "kept"
    # the docs' options page, regenerated: one row in each training command's logging panel
    assert probe["page"] == ["| `--tracker-notes` | TEXT | Notes the trackers keep. [default: none] |"] * 3


def test_a_commands_own_fields_come_before_the_shared_ones_and_a_field_without_a_flag_stays_out():
    from doplus_cli.commands import COMMANDS

    shared = set(field_options(TrainConfig))
    for name, command in COMMANDS.items():
        names = command.options
        own = [n for n in field_options(command.config_class) if n not in shared and n in names]
        assert own and max(names.index(n) for n in own) < min(names.index(n) for n in shared if n in names), name
        assert not set(command.without_flags) & set(names)


@pytest.mark.parametrize("command", HELP_COMMANDS)
def test_no_option_shows_its_default_twice(command):
    """A default click shows after the help text is not also written in the text's words."""
    group = typer.main.get_command(app)
    for word in command.split():
        group = group.commands[word]
    for param in group.params:
        if getattr(param, "show_default", False) and param.default is not None and not param.is_flag:
            assert "[default:" not in (param.help or ""), (command, param.name, param.help)
