"""The configuration loader, generic over frozen dataclasses: reading TOML, ``PREEMPTD_*`` variables and
``--set`` values, merging them with the origin of every key, and checking and converting each value against
its field's type and declared constraints (:class:`Range`, :class:`Url`). Errors name the file (or
``environment``, ``command line``), the dotted key and what was expected. agent/config.py declares the
sections; this module knows none of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import sys
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union
from urllib.parse import urlsplit

from agent.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

# Loader bookkeeping on a section, never set from a file: ``field(metadata=INTERNAL)``.
INTERNAL = {"internal": True}


@dataclass(frozen=True)
class Range:
    """A bound on a numeric key, declared on its type and checked by the loader:
    ``heartbeat_s: Annotated[float, Range(gt=0)]``. NaN and infinities are refused unless ``finite`` is
    False."""

    gt: float | None = None
    ge: float | None = None
    le: float | None = None
    finite: bool = True
    # What the error says was expected; by default "a number > 0", "an integer >= 1", ...
    text: str = ""

    def problem(self, value: Any) -> str | None:
        """What was expected, when ``value`` is out of range; None when it is fine."""
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return None
        bad = (
            (self.finite and not math.isfinite(value))
            or (self.gt is not None and not value > self.gt)
            or (self.ge is not None and not value >= self.ge)
            or (self.le is not None and not value <= self.le)
        )
        if not bad:
            return None
        if self.text:
            return self.text
        bounds = [
            f"{op} {bound:g}"
            for op, bound in ((">", self.gt), (">=", self.ge), ("<=", self.le))
            if bound is not None
        ]
        noun = "an integer" if isinstance(value, int) else "a finite number" if self.finite else "a number"
        return f"{noun} {' and '.join(bounds)}".rstrip()


@dataclass(frozen=True)
class Url:
    """A key that holds an http:// or https:// URL with a host (or, with ``empty``, nothing)."""

    empty: bool = False

    def problem(self, value: Any) -> str | None:
        if not isinstance(value, str) or (self.empty and value == ""):
            return None
        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018 - raises ValueError for a bad port
        except ValueError:
            return "an http:// or https:// URL"
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return "an http:// or https:// URL"
        return None


# The ranges most keys need (issue: a heartbeat of 0 busy-loops, a queue of 0 is unbounded, ...).


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            doc: dict[str, Any] = tomllib.load(handle)
            return doc
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: config file not found") from exc
    except PermissionError as exc:
        raise ConfigError(f"{path}: cannot read the config file: permission denied") from exc
    except IsADirectoryError as exc:
        raise ConfigError(f"{path}: is a directory, expected a TOML file") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not valid UTF-8 text: {exc}") from exc


def parse_value(raw: str) -> Any:
    text = raw.strip()
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def env_table(environ: Mapping[str, str], prefix: str, top_level: type) -> dict[str, Any]:
    """The ``<prefix><KEY>`` and ``<prefix><SECTION>__<KEY>`` variables as a nested table; single names
    that are not keys of ``top_level`` are left alone."""
    table: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(prefix) or name == prefix + "CONFIG":
            continue
        parts = [p.lower() for p in name[len(prefix) :].split("__")]
        if not all(parts):
            continue
        if len(parts) == 1 and parts[0] not in field_names(top_level):
            # Unrelated PREEMPTD_* variables (PREEMPTD_SOCKET is used by clients too) are not an error.
            continue
        node = table
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = parse_value(raw)
    return table


def dotted_to_nested(flat: Mapping[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for dotted, value in flat.items():
        if value is None:
            continue
        parts = dotted.split(".")
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return nested


def merge(
    into: dict[str, Any], new: Mapping[str, Any], origin: dict[str, str], where: str, prefix: str = ""
) -> None:
    for key, value in new.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            merge(into[key], value, origin, where, dotted + ".")
        else:
            into[key] = dict(value) if isinstance(value, Mapping) else value
        origin.setdefault(dotted, where)
        if not isinstance(value, Mapping):
            origin[dotted] = where


def field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if not f.metadata.get("internal")}


def extension_tables(
    merged: dict[str, Any], top_level: type, sections: tuple[str, ...]
) -> dict[str, dict[str, Any]]:
    """Take the plug-in tables (unknown tables under one of ``sections`` of ``top_level``) out of
    ``merged``, by dotted name."""
    tables: dict[str, dict[str, Any]] = {}
    for section in sections:
        node = merged.get(section)
        if not isinstance(node, dict):
            continue
        known = field_names(typing.get_type_hints(top_level)[section])
        for key in [k for k, v in node.items() if isinstance(v, Mapping) and k not in known]:
            tables[f"{section}.{key}"] = dict(node.pop(key))
    return tables


def build(cls: type[Any], table: Mapping[str, Any], prefix: str, origin: Mapping[str, str]) -> Any:
    if not isinstance(table, Mapping):
        raise ConfigError(
            f"{_where(origin, prefix.rstrip('.'))}: key {prefix.rstrip('.')!r}: expected a table"
        )
    hints = typing.get_type_hints(cls, include_extras=True)
    names = field_names(cls)
    for key in table:
        if key not in names:
            dotted = prefix + key
            close = difflib.get_close_matches(key, sorted(names), n=1)
            hint = f" (did you mean {prefix + close[0]!r}?)" if close else ""
            raise ConfigError(f"{_where(origin, dotted)}: unknown key {dotted!r}{hint}")
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in table and f.name in names:
            values[f.name] = _coerce(hints[f.name], table[f.name], prefix + f.name, origin)
    try:
        return cls(**values)
    except ConfigError as exc:  # a section's own check (__post_init__): say where the table came from
        where = _where(origin, prefix.rstrip("."))
        if str(exc).startswith(where):
            raise
        raise ConfigError(f"{where}: {exc}") from None


def _where(origin: Mapping[str, str], dotted: str) -> str:
    return origin.get(dotted) or origin.get(dotted.split(".", maxsplit=1)[0]) or "configuration"


def _fail(origin: Mapping[str, str], dotted: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(f"{_where(origin, dotted)}: key {dotted!r}: expected {expected}, got {value!r}")


def _coerce(hint: Any, value: Any, dotted: str, origin: Mapping[str, str]) -> Any:
    """Check ``value`` against the type ``hint`` and convert it (paths, tuples, nested sections); then apply
    the declarative checks (:class:`Range`, :class:`Url`) that annotate the type."""
    type_origin = typing.get_origin(hint)
    if type_origin is Annotated:
        base, *marks = typing.get_args(hint)
        result = _coerce(base, value, dotted, origin)
        for mark in marks:
            if isinstance(mark, (Range, Url)):
                problem = mark.problem(result)
                if problem is not None:
                    raise _fail(origin, dotted, problem, value)
        return result
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return build(hint, value, dotted + ".", origin)
    if hint is Any:
        return value
    coerce = _BY_ORIGIN.get(type_origin) if type_origin is not None else _BY_TYPE.get(hint)
    if coerce is None:
        raise ConfigError(f"{dotted}: unsupported configuration type {hint!r}")  # a bug in a section class
    return coerce(hint, value, dotted, origin)


def _coerce_union(hint: Any, value: Any, dotted: str, origin: Mapping[str, str]) -> Any:
    args = typing.get_args(hint)
    if value is None or (isinstance(value, str) and value.lower() in ("", "none") and type(None) in args):
        return None
    for arg in args:
        if arg is type(None):
            continue
        with contextlib.suppress(ConfigError):
            return _coerce(arg, value, dotted, origin)
    raise _fail(origin, dotted, " or ".join(_describe(a) for a in args if a is not type(None)), value)


def _coerce_literal(hint: Any, value: Any, dotted: str, origin: Mapping[str, str]) -> Any:
    args = typing.get_args(hint)
    if value in args:
        return value
    raise _fail(origin, dotted, "one of " + ", ".join(repr(a) for a in args), value)


def _coerce_bool(hint: Any, value: Any, dotted: str, origin: Mapping[str, str]) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0", "on", "off"):
        return value.lower() in ("true", "yes", "1", "on")
    raise _fail(origin, dotted, "true or false", value)


def _coerce_int(hint: Any, value: Any, dotted: str, origin: Mapping[str, str]) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise _fail(origin, dotted, "an integer", value)


def _coerce_float(hint: Any, value: Any, dotted: str, origin: Mapping[str, str]) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise _fail(origin, dotted, "a number", value)


def _coerce_str(hint: Any, value: Any, dotted: str, origin: Mapping[str, str]) -> str:
    if isinstance(value, str):
        return value
    raise _fail(origin, dotted, "a string", value)


def _coerce_path(hint: Any, value: Any, dotted: str, origin: Mapping[str, str]) -> Path:
    if isinstance(value, (str, Path)) and str(value):
        return Path(value)
    raise _fail(origin, dotted, "a path", value)


def _coerce_sequence(hint: Any, value: Any, dotted: str, origin: Mapping[str, str]) -> Any:
    if isinstance(value, str):
        value = [v for v in (p.strip() for p in value.split(",")) if v]
    if not isinstance(value, (list, tuple)):
        raise _fail(origin, dotted, "an array", value)
    args = typing.get_args(hint)
    item_hint = args[0] if args else Any
    items = [_coerce(item_hint, v, f"{dotted}[{i}]", origin) for i, v in enumerate(value)]
    return tuple(items) if typing.get_origin(hint) is tuple else items


def _coerce_mapping(hint: Any, value: Any, dotted: str, origin: Mapping[str, str]) -> dict[Any, Any]:
    if not isinstance(value, Mapping):
        raise _fail(origin, dotted, "a table", value)
    args = typing.get_args(hint)
    key_hint, value_hint = args if args else (str, Any)
    result: dict[Any, Any] = {}
    for k, v in value.items():
        key = k
        if key_hint is int:
            try:
                key = int(k)
            except (TypeError, ValueError) as exc:
                raise _fail(origin, f"{dotted}.{k}", "an integer key", k) from exc
        result[key] = _coerce(value_hint, v, f"{dotted}.{k}", origin)
    return result


Coerce = Callable[[Any, Any, str, Mapping[str, str]], Any]
_BY_ORIGIN: dict[Any, Coerce] = {
    Union: _coerce_union,
    types.UnionType: _coerce_union,
    Literal: _coerce_literal,
    tuple: _coerce_sequence,
    list: _coerce_sequence,
    dict: _coerce_mapping,
    typing.get_origin(Mapping[str, Any]): _coerce_mapping,
}
_BY_TYPE: dict[Any, Coerce] = {
    bool: _coerce_bool,
    int: _coerce_int,
    float: _coerce_float,
    str: _coerce_str,
    Path: _coerce_path,
}


def _describe(hint: Any) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", Path: "a path"}
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    return names.get(hint, getattr(hint, "__name__", str(hint)))
