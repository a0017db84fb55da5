"""Entries by name that configs choose and user modules extend: model families, objectives
and rewards each keep one of these."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A name can be registered once; ``kind`` names the entries in error messages."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> T:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def decorator(self, name: str) -> Callable[[T], T]:
        """``@registry.decorator(name)`` adds the function it decorates and returns it."""
        return lambda entry: self.add(name, entry)

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}")
        return self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def values(self) -> list[T]:
        return [self._entries[name] for name in self.names()]
