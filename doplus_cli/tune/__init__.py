"""`doplus tune`: a budgeted hyper-parameter search over any recipe option, each trial an ordinary doplus run.

    doplus tune --recipe R.yaml --space lr=log:1e-5:1e-3 --objective OVR --constraint "MU>=0.9*start" \\
        --trials 24 --out tune/R

The study is Optuna's: a TPE sampler (seeded by --seed), a pruner that stops a trial whose evaluations during
training fall behind those of the trials before it at the same step (median, hyperband or none), and a storage that many
workers share (a journal file by default; a database URL with --storage). Each trial is the recipe with the
trial's values, run by the recipe's command (`doplus unlearn`, `multitask` or `align`) as a subprocess and scored
as `bench schemes` scores a run (its command's bench adapter). The folder:

    DIR/tune.json          the study's settings (recipe values, --set, space, objective, constraints, pruner,
                           budget); a later command into DIR must give the same
    DIR/study.journal      Optuna's journal (without --storage): every trial, its values, state and scores
    DIR/recipes/NNNN.yaml  trial NNNN's recipe: the given one (paths absolute), --set, the trial's values
    DIR/trials/NNNN/       the run (config.yaml, metrics.jsonl, report.json, final/, evals/, its evaluation)
    DIR/trials/NNNN.log    its output and its evaluation's, appended at every start
    DIR/start/             the starting model's evaluation, for a constraint relative to it (`*start`)
    DIR/best.yaml          the best feasible trial's recipe: `doplus COMMAND --recipe DIR/best.yaml` runs it again
    DIR/TUNE.json, TUNE.md the trials, the best trial's metrics and model card, the parameters' importances;
    DIR/objective.png      the objective against each parameter

--trials is the study's budget, shared by every worker on its storage: a worker stops when the study holds that
many finished trials (complete, pruned or failed). The same command again continues the study, after a kill too:
a trial whose worker is gone is ended as interrupted and its values run again (package layout: space.py the
search space, goal.py the objective and constraints, study.py Optuna, trials.py one trial, report.py the outputs).
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from doplus_cli.bench.adapters import BenchAdapter, adapter_of
from doplus_cli.bench.schemes.planning import absolute_paths, config_of, differences, plain, split_pair
from doplus_cli.bench.schemes.running import Signals, Stopped, remove_output
from doplus_cli.config import (
    EXCLUSIVE_OPTIONS,
    TrainConfig,
    coerce_option,
    field_names,
    load_recipe,
    read_recipe,
    recipe_form,
    recorded,
)
from doplus_cli.errors import RunError, UserError
from doplus_cli.files import atomic_write_text
from doplus_cli.lifecycle import folder_entries, holding, in_use, run_guard, shared_turn
from doplus_cli.tune import study as studies
from doplus_cli.tune.goal import Constraint, Objective, parse_constraints, parse_objective
from doplus_cli.tune.space import TUNE_KEYS, Param, parse_space
from doplus_cli.tune.trials import (
    Outcome,
    Pruned,
    TrialStopped,
    evaluate_start,
    run_trial,
    trial_name,
    write_recipe,
)

SETTINGS = "tune.json"
GROWS = ("trials",)  # a study's settings that a later command may change: a budget raised extends the study
FAILURES_IN_A_ROW = 3  # a worker whose trials fail this many times in a row stops (the cause is rarely the values)
# Suites whose starting model `doplus evaluate` scores: a constraint relative to the starting model needs one.
START_SUITES = ("tofu", "muse", "wmdp")


@dataclass
class Tune:
    """One `doplus tune` command: the recipe, the space, the goal and the budget, checked."""

    recipe: Path
    adapter: BenchAdapter
    base: dict[str, Any]  # the recipe's values, paths absolute
    set_values: dict[str, Any]
    space: list[Param]
    objective: Objective
    constraints: list[Constraint]
    trials: int
    out: Path
    pruner: str
    storage: str | None
    seed: int
    steps: int  # the recipe's planned steps (the pruner's last step)
    eval_every: int | None

    @property
    def startup_trials(self) -> int:
        """Trials drawn at random before TPE models the space, and run before the median pruner stops any."""
        return max(2, min(10, self.trials // 4))

    @property
    def needs_start(self) -> bool:
        return any(c.relative for c in self.constraints)

    def settings(self) -> dict[str, Any]:
        """What tune.json records; a later command into the same folder must give the same."""
        return json.loads(json.dumps({
            "kind": self.adapter.command, "recipe": plain(self.base), "set": plain(self.set_values),
            "space": {p.key: p.plain() for p in self.space}, "objective": self.objective.metric,
            "direction": self.objective.direction, "constraints": [c.text() for c in self.constraints],
            "pruner": self.pruner, "trials": self.trials, "seed": self.seed}, default=str))

    def trial_values(self, params: dict[str, Any]) -> dict[str, Any]:
        """A trial's recipe: the recipe < --set < the trial's values, with no checkpoints along the way unless --set
        or the space gives `save_every` or `save_minutes`: a trial never resumes (an interrupted one runs again from
        its start), and a DualOptim+ checkpoint holds the weights and five optimizer states."""
        chosen = {**self.set_values, **params}
        values = {**copy.deepcopy(self.base), **chosen}
        for first, second in EXCLUSIVE_OPTIONS:  # steps or epochs: the one given over the recipe's stands
            for given, other in ((first, second), (second, first)):
                if given in chosen and other in values and other not in chosen:
                    del values[other]
        for key in ("save_every", "save_minutes"):  # the recipe's checkpoints are for resuming its run, which a
            if key not in chosen:                # trial never does
                values[key] = 0
        return plain(values)

    def trial_config(self, values: dict[str, Any], checked: bool = True) -> TrainConfig:
        sources = {key: str(self.recipe) for key in self.base}
        sources.update({key: f"--set {key}" for key in self.set_values})
        sources.update({p.key: f"--space {p.key}" for p in self.space})
        config = config_of(self.adapter, values, sources)
        if checked:
            copy.deepcopy(config).validate()
        return config


def plan(recipe: str, space: list[str], objective: str, constraints: list[str], trials: int, out: str | None,
         set_options: list[str], pruner: str, storage: str | None, seed: int) -> Tune:
    """Every check on the command, the recipe, the space and the goal; nothing is written."""
    path = Path(recipe).expanduser().resolve()
    raw = read_recipe(path)
    set_pairs = [(key.replace("-", "_"), value) for key, value in (split_pair(text, "--set") for text in set_options)]
    given = {str(k).replace("-", "_") for k in raw} | {k for k, _ in set_pairs}
    adapter = adapter_of(path, given)
    names = field_names(adapter.config_class)
    base = absolute_paths(load_recipe(path, adapter.config_class))
    for key in TUNE_KEYS:
        base.pop(key, None)
    set_values: dict[str, Any] = {}
    for key, text in set_pairs:
        if key not in names:
            raise UserError(f"--set {key}: unknown option '{key}'")
        if key in TUNE_KEYS:
            raise UserError(f"--set {key}: doplus tune sets {key} itself")
        value = recipe_form(key, coerce_option(key, None if text.lower() in ("null", "~") else text,
                                               f"--set {key}", adapter.config_class), adapter.config_class)
        set_values[key] = absolute_paths({key: value})[key]
    params = parse_space(space, adapter.config_class, fixed=set(set_values))
    if pruner not in studies.PRUNERS:
        raise UserError(f"--pruner {pruner}: choose from {', '.join(studies.PRUNERS)}")
    studies.check_storage(storage)
    if trials < 1:
        raise UserError("--trials must be at least 1")
    tune = Tune(path, adapter, base, set_values, params, Objective("", True), [], trials,
                Path(out or Path("tune") / path.stem).expanduser().resolve(), pruner, storage, seed, 0, None)
    corners = [{p.key: _low(p) for p in params}, {p.key: _high(p) for p in params}]
    corners += [{**corners[0], p.key: choice} for p in params if p.kind == "choice" for choice in p.choices[1:]]
    configs = [tune.trial_config(tune.trial_values(corner)) for corner in corners]  # each validated
    config = configs[0]
    adapter.check_evaluation(given | {p.key for p in params}, config, path)
    suite = str(recorded(getattr(config, "eval_suite", None)) or adapter.command)
    metrics = {m.key: m.higher_is_better for m in adapter.metric_list(config)}
    tune.objective = parse_objective(objective, metrics, suite)
    tune.constraints = parse_constraints(constraints, metrics, suite)
    if tune.needs_start and (adapter.command != "unlearn" or suite not in START_SUITES):
        raise UserError(f"--constraint {next(c.text() for c in tune.constraints if c.relative)}: a bound relative to "
                        f"the starting model needs a suite doplus evaluate scores it by ({', '.join(START_SUITES)} "
                        f"of an unlearn recipe); this recipe's is {suite}: give the bound as a number")
    tune.steps = adapter.planned_steps(config)
    tune.eval_every = getattr(config, "eval_every", None)
    return tune


def _low(param: Param) -> Any:
    return param.choices[0] if param.kind == "choice" else param.low


def _high(param: Param) -> Any:
    return param.choices[-1] if param.kind == "choice" else param.high


# ---- DIR ------------------------------------------------------------------------------------------------------


def check_out(tune: Tune) -> bool:
    """Whether DIR holds this study already; one line for a DIR that holds another study or something else."""
    settings = tune.out / SETTINGS
    if settings.is_file():
        try:
            saved = json.loads(settings.read_text())
        except ValueError:
            raise UserError(f"{settings}: not a doplus tune settings file (unreadable JSON)") from None
        changed = differences({k: v for k, v in saved.items() if k not in GROWS},
                              {k: v for k, v in tune.settings().items() if k not in GROWS})
        if changed:
            raise UserError(f"{tune.out}: holds a study with other settings ({'; '.join(changed[:3])}"
                            f"{'; ...' if len(changed) > 3 else ''}); use another --out")
        return True
    if tune.out.exists() and not tune.out.is_dir():
        raise UserError(f"{tune.out}: --out is a file, not a folder")
    if tune.out.is_dir() and folder_entries(tune.out):
        raise UserError(f"{tune.out}: not empty and not a doplus tune folder (no {SETTINGS}); use another --out")
    return False


def tune_dry_run(tune: Tune) -> str:
    """`doplus tune --dry-run`: the checks `plan` made, the folder's, and those the first trial's run makes before
    its model loads (its data, the fields its loss and evaluation need, the model); nothing run or written."""
    from doplus_cli.commands import command_named
    from doplus_cli.engine.teach import teaching_plan
    from doplus_cli.models import check_model

    exists = check_out(tune) if tune.out.exists() else False
    first = tune.trial_config(tune.trial_values({p.key: _low(p) for p in tune.space}))
    model, teaching = first.model, None
    if first.teach:
        teaching, model = teaching_plan(first, lambda teach: command_named("multitask").bound(teach).open())
    command_named(tune.adapter.command).bound(first).open()
    lines = ["doplus tune --dry-run: every check made before a trial starts passed; nothing was run or written",
             f"study: {tune.trials} trials of doplus {tune.adapter.command} into {tune.out}"
             + (" (continues the study there)" if exists else "")
             + f"; storage: {studies.check_storage(tune.storage)}; pruner: {tune.pruner}",
             f"objective: {tune.objective.describe()}"
             + (f" subject to {', '.join(c.text() for c in tune.constraints)}" if tune.constraints else ""),
             "space: " + "; ".join(p.describe() for p in tune.space),
             *([f"teaching stage: {teaching}"] if teaching else []),
             f"model: {check_model(model)[0]}", f"data: checked ({tune.steps} steps a trial)"]
    if tune.pruner != "none" and not tune.eval_every:
        lines.append("note: " + _no_pruning(tune))
    return "\n".join(lines)


def _no_pruning(tune: Tune) -> str:
    return (f"the recipe evaluates only at its end (no eval_every), so the {tune.pruner} pruner has nothing to compare "
            "and every trial runs to its end")


# ---- the study ------------------------------------------------------------------------------------------------


def run_tune(tune: Tune, say: Callable[[str], None]) -> dict[str, Any]:
    """Fill the study to --trials finished trials (with any other workers on its storage), then write the outputs
    from every trial in it; return TUNE.json."""
    from doplus_cli.tune.report import write_outputs

    studies.require_optuna()
    check_out(tune)  # before the turn's lock file goes into a folder that may not be a study's
    with run_guard():
        with shared_turn(tune.out):
            check_out(tune)  # again in the turn: another worker may have started a study here meanwhile
            atomic_write_text(tune.out / SETTINGS, json.dumps(tune.settings(), indent=2) + "\n")  # its budget now
            study = studies.open_study(tune, 0)
            worker = studies.join(study)
        if worker:
            study = studies.open_study(tune, worker)
        if tune.pruner != "none" and not tune.eval_every:
            say("note: " + _no_pruning(tune))
        Worker(tune, study, say).run()
        with shared_turn(tune.out):
            summary = write_outputs(tune, study)
    return summary


class Worker:
    """Asks for trials in its turn of DIR and runs them one at a time until the study holds --trials."""

    def __init__(self, tune: Tune, study: Any, say: Callable[[str], None]) -> None:
        self.tune, self.study, self.say = tune, study, say
        self.signals = Signals()
        self.start: dict[str, Any] | None = None

    def run(self) -> None:
        failures = 0
        with self.signals:
            while True:
                stack = ExitStack()
                with shared_turn(self.tune.out):
                    self.recover()
                    count = studies.counts(self.study)
                    if count["done"] + count["running"] >= self.tune.trials:
                        stack.close()
                        break
                    trial = self.study.ask()
                    name = trial_name(trial.number)
                    stack.enter_context(holding(self.tune.out / "trials" / name, f"doplus tune, trial {name}"))
                with stack:
                    failed = self.run_one(trial, count["done"] + 1)
                failures = failures + 1 if failed else 0
                if failures >= FAILURES_IN_A_ROW:
                    raise RunError(f"{failures} trials in a row failed (the last: {failed}); the study is kept: fix "
                                   "the cause and run the same command again")

    def recover(self) -> None:
        """End the trials left running by a worker that is gone (their folder held by no process) as interrupted,
        their values queued to run again."""
        from optuna.trial import TrialState

        for trial in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            name = trial_name(trial.number)
            if in_use(self.tune.out / "trials" / name) is None:
                studies.end_interrupted(self.study, trial.number, trial.params)
                self.say(f"trial {name} was left running by a worker that is gone: ended as interrupted, its values "
                         "queued to run again")

    def run_one(self, trial: Any, place: int) -> str | None:
        """Run one trial and tell the study how it ended; the error line when it failed, else None."""
        params = {p.key: p.suggest(trial) for p in self.tune.space}
        values = self.tune.trial_values(params)
        write_recipe(self.tune, trial.number, values)
        name = trial_name(trial.number)
        log = self.tune.out / "trials" / f"{name}.log"
        retry = trial.user_attrs.get("retry_of")
        self._say(name, f"[{place}/{self.tune.trials}] {_shown(params)} started"
                  + (f" (again: trial {trial_name(retry)} was interrupted)" if retry is not None else "")
                  + f" (log: {log})")
        error = self.run_and_tell(trial, name, values, log)
        size = remove_output(self.tune.out / "trials" / name, "checkpoints")  # an ended trial never resumes from one
        if size is not None:
            self._say(name, f"removed its checkpoints ({size / 1e9:.2f} GB)")
        return error

    def run_and_tell(self, trial: Any, name: str, values: dict[str, Any], log: Path) -> str | None:
        """Run the trial and tell the study how it ended (complete, pruned or failed); the error line when it
        failed, else None. A stop by a signal ends it as interrupted and raises Stopped."""
        try:
            outcome = run_trial(self.tune, trial, values, self.signals, log)
        except Pruned as pruned:
            trial.set_user_attr("pruned_step", pruned.step)
            studies.set_violations(trial, self.tune, [float("inf")] * len(self.tune.constraints))
            self.study.tell(trial, state=_states().PRUNED)
            self._say(name, f"pruned at step {pruned.step}")
            return None
        except TrialStopped as stopped:
            with shared_turn(self.tune.out):
                studies.end_interrupted(self.study, trial.number, trial.params)
            raise Stopped(stopped.number, f"trial {name}") from None
        except RunError as error:
            trial.set_user_attr("error", str(error))
            self.study.tell(trial, state=_states().FAIL)
            self._say(name, f"failed: {error}")
            return str(error)
        return self.finish(trial, name, values, outcome)

    def finish(self, trial: Any, name: str, values: dict[str, Any], outcome: Outcome) -> str | None:
        metric = self.tune.objective.metric
        value = outcome.scores.get(metric)
        if value is None:
            error = f"trial {name}'s evaluation gives no {metric}"
            trial.set_user_attr("error", error)
            self.study.tell(trial, state=_states().FAIL)
            self._say(name, f"failed: {error}")
            return error
        if self.tune.needs_start and self.start is None:
            with shared_turn(self.tune.out):
                report = json.loads((self.tune.out / "trials" / name / "report.json").read_text())
                self.start = evaluate_start(self.tune, values, str(report["model"]), self.signals)
        violations = [c.violation(outcome.scores, self.start) for c in self.tune.constraints]
        trial.set_user_attr("scores", outcome.scores)
        studies.set_violations(trial, self.tune, violations)
        trial.set_user_attr("seconds", round(outcome.seconds, 1))
        self.study.tell(trial, float(value))
        broken = [c.text() for c, v in zip(self.tune.constraints, violations) if v > 0]
        self._say(name, f"finished in {outcome.seconds:.0f} s: {metric} = {float(value):.4g}"
                  + (f" (violates {', '.join(broken)})" if broken else ""))
        return None

    def _say(self, name: str, text: str) -> None:
        self.say(f"{time.strftime('%H:%M:%S')} trial {name}: {text}")


def _states() -> Any:
    from optuna.trial import TrialState

    return TrialState


def _shown(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


# ---- bench schemes --tune: every scheme tuned at the same budget ------------------------------------------------


def scheme_studies(recipe: str, schemes: str, out: str | None, set_options: list[str], space: list[str],
                   trials: int, objective: str, constraints: list[str], task: int | None, task_ids: str | None,
                   ) -> list[tuple[str, Tune]]:
    """`bench schemes --tune`: one study per scheme, each of `trials` trials of the recipe with the scheme's values on
    forget task `task` (held out of the compared tasks, --task-ids), into OUT/tune/SCHEME/; checked, nothing
    written."""
    from doplus_cli.bench.schemes import tune_folder
    from doplus_cli.bench.schemes.planning import parse_schemes, scheme_values
    from doplus_cli.config import parse_task_ids

    if task is None or task_ids is None:
        raise UserError("--tune tunes each scheme on one forget task and compares the tuned schemes on others: give "
                        "--tune-task T and --task-ids without T")
    if task in parse_task_ids(task_ids, "--task-ids"):
        raise UserError(f"--tune-task {task} is also in --task-ids: the tuning and the compared tasks must differ")
    if objective is None:
        raise UserError("--tune needs --tune-objective METRIC: what each scheme's study optimises")
    studies = []
    for scheme in parse_schemes(schemes):
        fixed = [f"{key}={'null' if value is None else value}" for key, value in scheme_values(scheme).items()]
        study = plan(recipe, space, objective, constraints, trials, str(tune_folder(out, recipe, scheme)),
                     [*fixed, f"task_id={task}", *set_options], "median", None, 0)
        studies.append((scheme, study))
    return studies


def tune_schemes(studies: list[tuple[str, Tune]], task: int, say: Callable[[str], None]
                 ) -> tuple[dict[str, dict[str, Any]], str]:
    """Run each scheme's study (a finished one only writes its outputs again); each scheme's best values and how
    they were found, in words, for the bench's table."""
    tuned = {}
    for scheme, study in studies:
        say(f"tuning {scheme}: {study.trials} trials on forget task {task} into {study.out}")
        best = run_tune(study, say)["best"]
        if best is None:
            raise UserError(f"--tune: the study of {scheme} has no feasible complete trial ({study.out / 'TUNE.md'});"
                            " loosen --tune-constraint or give more --tune-trials")
        tuned[scheme] = best["params"]
        say(f"tuned {scheme}: " + _shown(best["params"]) + f" ({study.objective.metric} = {best['value']:.4g})")
    first = studies[0][1]
    goal = first.objective.describe() + (f" subject to {', '.join(c.text() for c in first.constraints)}"
                                         if first.constraints else "")
    how = (f"doplus tune gave each scheme {first.trials} trials (TPE, seed {first.seed}, median pruner) to "
           f"{goal} on forget task {task}, which the table's tasks leave out; space "
           + "; ".join(p.describe() for p in first.space) + "; the studies are in OUT/tune/SCHEME/")
    return tuned, how

