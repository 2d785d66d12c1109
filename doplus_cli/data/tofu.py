"""TOFU in the DualOptim+ authors' layout: several forget tasks per file, told apart by `task_id`.

The authors' files (their repository's `data/tofu`, closer-look's, `../shared/data/tofu`) hold 10 tasks of 40 rows
in `forget01.json`, 10 of 200 in `forget05.json` and 9 of 400 in `forget10.json` (and the same rows with their
paraphrases and perturbations in `{split}_perturbed.json`). Their `forget.py` (`get_task_data`) unlearns one task:

- forget set: the rows of that task;
- retain set: `retain{100 - min(10k, 90)}` for `forget0k`/`forget10` (forget01 -> retain90, forget05 -> retain50,
  forget10 -> retain10) followed by the forget file's rows of every task not unlearned yet (for one task: every
  other task; in continual unlearning the tasks unlearned before drop out too).

The hub's `locuslab/TOFU` has one forget set per config and no `task_id`; nothing here applies to it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

from doplus_cli.data.sources import Keys, MixtureSource, Source, available_tasks, open_source, select_tasks
from doplus_cli.errors import UserError

AUTHORS_RETAIN = "tofu-authors"  # --retain tofu-authors: the authors' retain set for the forget file and task
_FORGET_FILE = re.compile(r"^(?P<split>forget(?P<percent>\d+))\.jsonl?$")


def retain_split(forget_split: str) -> str:
    """The retain split the authors pair with a forget split: forget01 -> retain90, forget05 -> retain50,
    forget10 -> retain10 (`"retain" + str(100 - min(10 * k, 90)).zfill(2)` in their forget.py)."""
    percent = int(forget_split.removeprefix("forget"))
    return "retain" + str(100 - min(10 * percent, 90)).zfill(2)


def authors_retain(forget_spec: str, forget_file: Source, unlearned: Sequence[int], keys: Keys) -> Source:
    """The authors' retain set for unlearning the tasks `unlearned` (the current one last) of `forget_file`: the
    paired retain split from the same folder, then the forget file's rows of every other task."""
    name = os.path.basename(forget_spec)
    match = _FORGET_FILE.match(name)
    if forget_spec.startswith("hf:") or match is None or "[" in forget_spec:
        raise UserError(f"--retain {AUTHORS_RETAIN} needs --forget to be one of the authors' TOFU files "
                        f"(forget01.json, forget05.json or forget10.json, whole, with task_id), got {forget_spec}")
    if not available_tasks(forget_file):
        raise UserError(f"{forget_spec}: its rows have no task_id; --retain {AUTHORS_RETAIN} is built from the "
                        "authors' TOFU files, whose rows carry one (pass an explicit --retain FILE instead)")
    folder = os.path.dirname(forget_spec)
    split = retain_split(match["split"])
    candidates = [os.path.join(folder, split + ext) for ext in (".json", ".jsonl")]
    path = next((c for c in candidates if os.path.isfile(c)), None)
    if path is None:
        raise UserError(f"--retain {AUTHORS_RETAIN}: {candidates[0]} not found (the retain split the authors pair "
                        f"with {match['split']})")
    retain_file = open_source(path, "retain", keys)
    others = select_tasks(forget_file, unlearned, keep=False,
                          name=f"{forget_spec} (tasks {', '.join(map(str, _remaining(forget_file, unlearned)))})")
    if len(others) == 0:
        return retain_file
    return MixtureSource([(split, retain_file), ("other tasks", others)])


def _remaining(source: Source, unlearned: Sequence[int]) -> list[int]:
    return [task for task in available_tasks(source) if task not in set(unlearned)]


def describe_retain(source: Source) -> dict[str, Any]:
    """For the report: the retain set's parts and their row counts."""
    if isinstance(source, MixtureSource):
        return {"parts": [{"source": part.name, "rows": len(part)} for part in source.sources]}
    return {"parts": [{"source": source.name, "rows": len(source)}]}
