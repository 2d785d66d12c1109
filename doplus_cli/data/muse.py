"""MUSE's data (muse-bench/MUSE-News and MUSE-Books): its evaluation sets, read from the hub through `datasets` or
from a local folder in the same layout, and its raw text cut into fixed-length token windows for training.

A local MUSE folder holds one JSON-lines file per hub config and split, with the hub's field names:
`verbmem/forget.jsonl` (prompt, gt), `knowmem/forget_qa.jsonl`, `knowmem/retain_qa.jsonl` and their `_icl` files
(question, answer), `privleak/forget.jsonl`, `privleak/retain.jsonl`, `privleak/holdout.jsonl` (text),
`raw/forget.jsonl`, `raw/retain1.jsonl`, ... (text), and News's `scal/forget_N.jsonl` and `sust/forget_N.jsonl`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from doplus_cli.data.sources import Row, Source, path_problem, read_json_lines
from doplus_cli.errors import UserError
from doplus_cli.hub_errors import bound_hub_waits, dataset_error

# The hub repositories of MUSE's two corpora.
MUSE_HUB = {"news": "hf:muse-bench/MUSE-News", "books": "hf:muse-bench/MUSE-Books"}
MUSE_CORPORA = tuple(MUSE_HUB)
# MUSE's training length (baselines/scripts/unlearn_news.sh and unlearn_books.sh: MAX_LEN=2048): each window is
# the tokenizer's BOS and 2,047 tokens of the raw text.
MUSE_WINDOW = 2048
# The separator MUSE's load_data.py writes between the rows of raw/*.txt, the files its trainer reads.
MUSE_JOIN = "\n\n"

# The fields of each (config, split) the evaluation reads.
EVAL_FIELDS: dict[tuple[str, str], tuple[str, ...]] = {
    ("verbmem", "forget"): ("prompt", "gt"),
    ("knowmem", "forget_qa"): ("question", "answer"),
    ("knowmem", "forget_qa_icl"): ("question", "answer"),
    ("knowmem", "retain_qa"): ("question", "answer"),
    ("knowmem", "retain_qa_icl"): ("question", "answer"),
    ("privleak", "forget"): ("text",),
    ("privleak", "retain"): ("text",),
    ("privleak", "holdout"): ("text",),
}


def muse_data(data: str | None, corpus: str) -> str:
    """The data the muse suite reads: `data` as given, else the corpus's hub repository."""
    if corpus not in MUSE_HUB:
        raise UserError(f"unknown --muse-corpus '{corpus}': choose {' or '.join(MUSE_CORPORA)}")
    if data is None:
        return MUSE_HUB[corpus]
    if not data.startswith("hf:") and not os.path.isdir(data):
        raise UserError(f"{data}: --muse-data is neither a folder nor hf:NAME (a hub dataset in MUSE's layout)")
    return data


def muse_rows(data: str, config: str, split: str, max_rows: int | None = None) -> tuple[list[dict[str, str]], str]:
    """(the rows of MUSE's `config`/`split`, each with its fields as strings; where they come from), from a local
    folder (`<data>/<config>/<split>.jsonl`) or a hub dataset (`hf:NAME`, config `config`, split `split`)."""
    fields = EVAL_FIELDS.get((config, split), ("text",))
    if data.startswith("hf:"):
        return _hub_rows(data[len("hf:"):], config, split, fields, max_rows)
    return _file_rows(str(Path(data) / config / f"{split}.jsonl"), fields, max_rows)


def _file_rows(path: str, fields: Sequence[str], max_rows: int | None) -> tuple[list[dict[str, str]], str]:
    problem = path_problem(path)
    if problem == "file not found":
        raise UserError(f"{path}: not found (a MUSE folder holds <config>/<split>.jsonl files, see "
                        "docs/evaluation.md)")
    if problem is not None:
        raise UserError(f"{path}: {problem}")
    rows = []
    for line in read_json_lines(path, first_line_hint=False):
        record = line.record
        where = f"{path}:{line.number}"
        if not isinstance(record, dict):
            raise UserError(f"{where}: expected a JSON object per line, got {type(record).__name__}")
        rows.append(_checked(record, fields, where))
        if max_rows is not None and len(rows) >= max_rows:
            break
    if not rows:
        raise UserError(f"{path}: no rows")
    return rows, path


def _hub_rows(name: str, config: str, split: str, fields: Sequence[str],
              max_rows: int | None) -> tuple[list[dict[str, str]], str]:
    import datasets

    spec = f"hf:{name}:{config}@{split}"
    bound_hub_waits()
    try:
        table = datasets.load_dataset(name, config, split=split)
    except Exception as error:  # datasets raises many types for "not reachable" / "no such config or split"
        instead = "or make a local MUSE folder where the hub is reachable (docs/evaluation.md), --muse-data FOLDER"
        if (failure := dataset_error(spec, name, error, instead)) is not None:
            raise failure from failure.__cause__  # what the hub answered, itself chained to `error`
        why = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        raise UserError(f"{spec}: cannot load the hub dataset ({why}); make a local MUSE folder where the hub is "
                        "reachable (docs/evaluation.md) and pass --muse-data FOLDER") from error
    missing = [f for f in fields if f not in table.column_names]
    if missing:
        raise UserError(f"{spec}: missing field '{missing[0]}' (columns: {', '.join(sorted(table.column_names))})")
    if max_rows is not None:
        table = table.select(range(min(max_rows, len(table))))
    columns = {f: table[f] for f in fields}
    rows = [_checked({f: columns[f][i] for f in fields}, fields, f"{spec}[{i}]") for i in range(len(table))]
    if not rows:
        raise UserError(f"{spec}: no rows")
    return rows, spec


def _checked(record: dict, fields: Sequence[str], where: str) -> dict[str, str]:
    for field in fields:
        if field not in record:
            raise UserError(f"{where}: missing field '{field}'")
        if not isinstance(record[field], str):
            raise UserError(f"{where}: field '{field}' must be a string, got {type(record[field]).__name__}")
    return {field: record[field] for field in fields}


def window_ids(texts: Sequence[str], tokenizer, window: int) -> list[list[int]]:
    """MUSE's training windows: the texts joined by a blank line and tokenized without special tokens, cut into
    consecutive pieces of `window` tokens less the special tokens the tokenizer adds (its BOS), the last piece
    filled up from the start of the text so that every window is full (MUSE's DefaultDataset rotates it so)."""
    specials = len(tokenizer("", add_special_tokens=True)["input_ids"])
    body = window - specials
    if body < 1:
        raise UserError(f"--text-window {window}: leaves no room for text after the tokenizer's {specials} "
                        "special tokens")
    ids = tokenizer(MUSE_JOIN.join(texts), add_special_tokens=False)["input_ids"]
    if not ids:
        raise UserError("--text-window: the text rows hold no tokens")
    windows = [ids[start:start + body] for start in range(0, len(ids), body)]
    if len(windows[-1]) < body:
        windows[-1] = (windows[-1] + ids * (body // len(ids) + 1))[:body]
    return windows


class TextWindows:
    """A source of text rows seen as MUSE trains on it: fixed windows of `window` tokens over the joined texts
    (`window_ids`), each handed on as the text it decodes to (the batch encodes it again, BOS and all)."""

    def __init__(self, source: Source, tokenizer, window: int) -> None:
        texts = []
        for index in range(len(source)):
            row = source[index]
            if not row.is_text:
                raise UserError(f"{source.name}: row {index + 1} is a question/answer row; --text-window cuts "
                                "sets of text rows only (rows with just a 'text' field)")
            texts.append(row.text)
        self.tokenizer = tokenizer
        self.window = window
        self.windows = window_ids(texts, tokenizer, window)
        self.name = f"{source.name} ({len(self.windows)} windows of {window} tokens)"
        self.text_rows = len(self.windows)
        self.source_rows = len(texts)
        self.task_ids = None  # one set: no forget tasks

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> Row:
        return Row(text=self.tokenizer.decode(self.windows[index], skip_special_tokens=False))
