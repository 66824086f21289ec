"""The one TOML config loader of every borrowd process (daemon, proxy, gate).

A config is a tree of frozen dataclasses whose fields carry `meta(unit, help, **checks)`;
`build_dataclass` turns parsed TOML into that tree and every error is one line naming the key
path and the bad value (`pools[0].controller.feedforward.gain: -5.0 is below the minimum 0`).
Numbers are finite unless a field allows infinity; bounds come from the field metadata, so
every config that uses this loader gets the same checks.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from borrowd.models.errors import BorrowdError, ConfigError

PER_POOL = "per_pool"  # field metadata: a pool-wide rate, scaled to the pool's replicas
# Checks and marks a field's metadata may carry, besides `unit` and `help`.
CHECKS = ("min", "max", "gt", "lt", "choices", "pattern", "pattern_help", "allow_empty",
          "allow_inf", "example", PER_POOL)


def meta(unit: str, help: str, **checks: Any) -> dict[str, Any]:
    """Field metadata: unit, one-line help, and optional checks: `min`/`max` (inclusive),
    `gt`/`lt` (exclusive), `choices`, `pattern` (with `allow_empty`, and `pattern_help` said
    instead of the expression when a value does not match), `allow_inf` (a float
    field that may be infinite), `example` (shown for a field without default) and
    `per_pool` (a pool-wide rate that the controller scales to the pool's replicas). A
    misspelt name is a TypeError at import, never a check silently skipped."""
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        raise TypeError(f"unknown field checks {unknown}")
    return {"unit": unit, "help": help, **checks}


def load_toml(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """The parsed TOML at `path`; ConfigError naming the file when it is missing or broken."""
    path = Path(path)
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {path} is a directory, not a file") from None
    except OSError as exc:
        raise ConfigError(f"{what} {path} cannot be read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{what} {path} is not valid TOML: {exc}") from None


def join(path: str, key: str) -> str:
    """`path.key` (or `key` at the root)."""
    return f"{path}.{key}" if path else key


def reject_unknown(data: Mapping[str, Any], known: set[str] | frozenset[str], path: str,
                   moved: Mapping[str, str] | None = None) -> None:
    """ConfigError naming the first key of `data` that is not in `known`; a key in `moved`
    (old name -> where it is now, relative to the table above this one) says where it went."""
    for key in data:
        if moved and key in moved:
            raise ConfigError(f"{join(path, key)}: this key moved to {moved[key]}")
        if key not in known:
            raise ConfigError(f"{join(path, key)}: unknown key (known: {', '.join(sorted(known))})")


def field_values(cls: type, data: Any, path: str,
                 skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Converted and checked values of the fields of `cls` present in table `data` (fields in
    `skip` are neither accepted nor built); ConfigError names `path.key`."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or 'config'}: must be a table, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {item.name: item for item in dataclasses.fields(cls)
             if item.init and item.name not in skip}
    reject_unknown(data, set(known), path, getattr(cls, "MOVED_KEYS", None))
    values = {}
    for name, item in known.items():
        key_path = join(path, name)
        if name in data:
            values[name] = convert(data[name], hints[name], key_path, item.metadata)
            check(values[name], item.metadata, key_path)
        elif item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{key_path}: required key is missing")
    return values


def build_dataclass(cls: type, data: Any, path: str) -> Any:
    """An instance of dataclass `cls` from table `data`; ConfigError names `path.key`."""
    values = field_values(cls, data, path)
    return construct(cls, values, path)


def construct(cls: type, values: Mapping[str, Any], path: str) -> Any:
    """`cls(**values)`, with an error of its own validation prefixed by `path`."""
    try:
        return cls(**values)
    except ConfigError as exc:
        message = str(exc)
        if path and not message.startswith(path):
            message = f"{path}: {message}"
        raise ConfigError(message) from None
    except (BorrowdError, ValueError, TypeError) as exc:
        raise ConfigError(f"{path or 'config'}: {exc}") from None


def _type_name(kind: Any) -> str:
    return getattr(kind, "__name__", str(kind))


def convert(value: Any, kind: Any, path: str,
            metadata: Mapping[str, Any] | None = None) -> Any:
    """`value` (from TOML) as type `kind`; ConfigError naming `path` when it is not one."""
    metadata = metadata or {}
    origin = typing.get_origin(kind)
    if origin in (types.UnionType, typing.Union):
        options = [arg for arg in typing.get_args(kind) if arg is not type(None)]
        errors = []
        for option in options:
            try:
                return convert(value, option, path, metadata)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: bad value {value!r}")
    if origin is tuple:
        args = typing.get_args(kind)
        if not isinstance(value, list):
            raise ConfigError(f"{path}: must be an array, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(convert(item, args[0], f"{path}[{i}]", metadata)
                         for i, item in enumerate(value))
        if len(args) != len(value):
            raise ConfigError(f"{path}: must have {len(args)} items, got {len(value)}")
        pairs = enumerate(zip(args, value, strict=True))
        return tuple(convert(item, arg, f"{path}[{i}]", metadata) for i, (arg, item) in pairs)
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return build_dataclass(kind, value, path)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        try:
            return kind(value)
        except ValueError:
            choices = ", ".join(repr(member.value) for member in kind)
            raise ConfigError(f"{path}: bad value {value!r} (one of {choices})") from None
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: must be true or false, got {value!r}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: must be an integer, got {value!r}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: must be a number, got {value!r}")
        number = float(value)
        if math.isnan(number):
            raise ConfigError(f"{path}: must be a number, got nan")
        if math.isinf(number) and not metadata.get("allow_inf"):
            raise ConfigError(f"{path}: must be finite, got {value!r}")
        return number
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: must be a string, got {value!r}")
        return value
    raise ConfigError(f"{path}: values of type {_type_name(kind)} cannot be configured")


def check(value: Any, metadata: Mapping[str, Any], path: str) -> None:
    """ConfigError naming `path` and `value` when it breaks a bound of the field's metadata."""
    if isinstance(value, tuple):
        for index, item in enumerate(value):
            check(item, metadata, f"{path}[{index}]")
        return
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and "min" in metadata and value < metadata["min"]:
        raise ConfigError(f"{path}: {value!r} is below the minimum {metadata['min']!r}")
    if number and "max" in metadata and value > metadata["max"]:
        raise ConfigError(f"{path}: {value!r} is above the maximum {metadata['max']!r}")
    if number and "gt" in metadata and not value > metadata["gt"]:
        raise ConfigError(f"{path}: {value!r} must be above {metadata['gt']!r}")
    if number and "lt" in metadata and not value < metadata["lt"]:
        raise ConfigError(f"{path}: {value!r} must be below {metadata['lt']!r}")
    if "choices" in metadata and value not in metadata["choices"]:
        choices = ", ".join(repr(choice) for choice in metadata["choices"])
        raise ConfigError(f"{path}: bad value {value!r} (one of {choices})")
    if "pattern" in metadata and isinstance(value, str):
        if value == "" and metadata.get("allow_empty"):
            return
        if not re.match(metadata["pattern"], value):
            rule = metadata.get("pattern_help") or f"must match {metadata['pattern']}"
            raise ConfigError(f"{path}: bad value {value!r} ({rule})")


# ---------------------------------------------------------------------------------------------
# Settings given on a command line (`--set pi.kp_tokens_per_s=12000`) over a built config.


def parse_settings(items: typing.Sequence[str]) -> dict[str, Any]:
    """`KEY=VALUE` items (dotted keys, TOML values; a bare word is a string) as a nested table;
    ConfigError naming the item when it is not one."""
    table: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(part.strip() for part in parts):
            raise ConfigError(
                f"setting {item!r}: expected KEY=VALUE, e.g. pi.kp_tokens_per_s=12000")
        try:
            value = tomllib.loads(f"v = {text.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = text.strip()
        node = table
        for part in parts[:-1]:
            child = node.setdefault(part.strip(), {})
            if not isinstance(child, dict):
                raise ConfigError(f"setting {item!r}: {part.strip()} is given a value already")
            node = child
        node[parts[-1].strip()] = value
    return table


def with_settings(obj: Any, table: Mapping[str, Any], path: str) -> Any:
    """Dataclass `obj` with the values of `table` (from `parse_settings`) put in, each
    converted and checked as the loader checks a file's; ConfigError names `path.key`."""
    names = {item.name for item in dataclasses.fields(obj) if item.init}
    reject_unknown(table, names, path, getattr(obj, "MOVED_KEYS", None))
    values: dict[str, Any] = {}
    for key, value in table.items():
        current = getattr(obj, key)
        if isinstance(value, Mapping) and dataclasses.is_dataclass(current):
            values[key] = with_settings(current, value, join(path, key))
        else:
            values.update(field_values(type(obj), {key: value}, path))
    try:
        return dataclasses.replace(obj, **values)
    except ConfigError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith(path) else f"{path}: {message}") from None
    except (BorrowdError, ValueError, TypeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
