"""One registry type for every table of named, pluggable things: losses, schemes, suites, attacks, metrics,
prompt templates, protocols, options, commands, bench adapters.

A `Registry` maps names to entries of one declared type, in the order they were registered, and is read as a
mapping (`name in registry`, `registry[name]`, iteration, `.items()`). It refuses a second entry under a name it
holds and an entry of another type, so a table cannot lose an entry to a misspelt copy or hold something its
users cannot run. It imports nothing from doplus: every layer may use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

Entry = TypeVar("Entry")
_ABSENT: Any = object()


class Registry(Mapping[str, Entry], Generic[Entry]):
    """Names -> entries of `entry_type`, in registration order.

    `what` names the registry in its errors ("forget loss", "suite"). `entries` registers (name, entry) pairs or a
    mapping's items at once. `names`, where a lower layer validates the names before this registry can be
    imported, is the one list of them: any other name is refused, and `check_complete` says which have no entry.
    """

    def __init__(self, what: str, entry_type: type | tuple[type, ...],
                 entries: Mapping[str, Entry] | Iterable[tuple[str, Entry]] = (),
                 names: Iterable[str] | None = None) -> None:
        self.what = what
        self.entry_type = entry_type
        self.names = None if names is None else tuple(names)
        self._entries: dict[str, Entry] = {}
        for name, entry in (entries.items() if isinstance(entries, Mapping) else entries):
            self.register(name, entry)

    def register(self, name: str, entry: Entry = _ABSENT, *, build: Callable[[Any], Entry] | None = None) -> Any:
        """`register(name, entry)` adds `entry` and returns it. `register(name)` is a decorator that adds the
        function it decorates, `register(name, build=make)` one that adds `make(function)`; either returns the
        function unchanged."""
        if entry is _ABSENT:
            def decorate(function):
                self.register(name, function if build is None else build(function))
                return function

            return decorate
        self._check(name, entry)
        if name in self._entries:
            raise ValueError(f"{self.what} registry: '{name}' is already registered")
        self._entries[name] = entry
        return entry

    def _check(self, name: str, entry: Entry) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.what} registry: a name must be a non-empty string, not {name!r}")
        if self.names is not None and name not in self.names:
            raise ValueError(f"{self.what} registry: '{name}' is not one of its names ({', '.join(self.names)})")
        if not isinstance(entry, self.entry_type):
            expected = (" or ".join(t.__name__ for t in self.entry_type) if isinstance(self.entry_type, tuple)
                        else self.entry_type.__name__)
            raise TypeError(f"{self.what} registry: '{name}' must be of type {expected}, not {type(entry).__name__}")

    def check_complete(self) -> None:
        """A ValueError naming the declared `names` that have no entry (nothing without declared names)."""
        missing = [name for name in self.names or () if name not in self._entries]
        if missing:
            raise ValueError(f"{self.what} registry: no entry for {', '.join(missing)}")

    def listing(self, separator: str = ", ") -> str:
        """The names in order, joined for a help text or an error message: "GA, NPO, DPO"."""
        return separator.join(self._entries)

    @contextmanager
    def replaced(self, name: str, entry: Entry) -> Iterator[Entry]:
        """The registered entry `name` swapped for `entry` inside the block (a test's stand-in), restored after;
        the block gets the original."""
        original = self._entries[name]
        self._check(name, entry)
        self._entries[name] = entry
        try:
            yield original
        finally:
            self._entries[name] = original

    def __getitem__(self, name: str) -> Entry:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.what!r}: {self.listing()})"
