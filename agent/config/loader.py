"""The configuration loader, generic over frozen dataclasses: reading TOML, ``PREEMPTD_*`` variables and
``--set`` values, merging them with the origin of every key, and converting the merged tables with msgspec
against each field's type and its declared constraints (``msgspec.Meta``, :class:`Url`). Errors name the file
(or ``environment``, ``command line``), the dotted key and what was expected. agent/config/__init__.py declares the
sections; this module knows none of them.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import stat
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union
from urllib.parse import urlsplit

import msgspec

from agent.core.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

# Loader bookkeeping on a section, never set from a file: ``field(metadata=INTERNAL)``.
INTERNAL = {"internal": True}


# An upper bound that refuses infinity (and, like every bound, NaN): ``Meta(gt=0, le=FINITE)`` is "a finite
# number > 0". msgspec has no "finite" constraint of its own.
FINITE = sys.float_info.max


@dataclass(frozen=True)
class Url:
    """A key that holds an http:// or https:// URL with a host (or, with ``empty``, nothing):
    ``Annotated[str, Url()]``. Checked by the loader, since msgspec's constraints cannot say it (a port
    past 65535, a URL without a host)."""

    empty: bool = False
    text: str = "an http:// or https:// URL"

    def problem(self, value: Any) -> str | None:
        """What was expected, when ``value`` is a string that is no such URL; None when it is fine."""
        if not isinstance(value, str) or (self.empty and value == ""):
            return None
        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018 - raises ValueError for a bad port
        except ValueError:
            return self.text
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return self.text
        return None


@dataclass(frozen=True)
class ZeroOr:
    """A number that is 0 (off) or at least ``minimum``: ``Annotated[float, ZeroOr(0.1)]``. Checked by the
    loader, since msgspec's constraints cannot say "or"."""

    minimum: float

    @property
    def text(self) -> str:
        return f"0 (off) or a finite number >= {self.minimum:g}"

    def problem(self, value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None  # the wrong type: msgspec says so
        return None if value == 0 or self.minimum <= value <= FINITE else self.text


# Marks the loader checks itself (each has ``problem(value)`` and ``text``).
CHECKS = (Url, ZeroOr)

# A configuration file is a few kilobytes; a bigger "file" is a mistake (a log, a disk image).
MAX_FILE_BYTES = 1 << 20


def read_toml(path: Path) -> dict[str, Any]:
    """The TOML document in ``path``, a regular file of at most :data:`MAX_FILE_BYTES`. Anything else (a
    FIFO, a device, a socket: reading one can block for ever) is refused before it is opened, and again
    after (in case it was swapped in between)."""
    try:
        _check_regular(path, os.stat(path))
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as handle:
            _check_regular(path, os.fstat(fd))
            data = handle.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise ConfigError(_too_big(path))
        doc: dict[str, Any] = tomllib.loads(data.decode("utf-8"))
        return doc
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: config file not found") from exc
    except PermissionError as exc:
        raise ConfigError(f"{path}: cannot read the config file: permission denied") from exc
    except OSError as exc:
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ConfigError(f"{path}: cannot read the config file: {why}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not valid UTF-8 text: {exc}") from exc


def _check_regular(path: Path, info: os.stat_result) -> None:
    mode = info.st_mode
    if stat.S_ISDIR(mode):
        raise ConfigError(f"{path}: is a directory, expected a TOML file")
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
        raise ConfigError(f"{path}: is {kind}, not a regular file; point the configuration at a TOML file")
    if info.st_size > MAX_FILE_BYTES:
        raise ConfigError(_too_big(path))


def _too_big(path: Path) -> str:
    return f"{path}: is larger than {MAX_FILE_BYTES // 1024} KiB; a configuration file is a few kilobytes"


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
        _put(table, parts, parse_value(raw), "environment")
    return table


def dotted_to_nested(flat: Mapping[str, Any], where: str = "command line") -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for dotted, value in flat.items():
        if value is None:
            continue
        _put(nested, dotted.split("."), value, where)
    return nested


def _put(table: dict[str, Any], parts: list[str], value: Any, where: str) -> None:
    """Set ``parts`` (a dotted key) in the nested ``table``; a key that is also set as a table's value
    (``api=5`` and ``api.heartbeat_s=1``) is an error naming both."""
    node = table
    for depth, part in enumerate(parts[:-1]):
        inner = node.setdefault(part, {})
        if not isinstance(inner, dict):
            outer = ".".join(parts[: depth + 1])
            raise ConfigError(
                f"{where}: key {outer!r} is set to {inner!r} and {'.'.join(parts)!r} sets a key inside it; "
                f"{outer!r} is a table: set only keys inside it"
            )
        node = inner
    if isinstance(node.get(parts[-1]), dict) and not isinstance(value, Mapping):
        dotted = ".".join(parts)
        raise ConfigError(
            f"{where}: key {dotted!r} is set to {value!r} and keys inside it are set too; "
            f"{dotted!r} is a table: set only keys inside it"
        )
    node[parts[-1]] = value


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


@functools.lru_cache(maxsize=256)
def type_hints(cls: type) -> dict[str, Any]:
    """``cls``'s annotations, evaluated (with ``Annotated`` kept): once per class, as a file is loaded often
    (each reload, and many times in tests) and evaluating string annotations dominates its cost."""
    return typing.get_type_hints(cls, include_extras=True)


def field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if not f.metadata.get("internal")}


def build(cls: type[Any], table: Mapping[str, Any], prefix: str, origin: Mapping[str, str]) -> Any:
    """The frozen dataclass ``cls`` from ``table`` (the keys under ``prefix``), checked by msgspec against
    the field types and their ``msgspec.Meta`` constraints; every error is a :class:`ConfigError` naming the
    file, the dotted key and what was expected."""
    prepared = _prepare(cls, table, prefix.rstrip("."), origin)
    try:
        return msgspec.convert(prepared, cls, strict=True, str_keys=True, dec_hook=_decode)
    except msgspec.ValidationError as exc:
        raise _translate(str(exc), cls, prepared, prefix.rstrip("."), origin) from None
    except ConfigError as exc:  # a section's own check (__post_init__): say where the table came from
        # The message starts with the key it is about ("actions.signals (rule 'x') ...").
        named = re.match(r"[a-z_][\w.]*", str(exc))
        place = where(origin, named.group() if named else prefix.rstrip("."))
        if str(exc).startswith(place):
            raise
        raise ConfigError(f"{place}: {exc}") from None


def _decode(hint: Any, value: Any) -> Any:
    """msgspec's hook for the types it does not know: a path is a non-empty string."""
    if hint is Path and isinstance(value, (str, Path)) and str(value):
        return Path(value)
    raise ValueError(f"Expected {describe(hint)}")


_BOOL_WORDS = dict.fromkeys(("true", "yes", "on", "1"), True) | dict.fromkeys(
    ("false", "no", "off", "0"), False
)


def _prepare(hint: Any, value: Any, dotted: str, origin: Mapping[str, str]) -> Any:
    """What msgspec cannot do for a config table, done before it converts: refuse unknown keys (with a
    "did you mean"), check :class:`Url` keys, and read the string forms an environment variable or a flag
    can only give (``none`` for an optional key, ``yes``/``off`` for a boolean, ``a,b`` for an array)."""
    hint = _checked(hint, value, dotted, origin)
    kind = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _prepare_table(hint, value, dotted, origin)
    if kind in (Union, types.UnionType):
        return _prepare_union(hint, value, dotted, origin)
    if kind in (tuple, list) and isinstance(value, (str, list, tuple)):
        items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value
        item = (typing.get_args(hint) or (Any,))[0]
        return [_prepare(item, v, f"{dotted}[{i}]", origin) for i, v in enumerate(items)]
    if kind in (dict, _MAPPING) and isinstance(value, Mapping):
        item = (typing.get_args(hint) or (str, Any))[1]
        return {k: _prepare(item, v, f"{dotted}.{k}", origin) for k, v in value.items()}
    if hint is bool and isinstance(value, str):
        return _BOOL_WORDS.get(value.lower(), value)
    return value


def _checked(hint: Any, value: Any, dotted: str, origin: Mapping[str, str]) -> Any:
    """``hint`` without its ``Annotated`` checks, once ``value`` passed them (the error of the first it fails)."""
    if typing.get_origin(hint) is not Annotated:
        return hint
    hint, *marks = typing.get_args(hint)
    problem = next((p for m in marks if isinstance(m, CHECKS) and (p := m.problem(value))), None)
    if problem is not None:
        raise fail(origin, dotted, problem, value)
    return hint


def _prepare_union(hint: Any, value: Any, dotted: str, origin: Mapping[str, str]) -> Any:
    """``value`` for a union ``hint``: None for ``none`` (or nothing) when it is optional, prepared for its one
    other type, else as it is."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(args) < len(typing.get_args(hint)) and isinstance(value, str) and value.lower() in ("", "none"):
        return None
    return _prepare(args[0], value, dotted, origin) if len(args) == 1 else value


def _prepare_table(cls: Any, table: Any, dotted: str, origin: Mapping[str, str]) -> dict[str, Any]:
    if not isinstance(table, Mapping):
        raise fail(origin, dotted, "a table", table)
    hints = type_hints(cls)
    names = field_names(cls)
    prefix = f"{dotted}." if dotted else ""
    for key in table:
        if key not in names:
            close = difflib.get_close_matches(key, sorted(names), n=1)
            hint = f" (did you mean {prefix + close[0]!r}?)" if close else ""
            raise ConfigError(f"{where(origin, prefix + key)}: unknown key {prefix + key!r}{hint}")
    return {key: _prepare(hints[key], value, prefix + key, origin) for key, value in table.items()}


_MAPPING = typing.get_origin(Mapping[str, Any])
# msgspec's errors end with where: "Expected `int` >= 1 - at `$.api.queue_size`", "... - at `key` in `$.x`".
_AT = re.compile(r"(?P<what>.*) - at `(?P<key>key` in `)?\$(?P<path>[^`]*)`", re.DOTALL)


def _translate(message: str, cls: Any, table: Any, dotted: str, origin: Mapping[str, str]) -> ConfigError:
    """msgspec's error in today's words: the file, the dotted key, what was expected and what was there."""
    at = _AT.fullmatch(message)
    if at is None:
        return ConfigError(f"{where(origin, dotted)}: {message}")
    hint, value = cls, table
    for name, index in re.findall(r"\.(\w+)|\[(\d+|\.\.\.)\]", at["path"]):
        hint = _unwrap(hint)
        if name:
            hint, value = type_hints(hint)[name], value[name]
            dotted = f"{dotted}.{name}" if dotted else name
        elif index == "...":  # a dict's value; msgspec does not say which: the first that fails
            item = typing.get_args(hint)[1]
            key = next((k for k, v in value.items() if not _converts(v, item)), None)
            if key is None:
                return ConfigError(f"{where(origin, dotted)}: key {dotted!r}: {at['what']}")
            hint, value, dotted = item, value[key], f"{dotted}.{key}"
        else:
            hint, value, dotted = typing.get_args(hint)[0], value[int(index)], f"{dotted}[{index}]"
    if at["key"]:
        key_hint = typing.get_args(_unwrap(hint))[0]
        key = next(
            (k for k in value if not _converts({k: None}, types.GenericAlias(dict, (key_hint, Any)))), ""
        )
        return fail(origin, f"{dotted}.{key}", f"{describe(key_hint)} key", key)
    if at["what"].startswith(("Expected", "Invalid")):
        # "Expected `float`, got `str`" is the wrong type; "Expected `float` > 0.0" is out of range.
        wrong_type = ", got `" in at["what"] and typing.get_origin(hint) is Annotated
        return fail(origin, dotted, describe(typing.get_args(hint)[0] if wrong_type else hint), value)
    return ConfigError(f"{where(origin, dotted)}: key {dotted!r}: {at['what']}")


def _converts(value: Any, hint: Any) -> bool:
    try:
        msgspec.convert(value, hint, strict=True, str_keys=True, dec_hook=_decode)
    except (msgspec.ValidationError, ConfigError):
        return False
    return True


def _unwrap(hint: Any) -> Any:
    """The type under ``Annotated[...]`` and ``... | None``."""
    if typing.get_origin(hint) is Annotated:
        hint = typing.get_args(hint)[0]
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else hint
    return hint


def where(origin: Mapping[str, str], dotted: str) -> str:
    """Where ``dotted`` was set: its own origin, else the nearest enclosing table's."""
    parts = re.sub(r"\[\d+\]", "", dotted).split(".")
    found = (origin.get(".".join(parts[:n])) for n in range(len(parts), 0, -1))
    return next((where for where in found if where), "configuration")


def fail(origin: Mapping[str, str], dotted: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(f"{where(origin, dotted)}: key {dotted!r}: expected {expected}, got {value!r}")


_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", Path: "a path"}


def describe(hint: Any) -> str:
    """What a key of type ``hint`` holds, in the words of the errors: "an integer >= 1", "a path"."""
    kind = typing.get_origin(hint)
    if kind is Annotated:
        base, *marks = typing.get_args(hint)
        for mark in marks:
            if isinstance(mark, CHECKS):
                return mark.text
            if isinstance(mark, msgspec.Meta):
                return mark.description or _bounded(describe(base), mark)
        return describe(base)
    if kind is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if kind in (Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(hint) if a is not type(None))
    if kind in (tuple, list):
        return "an array"
    if kind in (dict, _MAPPING) or dataclasses.is_dataclass(hint):
        return "a table"
    return _WORDS.get(hint, getattr(hint, "__name__", str(hint)))


def _bounded(noun: str, meta: msgspec.Meta) -> str:
    bounds = [
        f"{op} {bound:g}"
        for op, bound in ((">", meta.gt), (">=", meta.ge), ("<", meta.lt), ("<=", meta.le))
        if bound is not None and bound != FINITE
    ]
    bounds += [
        f"of length {op} {n}" for op, n in ((">=", meta.min_length), ("<=", meta.max_length)) if n is not None
    ]
    bounds += [f"matching {meta.pattern!r}"] if meta.pattern is not None else []
    if meta.le == FINITE:
        noun = "a finite number"
    return f"{noun} {' and '.join(bounds)}".rstrip()
