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


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped (hyphens and underscores kept), spaces to hyphens,
    a repeated anchor numbered."""
    import re

    seen: dict[str, int] = {}
    anchors = set()
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_relative_links_in_the_readme_and_docs_resolve():
    import re

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    assert [p.name for p in (ROOT / "docs").glob("*.md") if f"(docs/{p.name})" not in readme] == []


def test_a_suite_worker_runs_one_torch_thread():
    """Under the README's `-n 2` each pytest-xdist worker computes on one thread (conftest.py), and the runs it
    starts inherit that; outside a worker nothing is set."""
    import os

    import torch

    from tests.environment import worker_threads

    assert worker_threads({"PYTEST_XDIST_WORKER": "gw1"}) == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    assert worker_threads({"OMP_NUM_THREADS": "4"}) == {}
    if os.environ.get("PYTEST_XDIST_WORKER"):
        assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
