"""The `doplus` command: one function per subcommand; each parses, builds a config and calls the engine."""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.text import Text

from doplus_cli.errors import UserError

app = typer.Typer(
    name="doplus",
    help="Machine unlearning for LLMs with the DualOptim+ optimizer.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(help="Measure optimizer and end-to-end speed and memory.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")

err_console = Console(stderr=True, highlight=False, soft_wrap=True)
_debug = {"on": False}


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks for errors."),
) -> None:
    _debug["on"] = debug


def _not_built(name: str, issue: int) -> None:
    raise UserError(f"`doplus {name}` is not built yet (tracked in issue #{issue}).")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def unlearn() -> None:
    """Unlearn a forget set while keeping a retain set (not built yet)."""
    _not_built("unlearn", 3)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def align() -> None:
    """Safety alignment as targeted unlearning (not built yet)."""
    _not_built("align", 3)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def multitask() -> None:
    """Multi-task training with one base state and N delta states (not built yet)."""
    _not_built("multitask", 3)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def evaluate() -> None:
    """Evaluate a model with the paper's metrics (not built yet)."""
    _not_built("evaluate", 4)


@bench_app.command("optimizer")
def bench_optimizer(
    params: str = typer.Option("50M", "--params", help="Synthetic parameter count: 50M, 1.5G, 200k, 123456."),
    dtype: str = typer.Option("float32", "--dtype", help="Parameter dtype: float32 or bfloat16."),
    device: str = typer.Option("auto", "--device", help="auto (cuda if available), cpu or cuda."),
    steps: int = typer.Option(7, "--steps", min=5, help="Timed steps per optimizer (median is reported)."),
    warmup: int = typer.Option(2, "--warmup", min=1, help="Untimed steps first (compilation happens here)."),
    only: str | None = typer.Option(
        None, "--only", help="Comma-separated subset of rows, e.g. adamw,doplus,doplus-8bit."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout instead of a table."),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Step time, state bytes and bandwidth of DualOptim+ against torch AdamW on synthetic parameters."""
    from doplus_cli.bench.optimizer import BenchConfig, print_table, run_optimizer_bench

    config = BenchConfig.from_cli(
        params=params, dtype=dtype, device=device, steps=steps, warmup=warmup, only=only, seed=seed
    )
    result = run_optimizer_bench(config, progress=not as_json)
    if as_json:
        import json

        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        print_table(result)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: user errors become one line on stderr and exit code 2.

    Usage errors (unknown option, bad value) are click's: also one line and exit code 2.
    """
    try:
        app(args=argv)
    except SystemExit as done:  # click ends every run with sys.exit; success returns normally instead
        if done.code not in (0, None):
            raise
    except UserError as error:
        if _debug["on"]:
            raise
        err_console.print(Text("error: ", style="bold red") + Text(str(error)))
        sys.exit(error.exit_code)
