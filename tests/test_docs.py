"""README and CI agree: .ci/run runs the README's test command exactly."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = [b.split("```", 1)[0].strip() for b in readme.split("```bash\n")[1:]]
    test_command = next(b for b in blocks if "pytest" in b)
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines


def test_readme_opens_with_the_install_and_quickstart_command():
    readme = (ROOT / "README.md").read_text()
    blocks = [b.split("```", 1)[0].strip() for b in readme.split("```bash\n")[1:]]
    assert "doplus " in blocks[0] and "torch==2.13.0" in blocks[0]
    assert "torch==2.13.0" in next(b for b in blocks if "pytest" in b)
    # from PyPI alone: PyTorch's CPU index is an optional line of its own, after the command
    assert "--index-url" not in blocks[0]
    optional = blocks[1]
    assert "--index-url https://download.pytorch.org/whl/cpu" in optional and "doplus " not in optional


def _section(markdown: str, heading: str) -> str:
    return markdown.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]


def test_the_readmes_own_data_section_shows_layouts_doplus_reads(tmp_path):
    """Each sample row of the README's "Your model, your data" table is read by doplus's file reader as its layout
    says (the question-only row with --answers-from-model); the quickstart's files are that question-only layout,
    and its recipe sets answers_from_model."""
    import json

    from doplus_cli.commands.unlearn import UnlearnConfig
    from doplus_cli.config import resolve_config
    from doplus_cli.data.sources import JsonlSource, Keys

    readme = (ROOT / "README.md").read_text()
    section = _section(readme, "## Your model, your data")
    assert "doplus unlearn --model ORG/MODEL --forget forget.jsonl --retain retain.jsonl --out runs/mine" in section
    rows = {line.split("|")[1].strip(): json.loads(re.search(r"`(\{.*?\})`", line).group(1))
            for line in section.splitlines() if line.startswith("| ") and "`{" in line}
    assert set(rows) == {"question and answer", "question only", "plain text"}
    for layout, row in rows.items():
        path = tmp_path / "rows.jsonl"
        path.write_text(json.dumps(row) + "\n")
        read = JsonlSource(str(path), Keys(need_answer=layout != "question only"))[0]
        assert (read.question, read.answer, read.text) == (row.get("question"), row.get("answer"), row.get("text"))
    config = resolve_config(str(ROOT / "recipes" / "quickstart.yaml"), {}, UnlearnConfig)
    assert config.answers_from_model and "quickstart_*.jsonl" in section
    for path in (config.forget, config.retain):
        assert {key for line in open(path) for key in json.loads(line)} == {"name", "question"}
    assert "messages" in section  # chat transcripts are said not to be read: no reader takes them
    assert "## Your model, your data" in (ROOT / "docs" / "index.md").read_text()


def test_the_readmes_scoring_fields_are_the_real_world_suites():
    """The fields the README names for `doplus evaluate --suite real-world` are the ones its reader requires."""
    from doplus_cli.errors import UserError
    from doplus_cli.evaluation.suites import _sample

    section = _section((ROOT / "README.md").read_text(), "## Your model, your data")
    assert "--suite real-world --forget forget.jsonl --retain retain.jsonl" in section
    row = {"question": "q", "answer": "a", "paraphrased_answer": "p", "perturbed_answer": ["w"]}
    assert _sample(row, "row", need_paraphrase=True).answer == "a"
    for field in row:
        assert f"`{field}`" in section or field in ("question", "answer")
        with pytest.raises(UserError):
            _sample({k: v for k, v in row.items() if k != field}, "row", need_paraphrase=True)


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


def test_every_docs_page_is_linked_from_the_index():
    """The README links the index; the index links every page."""
    assert "(docs/index.md)" in (ROOT / "README.md").read_text()
    index = (ROOT / "docs" / "index.md").read_text()
    assert [p.name for p in (ROOT / "docs").glob("*.md") if p.name != "index.md" and f"({p.name})" not in index] == []


def _doplus_commands(markdown: str) -> list[str]:
    """Every `doplus ...` command in the page's bash blocks, continuation lines joined, comments dropped."""
    import re

    commands = []
    for block in re.findall(r"```bash\n(.*?)```", markdown, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                part = part.split(" #", 1)[0].strip()
                if part.startswith("doplus "):
                    commands.append(part)
    return commands


def _parse(args: list[str]):
    """Parse `doplus ARGS` as the CLI would, down to the subcommand, without running it: an unknown option, a
    missing value or an unknown command raises click's UsageError."""
    import typer.main

    from doplus_cli.cli import app

    command = typer.main.get_command(app)
    context = command.make_context("doplus", list(args))
    while hasattr(command, "resolve_command"):
        rest = [*getattr(context, "_protected_args", []), *context.args]
        name, command, rest = command.resolve_command(context, rest)
        context = command.make_context(name, rest, parent=context)
    return context


def test_the_readmes_commands_parse():
    import shlex

    commands = _doplus_commands((ROOT / "README.md").read_text())
    assert any(c.startswith("doplus unlearn ") for c in commands)
    assert any(c.startswith("doplus evaluate ") for c in commands)
    assert any(c.startswith("doplus bench ") for c in commands)
    for command in commands:
        _parse(shlex.split(command)[1:])


def test_every_documented_command_parses():
    """The `doplus` commands of every docs page name options that exist (a synopsis's [optional] parts included)."""
    import shlex

    for page in sorted((ROOT / "docs").glob("*.md")):
        for command in _doplus_commands(page.read_text()):
            try:
                _parse(shlex.split(command.replace("[", "").replace("]", ""))[1:])
            except Exception as error:
                raise AssertionError(f"{page.name}: {command}: {error}") from error


def test_the_readmes_recipes_exist():
    import re

    readme = (ROOT / "README.md").read_text()
    for recipe in re.findall(r"--recipe (recipes/\S+\.yaml)", readme):
        assert (ROOT / recipe).is_file(), recipe


# Words and phrases that narrate how doplus or a result was made (a work session, an attempt, a test run cut short,
# files carried to a machine) instead of saying what it is; a result names its command, version, commit and machine.
def _phrases(patterns: list[str]) -> re.Pattern:
    """One pattern of several, a space in each matching any run of white space (a phrase may wrap)."""
    return re.compile("|".join(p.replace(" ", r"\s+") for p in patterns), re.I)


NARRATIVE = _phrases([
    r"\bsessions?\b", r"\bthis (?:stop|sprint|iteration|round)\b", r"\bissue #?\d+", r"\bstop \d+\b",
    r"\bearlier\b", r"\b(?:first|second|third|later|earlier|previous) attempts?\b", r"\bat (?:the|that) time\b",
    r"\bwe (?:tried|found|ran|saw|measured|decided|chose|kept|dropped|noticed|fixed|added|removed|had|wanted|used)\b",
    r"\bnot kept\b", r"\bturned out\b", r"\bfor now\b", r"\bbefore the changes\b", r"\bmidway\b",
    r"\bstopped after \d[\d.,]* ?(?:s|seconds?|min|minutes?)\b", r"\b\d[\d,]* passed, \d[\d,]* (?:failed|errored)\b",
    r"\btravelled\b", r"\b(?:one|two|three|\d+) calls on\b", r"\bnot re-?run\b", r"\bwere to run\b",
    r"\b(?:measured|run|tested) so far\b",
    r"\b(?:was|were) (?:run|measured|made|written|taken|recorded) on (?:\d|(?:mon|tues|wednes|thurs|fri|satur|sun)day"
    r"|jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)",
])
# Where such a word is the product's own vocabulary: process sessions, an earlier version or checkpoint, the
# distance the weights travelled (bench precision), a kill midway through a removal.
NOT_NARRATIVE = _phrases([
    r"process sessions?", r"start_new_session", r"\bsetsid\b", r'scope="session"',
    r"earlier (?:versions?|checkpoints?|steps?|tokens?|start|run of the same command)", r"'earlier'",
    r"distance travelled", r"weights travelled", r"travelled =", r"/ travelled", r"kill midway",
])


def narrative(text: str) -> list[str]:
    """The narrative phrases in `text`, each with its line; a match inside an allowed phrase is left out."""
    allowed = [m.span() for m in NOT_NARRATIVE.finditer(text)]
    found = []
    for match in NARRATIVE.finditer(text):
        if not any(start <= match.start() < end for start, end in allowed):
            line = text[text.rfind("\n", 0, match.start()) + 1:].split("\n", 1)[0]
            found.append(f"{' '.join(match.group(0).split())!r} in: {line.strip()[:120]}")
    return found


@pytest.mark.parametrize("sentence", [
    "Two calls on one machine; the packages missing there travelled as files.",
    "The suite with CUDA visible (stopped after 250 s): 913 passed, 120 failed or errored.",
    "only scored, never read: before the changes, once midway (after the first retraining) and at the end.",
    "Figures from this session; the first attempt was slower.",
    "We tried a larger batch and it was not kept.",
    "The benchmark was run on 3 May on two cores, the best at the time.",
    "Fixed in stop 39 (issue #12); the earlier figures are gone.",
])
def test_the_narrative_check_catches_development_narrative(sentence):
    assert narrative(sentence), sentence


@pytest.mark.parametrize("sentence", [
    "In a process session of its own (start_new_session): Ctrl-C reaches this process only.",
    "Resuming from an earlier checkpoint; an earlier version of OpenUnlearning averaged over every position.",
    "distance travelled vs fp32: how far the weights travelled against the fp32 run.",
    "doplus 0.2.0 at commit 8745293; one NVIDIA H200; `python3 -m pytest -n 14 tests`.",
])
def test_the_narrative_check_leaves_product_vocabulary(sentence):
    assert not narrative(sentence), sentence


def test_user_facing_files_say_nothing_of_how_doplus_was_developed():
    """No development narrative in what a user reads: the README, the docs, the changelog, the recipes and the
    package's help, messages, docstrings and comments."""
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md",
             *(p for pattern in ("*.md", "*.py") for p in (ROOT / "docs").rglob(pattern)),
             *(p for pattern in ("*.yaml", "*.sh", "*.py") for p in (ROOT / "recipes").rglob(pattern)),
             *(ROOT / "doplus_cli").rglob("*.py")]
    found = [f"{p.relative_to(ROOT)}: {hit}" for p in files for hit in narrative(p.read_text())]
    # the tests' own comments and docstrings name no development runs or issues either
    code = re.compile(r"\bstop \d+|\bissue #?\d+", re.I)
    found += [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in (ROOT / "tests").rglob("*.py") if p.name != "test_docs.py"
              for m in code.finditer(p.read_text())]
    assert not found, found


def test_no_users_example_reads_the_test_data_folder():
    """The test data folder beside the checkout (../shared) is the tests' own; a page's examples use the user's
    layout (data/tofu, data/safety)."""
    pages = [p for p in (ROOT / "docs").glob("*.md") if p.name != "development.md"]
    assert [p.name for p in pages if "../shared" in p.read_text() or "shared/data" in p.read_text()] == []


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


@pytest.mark.processes
def test_the_optimizer_pages_examples_run(tmp_path):
    """The Python examples of docs/optimizers.md (a plain loop, accelerate, the Hugging Face Trainer) run as
    written, each in its own process on the CPU."""
    import re
    import subprocess
    import sys

    from tests.helpers import child_env

    page = (ROOT / "docs" / "optimizers.md").read_text()
    examples = [block for block in re.findall(r"```python\n(.*?)```", page, flags=re.S) if "import " in block]
    assert len(examples) == 3
    for number, code in enumerate(examples):
        script = tmp_path / f"example{number}.py"
        script.write_text(code)
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                              env=child_env(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1"), timeout=300)
        assert done.returncode == 0, (number, done.stderr[-2000:])


def _documented_bench_commands() -> list[tuple[str, str]]:
    """(page, command) for every `doplus bench schemes --recipe recipes/...` the README and the docs show inline, in
    the text (tests/test_documented_commands.py runs those of the bash blocks, with every other command)."""
    import re

    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        blocks = set(_doplus_commands(text))
        for command in re.findall(r"`(doplus bench schemes --recipe recipes/[^`]+)`", text):
            if command not in blocks:
                found.append((page.name, command))
    return found


def test_every_documented_bench_command_passes_the_benchs_checks(tmp_path, capsys):
    """Each shipped recipe a page's text (not a bash block) runs through `doplus bench schemes` has what the bench
    compares runs by (an evaluation suite and its data): the page's command, with --list-runs, plans its runs as a
    user's copy of the recipe with the data beside it."""
    import shlex

    from tests.helpers import recipe_beside_shared_data, run_cli

    commands = _documented_bench_commands()
    assert commands  # the pages name some bench commands in their text
    for number, (page, command) in enumerate(commands):
        args = shlex.split(command)[3:]
        folder = tmp_path / str(number)
        args[1] = str(recipe_beside_shared_data(args[1].removeprefix("recipes/").removesuffix(".yaml"), folder))
        for flag in ("--out", "--run-index"):
            if flag in args:
                del args[args.index(flag):args.index(flag) + 2]
        args = [a.replace("=SAFETY_DIR", f"={folder / 'data' / 'safety'}") for a in args]
        code = run_cli("bench", "schemes", *args, "--out", folder / "bench", "--list-runs")
        assert code == 0, (page, command, capsys.readouterr().err)


def test_the_tutorials_run_count_is_the_benchs():
    """The number of runs the TOFU tutorial says its bench command starts: schemes × tasks × seeds, with the
    bench's own defaults for what the command leaves out."""
    import re
    import shlex

    from doplus_cli.bench.schemes import DEFAULT_SCHEMES, DEFAULT_SEEDS

    page = (ROOT / "docs" / "tutorial-tofu.md").read_text()
    (command,) = [c for c in _doplus_commands(page) if c.startswith("doplus bench schemes")]
    args = shlex.split(command)

    def listed(flag: str, default: str) -> int:
        return len((args[args.index(flag) + 1] if flag in args else default).split(","))

    schemes, tasks, seeds = listed("--schemes", DEFAULT_SCHEMES), listed("--task-ids", "1"), listed("--seeds",
                                                                                                     DEFAULT_SEEDS)
    said = re.search(r"This runs (\d+) ordinary `doplus unlearn` runs \((\d+) schemes × (\d+) tasks × (\d+) seeds",
                     " ".join(page.split()))
    assert said, "the tutorial no longer states its run count as 'This runs N ... (S schemes × T tasks × D seeds'"
    assert tuple(map(int, said.groups())) == (schemes * tasks * seeds, schemes, tasks, seeds)


def test_the_index_sends_each_command_to_a_page_that_documents_it():
    """A command named in a link of the docs index (`doplus bench precision`, `bench schemes`) is on the page the
    link opens."""
    index = (ROOT / "docs" / "index.md").read_text()
    missing = []
    for text, target in re.findall(r"\[([^\]]+)\]\(([\w.-]+\.md)(?:#[^)]*)?\)", index):
        page = (ROOT / "docs" / target).read_text()
        for name in re.findall(r"`(?:doplus )?(bench \w+|unlearn|multitask|align|evaluate|recipes)`", text):
            if name not in page:
                missing.append(f"{name} -> {target}")
    assert missing == []


def test_the_results_and_reproducing_pages_name_only_flags_doplus_has():
    import typer.main

    from doplus_cli.cli import app

    def flags(command) -> set[str]:
        found = {flag for param in command.params for flag in (*param.opts, *param.secondary_opts)}
        for inner in getattr(command, "commands", {}).values():
            found |= flags(inner)
        return found

    known = flags(typer.main.get_command(app))
    for name in ("results.md", "reproducing.md"):
        named = set(re.findall(r"`(--[a-z][a-z0-9-]*)", (ROOT / "docs" / name).read_text()))
        assert named - known == set(), name


def test_reproducing_runs_the_papers_baselines_and_ablations_from_the_scheme_table():
    """The paper's federated-learning baselines and its base-state ablations are schemes of config.SCHEMES; the page
    names each and calls none of them unimplemented."""
    from doplus_cli.config import FL_SCHEMES, SCHEMES

    page = (ROOT / "docs" / "reproducing.md").read_text()
    ablations = [name for name, scheme in SCHEMES.items() if {"base_update", "base_source"} & set(scheme.values)]
    assert len(ablations) == 3
    assert [name for name in (*FL_SCHEMES, *ablations) if name not in page] == []
    assert "not implemented" not in page


def test_the_options_page_is_what_the_declarations_give():
    """docs/options.md lists every option of every command from the same declarations --help is built from: an
    option added to a config field shows up there by running `python docs/options_reference.py`, and a page left
    behind fails here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("options_reference", ROOT / "docs" / "options_reference.py")
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    page = (ROOT / "docs" / "options.md").read_text()
    assert page == reference.render(), "run python docs/options_reference.py"
    for flag in ("--forget", "--scheme", "--loss", "--eval-attacks", "--suite", "--schemes", "--space"):
        assert f"| `{flag}`" in page, flag
