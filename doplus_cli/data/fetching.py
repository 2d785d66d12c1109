"""Where the data sets the shipped recipes read come from, and the command that puts each where they look.

doplus ships its recipes and the small files it writes itself (`recipes/data/`); the benchmarks' data come from
their authors. `DATA_SETS` names each such set once: the folder and file names that mark a path as one of its
files, the hub sets that are it, and the shell command that fetches it. `fetch_hint` turns a missing data file
into that command, filled in with the missing file's own folder, for the one-line file-not-found error;
`data_set_of` tells `doplus recipes list` which set a recipe's path or hub set belongs to. docs/data-sets.md gives
the same commands with the layout each recipe expects.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from pathlib import PurePath

from doplus_cli.registry import Registry


@dataclass(frozen=True)
class DataSet:
    """`short`: its name in `doplus recipes list`; `title`: the set as a user knows it. `folders`: folder names
    that mark a path as one of its files (compared without case). `files`: file-name patterns that do. `hub`: hub
    datasets that are the set. `fetch`: the command, with `{folder}` for the missing file's folder, `{path}` for the
    file itself, `{name}` for its name and `{root}` for the set's own folder on the path."""

    short: str
    title: str
    fetch: str
    folders: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    hub: tuple[str, ...] = ()


SAFETY_RELEASE = "https://raw.githubusercontent.com/vinid/safety-tuned-llamas/main/data"

DATA_SETS: Registry[DataSet] = Registry("data set", DataSet, {
    "tofu": DataSet(
        "TOFU", "TOFU as the DualOptim+ authors ship it",
        "git clone --depth 1 https://github.com/CityU-MLO/DualOptimPlus && mkdir -p {folder} && "
        "cp DualOptimPlus/data/tofu/*.json {folder}/",
        folders=("tofu",),
        files=("forget01*.json", "forget05*.json", "forget10*.json", "retain10.json", "retain50.json",
               "retain90.json", "retain_perturbed.json", "real_authors_perturbed.json",
               "world_facts_perturbed.json")),
    "safety": DataSet(
        "Safety-Tuned LLaMAs", "Safety-Tuned LLaMAs' safety set",
        f"curl -L --create-dirs -o {{path}} {SAFETY_RELEASE}/training/safety_only_data_Instructions.json",
        files=("safety_instructions.json", "safety_only_data_Instructions.json")),
    "safety-evaluation": DataSet(
        "safety eval sets", "Safety-Tuned LLaMAs' evaluation sets",
        f"curl -L --create-dirs -o {{path}} {SAFETY_RELEASE}/evaluation/{{name}}",
        files=("I-*.json", "Q-Harm.json")),
    "xstest": DataSet(
        "XSTest", "XSTest's prompts",
        "curl -L --create-dirs -o {path} "
        "https://raw.githubusercontent.com/paul-rottger/exaggerated-safety/main/xstest_prompts.csv",
        files=("xstest_prompts.csv",)),
    "alpaca": DataSet(
        "Alpaca", "Stanford Alpaca's seed tasks",
        "curl -L --create-dirs -o {path} https://raw.githubusercontent.com/tatsu-lab/stanford_alpaca/main/"
        "seed_tasks.jsonl",
        files=("alpaca_seed_tasks.jsonl", "seed_tasks.jsonl"), hub=("yahma/alpaca-cleaned", "tatsu-lab/alpaca")),
    "muse": DataSet(
        "MUSE", "MUSE (muse-bench/MUSE-News, MUSE-Books)",
        "python -c \"import datasets; [datasets.load_dataset('muse-bench/MUSE-News', c) for c in ('raw', "
        "'verbmem', 'knowmem', 'privleak', 'scal', 'sust')]\"",
        folders=("MUSE-News", "MUSE-Books"), hub=("muse-bench/MUSE-News", "muse-bench/MUSE-Books")),
    "wmdp": DataSet(
        "WMDP", "the WMDP corpora",
        "python recipes/data/make_wmdp_corpora.py --bio PATH/bio-forget-corpus.jsonl --out {folder} (the bio "
        "corpus is gated: request it on cais/wmdp-corpora's dataset card)",
        folders=("wmdp",), hub=("cais/wmdp-corpora", "cais/wmdp")),
    "trace": DataSet(
        "TRACE", "the TRACE benchmark",
        "unpack the TRACE-Benchmark archive that https://github.com/BeyonderXX/TRACE's README links, then "
        "ln -s \"$PWD/TRACE-Benchmark/LLM-CL-Benchmark_5000\" {root}",
        folders=("TRACE",)),
})


def data_set_of(path: str | os.PathLike) -> str | None:
    """The name in `DATA_SETS` of the set a local path or `hf:NAME[:CONFIG][@SPLIT]` belongs to: by hub name, then
    by file name, then by a folder on the path; None when none claims it."""
    text = os.fspath(path)
    if text.startswith("hf:"):
        name = text[len("hf:"):].split(":", 1)[0].split("@", 1)[0]
        return next((key for key, data in DATA_SETS.items() if name in data.hub), None)
    parts = PurePath(text).parts
    if not parts:
        return None
    for key, data in DATA_SETS.items():
        if any(fnmatch.fnmatchcase(parts[-1], pattern) for pattern in data.files):
            return key
    folders = [part.lower() for part in parts]  # a folder of the set (eval_data_dir: data/tofu) is one of its paths
    for key, data in DATA_SETS.items():
        if any(folder.lower() in folders for folder in data.folders):
            return key
    return None


def fetch_hint(path: str | os.PathLike) -> str | None:
    """For a data file that is not there: which set it belongs to and the command that fetches it to where it was
    looked for ("TOFU as the DualOptim+ authors ship it: git clone ..."), or None for a file of no known set."""
    key = data_set_of(path)
    if key is None or os.fspath(path).startswith("hf:"):
        return None
    data = DATA_SETS[key]
    pure = PurePath(os.fspath(path))
    lowered = [part.lower() for part in pure.parts]
    root = next((PurePath(*pure.parts[:lowered.index(folder.lower()) + 1]) for folder in data.folders
                 if folder.lower() in lowered[:-1]), pure.parent)
    command = data.fetch.format(folder=str(pure.parent) or ".", path=str(pure), name=pure.name, root=str(root))
    return f"{data.title}: {command} (docs/data-sets.md)"
