"""Named registries: one per extension point (policies, preemption strategies, block
managers, routers, trace formats), and the discovery that fills them.

Each entry registers itself, by name, in the module that defines it; a package imports
every one of its modules (`import_submodules`), so adding an entry is adding one file.
A registry is filled at import time and only read afterwards: it is the one piece of
module-level state of its package, and the same in every run of a process.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable, Generic, Iterable, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Names of one kind of extension (`what`, e.g. "policy") and what each builds.
    Registering a name twice with a different entry is an error (naming both), never a
    silent replacement; an unknown name is a ValueError listing the known ones."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> T:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.what} name must be a non-empty string, got {name!r}")
        known = self._entries.get(name)
        if known is not None and known is not entry:
            raise ValueError(f"{self.what} name {name!r} is already registered by "
                             f"{_describe(known)}; {_describe(entry)} cannot take it")
        self._entries[name] = entry
        return entry

    def named(self, name: str) -> Callable[[T], T]:
        """Class decorator: registers the class under `name` and sets its `name`."""

        def deco(cls: T) -> T:
            self.add(name, cls)
            cls.name = name
            return cls

        return deco

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown {self.what} {name!r}; known: "
                             f"{', '.join(self.names())}") from None

    def names(self) -> list[str]:
        """In the order they were registered (imports are deterministic, so is this)."""
        return list(self._entries)

    def items(self) -> list[tuple[str, T]]:
        """(name, entry) pairs in the order they were registered."""
        return list(self._entries.items())

    def __iter__(self) -> Iterator[str]:
        """The names, as `names()` (so `tuple(registry)` and `choices=registry` list them
        as they are when read, entries registered later included)."""
        return iter(list(self._entries))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._entries


def import_submodules(package: str, path: Iterable[str]) -> None:
    """Import every public module of a package (sorted by name), so that each
    registers what it defines. Call it at the end of the package's __init__."""
    for info in sorted(pkgutil.iter_modules(path), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package}.{info.name}")


def _describe(entry: object) -> str:
    module = getattr(entry, "__module__", None) or type(entry).__module__
    name = getattr(entry, "__qualname__", None) or repr(entry)
    return f"{module}.{name}"


PLUGINS_ENV = "SERVELAB_PLUGINS"
"""Environment variable naming modules of the user's own (comma-separated, importable from
the Python path) that register entries: the command line imports them before it offers
the registries' names, and so does every worker process of a sweep."""


def import_plugins() -> list[str]:
    """Import the modules `$SERVELAB_PLUGINS` names (in order; their registrations run on
    import) and return their names. A module that cannot be imported is a ValueError
    naming it."""
    import os

    names = [name.strip() for name in os.environ.get(PLUGINS_ENV, "").split(",") if name.strip()]
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ValueError(f"${PLUGINS_ENV} names {name!r}, which cannot be imported: {exc}") from None
    return names
