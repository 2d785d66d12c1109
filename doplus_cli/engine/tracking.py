"""Experiment trackers (`--report-to`) through accelerate's own tracker support.

`Accelerator(log_with=...)` holds the trackers, `init_trackers` opens the run with the resolved configuration
as hyper-parameters, `accelerator.log` writes each step's metrics.jsonl record, each evaluation and the final
report's numbers, and every call runs on the main process only (accelerate's `on_main_process`), so a run on
N processes logs once. Files go under OUT/trackers/ (or `tracker_dir`) unless the user's own settings say
otherwise: WANDB_DIR, WANDB_MODE (W&B runs offline by default: nothing needs a network), MLFLOW_TRACKING_URI,
MLFLOW_EXPERIMENT_NAME, TRACKIO_DIR. A resumed run continues the same tracker run: the W&B and MLflow run ids
are kept in each checkpoint, and no step is logged twice.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from doplus_cli.config import chosen_trackers

# report.json's sections that are not metrics (configuration, text, per-row tables)
_NOT_METRICS = ("config", "environment", "evals", "eval_curves", "samples", "final", "model", "status", "data",
                "steps_per_objective", "precision", "teach", "lora", "reference")


def accelerator_options(report_to: tuple[str, ...]) -> dict[str, Any]:
    """`Accelerator(**...)`'s tracker options for `--report-to`; the logging folder is set when the run's folder
    is known."""
    names = chosen_trackers(report_to)
    return {"log_with": names, "project_dir": "."} if names else {}


def hyper_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """The resolved configuration as flat values every tracker takes (numbers, text, booleans): None as
    "None", lists and mappings as JSON."""
    flat = {}
    for key, value in config.items():
        if value is None:
            value = "None"
        elif isinstance(value, (list, tuple, dict)):
            value = json.dumps(value, default=str)
        flat[key] = value
    return flat


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def numbers(values: dict[str, Any], prefix: str, depth: int = 4) -> dict[str, float]:
    """`{prefix}/{key}` for every number in `values`, nested mappings joined by `/`; text, lists and nulls left out."""
    found: dict[str, float] = {}
    for key, value in values.items():
        name = f"{prefix}/{key}"
        if _is_number(value):
            found[name] = value
        elif isinstance(value, dict) and depth > 1:
            found.update(numbers(value, name, depth - 1))
    return found


def _last_logged_step(out: Path) -> int:
    """The last step of metrics.jsonl as the interrupted run left it (every step in it was sent to the trackers)."""
    last = 0
    try:
        with open(out / "metrics.jsonl") as handle:
            for line in handle:
                try:
                    last = max(last, int(json.loads(line).get("step", 0)))
                except (ValueError, AttributeError):
                    continue  # a line cut short by the interruption
    except OSError:
        pass
    return last


def _mlflow_last_step(run_id: str) -> int:
    """The last step an MLflow run holds (every step logs train/lr, in one batch with the rest)."""
    from mlflow.tracking import MlflowClient

    return max((m.step for m in MlflowClient().get_metric_history(run_id, "train/lr")), default=0)


@dataclass(frozen=True)
class TrackerSettings:
    """Where and under which names a run is tracked (`--tracker-*`), made from the resolved configuration."""

    folder: Path  # --tracker-dir, else OUT/trackers (absolute)
    project: str  # --tracker-project, else doplus-COMMAND
    run_name: str  # --tracker-run-name, else the --out folder's name
    group: str | None  # --tracker-group
    tags: dict[str, str]  # command, scheme, seed, and the group and task_id where set
    resolved_config: dict[str, Any]  # the hyper-parameters a new tracker run is given


class RunTracker:
    """One tracker run per training run: built once, then `step`, `evaluation` and `finish`; a no-op without
    `--report-to`. Only the main process holds trackers (accelerate's `init_trackers` runs there alone).

    `resumed_ids`: the tracker run ids a resumed run's checkpoint kept (None: a new run); `start_step`: the step
    the run starts from."""

    def __init__(self, accelerator, out: Path, settings: TrackerSettings, resumed_ids: dict[str, str] | None,
                 start_step: int) -> None:
        self.accelerator = accelerator
        resumed = resumed_ids is not None
        # accelerate's LoggerType, as names; none on the other processes (trackers live on the main process only)
        self.names = [str(name) for name in getattr(accelerator, "log_with", None) or []
                      if accelerator.is_main_process]
        self.ids: dict[str, str] = dict(resumed_ids or {})
        # per tracker, the last step the interrupted run sent: W&B, MLflow and trackio keep what they got, so it is
        # not sent again (MLflow says what it holds; for the others metrics.jsonl does); TensorBoard drops its
        # events from the checkpoint's step on (purge_step) and takes them again
        self.logged_until: dict[str, int] = {}
        if resumed:
            self.logged_until = {name: _last_logged_step(out) for name in self.names} | {"tensorboard": start_step}
        self.finished = False
        self._own_mlflow_uri = False  # set here for this run; unset at the end (mlflow puts it in the environment)
        if not self.names:
            return
        folder, run_name, tags = settings.folder, settings.run_name, settings.tags
        accelerator.project_configuration.project_dir = str(out)
        # TensorBoard's events in trackers/tensorboard/RUN/PROJECT/ (accelerate names the last folder after the project)
        accelerator.project_configuration.logging_dir = str(folder / "tensorboard" / run_name)
        init_kwargs: dict[str, dict[str, Any]] = {}
        if "tensorboard" in self.names:
            init_kwargs["tensorboard"] = {"purge_step": start_step + 1} if resumed else {}
        if "wandb" in self.names:
            self.ids.setdefault("wandb", uuid.uuid4().hex[:16])
            options = {"id": self.ids["wandb"], "resume": "allow", "name": run_name, "group": settings.group,
                       "mode": os.environ.get("WANDB_MODE") or "offline",
                       "tags": [f"{k}:{v}" for k, v in tags.items()]}
            if not os.environ.get("WANDB_DIR"):
                (folder / "wandb").mkdir(parents=True, exist_ok=True)
                options["dir"] = str(folder)
            init_kwargs["wandb"] = options
        if "mlflow" in self.names:
            import mlflow

            init_kwargs["mlflow"] = {"run_name": run_name, "run_id": self.ids.get("mlflow"), "tags": tags}
            if not os.environ.get("MLFLOW_TRACKING_URI"):
                folder.mkdir(parents=True, exist_ok=True)  # a local SQLite store (MLflow 3 refuses ./mlruns)
                mlflow.set_tracking_uri(f"sqlite:///{folder / 'mlflow.db'}")
                self._own_mlflow_uri = True
                init_kwargs["mlflow"]["logging_dir"] = str(folder / "mlflow-artifacts")  # a new experiment's artifacts
        own_trackio_dir = "trackio" in self.names and not os.environ.get("TRACKIO_DIR")
        if "trackio" in self.names:
            os.environ.setdefault("TRACKIO_DIR", str(folder / "trackio"))  # read once, when trackio is imported
            init_kwargs["trackio"] = {"name": run_name, "group": settings.group, "resume": "allow"}
        # hyper-parameters once per tracker run: a resumed run's tracker run already holds them
        accelerator.init_trackers(settings.project,
                                  config=None if resumed else hyper_parameters(settings.resolved_config),
                                  init_kwargs=init_kwargs)
        if own_trackio_dir:
            os.environ.pop("TRACKIO_DIR")
        if "mlflow" in self.names:
            self.ids["mlflow"] = accelerator.get_tracker("mlflow").active_run.info.run_id
            if resumed:
                self.logged_until["mlflow"] = _mlflow_last_step(self.ids["mlflow"])

    def _log(self, values: dict[str, float], step: int) -> None:
        if not values or not self.names:
            return
        if all(step > until for until in self.logged_until.values()):
            self.accelerator.log(values, step=step)
        else:  # a resumed run's first steps: only to the trackers that do not hold them yet
            for tracker in self.accelerator.trackers:
                if step > self.logged_until.get(tracker.name, 0):
                    tracker.log(values, step=step)
        if "tensorboard" in self.names:  # on disk at once, so that a killed run keeps every step it logged
            self.accelerator.get_tracker("tensorboard", unwrap=True).flush()

    def step(self, record: dict[str, Any]) -> None:
        """metrics.jsonl's record of one optimizer step: each loss, lr, grad norm and step diagnostic."""
        self._log(numbers({k: v for k, v in record.items() if k != "step"}, "train", depth=1), record["step"])

    def evaluation(self, record: dict[str, Any]) -> None:
        """One evaluation during training, at its step."""
        self._log(numbers({k: v for k, v in record.items() if k != "step"}, "eval"), record["step"])

    def close(self) -> None:
        """Flush and close every tracker (the run ended, or stopped: its checkpoint keeps the run ids)."""
        if self.finished:
            return
        self.finished = True
        for tracker in getattr(self.accelerator, "trackers", []):
            tracker.finish()  # not accelerator.end_training(): that also ends the process group the run still uses
        if self._own_mlflow_uri:  # the next run in this process, or a process it starts, finds the user's setting
            import mlflow

            mlflow.set_tracking_uri(None)

    def finish(self, report: dict[str, Any], step: int) -> None:
        """The final report's numbers at the last step, then close."""
        if self.names and self.accelerator.is_main_process and not self.finished:
            self.accelerator.log(numbers({k: v for k, v in report.items() if k not in _NOT_METRICS}, "final"),
                                 step=step)
        self.close()
