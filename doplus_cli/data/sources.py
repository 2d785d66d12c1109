"""Forget and retain sets: local JSON-lines files, JSON-array files or Hugging Face hub datasets, read lazily.

A local file is scanned once when it is opened: every line is parsed and checked (so a malformed line 9,000
stops the run before training, not after an hour) and only its byte offset is kept. Rows are read back
from disk by offset when a batch needs them, so a set of any size never sits in memory. A hub dataset is
Arrow memory-mapped by `datasets`, which gives the same random access.
"""

from __future__ import annotations

import bisect
import json
import os
import re
import stat
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from doplus_cli.data.fetching import fetch_hint
from doplus_cli.errors import UserError, shown
from doplus_cli.hub_errors import bound_hub_waits, dataset_error


@dataclass(frozen=True)
class Row:
    """One example: a question with its answer, or a plain text (untargeted corpora)."""

    question: str | None = None
    answer: str | None = None
    text: str | None = None

    @property
    def is_text(self) -> bool:
        return self.text is not None


class Source(Protocol):
    name: str

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Row: ...


@dataclass(frozen=True)
class Keys:
    question: str = "question"
    answer: str = "answer"
    text: str = "text"
    need_answer: bool = True  # False when answers come from the model (`answers_from_model`)
    text_rows: bool = True  # rows with only a text field are an untargeted corpus (False: refused)
    question_flag: str = "--question-key"  # the option that names the question field, for error messages
    answer_flag: str = "--answer-key"  # the option that names the answer field, for error messages
    # Alpaca rows (`doplus align`): the optional field whose text, when not empty, follows the instruction
    # (`question`) after a blank line; rows in Stanford Alpaca's seed-task layout are read too (`_seed_task`).
    input: str | None = None
    input_flag: str = "--input-key"


def alpaca_prompt(instruction: str, input_text: str) -> str:
    """The prompt of an Alpaca row: the instruction, then a blank line and the input when the input is not
    empty (Stanford Alpaca's and Safety-Tuned LLaMAs' convention; the chat template, if any, wraps the whole)."""
    return f"{instruction}\n\n{input_text}" if input_text else instruction


# The longest line of a JSON-lines file doplus reads (64 MiB): a line is held whole while it is parsed, so a file
# without line breaks is refused here rather than read into memory; the longest rows of the sets doplus reads
# (MUSE's raw book text) are far shorter.
MAX_LINE_BYTES = 64 * 2**20
# The largest JSON-array file (256 MiB): an array is parsed whole, in memory; a larger set is written as JSON lines,
# which doplus reads row by row.
MAX_ARRAY_BYTES = 256 * 2**20


def path_problem(path: str | os.PathLike) -> str | None:
    """Why `path` cannot be read as a file, in a few words (None: it is a regular file): not found, a folder, a FIFO,
    a device, a socket. A FIFO or a device is refused rather than read: a data file is read twice (every line
    checked first, then each row by its byte offset), and a read from either may never end."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a broken symbolic link (its target does not exist)" if os.path.islink(path) else "file not found"
    except NotADirectoryError:
        return "file not found (a part of the path is a file, not a folder)"
    except PermissionError:
        return "cannot be read (permission denied)"
    except OSError as error:
        return f"cannot be read ({error.strerror or type(error).__name__})"
    except ValueError:
        return "not a usable path (it holds a NUL character)"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a folder"
    kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "something other than a file")
    return f"is {kind}, not a regular file"


def check_file(path: str | os.PathLike) -> None:
    """A regular file at `path`, or one line naming it and saying what it is instead (`path_problem`)."""
    problem = path_problem(path)
    if problem is not None:
        why = "; doplus reads a data file twice (checked, then row by row)" if "regular" in problem else ""
        hint = fetch_hint(path) if problem.startswith("file not found") else None  # a known set: its command
        raise UserError(f"{path}: {problem}{why}" + (f"; {hint}" if hint else ""))


def parse_json_line(raw: bytes, path: str, line_number: int, first_line_hint: bool = True) -> object:
    """One line of a JSON-lines file, or a one-line error naming the file and line (on line 1, with
    `first_line_hint`, saying that doplus reads one object per line): malformed JSON, bytes that are not UTF-8,
    a NUL byte (a binary or UTF-16 file), nesting deeper than Python's parser takes."""
    where = f"{path}:{line_number}"
    nul = raw.find(b"\0")
    if nul >= 0:
        raise UserError(f"{where}: a NUL byte at column {nul + 1}: not UTF-8 text (a binary file, or UTF-16?); "
                        "doplus reads UTF-8 JSON lines")
    try:
        text = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
    except UnicodeDecodeError as error:
        raise UserError(f"{where}: byte 0x{raw[error.start]:02x} at column {error.start + 1} is not UTF-8; doplus "
                        "reads UTF-8 JSON lines") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise UserError(f"{where}: JSON nested too deeply (more than Python's parser takes)") from None
    except ValueError as error:  # JSONDecodeError, and an integer past Python's digit limit
        hint = " (doplus reads JSON lines: one object per line)" if line_number == 1 and first_line_hint else ""
        reason = getattr(error, "msg", None) or " ".join(str(error).split())[:120]
        raise UserError(f"{where}: malformed JSON ({reason}){hint}") from None


class JsonLine(NamedTuple):
    """A parsed line of a JSON-lines file and where it is: its line number and its bytes in the file."""

    number: int
    start: int
    size: int
    record: object


def read_json_lines(path: str, first_line_hint: bool = True) -> Iterator[JsonLine]:
    """Each non-blank line of a JSON-lines file, parsed as it is reached (`parse_json_line`: a malformed line is
    one error naming the file and line). The forget, retain and evaluation sets, holdout files and judged
    responses are all read here."""
    check_file(path)
    with open(path, "rb") as handle:
        offset, number = 0, 0
        while raw := handle.readline(MAX_LINE_BYTES + 1):
            number += 1
            if len(raw) > MAX_LINE_BYTES:
                raise UserError(f"{path}:{number}: a line longer than {MAX_LINE_BYTES // 2**20} MiB; doplus reads "
                                "JSON lines, one row per line")
            start, offset = offset, offset + len(raw)
            if raw.strip():
                yield JsonLine(number, start, len(raw), parse_json_line(raw, path, number, first_line_hint))


def task_id_of(record: object, where: str) -> int | None:
    """A row's `task_id` (the DualOptim+ authors' TOFU files hold several forget sets per file, told apart by it;
    they write it as a string, "1") as an int, None when the row has none."""
    if not isinstance(record, dict) or record.get("task_id") is None:
        return None
    value = record["task_id"]
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit())):
        raise UserError(f"{where}: field 'task_id' must be a whole number, got {shown(value)}")
    return int(value)


def _seed_task(record: dict, keys: Keys, where: str) -> dict:
    """A row of Stanford Alpaca's `seed_tasks.jsonl` ({"instruction", "instances": [{"input", "output"}]}) as a
    flat Alpaca row; any other record as it is. A seed task with several instances is refused (one row is one
    example here)."""
    instances = record.get("instances")
    if keys.input is None or keys.answer in record or not isinstance(instances, list):
        return record
    if len(instances) != 1 or not isinstance(instances[0], dict):
        raise UserError(f"{where}: 'instances' holds {len(instances)} entries; doplus reads seed tasks with exactly "
                        "one {input, output} instance (write one row per instance)")
    return {**record, **instances[0]}


def _row_from(record: object, keys: Keys, where: str) -> Row:
    """Check one record and turn it into a Row; `where` is 'FILE:LINE' for the error message."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object per line, got {type(record).__name__}")
    record = _seed_task(record, keys, where)
    if keys.question in record:
        question = record[keys.question]
        if not isinstance(question, str):
            raise UserError(f"{where}: field '{keys.question}' must be a string, got {type(question).__name__}")
        if keys.input is not None:
            input_text = record.get(keys.input)
            input_text = "" if input_text is None else input_text
            if not isinstance(input_text, str):
                raise UserError(f"{where}: field '{keys.input}' must be a string, got {type(input_text).__name__} "
                                f"(set {keys.input_flag} to read another field)")
            question = alpaca_prompt(question, input_text)
        if not keys.need_answer:
            return Row(question=question)
        if keys.answer not in record:
            raise UserError(f"{where}: missing field '{keys.answer}' (set {keys.answer_flag} to read another field)")
        answer = record[keys.answer]
        if not isinstance(answer, str):
            raise UserError(f"{where}: field '{keys.answer}' must be a string, got {type(answer).__name__}")
        return Row(question=question, answer=answer)
    if keys.text_rows and keys.text in record and keys.answer not in record:
        text = record[keys.text]
        if not isinstance(text, str):
            raise UserError(f"{where}: field '{keys.text}' must be a string, got {type(text).__name__}")
        return Row(text=text)
    if not keys.text_rows:
        raise UserError(f"{where}: missing field '{keys.question}' (set {keys.question_flag} to read another field)")
    raise UserError(
        f"{where}: missing field '{keys.question}' (set {keys.question_flag} to read another field, "
        f"or give rows with only a '{keys.text}' field for an untargeted corpus)"
    )


class JsonlSource:
    """A JSON-lines file (`.jsonl`, or `.json` holding one object per line) with lazy row access."""

    def __init__(self, path: str, keys: Keys = Keys()) -> None:
        self.name = path
        self.path = path
        self.keys = keys
        check_file(path)
        self._offsets = array("q")
        self._lengths = array("q")
        self._line_numbers = array("q")
        self._task_ids = array("q")  # -1: the row has no task_id
        self.text_rows = 0
        self._handle = None
        self._scan()

    def _scan(self) -> None:
        for line in read_json_lines(self.path):
            where = f"{self.path}:{line.number}"
            row = _row_from(line.record, self.keys, where)
            task = task_id_of(line.record, where)
            self.text_rows += row.is_text
            self._offsets.append(line.start)
            self._lengths.append(line.size)
            self._line_numbers.append(line.number)
            self._task_ids.append(-1 if task is None else task)

    @property
    def task_ids(self) -> list[int | None] | None:
        """Each row's task_id, or None when no row has one."""
        if all(task < 0 for task in self._task_ids):
            return None
        return [None if task < 0 else task for task in self._task_ids]

    def place(self, index: int) -> str:
        """Where row `index` is: FILE:LINE."""
        return f"{self.path}:{self._line_numbers[index]}"

    def _parse(self, raw: bytes, line_number: int) -> Row:
        return _row_from(parse_json_line(raw, self.path, line_number), self.keys, f"{self.path}:{line_number}")

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, index: int) -> Row:
        if self._handle is None:  # one unbuffered handle for the run: one seek and one read per row
            self._handle = open(self.path, "rb", buffering=0)
        self._handle.seek(self._offsets[index])
        return self._parse(self._handle.read(self._lengths[index]), self._line_numbers[index])


class JsonArraySource:
    """A `.json` file holding one JSON array of row objects (as TRACE ships its train.json/test.json files and
    Safety-Tuned LLaMAs its safety_only_data_Instructions.json).

    The whole array is parsed once (such files are small: TRACE's hold 5,000 rows, the safety set 2,483); each
    element is checked and an error names the line it starts on and its position in the array."""

    def __init__(self, path: str, keys: Keys = Keys()) -> None:
        self.name = path
        check_file(path)
        if os.path.getsize(path) > MAX_ARRAY_BYTES:
            raise UserError(f"{path}: a JSON array larger than {MAX_ARRAY_BYTES // 2**20} MiB, which doplus would "
                            "parse whole in memory; write it as JSON lines (one object per line), read row by row")
        with open(path, "rb") as handle:
            raw = handle.read(MAX_ARRAY_BYTES + 1)
        nul = raw.find(b"\0")
        if nul >= 0:
            raise UserError(f"{path}:{_line_at(raw, nul)}: a NUL byte: not UTF-8 text (a binary file, or UTF-16?); "
                            "doplus reads UTF-8 JSON")
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as error:
            raise UserError(f"{path}:{_line_at(raw, error.start)}: byte 0x{raw[error.start]:02x} is not UTF-8; doplus "
                            "reads UTF-8 JSON") from None
        try:
            records = json.loads(text)
        except RecursionError:
            raise UserError(f"{path}:{_too_deep_line(text)}: JSON nested too deeply (more than Python's parser "
                            "takes)") from None
        except ValueError as error:  # JSONDecodeError, and an integer past Python's digit limit
            line = getattr(error, "lineno", None)
            where = f"{path}:{line}" if line else path
            reason = getattr(error, "msg", None) or " ".join(str(error).split())[:120]
            raise UserError(f"{where}: malformed JSON ({reason})") from None
        if not isinstance(records, list):  # pragma: no cover - only called on files that start with "["
            raise UserError(f"{path}: expected a JSON array of objects")
        lines = _element_lines(text, len(records))
        wheres = [f"{path}:{line}: element {i + 1}" for i, line in enumerate(lines)]
        self._wheres = wheres
        self._rows = [_row_from(record, keys, where) for record, where in zip(records, wheres)]
        ids = [task_id_of(record, where) for record, where in zip(records, wheres)]
        self.task_ids = ids if any(task is not None for task in ids) else None
        self.text_rows = sum(row.is_text for row in self._rows)

    def place(self, index: int) -> str:
        """Where row `index` is: FILE:LINE: element N."""
        return self._wheres[index]

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> Row:
        return self._rows[index]


def _too_deep_line(text: str) -> int:
    """The line on which the element of the JSON array `text` starts that is nested too deeply to parse (1 when
    the array cannot be walked element by element)."""
    decoder, position = json.JSONDecoder(), text.find("[") + 1
    while 0 < position < len(text):
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        try:
            _, position = decoder.raw_decode(text, position)
        except RecursionError:
            return text.count("\n", 0, position) + 1
        except ValueError:
            break
    return 1


def _line_at(raw: bytes, offset: int) -> int:
    """The line of `raw` on which byte `offset` lies, from 1."""
    return raw.count(b"\n", 0, offset) + 1


def _element_lines(text: str, count: int) -> list[int]:
    """The line on which each of the `count` elements of the JSON array `text` starts (the text is valid JSON:
    `json.loads` read it first)."""
    decoder = json.JSONDecoder()
    position, line, lines = text.index("[") + 1, 1 + text.count("\n", 0, text.index("[")), []
    for _ in range(count):
        start = position
        while text[position] in " \t\r\n,":
            position += 1
        line += text.count("\n", start, position)
        lines.append(line)
        _, end = decoder.raw_decode(text, position)
        line += text.count("\n", position, end)
        position = end
    return lines


def _starts_with_array(path: str) -> bool:
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as handle:
        return handle.read(4096).lstrip()[:1] == b"["


class HubSource:
    """`hf:NAME[:CONFIG][@SPLIT]` through `datasets` (downloaded once, then Arrow memory-mapped)."""

    def __init__(self, spec: str, keys: Keys = Keys()) -> None:
        self.name = spec
        self.keys = keys
        name, config, split = parse_hub_spec(spec)
        import datasets

        bound_hub_waits()
        try:
            self._data = datasets.load_dataset(name, config, split=split)
        except Exception as error:  # datasets raises many types for "not reachable" / "no such config"
            instead = "or export it to JSON lines where the hub is reachable and pass the file instead"
            failure = dataset_error(spec, name, error, instead)
            if failure is not None:
                raise failure from failure.__cause__  # what the hub answered, itself chained to `error`
            raise UserError(f"{spec}: cannot load the hub dataset ({str(error).splitlines()[0][:200]}); "
                            f"{instead[3:]}") from error
        columns = set(self._data.column_names)
        if keys.question not in columns and (keys.text not in columns or not keys.text_rows):
            raise UserError(f"{spec}: missing field '{keys.question}' (columns: {', '.join(sorted(columns))})")
        if keys.question in columns and keys.need_answer and keys.answer not in columns:
            raise UserError(f"{spec}: missing field '{keys.answer}' (columns: {', '.join(sorted(columns))})")
        self.text_rows = len(self._data) if keys.question not in columns else 0
        self.task_ids = ([task_id_of({"task_id": v}, f"{spec}[{i}]") for i, v in enumerate(self._data["task_id"])]
                         if "task_id" in columns else None)  # locuslab/TOFU has none: one forget set per config

    def __len__(self) -> int:
        return len(self._data)

    def place(self, index: int) -> str:
        """Where row `index` is: SPEC[INDEX]."""
        return f"{self.name}[{index}]"

    def __getitem__(self, index: int) -> Row:
        return _row_from(self._data[int(index)], self.keys, f"{self.name}[{index}]")


class RowRange:
    """Rows [start, stop) of another source: a task's training rows without the rows kept out for evaluation."""

    def __init__(self, source: Source, start: int, stop: int) -> None:
        self.source, self.start, self.stop = source, start, stop
        self.name = source.name
        self.text_rows = getattr(source, "text_rows", 0)  # at most the whole source's

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def task_ids(self) -> list[int | None] | None:
        ids = getattr(self.source, "task_ids", None)
        return None if ids is None else ids[self.start:self.stop]

    def place(self, index: int) -> str:
        return row_place(self.source, self.start + index)

    def __getitem__(self, index: int) -> Row:
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.source[self.start + index]


class RowSubset:
    """The rows of another source at the given indices, in their order: one forget task of the authors' TOFU files,
    or the rows of the tasks that stay in the retain set."""

    def __init__(self, source: Source, indices: Sequence[int], name: str) -> None:
        self.source, self.indices, self.name = source, array("q", indices), name
        self.text_rows = sum(source[i].is_text for i in self.indices) if getattr(source, "text_rows", 0) else 0
        ids = getattr(source, "task_ids", None)
        self.task_ids = None if ids is None else [ids[i] for i in self.indices]

    def place(self, index: int) -> str:
        return row_place(self.source, self.indices[index])

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> Row:
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.source[self.indices[index]]


def row_place(source: Source, index: int) -> str:
    """Where row `index` of `source` is, for a message: FILE:LINE for a file, SPEC[INDEX] for a hub set."""
    place = getattr(source, "place", None)
    return place(index) if place is not None else f"{source.name}: row {index + 1}"


def available_tasks(source: Source) -> list[int]:
    """The task ids a source's rows carry, sorted ([] when its rows have none)."""
    return sorted({task for task in getattr(source, "task_ids", None) or [] if task is not None})


def select_tasks(source: Source, task_ids: Sequence[int], keep: bool = True, name: str | None = None) -> RowSubset:
    """The rows of `source` whose task_id is in `task_ids` (keep=True) or is not (keep=False)."""
    wanted = set(task_ids)
    ids = getattr(source, "task_ids", None) or []
    indices = [i for i, task in enumerate(ids) if (task in wanted) == keep]
    return RowSubset(source, indices, name or source.name)


def task_rows(source: Source, spec: str, task_id: int) -> RowSubset:
    """One forget task of a file whose rows carry `task_id`; a task the file does not hold is one line naming the
    file and the ids it has."""
    have = available_tasks(source)
    untasked = next((i for i, task in enumerate(getattr(source, "task_ids", None) or []) if task is None), None)
    if have and untasked is not None:  # such a row belongs to no task: it would be left out without a word
        raise UserError(f"{row_place(source, untasked)}: missing field 'task_id', which the file's other rows carry "
                        f"(task ids {_id_list(have)}): give every row of a file of forget tasks its task_id")
    if task_id not in have:
        raise UserError(f"{spec}: no rows with task_id {task_id} (its rows have task ids {_id_list(have)})")
    return select_tasks(source, [task_id], name=f"{spec} (task {task_id})")


def _id_list(ids: Sequence[int]) -> str:
    return ", ".join(map(str, ids))


class MixtureSource:
    """Several sources as one set, their rows one after the other. An `IndexStream` over it walks a permutation
    of the union, so each batch is a draw without replacement from all rows together: every source's share of
    a batch is, on average, its share of the rows, and one pass over the mixture takes every row once.
    `part_of(i)` is the index (in `part_names`) of the source that row i comes from."""

    def __init__(self, parts: Sequence[tuple[str, Source]]) -> None:
        self.part_names = tuple(name for name, _ in parts)
        self.sources = [source for _, source in parts]
        self.starts = [0]
        for source in self.sources:
            self.starts.append(self.starts[-1] + len(source))
        self.name = " + ".join(source.name for source in self.sources)
        self.text_rows = sum(getattr(source, "text_rows", 0) for source in self.sources)

    def __len__(self) -> int:
        return self.starts[-1]

    def part_of(self, index: int) -> int:
        if not 0 <= index < len(self):
            raise IndexError(index)
        return bisect.bisect_right(self.starts, index) - 1

    def __getitem__(self, index: int) -> Row:
        part = self.part_of(index)
        return self.sources[part][index - self.starts[part]]


def parse_hub_spec(spec: str) -> tuple[str, str | None, str]:
    """`hf:NAME[:CONFIG][@SPLIT]` or `hf:NAME:CONFIG/SPLIT` (MUSE's `hf:muse-bench/MUSE-News:raw/forget`) ->
    (name, config, split); the split defaults to train."""
    body = spec[len("hf:"):]
    body, _, split = body.partition("@")
    name, _, config = body.partition(":")
    if "/" in config and not split:
        config, _, split = config.partition("/")
    if not name:
        raise UserError(f"{spec}: write a hub dataset as hf:NAME[:CONFIG][@SPLIT], e.g. hf:locuslab/TOFU:forget10")
    return name, config or None, split or "train"


_ROW_RANGE = re.compile(r"^(?P<base>.+)\[(?P<start>\d*):(?P<stop>\d*)\]$")


def open_source(spec: str, role: str, keys: Keys = Keys()) -> Source:
    """Open the forget or retain set named by `spec`; an empty set is an error.

    A local file may end in `[START:STOP]` (Python slice bounds, either may be left out) to take those rows
    only: `retain90.json[:80]` is its first 80 rows (a hub split takes datasets' own `@train[:80]`)."""
    match = _ROW_RANGE.match(spec)
    if match and not spec.startswith("hf:") and not os.path.exists(spec):
        whole = open_source(match["base"], role, keys)
        start = int(match["start"]) if match["start"] else 0
        stop = int(match["stop"]) if match["stop"] else len(whole)
        if not start < stop <= len(whole):
            raise UserError(f"{spec}: rows [{start}:{stop}] are not within the {len(whole)} rows of {match['base']}")
        return RowRange(whole, start, stop)
    if spec.startswith("hf:"):
        source: Source = HubSource(spec, keys)
    elif _starts_with_array(spec):
        source = JsonArraySource(spec, keys)
    else:
        source = JsonlSource(spec, keys)
    if len(source) == 0:
        raise UserError(f"{spec}: the {role} set is empty")
    return source
