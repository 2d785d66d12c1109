"""Small helpers shared by the end-to-end tests."""

from __future__ import annotations

from pathlib import Path

from doplus_cli.cli import main

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args) -> int:
    """Run `doplus ARGS` in this process; return the exit code (0 on success)."""
    try:
        main([str(a) for a in args])
    except SystemExit as done:
        return done.code
    return 0


def write_sets(tofu_dir, folder, forget_rows: int, retain_rows: int):
    """forget.jsonl and retain.jsonl in `folder`: the first rows of TOFU's forget01 and retain90 (read from
    ../shared, never copied into the project); returns the folder."""
    for role, name, n in (("forget", "forget01.json", forget_rows), ("retain", "retain90.json", retain_rows)):
        lines = [line for line in open(tofu_dir / name) if line.strip()][:n]
        (folder / f"{role}.jsonl").write_text("".join(lines))
    return folder


def write_parity_task(folder):
    """A 4-question lm-eval multiple-choice task (tiny_parity) as a local YAML in `folder`; returns the folder."""
    import json

    folder.mkdir()
    docs = [{"question": f"Is {n} even?", "choices": ["yes", "no"], "label": n % 2} for n in range(4)]
    (folder / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "tiny_parity.yaml").write_text(
        "task: tiny_parity\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'docs.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: choices\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\nmetadata:\n  version: 1.0\n"
    )
    return folder
