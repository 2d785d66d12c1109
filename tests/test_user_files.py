"""A user's files are never deleted or written over: an output folder's record (ownership.py) lists what doplus
wrote there, `--overwrite` removes exactly that, `--resume` needs a run that was started, and the folder's lock is
never taken from the run that holds it.

The documented flow comes first: `doplus recipes copy quickstart my-run/`, then a run with `--out my-run`, which
must keep the recipe's own data/ whether or not `--overwrite` is given."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from doplus_cli import lifecycle, ownership
from doplus_cli.errors import UserError
from tests.helpers import run_cli, write_sets


@pytest.fixture(scope="module")
def data(tofu_dir, tmp_path_factory):
    return write_sets(tofu_dir, tmp_path_factory.mktemp("user-files-data"), 6, 8)


def args(model, data, out, *extra):
    return ["unlearn", "--model", model, "--forget", data / "forget.jsonl", "--retain", data / "retain.jsonl",
            "--loss", "GA+GD", "--steps", 2, "--lr", 1e-3, "--batch-size", 2, "--max-length", 48,
            "--show-samples", 0, "--out", out, *extra]


def tree(folder: Path) -> dict[str, str]:
    """Every file under `folder` (lock files aside) with the sha256 of its contents."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.name.startswith(".doplus")}


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


def test_the_documented_recipes_copy_flow_keeps_the_recipes_own_data(tiny_chat_llama, tmp_path, capsys):
    """`recipes copy quickstart my-run/` puts the recipe's data in my-run/data/; a run with --out my-run (the
    model's own answers go to answers/, not data/) then works, and so does the same run with --overwrite, and the
    data is byte for byte what was copied."""
    folder = tmp_path / "my-run"
    assert run_cli("recipes", "copy", "quickstart", f"{folder}/") == 0
    copied = tree(folder)
    assert any(name.startswith("data/") for name in copied)
    run = ["unlearn", "--recipe", folder / "quickstart.yaml", "--out", folder, "--model", tiny_chat_llama,
           "--steps", 2, "--max-new-tokens", 4, "--show-samples", 0, "--max-length", 48]
    assert run_cli(*run) == 0
    assert (folder / "final").is_dir() and (folder / "answers" / "forget.jsonl").is_file()
    assert {k: v for k, v in tree(folder).items() if k in copied} == copied
    capsys.readouterr()
    assert run_cli(*run) == 2  # a run is there now: replacing it needs --overwrite
    line = error_line(capsys)
    assert "holds a `doplus unlearn` started" in line and "--overwrite" in line, line
    assert run_cli(*run, "--overwrite") == 0
    assert {k: v for k, v in tree(folder).items() if k in copied} == copied
    record = ownership.read(folder)
    assert "data" not in record["entries"] and "answers" in record["entries"]


def test_overwrite_removes_exactly_what_the_run_recorded(tiny_llama, data, tmp_path, capsys):
    """User files beside a run (made before it, and after it) survive --overwrite; the run's own entries are
    replaced; a user file where the run must write stops the run in one line, with or without --overwrite, and
    is left as it was."""
    out = tmp_path / "out"
    (out / "mine").mkdir(parents=True)
    (out / "mine" / "notes.txt").write_text("mine\n")
    (out / "evals").mkdir()  # the run writes evals/ only with --eval-every: this one is the user's
    (out / "evals" / "keep.txt").write_text("mine too\n")
    assert run_cli(*args(tiny_llama, data, out)) == 0
    (out / "later.txt").write_text("written after the run\n")
    before = tree(out)
    first = json.loads((out / "report.json").read_text())["wall_time_s"]
    assert run_cli(*args(tiny_llama, data, out, "--overwrite")) == 0
    after = tree(out)
    for name in ("mine/notes.txt", "evals/keep.txt", "later.txt"):
        assert after[name] == before[name]
    assert json.loads((out / "report.json").read_text())["wall_time_s"] != first  # replaced, not kept
    assert "evals" not in ownership.read(out)["entries"]

    clash = tmp_path / "clash"
    clash.mkdir()
    (clash / "report.md").write_text("my own report\n")
    for extra in ((), ("--overwrite",)):
        capsys.readouterr()
        assert run_cli(*args(tiny_llama, data, clash, *extra)) == 2
        line = error_line(capsys)
        assert f"{clash / 'report.md'}: exists and doplus did not write it" in line, line
        assert (clash / "report.md").read_text() == "my own report\n"
        assert not (clash / "config.yaml").exists() and not (clash / ownership.RECORD_NAME).exists()


def test_resume_where_no_run_was_started_refuses_and_deletes_nothing(tiny_llama, data, tmp_path, capsys,
                                                                      monkeypatch, tofu_dir):
    """The README's layout: TOFU in data/tofu/ of the working directory, and `--out . --resume` there."""
    work = tmp_path / "work"
    (work / "data" / "tofu").mkdir(parents=True)
    for name in ("forget10.json", "retain90.json"):
        if (tofu_dir / name).is_file():
            shutil.copy(tofu_dir / name, work / "data" / "tofu" / name)
    (work / "data" / "tofu" / "notes.txt").write_text("mine\n")
    before = tree(work)
    monkeypatch.chdir(work)
    capsys.readouterr()
    assert run_cli(*args(tiny_llama, data, ".", "--resume")) == 2
    line = error_line(capsys)
    assert "no `doplus unlearn` was started here" in line and "nothing to resume" in line, line
    assert tree(work) == before


def test_a_damaged_or_foreign_record_is_one_line_and_nothing_is_deleted(tiny_llama, data, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious").mkdir()
    (out / "precious" / "thesis.tex").write_text("years of work\n")
    for record in ('{"format": 1, "command": "doplus unlearn", "entries": ["../precious"]}',
                   '{"format": 1, "command": "doplus unlearn", "entries": ["precious/thesis.tex"]}',
                   '{"format": 1, "command": "doplus unlearn", "entries": ',
                   '[' * 100_000):
        (out / ownership.RECORD_NAME).write_text(record)
        capsys.readouterr()
        assert run_cli(*args(tiny_llama, data, out, "--overwrite")) == 2
        line = error_line(capsys)
        assert "unreadable record of what doplus wrote" in line and len(line) < 400, line
        assert (out / "precious" / "thesis.tex").read_text() == "years of work\n"
    (out / ownership.RECORD_NAME).write_text('{"format": 1, "command": "doplus evaluate", "entries": ["precious"]}')
    assert run_cli(*args(tiny_llama, data, out, "--overwrite")) == 2
    assert "holds the files of a `doplus evaluate`" in error_line(capsys)
    assert (out / "precious" / "thesis.tex").is_file()


@pytest.mark.parametrize("extra,expected", [
    (("--resume", "--overwrite"), "--resume and --overwrite"),
    (("--keep-last", 0), "--keep-last"),
    (("--accept-unverified",), "--accept-unverified applies to a resumed run"),
    (("--fsdp",), "--fsdp shards"),
])
def test_flags_that_contradict_each_other_or_mean_nothing_are_refused(tiny_llama, data, tmp_path, capsys, extra,
                                                                      expected):
    out = tmp_path / "out"
    capsys.readouterr()
    assert run_cli(*args(tiny_llama, data, out, *extra)) == 2
    line = error_line(capsys)
    assert expected in line, line
    assert not out.exists() or not any(out.iterdir())


def _holder_file(folder: Path) -> None:
    (folder / lifecycle.HOLDER_NAME).write_text(json.dumps({"host": "h", "pid": 1, "command": "doplus unlearn",
                                                            "since": "now"}))


def test_a_start_that_loses_the_race_for_a_new_folder_never_removes_the_winners_lock_or_folder(tmp_path,
                                                                                                monkeypatch):
    """This start creates the folder, and another run takes its lock first (between this one's mkdir and its lock):
    this one stops in one line, and the winner's lock file, holder file and folder stay."""
    folder = tmp_path / "new"
    winner: dict[str, lifecycle.FolderLock] = {}
    real_flock = fcntl.flock

    def winner_first(fd, operation):
        if not winner:
            lock = lifecycle.FolderLock(folder / lifecycle.LOCK_NAME)
            winner["lock"] = lock  # its own descriptor: flock refuses this start's
            assert lock.acquire(blocking=False)
            _holder_file(folder)
        return real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", winner_first)
    with pytest.raises(lifecycle.FolderInUse, match="another doplus run holds this folder"):
        with lifecycle.run_guard():
            lifecycle.hold(folder, "doplus unlearn")
    monkeypatch.setattr(fcntl, "flock", real_flock)
    assert (folder / lifecycle.LOCK_NAME).is_file() and (folder / lifecycle.HOLDER_NAME).is_file()
    assert lifecycle.in_use(folder) is not None  # still held, by the winner
    winner["lock"].release()


def test_a_lock_granted_on_a_file_its_holder_removed_is_not_held(tmp_path, monkeypatch):
    """A start opened the lock file just before its holder removed it (a run that failed on bad input removes the
    folder it created) and is granted the lock just after, while a third run holds the file now at the path: the
    late start must see the folder as held, never believe it holds it beside the third."""
    folder = tmp_path / "f"
    folder.mkdir()
    first = lifecycle.FolderLock(folder / lifecycle.LOCK_NAME)
    assert first.acquire(blocking=False)
    third: dict[str, lifecycle.FolderLock] = {}
    real_flock = fcntl.flock

    def holder_leaves_and_a_third_run_comes(fd, operation):
        if not third:  # the late start's flock (the holder's release and the third's lock call it too)
            third["lock"] = lock = lifecycle.FolderLock(folder / lifecycle.LOCK_NAME)
            (folder / lifecycle.LOCK_NAME).unlink()  # the holder's clean-up
            first.release()
            assert lock.acquire(blocking=False)  # a new file at the path
        return real_flock(fd, operation)

    late = lifecycle.FolderLock(folder / lifecycle.LOCK_NAME)
    monkeypatch.setattr(fcntl, "flock", holder_leaves_and_a_third_run_comes)
    assert late.acquire(blocking=False) is False
    third["lock"].release()
    assert late.acquire(blocking=False) is True  # free now: taken on the file at the path
    late.release()


def test_a_folder_gone_reads_as_held_and_is_not_made_again(tmp_path):
    """The lock never creates its folder: one its holder removed reads as held (a listing or a late start leaves no
    folder behind)."""
    gone = tmp_path / "gone"
    assert lifecycle.FolderLock(gone / lifecycle.LOCK_NAME).acquire(blocking=False) is False
    assert not gone.exists()


def test_a_blocking_acquire_waits_for_the_holder_and_then_holds(tmp_path):
    """`shared_turn`'s wait: a second lock on the file waits while the first is held (by another thread: its own
    open file) and holds once it is let go; a third then finds it held."""
    first, second = (lifecycle.FolderLock(tmp_path / lifecycle.SHARED_LOCK_NAME) for _ in range(2))
    assert first.acquire(blocking=False)
    got = threading.Event()
    waiter = threading.Thread(target=lambda: second.acquire(blocking=True) and got.set(), daemon=True)
    waiter.start()
    assert not got.wait(0.3)  # still held by the first
    first.release()
    waiter.join(timeout=30)
    assert got.is_set()
    assert lifecycle.FolderLock(tmp_path / lifecycle.SHARED_LOCK_NAME).acquire(blocking=False) is False
    second.release()


def test_a_lock_file_that_cannot_be_opened_is_one_line(tmp_path):
    folder = tmp_path / "odd"
    (folder / lifecycle.LOCK_NAME).mkdir(parents=True)  # a folder where the lock file goes
    with pytest.raises(UserError, match=r"\.doplus\.lock: cannot create the folder's lock \(Is a directory\)$"):
        lifecycle.FolderLock(folder / lifecycle.LOCK_NAME).acquire(blocking=False)


def test_a_file_system_without_locks_is_one_line(tmp_path, monkeypatch):
    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with pytest.raises(UserError, match="cannot lock the folder"):
        with lifecycle.run_guard():
            lifecycle.hold(tmp_path / "nfs", "doplus unlearn")
    assert not (tmp_path / "nfs").exists()  # created by this start, which held nothing: removed again


def test_files_a_run_writes_follow_the_umask(tiny_llama, data, tmp_path):
    """safetensors writes its files 0600; a run's weights are readable as the process's umask says, like every
    other file it writes (colleagues on a shared cluster read final/)."""
    previous = os.umask(0o022)
    try:
        out = tmp_path / "shared"
        assert run_cli(*args(tiny_llama, data, out, "--steps", 3, "--save-every", 2)) == 0
    finally:
        os.umask(previous)
    for path in (out / "final" / "model.safetensors", out / "checkpoints" / "step-2" / "model.safetensors",
                 out / "checkpoints" / "step-2" / "optimizer.pt", out / "report.json", out / "config.yaml"):
        assert oct(path.stat().st_mode & 0o777) == oct(0o644), path


@settings(derandomize=True, database=None, deadline=None, max_examples=150)
@given(st.one_of(st.binary(max_size=300), st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)),
    max_leaves=20).map(lambda value: json.dumps(value).encode())))
def test_any_record_file_is_read_or_refused_in_one_line(content):
    """A folder's record comes with the folder (a run copied from a colleague, a cluster's scratch): any bytes
    are a record of names of the folder's own entries, or one line; never another exception, never a path outside
    the folder."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / ownership.RECORD_NAME).write_bytes(content)
        try:
            record = ownership.read(Path(folder))
        except UserError as error:
            assert "\n" not in str(error) and len(str(error)) < 400
            return
        assert isinstance(record["command"], str)
        assert all("/" not in name and name not in ("", ".", "..") for name in record["entries"])


def test_a_data_file_edited_while_the_run_reads_it_stops_the_run_at_the_next_checkpoint(tiny_llama, data, tmp_path,
                                                                                         capsys, monkeypatch):
    """Rows are read from disk as batches need them: a same-length edit of the forget file during the run (its
    row count and size unchanged) is caught at the next checkpoint, named in one line, and nothing is saved from
    the steps that may have read it."""
    from doplus_cli.engine import checkpoint

    forget = tmp_path / "forget.jsonl"
    shutil.copy(data / "forget.jsonl", forget)
    real = checkpoint.non_finite_in

    edited = []

    def edit_first(*a, **k):  # the first thing a checkpoint does: the edit lands just before it
        if not edited:
            text = forget.read_text()
            at = text.index('"answer": "') + 12  # one letter of the first answer, the length unchanged
            forget.write_text(text[:at] + ("x" if text[at] != "x" else "y") + text[at + 1:])
            edited.append(at)
        return real(*a, **k)

    monkeypatch.setattr(checkpoint, "non_finite_in", edit_first)
    out = tmp_path / "out"
    capsys.readouterr()
    code = run_cli("unlearn", "--model", tiny_llama, "--forget", forget, "--retain", data / "retain.jsonl",
                   "--loss", "GA+GD", "--steps", 4, "--save-every", 2, "--batch-size", 2, "--max-length", 48,
                   "--show-samples", 0, "--out", out)
    line = error_line(capsys)
    assert code == 2 and f"{forget} (edited, same 6 rows): changed while the run was reading it" in line, line
    assert edited and not (out / "checkpoints" / "step-2").exists() and not (out / "report.json").exists()
