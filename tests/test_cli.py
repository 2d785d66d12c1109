"""The `doplus` command's shell: subcommands, one-line errors, exit codes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from doplus_cli.cli import main


def test_help_lists_every_subcommand():
    result = subprocess.run([sys.executable, "-m", "doplus_cli", "--help"], capture_output=True, text=True)
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
    options with the flags the command parses, in the order of its help."""
    import typer.main

    from doplus_cli.cli import app
    from doplus_cli.options import command_flags

    for command in ("unlearn", "multitask", "align"):
        parsed = {p.name: (p.opts, p.secondary_opts) for p in typer.main.get_command(app).commands[command].params}
        assert list(parsed.items()) == list(command_flags(command).items())
