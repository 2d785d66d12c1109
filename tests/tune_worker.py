"""A `doplus tune` worker whose trials are a stub, for tests/test_tune.py: the study, its storage, the turns, the
folders and the outputs are doplus's own; only the run a trial would start is replaced by a score computed from the
trial's values (the objective -(log10(lr) + 3)^2, best at lr = 1e-3), so workers can be run, raced and killed in
seconds. Each trial leaves TUNE_STUB_MARKS/NNNN-PID (the process that ran it) and lasts TUNE_STUB_SECONDS.

    python tests/tune_worker.py tune --recipe ... (doplus's arguments)
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import doplus_cli.tune as tune_module  # noqa: E402
from doplus_cli.cli import main  # noqa: E402
from doplus_cli.tune.trials import Outcome, TrialStopped  # noqa: E402


def score(lr: float) -> float:
    return -((math.log10(lr) + 3) ** 2)


def stub_trial(tune, trial, values, signals, log):
    marks = Path(os.environ["TUNE_STUB_MARKS"])
    marks.mkdir(parents=True, exist_ok=True)
    (marks / f"{trial.number:04d}-{os.getpid()}").write_text(json.dumps(values))
    end = time.time() + float(os.environ.get("TUNE_STUB_SECONDS", "0"))
    while time.time() < end:
        if signals.received:
            raise TrialStopped(signals.received)
        time.sleep(0.02)
    value = score(values["lr"])
    return Outcome({"OVR": value, "MU": 10.0}, 0.0, tune.steps, {})


if __name__ == "__main__":
    tune_module.run_trial = stub_trial
    main(sys.argv[1:])
