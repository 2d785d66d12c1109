"""README and CI agree: .ci/run runs the README's test command exactly."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = [b.split("```", 1)[0].strip() for b in readme.split("```bash\n")[1:]]
    test_command = next(b for b in blocks if "pytest" in b)
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines


def test_readme_opens_with_the_two_setup_commands():
    readme = (ROOT / "README.md").read_text()
    first_blocks = [b.split("```", 1)[0].strip() for b in readme.split("```bash\n")[1:3]]
    assert "doplus " in first_blocks[0] and "torch==2.13.0" in first_blocks[0]
    assert "pytest" in first_blocks[1] and "torch==2.13.0" in first_blocks[1]
