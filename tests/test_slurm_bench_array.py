"""recipes/cluster/slurm_bench_array.sh run by bash with stand-ins for `doplus`, `sbatch` and `scontrol` (executables
on PATH that record their arguments) and SLURM's variables: what it submits, what an array task runs, and its
requeue on the time-limit signal (USR1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_slurm_script import stand_ins, usr1_while_training

pytestmark = pytest.mark.processes  # each case is a bash process

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "recipes" / "cluster" / "slurm_bench_array.sh"
BENCH = "--recipe recipes/bench/tofu_protocol.yaml --schemes joint,doplus --seeds 0,1 --out bench/protocol"

STAND_INS = {
    # doplus: --list-runs --indexes prints $INDEXES (the runs in those states); a run trains until SIGTERM when the
    # test waits for one (then exits as doplus does after its checkpoint), else it finishes
    "doplus": """echo "doplus $*" >> "$RECORD"
if [[ " $* " == *" --list-runs "* ]]; then [ -n "${INDEXES:-}" ] && echo "$INDEXES"; exit 0; fi
if [ -n "${TRAINING:-}" ]; then
    trap 'echo "TERM reached the bench" >> "$RECORD"; exit 143' TERM
    echo $$ > "$TRAINING"
    while true; do sleep 0.05; done
fi""",
    "sbatch": 'echo "sbatch $*" >> "$RECORD"',
    "scontrol": 'echo "scontrol $*" >> "$RECORD"',
}


@pytest.fixture
def bin_folder(tmp_path):
    return stand_ins(tmp_path / "bin", STAND_INS)


def environment(tmp_path, bin_folder, **extra):
    return {"PATH": os.pathsep.join([str(bin_folder), os.path.dirname(sys.executable), "/usr/bin", "/bin"]),
            "HOME": os.environ.get("HOME", "/tmp"), "RECORD": str(tmp_path / "calls"), "BENCH": BENCH, **extra}


def calls(tmp_path) -> list[str]:
    record = tmp_path / "calls"
    return record.read_text().splitlines() if record.exists() else []


def run(tmp_path, bin_folder, **extra):
    return subprocess.run(["bash", str(SCRIPT)], env=environment(tmp_path, bin_folder, **extra), capture_output=True,
                          text=True, timeout=60)


def test_submits_the_runs_still_to_do_or_only_the_failed_and_nothing_when_none(tmp_path, bin_folder):
    result = run(tmp_path, bin_folder, INDEXES="0-2,5")
    assert result.returncode == 0, result.stderr
    assert calls(tmp_path) == [f"doplus bench schemes {BENCH} --list-runs --indexes pending,failed",
                               f"sbatch --array=0-2,5 {SCRIPT}"]
    (tmp_path / "calls").unlink()
    result = run(tmp_path, bin_folder, INDEXES="3", STATES="failed", MAX_AT_ONCE="4")
    assert result.returncode == 0, result.stderr
    assert calls(tmp_path) == [f"doplus bench schemes {BENCH} --list-runs --indexes failed",
                               f"sbatch --array=3%4 {SCRIPT}"]
    (tmp_path / "calls").unlink()
    result = run(tmp_path, bin_folder, INDEXES="")
    assert result.returncode == 0 and "nothing to submit" in result.stdout
    assert not any(c.startswith("sbatch") for c in calls(tmp_path))
    result = run(tmp_path, bin_folder, BENCH="")
    assert result.returncode != 0 and "set BENCH to the arguments of doplus bench schemes" in result.stderr


def test_an_array_task_runs_its_index_and_usr1_requeues_that_task(tmp_path, bin_folder):
    result = run(tmp_path, bin_folder, SLURM_ARRAY_TASK_ID="6", SLURM_ARRAY_JOB_ID="900")
    assert result.returncode == 0, result.stderr
    assert calls(tmp_path) == [f"doplus bench schemes {BENCH} --run-index 6"]

    (tmp_path / "calls").unlink()
    training = tmp_path / "training.pid"
    code, out, err = usr1_while_training(SCRIPT, environment(tmp_path, bin_folder, SLURM_ARRAY_TASK_ID="6",
                                                             SLURM_ARRAY_JOB_ID="900", TRAINING=str(training)),
                                         training)
    assert code == 143, err
    assert calls(tmp_path) == [f"doplus bench schemes {BENCH} --run-index 6", "TERM reached the bench",
                               "scontrol requeue 900_6"]
    assert "requeueing 900_6" in out
