"""recipes/cluster/slurm_unlearn.sh run by bash with stand-ins for `srun`, `scontrol`, `scancel` and `accelerate`
(executables on PATH that record their arguments) and SLURM's variables: the --grad-accum it computes for several
node and GPU counts, its refusal, its --resume decision, and its requeue on the time-limit signal (USR1)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # each case is a bash process (and one a python one)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "recipes" / "cluster" / "slurm_unlearn.sh"
JOB = "4242"

STAND_INS = {
    "scontrol": """echo "scontrol $*" >> "$RECORD"
if [ "$1" = show ]; then printf 'node1\\nnode2\\n'; fi""",
    # srun runs its command (here on one node): its options first, then the command
    "srun": """echo "srun $*" >> "$RECORD"
while [[ "$1" == --* ]]; do shift; done
exec "$@\"""",
    # accelerate launch: a run that trains until SIGTERM when the test waits for one, else one that finishes
    "accelerate": """echo "accelerate $*" >> "$RECORD"
if [ -n "${TRAINING:-}" ]; then
    trap 'echo "TERM reached the run" >> "$RECORD"; exit 143' TERM
    echo $$ > "$TRAINING"
    while true; do sleep 0.05; done
fi""",
    "scancel": """echo "scancel $*" >> "$RECORD"
kill -TERM "$(cat "$TRAINING")\"""",
}


def stand_ins(folder, scripts):
    """Executable bash stand-ins, one per {name: body}, in `folder` (put first on PATH); returns the folder."""
    folder.mkdir()
    for name, body in scripts.items():
        (folder / name).write_text("#!/usr/bin/env bash\n" + body + "\n")
        (folder / name).chmod(0o755)
    return folder


@pytest.fixture
def bin_folder(tmp_path):
    return stand_ins(tmp_path / "bin", STAND_INS)


def environment(tmp_path, bin_folder, nodes, gpus, recipe_batch=None, **extra):
    """SLURM's variables for a job of `nodes` x `gpus`; `recipe_batch` ("4 32"): a python stand-in that prints the
    recipe's batch_size and grad_accum instead of reading it."""
    path = [str(bin_folder)]
    if recipe_batch is not None:
        fake = tmp_path / "python-stand-in"
        fake.mkdir(exist_ok=True)
        (fake / "python").write_text(f"#!/usr/bin/env bash\necho {recipe_batch}\n")
        (fake / "python").chmod(0o755)
        path.insert(0, str(fake))
    path += [os.path.dirname(sys.executable), "/usr/bin", "/bin"]
    return {"PATH": os.pathsep.join(path), "HOME": os.environ.get("HOME", "/tmp"), "RECORD": str(tmp_path / "calls"),
            "RECIPE": str(ROOT / "recipes" / "tofu" / "llama2-7b" / "npo_gd.yaml"), "OUT": str(tmp_path / "out"),
            "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NNODES": str(nodes), "SLURM_JOB_ID": JOB,
            "SLURM_JOB_NAME": "doplus-unlearn", "SLURM_NODEID": "0", "GPUS_PER_NODE": str(gpus),
            "PYTHONPATH": str(ROOT), **extra}


def calls(tmp_path) -> list[str]:
    record = tmp_path / "calls"
    return record.read_text().splitlines() if record.exists() else []


def launched(tmp_path) -> str:
    (line,) = [c for c in calls(tmp_path) if c.startswith("accelerate ")]
    return line


def usr1_while_training(script_path, env, training):
    """Run the script until its stand-in training has written its pid, then send the batch shell SIGUSR1 (SLURM's
    --signal=B:USR1 before the time limit); the exit code and output."""
    script = subprocess.Popen(["bash", str(script_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env)
    try:
        deadline = time.time() + 60
        while not training.exists() or not training.read_text().strip():
            assert script.poll() is None and time.time() < deadline, script.communicate(timeout=60)
            time.sleep(0.02)
        script.send_signal(signal.SIGUSR1)
        out, err = script.communicate(timeout=60)
    finally:
        if script.poll() is None:
            script.kill()
            script.wait(timeout=60)
    return script.returncode, out, err


def test_grad_accum_keeps_the_recipes_effective_batch_for_any_node_and_gpu_count(tmp_path, bin_folder):
    # the shipped Llama-2-7B recipe read by doplus itself: batch_size 4 x grad_accum 32 = 128 on one process
    result = subprocess.run(["bash", str(SCRIPT)], env=environment(tmp_path, bin_folder, 2, 8), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    line = launched(tmp_path)
    assert "--num_machines 2 --num_processes 16" in line and "--grad-accum 2 " in line  # 4 x 2 x 16 = 128
    assert "--resume" not in line and "--main_process_ip node1" in line
    # then the arithmetic over counts, the recipe's values given by a stand-in: grad_accum = 128 / (4 x processes)
    for nodes, gpus in ((1, 1), (1, 4), (4, 8), (2, 16)):
        (tmp_path / "calls").unlink()
        result = subprocess.run(["bash", str(SCRIPT)], env=environment(tmp_path, bin_folder, nodes, gpus, "4 32"),
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        accum = int(re.search(r"--grad-accum (\d+)", launched(tmp_path)).group(1))
        assert 4 * accum * nodes * gpus == 128, (nodes, gpus, accum)
        assert f"--num_processes {nodes * gpus} " in launched(tmp_path)


def test_an_effective_batch_that_does_not_divide_is_refused_before_anything_starts(tmp_path, bin_folder):
    # 3 nodes x 8 GPUs = 24 processes: 128 is not a multiple of 4 x 24; nor is EFFECTIVE_BATCH=100 of 4 x 16
    for nodes, gpus, extra in ((3, 8, {}), (2, 8, {"EFFECTIVE_BATCH": "100"})):
        result = subprocess.run(["bash", str(SCRIPT)],
                                env=environment(tmp_path, bin_folder, nodes, gpus, "4 32", **extra),
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2
        assert "is not a multiple of batch_size 4 x" in result.stderr and len(result.stderr.splitlines()) == 1
        assert not any(c.startswith(("srun", "accelerate")) for c in calls(tmp_path))


def test_a_folder_with_a_started_run_resumes_and_usr1_requeues_the_job(tmp_path, bin_folder):
    """OUT holds the run's record, .doplus-run.json (a run stopped before its first checkpoint): --resume. SIGUSR1 to
    the batch shell (SLURM's --signal=B:USR1 before the time limit): scancel sends SIGTERM to the step, the script
    waits for it to end and requeues its own job."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / ".doplus-run.json").write_text("{}\n")
    training = tmp_path / "training.pid"
    code, out, err = usr1_while_training(SCRIPT, environment(tmp_path, bin_folder, 2, 8, "4 32",
                                                             TRAINING=str(training)), training)
    assert code == 143, err
    assert launched(tmp_path).endswith("--resume")
    assert calls(tmp_path)[-3:] == [f"scancel --signal=TERM {JOB}", "TERM reached the run",
                                    f"scontrol requeue {JOB}"]
    assert f"requeueing job {JOB}" in out
