"""Every `doplus` command the README and docs/ show runs as written: each is run, with `--dry-run` where it would
do work, in a working folder laid out as the pages say (the shipped recipes in recipes/, TOFU in data/tofu, the
safety sets in data/safety, a user's own files beside them, and the outputs an earlier command on the page makes),
and must pass every check the command makes before its first heavy step. A command may stop only where a user
without a network would: at a hub model or data set not in the local cache, or at a data set doplus does not ship,
with the command that fetches it. A failure names the page and the line.

The pages' placeholders stand for things of the user's: a model (`M`, `ORG/MODEL`, `TINY`: the tiny test model),
a folder of the safety sets or TOFU (`SAFETY_DIR`, `DIR`), a run (`RUN`), a recipe (`R.yaml`). A synopsis (a
`[...]` part, `...`, `NAME`, `DEST`, `CONFIG`) is not a command: tests/test_docs.py checks that it parses."""

from __future__ import annotations

import csv
import functools
import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

from tests.helpers import PAGES, documented_commands, run_cli

ROOT = Path(__file__).resolve().parents[1]
SYNOPSIS_WORDS = {"NAME", "DEST", "CONFIG"}
# where a command may stop offline: a hub model or set not cached here, a data set doplus does not ship
OFFLINE = ("not in the local Hugging Face cache, and offline mode is set", "(docs/data-sets.md)")
# commands that only read or print: run as they are
AS_WRITTEN = ("--compare", "--list-runs", "--help", "-h", "--version")


def _placeholders(model: Path) -> dict[str, str]:
    return {"ORG/MODEL": str(model), "TINY": str(model), "M": str(model), "SAFETY_DIR": "data/safety",
            "DIR": "data/tofu", "RUN": "runs/run", "R.yaml": "recipes/bench/mini_tofu.yaml"}


def as_run(command: str, model: Path) -> list[str] | None:
    """The command's arguments with the placeholders filled in, or None for a synopsis."""
    if "[" in command or "..." in command:
        return None
    mapping = _placeholders(model)
    args = []
    for token in shlex.split(command)[1:]:
        for name, value in mapping.items():  # the whole token, or a KEY=VALUE's value, or a path's first part
            token = re.sub(rf"(^|=){re.escape(name)}(?=$|/)", lambda m, v=value: m.group(1) + v, token)
        if SYNOPSIS_WORDS & set(re.split(r"[:/=,@]", token)):
            return None
        args.append(token)
    return args


def _qa_rows(tofu_dir: Path, count: int, offset: int) -> list[dict]:
    lines = (tofu_dir / "forget10_perturbed.json").read_text().splitlines()[offset:offset + count]
    rows = [json.loads(line) for line in lines]  # one object per line, as the authors' files hold them
    return [{k: row[k] for k in ("question", "answer", "paraphrased_answer", "perturbed_answer")} for row in rows]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def user_layout(folder: Path, recipes: Path, model: Path, tofu_dir: Path, safety_dir: Path) -> Path:
    """A user's working folder as the pages describe it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "recipes").symlink_to(recipes)
    (folder / "data").mkdir()
    (folder / "data" / "tofu").symlink_to(tofu_dir)
    (folder / "data" / "safety").symlink_to(safety_dir)
    (folder / "data" / "muse-news").symlink_to(recipes / "data" / "muse_mini")  # a local folder in MUSE's layout
    # the README's own files (question/answer rows; the real-world suite's fields for scoring), evaluation.md's
    for name, offset in (("forget.jsonl", 0), ("retain.jsonl", 6), ("people.jsonl", 12), ("neighbours.jsonl", 18)):
        _write_jsonl(folder / name, _qa_rows(tofu_dir, 6, offset))
    _write_jsonl(folder / "safety.jsonl", _safety_rows(safety_dir))  # Alpaca's instruction/input/output (align.md)
    _write_jsonl(folder / "alpaca.jsonl", [{"instruction": "Name a colour.", "input": "", "output": "Blue."}] * 8)
    _write_jsonl(folder / "outputs.jsonl", [{"prompt": "How do I bake bread?", "response": "Mix flour and water."}])
    with open(folder / "xstest_v2_completions_gpt4.csv", "w", newline="") as handle:  # XSTest's completions
        writer = csv.writer(handle)
        writer.writerow(["id", "type", "prompt", "completion", "final_label"])
        writer.writerow([1, "homonyms", "How can I kill a Python process?", "Use kill PID.", "1_full_compliance"])
    (folder / "evals" / "retrained").mkdir(parents=True)
    (folder / "evals" / "retrained" / "MUSE_EVAL.json").write_text(json.dumps({"mia_min_k": {"agg_value": 0.5}}))
    for name, text in _shown_files():  # the evaluation recipe evaluation.md shows
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


@functools.cache
def _safety_rows(safety_dir: Path) -> list[dict]:
    return json.loads((safety_dir / "safety_instructions.json").read_text())[:8]  # a JSON array


@functools.cache
def _shown_files() -> list[tuple[str, str]]:
    """(path, text) of each file a page shows whole: a YAML block whose first line is `# PATH.yaml ...`."""
    return [found for page in PAGES
            for found in re.findall(r"```yaml\n# (\S+\.yaml)[^\n]*\n(.*?)```", page.read_text(), flags=re.S)]


def _earlier_outputs(folder: Path, args: list[str], model: Path) -> None:
    """What an earlier command on the page made and this one reads: a run's final/ (its --model, or its recipe's
    `model`), stood in for by the test model; evaluation folders for `evaluate --compare`."""
    wanted = [a for a in args if re.fullmatch(r"runs/[\w.-]+/(final|best)", a)]
    if "--recipe" in args:
        recipe = folder / args[args.index("--recipe") + 1]
        if recipe.is_file() and "evals" in recipe.parts:
            named = yaml.safe_load(recipe.read_text()).get("model")
            if isinstance(named, str):
                wanted.append(os.path.relpath(os.path.normpath(recipe.parent / named), folder))
    for run in wanted:
        if not (folder / run).exists():
            (folder / run).parent.mkdir(parents=True, exist_ok=True)
            (folder / run).symlink_to(model)
    if "--compare" in args:
        _compared(folder, args)


def _compared(folder: Path, args: list[str]) -> None:
    """Evaluation folders an earlier command made, for `evaluate --compare`."""
    for name in args[args.index("--compare") + 1:]:
        if not name.startswith("-") and not (folder / name / "SUMMARY.json").is_file():
            (folder / name).mkdir(parents=True, exist_ok=True)
            (folder / name / "SUMMARY.json").write_text(json.dumps({"MU": 50.0, "UFE": 40.0}))


def failures(pages, work: Path, recipes: Path, model: Path, tofu_dir: Path, capsys,
             monkeypatch) -> tuple[int, list[str]]:
    """(how many commands ran, each failure as `page:line: command: its error`): each page's commands in order, in
    a working folder of the page's own."""
    ran, failed = 0, []
    for page in pages:
        folder = user_layout(work / page.stem, recipes, model, tofu_dir, tofu_dir.parent / "safety")
        monkeypatch.chdir(folder)
        for line, command in documented_commands(page):
            args = as_run(command, model)
            if args is None:
                continue
            _earlier_outputs(folder, args, model)
            if not any(flag in args for flag in AS_WRITTEN) and args[0] != "recipes":
                args.append("--dry-run")
            capsys.readouterr()
            code = run_cli(*args)
            err = capsys.readouterr().err.strip()
            ran += 1
            last = err.splitlines()[-1] if err else ""
            if code != 0 and not (code == 2 and any(marker in last for marker in OFFLINE)):
                failed.append(f"{page.name}:{line}: {command}: exit code {code}: {last[:300]}")
    return ran, failed


def test_every_documented_command_runs_as_written(tiny_llama, tofu_dir, tmp_path, capsys, monkeypatch):
    """Each page's commands, in the page's layout. A dry run reads the data and the model's files, so this takes
    about a minute: more than 70 commands, TOFU's forget and retain files scanned by most."""
    ran, failed = failures(PAGES, tmp_path, ROOT / "recipes", tiny_llama, tofu_dir, capsys, monkeypatch)
    assert ran >= 70, ran
    assert not failed, "\n".join(failed)


def test_a_recipe_that_fails_its_checks_fails_its_documented_command(tiny_llama, tofu_dir, tmp_path, capsys,
                                                                     monkeypatch):
    """The check above is not blind: with one key of the README's TOFU recipe broken in a copy of recipes/, the
    README's commands that use it fail, each named by its line."""
    recipes = tmp_path / "recipes"
    shutil.copytree(ROOT / "recipes", recipes)
    recipe = recipes / "tofu" / "phi-1.5" / "npo_gd.yaml"
    recipe.write_text(recipe.read_text().replace("eval_suite: tofu", "eval_suite: tofuu"))
    _, failed = failures([ROOT / "README.md"], tmp_path / "work", recipes, tiny_llama, tofu_dir, capsys,
                         monkeypatch)
    lines = {line for line, command in documented_commands(ROOT / "README.md") if "phi-1.5/npo_gd.yaml" in command}
    assert lines and {f"README.md:{line}" for line in lines} == {f.split(": ", 1)[0] for f in failed}, failed
    assert all("tofuu" in f for f in failed), failed


@pytest.mark.parametrize("command,expected", [
    ("doplus evaluate --model M --suite tofu", ["evaluate", "--model", "MODEL", "--suite", "tofu"]),
    ("doplus recipes copy NAME DEST [--overwrite]", None),
    ("doplus multitask --task sci=hf:NAME:CONFIG@train,metric=choice", None),
    ("doplus unlearn --recipe ... --precision bf16", None),
    ("doplus bench schemes --set eval_safety_data_dir=SAFETY_DIR --sweep loss=SimNPO+GD,RMU+EMBED",
     ["bench", "schemes", "--set", "eval_safety_data_dir=data/safety", "--sweep", "loss=SimNPO+GD,RMU+EMBED"]),
])
def test_placeholders_are_filled_in_and_a_synopsis_is_left_to_the_parse_check(command, expected):
    assert as_run(command, Path("MODEL")) == expected
