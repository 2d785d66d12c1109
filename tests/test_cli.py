"""The `doplus` command's shell: subcommands, one-line errors, exit codes."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from doplus_cli.cli import main


def test_help_lists_every_subcommand():
    result = subprocess.run([sys.executable, "-m", "doplus_cli", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0
    out = result.stdout
    for name in ("unlearn", "align", "multitask", "evaluate", "bench", "recipes"):
        assert name in out


def test_unknown_option_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "optimizer", "--no-such-option"])
    assert exit_info.value.code == 2
    assert "No such option" in capsys.readouterr().err


def test_console_script_entry_point_runs_as_a_module():
    result = subprocess.run(
        [sys.executable, "-m", "doplus_cli", "unlearn"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().startswith("error:")


def test_each_training_command_takes_the_options_its_table_lists():
    """options.COMMAND_OPTIONS, from which the model card writes its command line, names each training command's
    options with the flags the command parses; the command takes them in the order of its help's panels."""
    import typer.main

    from doplus_cli.cli import app
    from doplus_cli.options import command_flags, in_panels

    for command in ("unlearn", "multitask", "align"):
        parsed = {p.name: (p.opts, p.secondary_opts) for p in typer.main.get_command(app).commands[command].params}
        flags = command_flags(command)
        assert list(parsed.items()) == [(name, flags[name]) for name in in_panels(command)]


def test_a_registered_command_is_a_cli_command_from_its_module_alone(monkeypatch):
    """A new training command is its module's `Command` and its registration: the CLI command, its help and its
    options come from the command object (its `options` names, each declared once on its config field)."""
    import typer
    from typer.testing import CliRunner

    from doplus_cli import cli, options
    from doplus_cli.commands.base import Command
    from doplus_cli.commands.unlearn import UnlearnConfig

    class Toy(Command):
        command, marker, config_class = "toy", "toy_marker", UnlearnConfig
        help = "A toy command that trains nothing."
        options = ("recipe", "model", "lr", "out")

        def from_options(self, values):
            return {**values, "converted": True}

    monkeypatch.setattr(options, "COMMAND_OPTIONS", dict(options.COMMAND_OPTIONS))
    monkeypatch.setattr(options, "COMMAND_CONFIGS", dict(options.COMMAND_CONFIGS))
    monkeypatch.setattr(options, "COMMAND_FIELDS", dict(options.COMMAND_FIELDS))
    options.declare("toy", Toy.config_class, Toy.options)
    with pytest.raises(ValueError, match="declared already"):
        options.declare("toy", Toy.config_class, Toy.options)
    with pytest.raises(ValueError, match="no_such_option"):
        options.declare("toy2", Toy.config_class, ("lr", "no_such_option"))
    handed = []
    monkeypatch.setattr(cli, "_train", lambda command, values: handed.append((command, values)))
    app = typer.Typer()
    app.command("toy")(cli._training_command(Toy()))
    app.command("other")(lambda: None)  # two commands: typer then dispatches by name

    toy = typer.main.get_command(app).commands["toy"]
    assert toy.help == "A toy command that trains nothing."
    params = {p.name: p for p in toy.params}
    assert list(params) == ["recipe", "model", "lr", "out"]  # only the options it names, in its order
    assert params["lr"].opts == ["--lr"]
    assert params["lr"].help.endswith(f"[default: {UnlearnConfig.lr}]")  # the default shown is its config class's

    ran = CliRunner().invoke(app, ["toy", "--lr", "0.5"])
    assert ran.exit_code == 0, ran.output
    assert handed == [("toy", {"recipe": None, "model": None, "lr": 0.5, "out": None, "converted": True})]


def test_more_processes_than_visible_gpus_is_one_line_and_exit_code_2(tiny_llama, tofu_dir, tmp_path, capsys,
                                                                      monkeypatch):
    """Seen on a one-GPU H200: `--num-processes 2` put both workers on the GPU and NCCL stopped them with
    "Duplicate GPU detected" after loading the model. Now the launcher refuses before anything loads."""
    import torch

    from tests.helpers import run_cli, write_sets

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    (tmp_path / "data").mkdir()
    data = write_sets(tofu_dir, tmp_path / "data", 4, 4)
    out = tmp_path / "run"
    code = run_cli("unlearn", "--model", tiny_llama, "--forget", data / "forget.jsonl", "--retain",
                   data / "retain.jsonl", "--steps", 2, "--out", out, "--num-processes", 2)
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: --num-processes 2: this machine shows 1 CUDA device(s) and each process needs its own; "
                   "use --num-processes 1, or run the 2 processes on the CPU with CUDA_VISIBLE_DEVICES=''"), err
    assert not out.exists()  # nothing written


@pytest.mark.parametrize(
    "master_port,launcher_code,worker_codes,expected",
    [
        (None, 0, {}, 0),  # a run that finished
        ("29611", 0, {0: 130, 1: 130}, 130),  # stopped by Ctrl-C: the workers exit 0 and leave 128 + SIGINT
        (None, 0, {1: 2}, 2),  # only worker 1 left a code (a user error it alone met)
        (None, 1, {}, 1),  # torchrun itself failed: its code
    ],
    ids=["finished", "MASTER_PORT, interrupted", "a worker's user error", "launcher failed"],
)
def test_launch_asks_for_a_free_rendezvous_port_unless_the_job_sets_one(tiny_llama, tofu_dir, tmp_path, monkeypatch,
                                                                        capsys, master_port, launcher_code,
                                                                        worker_codes, expected):
    """Seen on an H100 with tests side by side: two launches on accelerate's default port 29500 at once, and the
    second's workers stopped with "address already in use". `--main_process_port 0` makes accelerate pick a free
    one; a job's MASTER_PORT (a cluster script's) is passed on as it is. The launching process exits with the
    code the first worker left (workers exit 0 so that torchrun prints no traceback), else the launcher's."""
    import os
    import signal

    import torch

    from doplus_cli.errors import EXIT_FILE_VARIABLE
    from tests.helpers import run_cli, write_sets

    launched = []

    class Launcher:
        pid = 0

        def __init__(self, command, env, **_):
            launched.append((command, env))

        def wait(self):  # the workers' side: each leaves its code where `errors.worker_exit_code` puts it
            exit_file = launched[-1][1][EXIT_FILE_VARIABLE]
            for rank, code in worker_codes.items():
                with open(f"{exit_file}.rank{rank}", "w") as handle:
                    handle.write(str(code))
            return launcher_code

    monkeypatch.setattr(subprocess, "Popen", Launcher)
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # the launcher's handlers stay out of pytest's process
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    if master_port is None:
        monkeypatch.delenv("MASTER_PORT", raising=False)
    else:
        monkeypatch.setenv("MASTER_PORT", master_port)
    (tmp_path / "data").mkdir()
    data = write_sets(tofu_dir, tmp_path / "data", 4, 4)
    out = tmp_path / "run"
    code = run_cli("unlearn", "--model", tiny_llama, "--forget", data / "forget.jsonl", "--retain",
                   data / "retain.jsonl", "--steps", 2, "--out", out, "--num-processes", 2)
    assert code == expected and len(launched) == 1
    command, env = launched[0]
    assert command[command.index("--main_process_port") + 1] == (master_port or "0")
    assert command[command.index("--num_processes") + 1] == "2" and "--num-processes" not in command
    # observable: the command line said once on stderr; nothing left by the launching process (it held the folder
    # for its workers, which wrote nothing here, so the folder it created is gone); the exit files' folder removed
    err = capsys.readouterr().err
    assert err.count("launching 2 processes: accelerate launch ... -m doplus_cli unlearn --model") == 1
    assert "--num-processes" not in err
    assert not out.exists()
    assert not os.path.exists(os.path.dirname(env[EXIT_FILE_VARIABLE]))


def test_version_prints_doplus_and_the_packages_version(capsys):
    import re
    from pathlib import Path

    from doplus_cli import __version__

    try:
        main(["--version"])
    except SystemExit as done:
        assert done.code in (0, None)
    assert capsys.readouterr().out == f"doplus {__version__}\n"
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1) == __version__


def _every_command(command, path=()):
    """(path, click command) for the app and every command and group under it."""
    yield path, command
    for name, inner in getattr(command, "commands", {}).items():
        yield from _every_command(inner, (*path, name))


def test_h_is_help_on_every_command():
    import typer.main
    from typer.testing import CliRunner

    from doplus_cli.cli import app

    env = {"COLUMNS": "120", "TERM": "dumb", "NO_COLOR": "1"}
    paths = [path for path, _ in _every_command(typer.main.get_command(app))]
    assert ("bench", "schemes") in paths and ("recipes", "list") in paths and ("unlearn",) in paths
    for path in paths:
        short = CliRunner().invoke(app, [*path, "-h"], env=env)
        long = CliRunner().invoke(app, [*path, "--help"], env=env)
        assert short.exit_code == long.exit_code == 0, (path, short.output)
        assert short.output == long.output and re.search(r"│ --help\s+-h\s", long.output), path


def test_evaluates_suite_help_names_every_registered_suite():
    """The --suite help is made from the suite registry, so a new suite (wmdp, muse) is listed without a second
    list to keep."""
    import typer.main

    from doplus_cli.cli import app
    from doplus_cli.evaluation.runner import SUITE_REGISTRY

    evaluate = typer.main.get_command(app).commands["evaluate"]
    (suite,) = [param for param in evaluate.params if param.name == "suites" or "--suite" in param.opts]
    assert suite.help.startswith(SUITE_REGISTRY.listing() + ",")
    assert "wmdp" in suite.help and "muse" in suite.help


def test_unlearns_warmup_help_says_the_authors_cycle_epoch():
    """`doplus unlearn`'s warm-up default is one epoch of the F_f:F_r cycle as the authors count it
    (commands/unlearn.py default_warmup, engine/schedule.authors_epoch_steps), not one pass over the forget set."""
    import typer.main

    from doplus_cli.cli import app
    from doplus_cli.engine.schedule import authors_epoch_steps, authors_warmup

    unlearn = typer.main.get_command(app).commands["unlearn"]
    (warmup,) = [param for param in unlearn.params if "--warmup-steps" in param.opts]
    assert "one pass over the forget set" not in warmup.help
    assert "ceil(forget rows / effective batch) x (F_f + F_r) / F_f" in warmup.help and "at most --steps" in warmup.help
    # the formula the help states, against the code on the paper's setting: 400 forget rows, batch 40, 1:5
    assert authors_warmup(authors_epoch_steps("doplus", 400, 3600, 1, 5, 40)) == -(-400 // 40) * (1 + 5) // 1 == 60
    assert authors_warmup(authors_epoch_steps("joint", 400, 3600, 1, 5, 40)) == 10
