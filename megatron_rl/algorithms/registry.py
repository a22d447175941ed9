"""Name -> function registries for advantage estimators, policy losses and KL estimators.

A registry refuses a second registration under the same name (two modules silently
overriding each other is a bug found late), and an unknown name fails with the list of
valid ones, so a config typo is fixed from the error message alone.
"""

from __future__ import annotations

from typing import Callable, Iterator, TypeVar

F = TypeVar("F", bound=Callable)


class Registry:
    """A named table of functions filled by the `register(name)` decorator."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Callable] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator adding the function under `name`; a name already taken raises ValueError."""

        def decorate(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered "
                                 f"(by {self._entries[name].__module__}.{self._entries[name].__qualname__}); "
                                 f"pick another name")
            self._entries[name] = fn
            return fn

        return decorate

    def get(self, name: str) -> Callable:
        """The function registered as `name`; an unknown name raises ValueError listing the valid ones."""
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}: valid names are {', '.join(self.names())}")
        return self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)


ADVANTAGE_ESTIMATORS = Registry("advantage estimator")
POLICY_LOSSES = Registry("policy loss")
KL_ESTIMATORS = Registry("KL estimator")
