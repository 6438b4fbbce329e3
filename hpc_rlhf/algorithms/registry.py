"""Name -> implementation registries of the algorithm units, and the declared units of the RL registries.

Trainers look algorithms up by the name in the config and then only read attributes of what they
got back; they never branch on the name itself.

This module imports no torch: the config checks the names it is given against the RL registries below, and
the ``algo`` options a unit reads, at parse time without loading the tensor code.  Each RL registry declares
its units here, each with the ``algo`` options it reads: a section of the ``algo`` config (``"clip"``: all its
options) or one option of a section (``"clip.eps_clip"``).  The module that implements a unit registers it
under its declared name (``@POLICY_LOSSES.register("ppo")``); tests/unit/config/test_config.py checks that the declared
and the registered units are the same.  Adding an RL unit is its registered implementation, its line here and,
for knobs of its own, an options section in ``config/algo.py``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named collection of implementations of one kind (advantage estimators, policy losses...).

    ``units`` declares names and the options each reads (see the module doc).  ``@REG.register("name")`` adds the
    decorated object under ``name`` and returns it unchanged; ``REG.get("name")`` returns it, and an unknown name
    raises ``KeyError`` listing the known ones.  ``names()`` are the declared and the registered names.
    """

    def __init__(self, kind: str, units: dict[str, tuple[str, ...]] | None = None) -> None:
        self.kind = kind
        self.declared: dict[str, tuple[str, ...]] = dict(units or {})
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
        return sorted(self.declared.keys() | self._items.keys())

    def read_paths(self, name: str, algo: Any) -> list[str]:
        """The options unit ``name`` reads, as paths in ``algo`` (the config's algo section): ``clip.eps_clip``..."""
        paths = []
        for entry in self.declared.get(name, ()):
            section, _, option = entry.partition(".")
            paths += [entry] if option else [f"{section}.{f.name}" for f in dataclasses.fields(getattr(algo, section))]
        return paths

    def options(self, name: str, algo: Any) -> dict[str, Any]:
        """The options unit ``name`` reads from ``algo``, by option name: the keyword arguments it takes."""
        out = {}
        for path in self.read_paths(name, algo):
            section, option = path.split(".")
            out[option] = getattr(getattr(algo, section), option)
        return out

    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


ADVANTAGE_ESTIMATORS: Registry = Registry("advantage_estimator", {
    "gae": ("advantage", "gae", "critic"),
    "reinforce": ("advantage",),
    "reinforce_baseline": ("advantage",),
    "rloo": ("advantage",),
    "group_norm": ("advantage.advantage_eps",),
    "dr_grpo": (),
    "maxrl": ("advantage.advantage_eps",),
    "gdpo": ("advantage.advantage_eps",),
    "opd": ("opd",),
})
# The estimators that normalise each named part of the reward (rewards/types.py: components) rather than the shaped
# scalar reward: the config refuses the shaping options and reward weights with them.
COMPONENT_ESTIMATORS = frozenset({"gdpo"})
POLICY_LOSSES: Registry = Registry("policy_loss", {
    "ppo": ("clip",),
    "gspo": ("clip",),
    "cispo": ("clip.eps_clip", "clip.eps_clip_high"),
    "sapo": ("sapo",),
    "dppo_tv": ("dppo_tv",),
    "dppo_kl": ("dppo_kl",),
})
IS_CORRECTIONS: Registry = Registry("is_correction", dict.fromkeys(("tis", "icepop", "seq_mask_tis"), ("is_bounds",)))
TOKEN_MASKS: Registry = Registry("token_mask", {"m2po": ("m2po",)})
KL_ESTIMATORS: Registry = Registry("kl_estimator", dict.fromkeys(("k1", "k2", "k3"), ()))
LOSS_AGGREGATIONS: Registry = Registry("loss_agg_mode", dict.fromkeys(("token_mean", "seq_mean", "constant"), ()))
