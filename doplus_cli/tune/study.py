"""The Optuna side of `doplus tune`: the storage, the study, its sampler and pruner, and the bookkeeping that lets
many workers fill one study and a killed worker's trial run again.

Every worker asks for its next trial in its turn of the study folder (`lifecycle.shared_turn`), and takes the
trial's folder (`lifecycle.holding`) in that same turn. So in its turn a worker knows that a trial Optuna lists as
running whose folder no process holds was left by a worker that is gone: that trial is ended as failed, recorded as
interrupted (it does not count against `--trials`), and its values are queued, so the next ask runs them again.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from doplus_cli.errors import UserError

if TYPE_CHECKING:
    import optuna

    from doplus_cli.tune import Tune

STUDY_NAME = "doplus-tune"
JOURNAL = "study.journal"
PRUNERS = ("median", "hyperband", "none")
RDB_SCHEMES = ("sqlite", "postgresql", "mysql", "oracle", "mssql")
OPTUNA_FLOOR = "4.0"  # optuna.storages.journal.JournalFileBackend


def require_optuna() -> Any:
    """optuna, or one line saying how to install it (it is an optional extra)."""
    try:
        import optuna
    except ImportError:
        raise UserError("doplus tune searches with Optuna, which is not installed: pip install 'doplus-cli[tune]' "
                        f"(or pip install 'optuna>={OPTUNA_FLOOR}')") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # doplus says what each trial did, in its own lines
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    return optuna


def check_storage(storage: str | None) -> str:
    """What `--storage` names, in words; one line for a URL of a kind Optuna does not take."""
    if storage is None:
        return f"journal file DIR/{JOURNAL}"
    scheme = storage.partition("://")[0].partition("+")[0] if "://" in storage else None
    if scheme is None:
        return f"journal file {storage}"
    if scheme not in RDB_SCHEMES:
        raise UserError(f"--storage {storage}: a journal file's path, or a database URL (sqlite:///study.db, "
                        "postgresql://..., mysql://...)")
    return f"database {scheme}"


def open_storage(tune: Tune) -> Any:
    optuna = require_optuna()
    if tune.storage is not None and "://" in tune.storage:
        return optuna.storages.RDBStorage(tune.storage)
    from optuna.storages.journal import JournalFileBackend

    path = Path(tune.storage).expanduser().resolve() if tune.storage else tune.out / JOURNAL
    path.parent.mkdir(parents=True, exist_ok=True)
    return optuna.storages.JournalStorage(JournalFileBackend(str(path)))


def pruner_of(tune: Tune) -> Any:
    optuna = require_optuna()
    if tune.pruner == "median":  # a trial below the median of those before it at the same step stops
        return optuna.pruners.MedianPruner(n_startup_trials=tune.startup_trials, n_warmup_steps=0)
    if tune.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=max(1, tune.eval_every or 1), max_resource=tune.steps,
                                              reduction_factor=3)
    return optuna.pruners.NopPruner()


def open_study(tune: Tune, seed_offset: int) -> optuna.Study:
    """The study in the storage (made by the first worker), with a TPE sampler seeded `--seed` + `seed_offset` (each
    worker its own stream: the first worker's is `--seed`) and the constraints as the sampler's."""
    optuna = require_optuna()
    old_constraints = tune.constraints and not per_trial_constraints()
    sampler = optuna.samplers.TPESampler(seed=tune.seed + seed_offset, n_startup_trials=tune.startup_trials,
                                         constraints_func=constraint_values if old_constraints else None)
    return optuna.create_study(study_name=STUDY_NAME, storage=open_storage(tune), sampler=sampler,
                               pruner=pruner_of(tune), direction=tune.objective.direction, load_if_exists=True)


def per_trial_constraints() -> bool:
    """Whether this Optuna takes constraints on the trial (`Trial.set_constraint`, 5.0 and later, where the
    sampler's `constraints_func` is deprecated)."""
    import optuna

    return hasattr(optuna.trial.Trial, "set_constraint")


def constraint_values(trial: Any) -> list[float]:
    """The sampler's view of a trial's constraints (<= 0 where each holds), set by the worker before it tells
    (Optuna before 5.0)."""
    return list(trial.user_attrs.get("violations") or [float("inf")])


def set_violations(trial: Any, tune: Tune, violations: list[float]) -> None:
    """Record how far the trial is from each constraint (<= 0 where it holds), where the sampler reads it."""
    trial.set_user_attr("violations", violations)
    if tune.constraints and per_trial_constraints():
        for constraint, value in zip(tune.constraints, violations):
            trial.set_constraint(constraint.text(), value)


def join(study: optuna.Study) -> int:
    """This worker's number among those that have opened the study (0 for the first), recorded in the study."""
    number = int(study.user_attrs.get("workers", 0))
    study.set_user_attr("workers", number + 1)
    return number


def interrupted(study: optuna.Study) -> set[int]:
    return set(study.user_attrs.get("interrupted", []))


def counts(study: optuna.Study) -> dict[str, int]:
    """Trials by state; `done` counts against --trials (complete, pruned, failed, not those interrupted)."""
    from optuna.trial import TrialState

    gone = interrupted(study)
    found = {"complete": 0, "pruned": 0, "failed": 0, "interrupted": 0, "running": 0, "waiting": 0}
    for trial in study.get_trials(deepcopy=False):
        if trial.state == TrialState.FAIL and trial.number in gone:
            found["interrupted"] += 1
        else:
            found[{TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned", TrialState.FAIL: "failed",
                   TrialState.RUNNING: "running", TrialState.WAITING: "waiting"}[trial.state]] += 1
    found["done"] = found["complete"] + found["pruned"] + found["failed"]
    return found


def end_interrupted(study: optuna.Study, number: int, params: dict[str, Any]) -> None:
    """Trial `number` stopped before its end (its worker was stopped or killed): failed, recorded as interrupted,
    and its values queued to run again."""
    from optuna.trial import TrialState

    study.set_user_attr("interrupted", sorted(interrupted(study) | {number}))
    study.tell(number, state=TrialState.FAIL, skip_if_finished=True)
    study.enqueue_trial(params, user_attrs={"retry_of": number})
