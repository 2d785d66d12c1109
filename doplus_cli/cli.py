"""The `doplus` command: one function per subcommand; each parses, builds a config and calls the engine."""

from __future__ import annotations

import contextlib
import inspect
import os
import shlex
import sys
import tempfile
from typing import Any

import typer
from rich import markup
from rich.console import Console
from rich.text import Text

from doplus_cli import __version__, lifecycle, options
from doplus_cli.bench.schemes import DEFAULT_SCHEMES, DEFAULT_SEEDS
from doplus_cli.commands import COMMANDS, Command, command_named
from doplus_cli.config import list_value, resolve_config
from doplus_cli.errors import EXIT_FILE_VARIABLE, UserError, quiet_worker, worker_exit_code
from doplus_cli.evaluation.runner import SUITE_REGISTRY, resolve_eval_config, run_evaluate
from doplus_cli.evaluation.suite_api import evaluate_defaults

app = typer.Typer(
    name="doplus",
    help="Machine unlearning for LLMs with the DualOptim+ optimizer.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},  # every command's too: click passes it down
)
bench_app = typer.Typer(help="Measure optimizer speed and memory; compare the update schemes end to end.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")
recipes_app = typer.Typer(help="The shipped recipes: list them, copy one (with its data files) to edit and run.",
                          no_args_is_help=True)
app.add_typer(recipes_app, name="recipes")

err_console = Console(stderr=True, highlight=False, soft_wrap=True)
_debug = {"on": False}
_argv: dict[str, list[str]] = {"value": []}  # the arguments main() parsed, for --num-processes relaunching


def _print_version(value: bool) -> None:
    if value:
        print(f"doplus {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks for errors."),
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print doplus's version and exit."),
) -> None:
    _debug["on"] = debug


def _train(command: str, values: dict[str, Any]) -> None:
    """A training command: its options (named as the config's fields) over its command's config (defaults, then the
    recipe, then the flags given), its teaching recipe run, then the command's run and report. With --num-processes N,
    this process relaunches the command on N processes instead. The output folder is held, and SIGTERM and SIGINT
    handled, from here to the end (`lifecycle`): a launch's processes leave the lock to this one."""
    from doplus_cli.engine.loop import default_out_dir
    from doplus_cli.engine.teach import apply_teaching

    recipe, num_processes = values.pop("recipe"), values.pop("num_processes")
    dry_run, gpu_memory = values.pop("dry_run"), values.pop("gpu_memory")
    training = command_named(command)
    config = resolve_config(recipe, values, training.config_class)
    if dry_run:  # every check before the model loads, and the plan: nothing loaded, trained or written
        from doplus_cli.engine.teach import teaching_plan

        teaching = (teaching_plan(config, lambda teach: command_named("multitask").bound(teach).open())
                    if config.teach else None)
        print(training.dry_run(config, num_processes, gpu_memory, teaching))
        return
    launched = "LOCAL_RANK" in os.environ  # a worker of accelerate launch: the engine names and holds the folder
    launching = num_processes is not None and num_processes > 1 and not launched
    if launching:
        _check_devices_for(num_processes)
    with lifecycle.run_guard():
        if not launched:
            config = config.replace(out=config.out or default_out_dir(command))
            lifecycle.hold(config.out, f"doplus {command}")
        lifecycle.stage("teaching the starting model")
        config = apply_teaching(config, err_console)  # before a launch of N processes, so that it runs once
        if launching:
            _relaunch_with_accelerate(num_processes, config.out)
        report = training.run(config, err_console)
    if report:
        training.print_summary(report, Console(highlight=False))


def _training_command(training: Command) -> Any:
    """`doplus NAME` of a registered training command: its options (options.py) as the function's signature, its
    help as its docstring, and the values, as config fields, handed to `_train`."""
    def command(**values: Any) -> None:
        _train(training.command, training.from_options(values))

    command.__name__, command.__doc__ = training.command, training.help
    return options.takes(training.command)(command)


for _training in COMMANDS.values():  # in the order of registration: unlearn, multitask, align
    app.command(_training.command, epilog=options.examples(_training.examples))(_training_command(_training))

# The examples at the foot of the other commands' --help, each one a command the docs run as written.
EXAMPLES: dict[str, tuple[str, ...]] = {
    "evaluate": ("doplus evaluate --split forget10 --data-dir data/tofu",
                 "doplus evaluate --recipe evals/npo.yaml --max-samples 20",
                 "doplus evaluate --compare evals/joint evals/doplus"),
    "bench optimizer": ("doplus bench optimizer --params 50M", "doplus bench optimizer --stability"),
    "bench precision": ("doplus bench precision",),
    "bench schemes": ("doplus bench schemes --recipe recipes/tofu/phi-1.5/npo_gd.yaml --schemes "
                      "alternate,dualoptim,doplus --task-ids 1,2,3,4,5 --out bench/npo",),
    "tune": ("doplus tune --recipe recipes/bench/real_world_mini.yaml --space lr=log:1e-5:1e-3 --objective "
             "retain_rouge --constraint \"forget_rouge<=0.05\" --trials 4 --out tune/real_world_mini",),
}


EVALUATE_DEFAULTS = evaluate_defaults()  # EvalConfig's, shown by click after the help texts


@app.command(epilog=options.examples(EXAMPLES["evaluate"]))
@options.takes("evaluate", EVALUATE_DEFAULTS, context=True, names={"suites": SUITE_REGISTRY.listing()})
def evaluate(**values: Any) -> None:
    """Evaluate a model with the suites of --suite: TOFU/real-world indicators and MU/UFE/TFE/OVR, MUSE, WMDP,
    lm-eval, privacy, safety and XSTest."""
    from doplus_cli.evaluation.report import compare_table

    context, folders, recipe = values.pop("context"), values.pop("folders"), values.pop("recipe")
    if values.pop("compare"):
        if not folders or len(folders) < 2:
            raise UserError("--compare needs at least two evaluation folders: doplus evaluate --compare DIR1 DIR2")
        Console(highlight=False).print(compare_table(folders), markup=False)
        return
    if folders:
        raise UserError(f"unexpected argument '{folders[0]}' (folders are only taken with --compare)")
    from doplus_cli.evaluation.summary import print_summary

    dry_run = values.pop("dry_run")
    values = options.with_recipe(context, recipe, values, options.EVALUATE_PATH_KEYS)
    config = resolve_eval_config(values)
    if dry_run:
        from doplus_cli.evaluation.runner import evaluate_dry_run

        print(evaluate_dry_run(config))
        return
    runner = None
    if config.attacks:  # relearning trains through the engine, which the evaluation layer cannot import
        from doplus_cli.engine.attacks import attack_runner

        runner = attack_runner(err_console)
    record = run_evaluate(config, err_console, runner)
    print_summary(record, Console(highlight=False))


# The benches' defaults, which click shows after each option's help (the options themselves: options.py). A bench's
# --recipe is a YAML file of its options but --json (which says how the result is printed, not what is measured),
# under the flags given (options.with_recipe); bench schemes' --recipe is the recipe of its runs, and required.
BENCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "bench optimizer": {"params": "50M", "dtype": "float32", "device": "auto", "steps": 7, "warmup": 2,
                        "json": False, "seed": 0, "stability": False},
    "bench precision": {"out": "bench/precision", "steps": 20, "lr": 1e-5,
                        "modes": "fp32,bf16-mixed,bf16,bf16-uncompensated", "json": False},
    "bench schemes": {"recipe": ..., "schemes": DEFAULT_SCHEMES, "seeds": DEFAULT_SEEDS, "log_update_similarity": False,
                      "fsdp": False, "keep_checkpoints": False, "remove_final": False, "summarize_from": "final",
                      "list_runs": False, "json": False, "summarize": False, "parallel": 1, "tune_trials": 12},
    "tune": {"recipe": ..., "space": ..., "objective": ..., "trials": 20, "pruner": "median", "seed": 0},
}


@bench_app.command("optimizer", epilog=options.examples(EXAMPLES["bench optimizer"]))
@options.takes("bench optimizer", BENCH_DEFAULTS["bench optimizer"], context=True)
def bench_optimizer(**values: Any) -> None:
    """Step time, state bytes and bandwidth of DualOptim+ against torch AdamW on synthetic parameters."""
    from doplus_cli.bench.optimizer import BenchConfig, print_table, run_optimizer_bench

    context, recipe, as_json = values.pop("context"), values.pop("recipe"), values.pop("json")
    dry_run = values.pop("dry_run")
    given = options.with_recipe(context, recipe, values, ())
    stability, v_floor, seed = given.pop("stability"), given.pop("v_floor"), given["seed"]
    if v_floor is not None and not stability:
        raise UserError("--v-floor sets the floors of --stability's safeguarded rows: add --stability")
    if dry_run:
        from doplus_cli.bench.optimizer import optimizer_dry_run

        print(optimizer_dry_run(BenchConfig.from_cli(**given), stability))
        return
    if stability:
        from doplus_cli.bench.stability import parse_floors, print_stability, stability_rows

        floors = parse_floors(v_floor)
        rows = stability_rows(seed, progress=None if as_json else err_console.print, floors=floors)
        if as_json:
            import json

            sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        else:
            print_stability(rows)
        return

    config = BenchConfig.from_cli(**given)  # params, dtype, device, steps, warmup, only, seed
    result = run_optimizer_bench(config, progress=not as_json)
    if as_json:
        import json

        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        print_table(result)


@bench_app.command("precision", epilog=options.examples(EXAMPLES["bench precision"]))
@options.takes("bench precision", BENCH_DEFAULTS["bench precision"], context=True)
def bench_precision(**values: Any) -> None:
    """Each --precision (and bf16 without compensation) on the same short unlearning run: weight elements
    changed, distance travelled against fp32, bytes per parameter, step time."""
    from doplus_cli.bench.precision import MODES, print_table, run_precision_bench

    context, recipe, as_json = values.pop("context"), values.pop("recipe"), values.pop("json")
    dry_run = values.pop("dry_run")
    given = options.with_recipe(context, recipe, values, ("model",))  # a model folder: next to the recipe first
    model, out, steps, lr, modes = (given[name] for name in ("model", "out", "steps", "lr", "modes"))
    chosen = list_value(modes, str, False, "--modes")
    unknown = [m for m in chosen if m not in MODES]
    if unknown or not chosen:
        raise UserError(f"--modes {modes}: choose from {', '.join(MODES)}")
    if dry_run:
        from doplus_cli.bench.precision import precision_dry_run

        print(precision_dry_run(model, out, steps, lr, chosen))
        return
    _quiet_libraries()
    result = run_precision_bench(model, out, steps, lr, chosen, say=lambda line: err_console.print(Text(line)))
    if as_json:
        import json

        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        print_table(result, Console(highlight=False, width=None if sys.stdout.isatty() else 200))


@bench_app.command("schemes", epilog=options.examples(EXAMPLES["bench schemes"]))
@options.takes("bench schemes", BENCH_DEFAULTS["bench schemes"])
def bench_schemes(**values: Any) -> None:
    """Every scheme x seed on one recipe as ordinary runs, evaluated; mean ± std tables and plots."""
    from doplus_cli.bench.schemes import (
        array_syntax,
        list_grid,
        listing,
        parse_states,
        plan,
        print_listing,
        print_summary,
        run_schemes_bench,
    )

    (recipe, schemes, seeds, task_ids, out, set_options, sweep, log_update_similarity, num_processes, fsdp,
     keep_checkpoints, remove_final, summarize_from, list_runs, as_json, indexes, run_index, summarize, parallel,
     tune_space, tune_trials, tune_objective, tune_constraint, tune_task, dry_run) = (
        values[name] for name in options.COMMAND_OPTIONS["bench schemes"])
    tuned = None
    if tune_space:
        _bench_tune_only_alone(list_runs, run_index, summarize)
        from doplus_cli.tune import scheme_studies, tune_schemes

        studies = scheme_studies(recipe, schemes, out, list(set_options or []), list(tune_space), tune_trials,
                                 tune_objective, list(tune_constraint or []), tune_task, task_ids)
        placeholder = {scheme: {p.key: p.low if p.kind != "choice" else p.choices[0] for p in study.space}
                       for scheme, study in studies}  # the grid checked at the space's low values first
        plan(recipe, schemes, seeds, out, list(set_options or []), sweep, log_update_similarity, task_ids,
             summarize_from, (placeholder, ""))
        if dry_run:
            from doplus_cli.tune import tune_dry_run

            for _, study in studies:
                print(tune_dry_run(study))
        else:
            tuned = tune_schemes(studies, tune_task, say=lambda line: err_console.print(Text(line)))
    elif any(v for v in (tune_objective, tune_constraint, tune_task)):
        raise UserError("--tune-objective, --tune-constraint and --tune-task go with --tune")
    modes = [flag for flag, given in (("--list-runs", list_runs), ("--run-index", run_index is not None),
                                      ("--summarize", summarize)) if given]
    if len(modes) > 1:
        raise UserError(f"{' and '.join(modes)}: give one of them")
    if (as_json or indexes is not None) and not list_runs:
        raise UserError(f"{'--json' if as_json else '--indexes'} goes with --list-runs")
    if parallel > 1:
        alone = [flag for flag, given in (("--list-runs", list_runs), ("--run-index", run_index is not None),
                                          ("--summarize", summarize),
                                          ("--num-processes", (num_processes or 1) > 1)) if given]
        if alone:
            raise UserError(f"--parallel {parallel} runs several of the grid's runs at once, each in one process; "
                            f"{alone[0]} does not go with it")
    # Without a terminal (a batch job's log) rich would fold the tables into 80 columns.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    if dry_run:
        from doplus_cli.bench.schemes import schemes_dry_run

        bench = plan(recipe, schemes, seeds, out, list(set_options or []), sweep, log_update_similarity, task_ids,
                     summarize_from, (placeholder, "") if tune_space else None)
        if run_index is not None:
            from doplus_cli.bench.schemes.grid import check_run_index

            check_run_index(bench, run_index)
        print(schemes_dry_run(bench, num_processes, fsdp, keep_checkpoints, parallel, remove_final))
        return
    if list_runs:
        states_wanted = parse_states(indexes) if indexes is not None else None
        bench = plan(recipe, schemes, seeds, out, list(set_options or []), sweep, log_update_similarity, task_ids,
                     summarize_from)
        states = list_grid(bench)
        if states_wanted is not None:
            chosen = array_syntax([s.index for s in states if s.state in states_wanted])
            sys.stdout.write(chosen + "\n" if chosen else "")
        elif as_json:
            import json

            sys.stdout.write(json.dumps(listing(bench, states), indent=2) + "\n")
        else:
            given = [a for a in _argv["value"] if a != "--list-runs"]
            print_listing(bench, states, "doplus " + shlex.join(given), console)
        return
    with lifecycle.run_guard():  # the bench holds its folder (bench/schemes/), each run its own
        summary = run_schemes_bench(recipe, schemes, seeds, out, list(set_options or []), sweep,
                                    log_update_similarity, num_processes, fsdp,
                                    say=lambda line: err_console.print(Text(line)), task_ids=task_ids,
                                    keep_checkpoints=keep_checkpoints, summarize_from=summarize_from,
                                    run_index=run_index, summarize=summarize, tuned=tuned, parallel=parallel,
                                    remove_final=remove_final)
    if summary is not None:
        print_summary(summary, console)


@app.command("tune", epilog=options.examples(EXAMPLES["tune"]))
@options.takes("tune", BENCH_DEFAULTS["tune"])
def tune(**values: Any) -> None:
    """Search recipe options with Optuna (TPE, pruning) for the best objective under constraints; each trial an
    ordinary run; best.yaml and a report at the end (docs/tune.md; needs pip install 'doplus-cli[tune]')."""
    from doplus_cli.tune import plan, run_tune, tune_dry_run

    (recipe, space, objective, constraint, trials, out, set_options, pruner, storage, seed, dry_run) = (
        values[name] for name in options.COMMAND_OPTIONS["tune"])
    study = plan(recipe, list(space or []), objective, list(constraint or []), trials, out, list(set_options or []),
                 pruner, storage, seed)
    if dry_run:
        print(tune_dry_run(study))
        return
    summary = run_tune(study, say=lambda line: err_console.print(Text(line)))
    best = summary["best"]
    if best is None:
        print(f"no feasible complete trial; the trials: {study.out / 'TUNE.md'}")
        return
    print(f"best trial {best['number']:04d}: {study.objective.metric} = {best['value']:.6g} with "
          + ", ".join(f"{k}={v}" for k, v in best["params"].items()))
    print(f"recipe: {best['recipe']}; report: {study.out / 'TUNE.md'}")


def _bench_tune_only_alone(list_runs: bool, run_index: int | None, summarize: bool) -> None:
    """--tune runs its studies before the grid, in this process: the grid's job-array modes take a grid whose
    values are known."""
    modes = [flag for flag, given in (("--list-runs", list_runs), ("--run-index", run_index is not None),
                                      ("--summarize", summarize)) if given]
    if modes:
        raise UserError(f"--tune and {modes[0]}: --tune runs each scheme's study, then the grid, in one process; "
                        "tune a grid for a job array with doplus tune --set scheme=... per scheme, then --set the "
                        "values found")


def _quiet_libraries() -> None:
    """Keep library chatter out of the run's output: weight-loading progress bars, bitsandbytes' notice
    about an optional CPU kernel package. Warnings that matter still show."""
    import logging
    import os

    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass


def _check_devices_for(num_processes: int) -> None:
    """N processes on a machine that shows CUDA need N GPUs: the workers would share one, and NCCL stops them
    with "Duplicate GPU detected" after the model has loaded. Without CUDA they are CPU processes (gloo)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if 0 < gpus < num_processes:
        raise UserError(
            f"--num-processes {num_processes}: this machine shows {gpus} CUDA device(s) and each process needs "
            f"its own; use --num-processes {gpus}, or run the {num_processes} processes on the CPU with "
            "CUDA_VISIBLE_DEVICES=''"
        )


def _relaunch_with_accelerate(num_processes: int, out: str) -> None:
    """`doplus unlearn --num-processes N ...` = `accelerate launch --num_processes N -m doplus_cli unlearn ...`.

    accelerate's multi-process launcher (torchrun underneath) is used on CPU too: without CUDA the engine asks
    accelerate for CPU processes, which then form a gloo group. `out`: the folder this process named and holds,
    passed on to the workers.
    """
    import signal
    import subprocess

    args, skip = [], False
    for arg in _argv["value"]:
        if skip:
            skip = False
            continue
        if arg == "--num-processes":
            skip = True
            continue
        if arg.startswith("--num-processes="):
            continue
        args.append(arg)
    if not any(a == "--out" or a.startswith("--out=") for a in args):
        args += ["--out", out]
    # The rendezvous port: MASTER_PORT where the job sets one, else a free port that accelerate picks (0). Its
    # default, 29500, fails with "address already in use" when two runs start together on one node.
    port = os.environ.get("MASTER_PORT") or "0"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
               str(num_processes), "--num_machines", "1", "--main_process_port", port, "--mixed_precision", "no",
               "--dynamo_backend", "no", "-m", "doplus_cli", *args]
    err_console.print(Text(f"launching {num_processes} processes: accelerate launch ... -m doplus_cli "
                           + " ".join(args)))
    with tempfile.TemporaryDirectory(prefix="doplus-launch-") as folder:
        exit_file = os.path.join(folder, "exit")
        launched: list[subprocess.Popen] = []

        def forward(received, _frame) -> None:
            """SIGTERM/SIGINT go to the workers, not to torchrun (which would answer with a traceback): they
            finish the step, write a checkpoint and exit 0, leaving 128 + signal for this process. Installed
            before the launch, so that no signal ends this process while its workers go on."""
            import psutil

            for process in launched:
                for worker in psutil.Process(process.pid).children(recursive=True):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        worker.send_signal(received)

        for number in (signal.SIGTERM, signal.SIGINT):  # a preempted job's signal reaches every process
            signal.signal(number, forward)
        # In a process session of its own (start_new_session): Ctrl-C in the terminal reaches this process only,
        # which hands it to the workers.
        process = subprocess.Popen(command, env={**os.environ, EXIT_FILE_VARIABLE: exit_file}, start_new_session=True)
        launched.append(process)
        code = process.wait()
        left = {int(name.rsplit("rank", 1)[1]): int(open(os.path.join(folder, name)).read() or 1)
                for name in os.listdir(folder) if name.startswith("exit.rank")}
        if left:  # a user error, a stop by signal: the first worker's code (it printed the line)
            code = left.get(0, max(left.values()))
    sys.exit(code)


def _resume_defaults_to_latest(argv: list[str]) -> list[str]:
    """`--resume` without a value (last, or followed by another option) means `--resume latest`; `doplus evaluate
    --resume` is a switch."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command == "evaluate":
        return argv
    result = []
    for i, arg in enumerate(argv):
        result.append(arg)
        if arg == "--resume" and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            result.append("latest")
    return result


@recipes_app.command("list")
def recipes_list() -> None:
    """Every shipped recipe: its name (for `doplus recipes copy`), the command it is for, whether it runs with
    what doplus ships or which data sets it needs (docs/data-sets.md says how to fetch each), its description."""
    from doplus_cli.recipes import list_recipes, recipes_root

    recipes = list_recipes()
    data = {recipe.name: "needs " + ", ".join(recipe.needs) if recipe.needs
            else "-" if recipe.command not in COMMANDS else "ships with doplus" for recipe in recipes}
    console = Console(highlight=False)
    if console.is_terminal:
        from rich.table import Table

        table = Table(title=f"recipes in {recipes_root()}", title_justify="left")
        table.add_column("name", no_wrap=True)
        table.add_column("command", no_wrap=True)
        table.add_column("data")
        table.add_column("description")
        for recipe in recipes:
            table.add_row(recipe.name, recipe.command, data[recipe.name], recipe.description)
        console.print(table)
        return
    # no terminal (a batch log, a pipe): one plain line per recipe, nothing wrapped
    name_width = max(len(r.name) for r in recipes)
    command_width = max(len(r.command) for r in recipes)
    data_width = max(len(text) for text in data.values())
    print(f"recipes in {recipes_root()}")
    print(f"{'name':<{name_width}}  {'command':<{command_width}}  {'data':<{data_width}}  description")
    for recipe in recipes:
        print(f"{recipe.name:<{name_width}}  {recipe.command:<{command_width}}  {data[recipe.name]:<{data_width}}  "
              f"{recipe.description}")


@recipes_app.command("copy")
def recipes_copy(
    name: str = typer.Argument(..., help="A recipe's name as `doplus recipes list` shows it (quickstart, "
                               "tofu/phi-1.5/idk_gd, bench/mini_tofu)."),
    dest: str = typer.Argument(..., help="A folder to copy the recipe into (an existing folder, a path ending in /, "
                               "or a new path without .yaml: created), or a .yaml file to write."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace files that exist at DEST."),
) -> None:
    """Copy a recipe with the data files and teaching recipe it names that ship with doplus; list the files it
    names that do not ship (TOFU, the safety sets, TRACE), which you provide."""
    from doplus_cli.recipes import copy_recipe

    result = copy_recipe(name, dest, overwrite=overwrite)
    for path in result.copied:
        print(f"wrote {path}")
    for line in result.missing:
        print(f"not copied: {line}")
    if result.command in ("unlearn", "multitask", "align"):
        print(f"run it with: doplus {result.command} --recipe {result.recipe}")


def _one_line_help(group: typer.Typer) -> None:
    """Each command's help as rich shows it: its docstring's paragraphs unwrapped (rich keeps a docstring's line
    breaks in the commands' list) and its markup escaped (`pip install 'doplus-cli[tune]'` is no rich tag)."""
    for info in group.registered_commands:
        text = info.help or inspect.getdoc(info.callback) or ""
        info.help = "\n\n".join(markup.escape(" ".join(part.split())) for part in text.split("\n\n"))
    for sub in group.registered_groups:
        _one_line_help(sub.typer_instance)


_one_line_help(app)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: every user error is one line on stderr and exit code 2.

    Usage errors (unknown option, bad value) come from click; they are printed as one line too, with a
    pointer to `--help`. `--debug` re-raises instead, with the full traceback.
    """
    _quiet_libraries()
    argv = _resume_defaults_to_latest(list(sys.argv[1:] if argv is None else argv))
    _argv["value"] = argv
    try:
        code = app(args=argv, standalone_mode=False)
    except _click_error_type() as error:
        if type(error).__name__ == "NoArgsIsHelpError":  # a group called alone: its help, as click prints it
            error.show()
            sys.exit(error.exit_code)
        if _debug["on"]:
            raise
        command = error.ctx.command_path if getattr(error, "ctx", None) is not None else "doplus"
        err_console.print(
            Text("error: ", style="bold red") + Text(f"{error.format_message()} (see `{command} --help`)")
        )
        sys.exit(getattr(error, "exit_code", 2))
    except (UserError, lifecycle.Stopped) as error:
        if _debug["on"] and not isinstance(error, lifecycle.Stopped):
            raise
        if not quiet_worker():  # a stopped run's line ends with the command, these arguments, that continues it
            line = error.continued(argv) if isinstance(error, lifecycle.Resumable) else str(error)
            err_console.print(Text("error: ", style="bold red") + Text(line))
        sys.exit(worker_exit_code(error.exit_code))
    except OSError as error:  # a place no check named before (an unwritable --out's parent, say): still one line
        if _debug["on"] or not error.filename:
            raise
        if not quiet_worker():
            err_console.print(Text("error: ", style="bold red") + Text(f"{error.filename}: {error.strerror}"))
        sys.exit(worker_exit_code(2))
    _leave_process_group()
    if isinstance(code, int) and code != 0:
        sys.exit(code)


def _click_error_type() -> type[Exception]:
    """click's `ClickException`, the base of every usage error it raises, found from typer's public `BadParameter`
    (one of them): typer before 0.26 runs on the click package, 0.26 and later on a copy of click it carries
    inside and does not export. `NoArgsIsHelpError` is told by its name, as typer's own error printer does."""
    return next(kind for kind in typer.BadParameter.__mro__ if kind.__name__ == "ClickException")


def _leave_process_group() -> None:
    """After a command that ran as one of several processes and finished: destroy the process group, as PyTorch
    asks (without it NCCL warns at exit, and a rank can abort in interpreter finalization while gloo's worker
    threads still hold tensors, pytorch/pytorch#179291). A failed process exits without it: torchrun stops the
    others, and a destroy that waits on a dead peer could hang."""
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
