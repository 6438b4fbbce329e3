"""Name -> implementation registries for the RL algorithms.

Trainers look algorithms up by the name in the config and then only read attributes of what they
got back; they never branch on the name itself.  Adding an algorithm is one decorated class or
function, nothing else.
"""
from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named collection of implementations of one kind (advantage estimators, policy losses...).

    ``@REG.register("name")`` adds the decorated object under ``name`` and returns it unchanged;
    ``REG.get("name")`` returns it, and an unknown name raises ``KeyError`` listing the known ones.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        if not name or not isinstance(name, str):
            raise ValueError(f"{self.kind}: a registry name must be a non-empty string, got {name!r}")

        def deco(obj: T) -> T:
            if name in self._items and self._items[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            known = ", ".join(sorted(self._items)) or "(none)"
            raise KeyError(f"unknown {self.kind} {name!r}; known: {known}") from None

    __getitem__ = get

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


ADVANTAGE_ESTIMATORS: Registry = Registry("advantage_estimator")
POLICY_LOSSES: Registry = Registry("policy_loss")
IS_CORRECTIONS: Registry = Registry("is_correction")
