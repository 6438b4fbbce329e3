"""Typed configs: nested dataclasses filled from a YAML file plus command-line overrides.

A key is a dotted path (``train.learning_rate``), or the path of a section followed by a name that is
unique inside that section (``rollout.cuda_graphs`` for ``rollout.lean.cuda_graphs``; with no section, a
name unique in the whole config: ``learning_rate``).  The name is an option's own or one of its aliases,
its other names (``vllm_max_model_len`` for ``rollout.vllm.max_model_len``).  Unknown keys, wrong types,
values outside a field's choices and numbers outside a field's range are errors raised at parse time with
a sentence naming the key and what is allowed.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml


class ConfigError(ValueError):
    """A config value or key is invalid; the message names the key and what is allowed."""


@dataclasses.dataclass(frozen=True)
class Range:
    """The numbers a numeric field takes: bounds (None: none on that side); ``choices`` are allowed besides."""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple = ()

    def __contains__(self, x: float) -> bool:
        if x in self.choices:
            return True
        return ((self.ge is None or x >= self.ge) and (self.gt is None or x > self.gt)
                and (self.le is None or x <= self.le) and (self.lt is None or x < self.lt))

    def __str__(self) -> str:
        """'>= 0', '> 0', 'in (0, 1]' ..., after the choices: '-1 or >= 1'."""
        low = ("[", ">=", self.ge) if self.ge is not None else ("(", ">", self.gt) if self.gt is not None else None
        high = ("]", "<=", self.le) if self.le is not None else (")", "<", self.lt) if self.lt is not None else None
        if low and high:
            text = f"in {low[0]}{_num(low[2])}, {_num(high[2])}{high[0]}"
        else:
            _, op, bound = low or high
            text = f"{op} {_num(bound)}"
        return " or ".join([*map(_num, self.choices), text])


def _num(x: float) -> str:
    """A number as a person writes it: -1 for -1.0, 1e-05, 4294967295."""
    short = format(x, "g")
    return short if float(short) == x else repr(x)


def field(default: Any = dataclasses.MISSING, *, help: str, choices: tuple | None = None, registry: Any = None,
          default_factory: Any = dataclasses.MISSING, ge: float | None = None, gt: float | None = None,
          le: float | None = None, lt: float | None = None, unbounded: bool = False, path: str | None = None,
          aliases: tuple[str, ...] = (), same_tokenizer_as: str | None = None):
    """A dataclass field that carries its help text (used by the generated reference).

    ``choices`` are the values allowed; ``registry`` (a ``Registry`` of units) allows the names registered in
    it, read when a config is parsed, next to the ``choices`` (e.g. ``"none"``).  A number (or each number of
    a list) must be in the range that ``ge``/``gt``/``le``/``lt`` bound, or one of the ``choices``; every
    numeric field declares a range, or ``unbounded=True`` when any number is meaningful.  ``path`` marks a
    string naming what the run reads, checked before any rank starts: "model" (a model folder or hub name),
    "tokenizer" (a model whose tokenizer is read too: a folder must hold the tokenizer's files), "file" (a local
    file), "data" (data sources), "reward" (a reward-function file or built-in) or "agent" (an environment file: it
    is imported and must define an environment).  ``same_tokenizer_as`` names the option of another model (a dotted
    path) whose tokenizer this one's must be, compared with the paths.  ``aliases`` are other names of the
    option, read wherever its own name is (``resolve_key``).
    """
    meta: dict[str, Any] = {"help": help}
    if ge is not None or gt is not None or le is not None or lt is not None:
        meta["range"] = Range(ge, gt, le, lt, tuple(choices or ()))
    elif choices is not None:
        meta["choices"] = choices
    if unbounded:
        meta["unbounded"] = True
    if registry is not None:
        meta["registry"] = registry
    if path is not None:
        meta["path"] = path
    if same_tokenizer_as is not None:
        meta["same_tokenizer_as"] = same_tokenizer_as
    if aliases:
        meta["aliases"] = tuple(aliases)
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def allowed_values(f: dataclasses.Field) -> tuple | None:
    """The values a field takes beyond its type: its choices and its registry's names (None: any value)."""
    choices, registry = f.metadata.get("choices"), f.metadata.get("registry")
    if choices is None and registry is None:
        return None
    return tuple(choices or ()) + tuple(registry.names() if registry is not None else ())


def _check_allowed(path: str, f: dataclasses.Field, value: Any) -> None:
    allowed = allowed_values(f)
    if allowed is not None and value is not None and value not in allowed:
        raise ConfigError(f"{path}: {value!r} is not allowed; choose one of {', '.join(map(repr, allowed))}")
    bounds = f.metadata.get("range")
    if bounds is not None and value is not None:
        for i, x in enumerate(value) if isinstance(value, list) else [(None, value)]:
            if x not in bounds:
                key = path if i is None else f"{path}[{i}]"
                raise ConfigError(f"{key}: {_num(x)} is out of range; it must be {bounds}")


def _is_config(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)  # evaluates every annotation: slow, and asked once per key


def leaf_paths(cls: type, prefix: str = "") -> dict[str, tuple[str, dataclasses.Field, Any]]:
    """Map every dotted leaf path of a config class to (path, field, type)."""
    out: dict[str, tuple[str, dataclasses.Field, Any]] = {}
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        path = f"{prefix}{f.name}"
        if _is_config(tp):
            out.update(leaf_paths(tp, path + "."))
        else:
            out[path] = (path, f, tp)
    return out


def leaf_values(cfg: Any) -> list[tuple[str, dataclasses.Field, Any]]:
    """(dotted path, field, value) of every leaf of a config object."""
    out = []
    for path, (_, f, _) in leaf_paths(type(cfg)).items():
        value = cfg
        for name in path.split("."):
            value = getattr(value, name)
        out.append((path, f, value))
    return out


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is list:
        return f"list[{_type_name(get_args(tp)[0])}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert ``value`` (from YAML or a command-line string) to ``tp`` or raise ConfigError."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            if type(None) in args:
                return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}: {value!r} is not a valid {_type_name(tp)}")
    if origin is Literal:
        allowed = get_args(tp)
        for a in allowed:
            if value == a or (isinstance(value, str) and str(a) == value):
                return a
        raise ConfigError(f"{key}: {value!r} is not allowed; choose one of {', '.join(map(repr, allowed))}")
    if origin is list:
        (inner,) = get_args(tp)
        if isinstance(value, str):  # "a,b", or the YAML flow form "[a, b]" a config file would use
            text = value.strip()
            if text.startswith("[") and text.endswith("]"):
                text = text[1:-1]
            value = [v.strip().strip("'\"") for v in text.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            value = [value]
        return [coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"{key}: {value!r} is not a boolean (use true or false)")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: {value!r} is not an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: {value!r} is not an integer")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: {value!r} is not a number")
        try:
            number = float(value) if isinstance(value, (int, float, str)) else None
        except ValueError:
            number = None
        if number is None:
            raise ConfigError(f"{key}: {value!r} is not a number")
        if not math.isfinite(number):
            raise ConfigError(f"{key}: {value!r} is not a finite number")
        return number
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: {value!r} is not a string")
    raise ConfigError(f"{key}: unsupported field type {tp!r}")


# options that are gone, with what replaced them (the last name of the key)
REMOVED = {"lean_decoder": "rollout.engine (or model.engine) replaced it: `hf` for false, `auto` or `lean` for true"}


def names(path: str, f: dataclasses.Field) -> tuple[str, ...]:
    """The names of the option at ``path``: its own, then its aliases."""
    return (path.rsplit(".", 1)[-1], *f.metadata.get("aliases", ()))


def resolve_key(cls: type, key: str) -> str:
    """Turn a key (the module doc says which) into the dotted path of its option, or raise ConfigError."""
    paths = leaf_paths(cls)
    if key in paths:
        return key
    section, _, name = key.rpartition(".")
    matches = [p for p, (_, f, _) in paths.items()
               if (not section or p.startswith(section + ".")) and name in names(p, f)]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise ConfigError(f"option {key!r} is ambiguous; write one of {', '.join(sorted(matches))}")
    known = sorted({n for p, (_, f, _) in paths.items() for n in names(p, f)} | set(paths))
    close = difflib.get_close_matches(key, known, n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    if name in REMOVED:
        hint = f" {REMOVED[name]}."
    raise ConfigError(f"unknown option {key!r} for {cls.__name__}.{hint} "
                      f"`hpc-rlhf options` lists them all (docs/options.md too).")


def flatten_keys(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten_keys(v, path + "."))
        else:
            out[path] = v
    return out


def _build(cls: type, values: dict[str, Any], prefix: str = ""):
    kwargs = {}
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        path = f"{prefix}{f.name}"
        if _is_config(tp):
            kwargs[f.name] = _build(tp, values, path + ".")
        elif path in values:
            kwargs[f.name] = coerce(values[path], tp, path)
            _check_allowed(path, f, kwargs[f.name])
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{path} is required ({f.metadata.get('help', '')})")
    return cls(**kwargs)


def _validate(obj: Any) -> None:
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            _validate(v)
    check = getattr(obj, "validate", None)
    if check is not None:
        check()


_KEY_VALUE = re.compile(r"^[A-Za-z_][\w.]*=")


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """Parse ``key=value``, ``--key=value`` and ``--key value`` (``--flag`` alone means true)."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("--"):
            a = a[2:]
            if "=" in a:
                k, v = a.split("=", 1)
            elif i + 1 < len(args) and not args[i + 1].startswith("--") and not _KEY_VALUE.match(args[i + 1]):
                k, v = a, args[i + 1]
                i += 1
            else:
                k, v = a, "true"
        elif "=" in a:
            k, v = a.split("=", 1)
        else:
            raise ConfigError(f"cannot read argument {a!r}: write key=value or --key value")
        pairs.append((k.replace("-", "_"), v))
        i += 1
    return pairs


def load_config(cls: type, path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict | None = None):
    """Build and validate a ``cls`` from (in order of precedence) overrides, YAML file, ``base``."""
    values: dict[str, Any] = {}
    sources: list[tuple[str, dict]] = []
    if base:
        sources.append(("defaults", base))
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of options, not {type(data).__name__}")
        sources.append((str(path), data))
    for origin, data in sources:
        for k, v in flatten_keys(data).items():
            try:
                values[resolve_key(cls, k)] = v
            except ConfigError as e:
                raise ConfigError(f"{origin}: {e}") from None
    for k, v in parse_overrides(overrides or []):
        values[resolve_key(cls, k)] = v
    cfg = _build(cls, values)
    _validate(cfg)
    return cfg


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
