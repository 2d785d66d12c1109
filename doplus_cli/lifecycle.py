"""A run's life in its output folder: one run per folder, and SIGTERM or Ctrl-C from the run's first second.

One run per folder: the run holds an advisory lock on `OUT/.doplus.lock` (the operating system's `flock` through
filelock, `FolderLock`) from its start to its end, so a second start on the same folder stops at once with one
line naming the holder (host, process id, since when; from `OUT/.doplus-holder.json`). The operating system
releases the lock when the holding process ends, however it ends, so a killed run leaves nothing to clear by hand.
A launch of several processes is held by the process that launches them (doplus's `--num-processes`) or by the
first process (`RANK` 0 under `accelerate launch` or torchrun): the others never wait on it.

Signals: `run_guard()` installs the SIGTERM and SIGINT handler when a command starts. Until the run has something
worth a checkpoint (loading, teaching, answers from the model, the evaluation before training; every moment of
`doplus evaluate`) a signal ends it at once with `Stopped` (exit code 128 + the signal's number): nothing is lost,
the same command with `--resume` starts it again. While it trains (`StopRequest.deferred()`) a signal only marks the
stop, and the loop ends after the current step with a checkpoint.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

from doplus_cli import ownership
from doplus_cli.errors import EXIT_FILE_VARIABLE, UserError, writing
from doplus_cli.files import atomic_write_text
from doplus_cli.ownership import RECORD_NAME

LOCK_NAME = ".doplus.lock"
HOLDER_NAME = ".doplus-holder.json"
# Several processes that share a folder (the workers of a bench grid run as a job array) take this one in turn, for
# the moment they write what they share (the bench's index, its tables).
SHARED_LOCK_NAME = ".doplus-shared.lock"
LOCK_FILES = (LOCK_NAME, HOLDER_NAME, SHARED_LOCK_NAME)  # never part of a run: left out of "is the folder empty"
# Internal plumbing, not a user setting: the folders this process holds, as `PATH=PID` entries; the processes it
# starts (the workers of a `--num-processes` launch) inherit them and do not wait on their launcher's lock.
HELD_VARIABLE = "DOPLUS_HELD_FOLDERS"
# `off`: no lock, for a file system without working locks (Lustre mounted without `flock`); one run per folder is
# then the user's to keep.
LOCK_SWITCH = "DOPLUS_FOLDER_LOCK"


class FolderInUse(UserError):
    """Another run holds the folder: one line naming it, exit code 2."""


class Resumable:
    """What an error that a signal ends a command with knows about continuing it: its one line, and with
    `continued(command_line)` the command that continues it, built from the arguments the command was invoked with.
    The CLI gives its own; a library caller that has no command line says the line without it (`str`), so no hint
    ever names another process's arguments."""

    lead = "continue with"  # the words before the command
    processes = 1  # the command continues on this many processes (`--num-processes`)

    def continued(self, command_line: Sequence[str] | None) -> str:
        if command_line is None:
            return str(self)
        return f"{self}; {self.lead}: {resume_command(command_line, self.processes)}"


class Stopped(Resumable, BaseException):
    """SIGTERM or SIGINT before anything needed a checkpoint: the command ends at once with 128 + the signal's
    number. A BaseException, so that no `except Exception` on the way (a judge that may fail to load) takes it for
    an ordinary failure and carries on."""

    def __init__(self, number: int, stage: str | None) -> None:
        during = f" while {stage}" if stage else ""
        super().__init__(f"stopped by {signal.Signals(number).name}{during}; nothing was lost")
        # a worker of `--num-processes N` (its launcher left it the exit file): the command takes N again
        self.processes = int(os.environ.get("WORLD_SIZE", "1")) if os.environ.get(EXIT_FILE_VARIABLE) else 1
        self.exit_code = 128 + number


def resume_command(command_line: Sequence[str], processes: int = 1) -> str:
    """The command line that continues `doplus ARGS` (`command_line`: ARGS): the same arguments with `--resume`,
    without `--overwrite`, with `--num-processes` when it ran on several (a bench continues by itself: the same
    arguments)."""
    argv = [str(a) for a in command_line if a != "--overwrite"]
    if next((a for a in argv if not a.startswith("-")), None) == "bench":
        return "doplus " + " ".join(shlex.quote(a) for a in argv)
    if "--resume" not in argv:
        argv.append("--resume")
    if processes > 1 and not any(a.startswith("--num-processes") for a in argv):
        argv += ["--num-processes", str(processes)]
    return "doplus " + " ".join(shlex.quote(a) for a in argv)


class StopRequest:
    """The SIGTERM (a cluster preempting the job) and SIGINT (Ctrl-C) handler of one command. Outside `deferred()` a
    signal raises `Stopped` at once; inside, it is recorded and the training loop stops after the current step,
    with a checkpoint, instead of being killed mid-step."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.signal_number = 0
        self.stage: str | None = None  # what the command is doing, for the line a signal ends it with
        self._deferring = 0
        self._previous: dict[int, Any] = {}

    def _handle(self, number, frame) -> None:
        self.signal_number, self.signal_name = number, signal.Signals(number).name
        if not self._deferring:
            raise Stopped(number, self.stage)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """Inside: a signal is recorded for `requested`, the loop's check after each step."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1

    def requested(self, accelerator) -> bool:
        """Whether any process was signalled: all processes stop after the same step."""
        if accelerator.num_processes == 1:
            return self.signal_name is not None
        import torch

        flag = torch.tensor([float(self.signal_name is not None)], device=accelerator.device)
        if accelerator.reduce(flag, reduction="sum").item() > 0:
            if self.signal_name is None:
                self.signal_number, self.signal_name = int(signal.SIGTERM), "SIGTERM (on another process)"
            return True
        return False

    def install(self) -> None:
        """The handler for SIGTERM and SIGINT (on the main thread only: Python delivers signals there); again is a
        no-op."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for number in (signal.SIGTERM, signal.SIGINT):
            self._previous[number] = signal.signal(number, self._handle)

    def restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()


class _Guard:
    """The outermost `run_guard`: its stop handler and the folder locks taken under it."""

    def __init__(self) -> None:
        self.stop = StopRequest()
        self.locks = ExitStack()
        self.held: set[str] = set()


_ACTIVE: list[_Guard] = []


@contextmanager
def run_guard() -> Iterator[StopRequest]:
    """A command's stop handler and folder locks, from its first second to its end. A guard inside another (the
    teaching stage's run inside a command, the engine's inside the CLI's) shares the outer one."""
    if _ACTIVE:
        yield _ACTIVE[0].stop
        return
    guard = _Guard()
    _ACTIVE.append(guard)
    try:
        guard.stop.install()
        with guard.locks:
            yield guard.stop
    finally:
        guard.stop.restore()
        _ACTIVE.remove(guard)


def stage(what: str) -> None:
    """Say what the command does now, for the line a signal ends it with."""
    if _ACTIVE:
        _ACTIVE[0].stop.stage = what


def hold(folder: str | os.PathLike, command: str) -> Path:
    """Lock `folder` (created if missing) for `command` until the outermost `run_guard` ends; refuse one another
    run holds, in one line naming it. Not taken by a worker whose launcher or first process holds it."""
    if not _ACTIVE:
        raise RuntimeError("hold() needs an active run_guard()")
    return _ACTIVE[0].locks.enter_context(holding(folder, command))


@contextmanager
def holding(folder: str | os.PathLike, command: str) -> Iterator[Path]:
    """`hold()` for a block: the folder is released when the block ends (a bench holds each run's folder while it
    runs that run, and the run's own process, which inherits the hold, does not wait on it)."""
    if not _ACTIVE:
        raise RuntimeError("holding() needs an active run_guard()")
    guard = _ACTIVE[0]
    path, created = _folder(folder)
    key = os.path.realpath(path)
    if (key in guard.held or _held_by_launcher(key) or _locks_off()
            or os.environ.get("RANK", "0") != "0"):  # a torchrun worker: its first process holds it
        try:
            yield path
        finally:
            if created:  # no lock here: only an empty folder goes
                with suppress(OSError):
                    path.rmdir()
        return
    with _folder_lock(path, key, command, created):
        guard.held.add(key)
        try:
            yield path
        finally:
            guard.held.discard(key)


def in_use(folder: str | os.PathLike) -> str | None:
    """Who holds `folder` (as `holder()` says it), or None when no process does. The lock is tried and at once let
    go; a folder without a lock file was never held. Another process's start in that same instant would find the
    folder held, so this is for listing, never called on a folder a run is about to take."""
    path = Path(folder)
    if not (path / LOCK_NAME).is_file() or _locks_off():
        return None
    if os.path.realpath(path) in (_ACTIVE[0].held if _ACTIVE else set()):
        return holder(path)
    lock = FolderLock(path / LOCK_NAME)
    try:
        if not lock.acquire(blocking=False):
            return holder(path)
    except UserError:
        return None
    lock.release()
    return None


@contextmanager
def shared_turn(folder: str | os.PathLike) -> Iterator[None]:
    """The turn of this process among those that share `folder` (a bench's job-array workers): it waits for the
    others' (each a moment's writing, or the starting model's one evaluation). Not the folder's run lock: a folder
    one process holds for hours can still be shared this way."""
    path, _ = _folder(folder)
    if _locks_off():
        yield
        return
    lock = FolderLock(path / SHARED_LOCK_NAME)
    lock.acquire(blocking=True)
    try:
        yield
    finally:
        lock.release()


def _locks_off() -> bool:
    return os.environ.get(LOCK_SWITCH, "").lower() == "off"


class FolderLock:
    """An exclusive lock on a lock file, held until `release()` or the end of the process: filelock's
    `UnixFileLock` (the operating system's `flock`), one open file per instance, so two instances exclude each other
    in one process as in two.

    A lock granted on a file its holder removed meanwhile is not held: a run that created a folder and wrote nothing
    into it removes the folder again, lock file included, while it holds the lock, and a start that opened the old
    file just before and is granted its lock just after would otherwise hold a lock nobody else can see, beside a
    run that takes the new one. filelock (4.3.1 and later) refuses a lock granted on a file with no name left
    (`st_nlink` 0): a blocking acquire tries again, a non-blocking one reads it as held."""

    def __init__(self, file: Path) -> None:
        self.file = Path(file)
        self.lock: Any = None  # the held `UnixFileLock`

    def acquire(self, blocking: bool) -> bool:
        """Take the lock (waiting for it when `blocking`); False when another process holds it. A file system that
        refuses locks is one line (no soft lock instead: a marker file outlives a killed holder); a folder that is
        gone reads as held (its holder removed it)."""
        from filelock import Timeout, UnixFileLock

        if not self.file.parent.is_dir():  # filelock would create the folder again
            return False
        lock = UnixFileLock(self.file, thread_local=False, fallback_to_soft=False)
        try:
            lock.acquire(blocking=blocking)
        except Timeout:  # held, or granted on a file its holder removed (then the folder is gone too)
            return False
        except OSError as error:
            raise _lock_error(self.file, error) from None
        self.lock = lock
        return True

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def _lock_error(file: Path, error: OSError) -> UserError:
    """The line for filelock's OSError: the lock file could not be opened (or created), or the file system refused
    the lock on it; an open of the file tells which."""
    try:
        os.close(os.open(file, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666))
    except OSError:
        return UserError(f"{file}: cannot create the folder's lock ({error.strerror or error})")
    return UserError(f"{file}: cannot lock the folder ({error.strerror or error}); on Lustre mount with -o flock, or "
                     f"set {LOCK_SWITCH}=off and keep to one run per folder yourself")


def _folder(folder: str | os.PathLike) -> tuple[Path, bool]:
    """(`folder`, whether this call created it): made with one `mkdir`, so of several starts that race for a new
    folder exactly one creates it, and only that one may ever remove it."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise UserError(f"{folder}: --out exists and is a file, not a folder")
    with writing(path, "; choose another --out"):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir()
        except FileExistsError:
            if not path.is_dir():
                raise UserError(f"{folder}: --out exists and is a file, not a folder") from None
            return path, False
    return path, True


def _remove_if_unused(path: Path) -> None:
    """Remove a folder this process created and holds the lock of, when nothing but the lock's files (and a record
    of entries none of which were written) is in it: a run that failed on bad input leaves no folder behind. Called
    while the lock is held, so no other run can have taken the folder; the lock file goes last before the folder."""
    try:
        if not path.is_dir() or folder_entries(path):
            return
        for name in (HOLDER_NAME, RECORD_NAME, SHARED_LOCK_NAME, LOCK_NAME):
            (path / name).unlink(missing_ok=True)
        path.rmdir()
    except OSError:
        pass  # a file appeared meanwhile: the folder is in use, leave it


_HELD_LOCK = threading.Lock()  # a bench's --parallel workers take and let go of run folders from several threads


def _held_entries() -> list[str]:
    return [entry for entry in os.environ.get(HELD_VARIABLE, "").split(os.pathsep) if entry]


def _mark_held(entry: str, held: bool) -> None:
    """Add `entry` (FOLDER=PID) to the folders this process holds, as the processes it starts inherit them, or take
    it out again, leaving those another thread holds meanwhile."""
    with _HELD_LOCK:
        entries = _held_entries()
        if held:
            entries.append(entry)
        elif entry in entries:
            entries.remove(entry)
        if entries:
            os.environ[HELD_VARIABLE] = os.pathsep.join(entries)
        else:
            os.environ.pop(HELD_VARIABLE, None)


def environment() -> dict[str, str]:
    """A copy of this process's environment for a process it starts, taken while no other thread changes the
    folders it holds."""
    with _HELD_LOCK:
        return dict(os.environ)


def _held_by_launcher(key: str) -> bool:
    entries = dict(entry.rsplit("=", 1) for entry in _held_entries() if "=" in entry)
    return key in entries and entries[key] != str(os.getpid())


@contextmanager
def _folder_lock(path: Path, key: str, command: str, created: bool) -> Iterator[None]:
    lock = FolderLock(path / LOCK_NAME)
    try:
        acquired = lock.acquire(blocking=False)
    except UserError:
        if created:  # a file system where no process can hold the folder: the one this start made goes again
            _remove_if_unused(path)
        raise
    if not acquired:
        raise FolderInUse(f"{path}: another doplus run holds this folder ({holder(path)}); wait for it to end, "
                          "or choose another --out")
    entry = f"{key}={os.getpid()}"
    marked = False
    try:
        atomic_write_text(path / HOLDER_NAME, json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(), "command": command,
             "since": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime())}) + "\n")
        _mark_held(entry, True)
        marked = True
        yield
    finally:
        if marked:
            _mark_held(entry, False)
        (path / HOLDER_NAME).unlink(missing_ok=True)  # still locked: no other run has written its own yet
        if created:
            _remove_if_unused(path)
        lock.release()


def holder(path: Path) -> str:
    """`doplus unlearn on host H, process P, since T`, from the holder's side file."""
    try:
        info = json.loads((path / HOLDER_NAME).read_text())
        return (f"{info['command']} on host {info['host']}, process {info['pid']}, since {info['since']}")
    except (OSError, ValueError, KeyError):
        return "its holder has not written who it is yet"


def folder_entries(path: Path) -> list[Path]:
    """The folder's entries other than the lock's files and a record of entries none of which exist
    (ownership.py)."""
    entries = [p for p in path.iterdir() if p.name not in LOCK_FILES and not p.name.startswith(HOLDER_NAME)]
    record = path / RECORD_NAME
    if record in entries:
        try:
            written = ownership.present(path, ownership.read(path))
        except UserError:
            written = [RECORD_NAME]  # a damaged record: the folder is not empty
        if not written:
            entries.remove(record)
    return entries
