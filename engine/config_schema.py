"""A small strict schema: dataclass sections parsed from JSON with errors that name the key path.

Each config section is a dataclass whose field names are the JSON keys. A field's metadata may
carry `min`, `max` (inclusive bounds), `gt` (exclusive lower bound) and `choices`. Types
understood: bool, int, float, str, Literal[...], X | None, nested section dataclasses, dict,
list[float], and unions of these (e.g. `int | Literal["auto"] | None`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from typing import Any, Literal


class ConfigError(ValueError):
    """A config value or key is wrong; the message names the key path and the fix."""


def closest(name: str, options: typing.Iterable[str]) -> str | None:
    options = list(options)
    lowered = {o.lower(): o for o in options}
    if name.lower() in lowered:
        return lowered[name.lower()]
    match = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return match[0] if match else None


def unknown_key_error(path: str, key: str, valid: typing.Iterable[str]) -> ConfigError:
    valid = sorted(valid)
    full = f"{path}.{key}" if path else key
    guess = closest(key, valid)
    hint = f" Did you mean '{f'{path}.{guess}' if path else guess}'?" if guess else ""
    where = f"'{path}'" if path else "the top level"
    return ConfigError(f"{full}: unknown key.{hint} Valid keys at {where}: {', '.join(valid)}.")


def describe(annotation: Any) -> str:
    """A readable name for what a type annotation allows."""
    origin = typing.get_origin(annotation)
    if annotation is type(None):
        return "null"
    if origin is Literal:
        return " or ".join(json.dumps(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(annotation))
    if origin is list:
        return f"a list of {describe(typing.get_args(annotation)[0])}"
    if dataclasses.is_dataclass(annotation):
        return "an object"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string", dict: "an object"}.get(
        annotation, getattr(annotation, "__name__", str(annotation))
    )


_NO_MATCH = object()


def _coerce(value: Any, annotation: Any, path: str) -> Any:
    """Returns the value converted to the annotation, or _NO_MATCH."""
    origin = typing.get_origin(annotation)
    if annotation is type(None):
        return None if value is None else _NO_MATCH
    if origin is Literal:
        choices = typing.get_args(annotation)
        if isinstance(value, str):
            for c in choices:  # names are case-insensitive, as in DeepSpeed
                if isinstance(c, str) and c.lower() == value.lower():
                    return c
        return value if value in choices and not isinstance(value, bool) else _NO_MATCH
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            out = _coerce(value, option, path)
            if out is not _NO_MATCH:
                return out
        return _NO_MATCH
    if origin is list:
        if not isinstance(value, (list, tuple)):
            return _NO_MATCH
        (item,) = typing.get_args(annotation)
        items = [_coerce(v, item, path) for v in value]
        return _NO_MATCH if any(i is _NO_MATCH for i in items) else items
    if dataclasses.is_dataclass(annotation):
        return parse_section(annotation, value, path) if isinstance(value, dict) else _NO_MATCH
    if annotation is bool:
        return value if isinstance(value, bool) else _NO_MATCH
    if annotation is int:
        if isinstance(value, bool):
            return _NO_MATCH
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():  # DeepSpeed configs write 5e8
            return int(value)
        return _NO_MATCH
    if annotation is float:
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else _NO_MATCH
    if annotation is str:
        return value if isinstance(value, str) else _NO_MATCH
    if annotation is dict:
        return dict(value) if isinstance(value, dict) else _NO_MATCH
    raise TypeError(f"schema annotation {annotation!r} at {path} is not supported")


def show(value: Any) -> str:
    """A value as the user wrote it in JSON (true, null, "text")."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _check_bounds(value: Any, meta: typing.Mapping[str, Any], path: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    if "min" in meta and value < meta["min"]:
        raise ConfigError(f"{path}: {show(value)} is out of range; it must be >= {meta['min']}.")
    if "gt" in meta and value <= meta["gt"]:
        raise ConfigError(f"{path}: {show(value)} is out of range; it must be > {meta['gt']}.")
    if "max" in meta and value > meta["max"]:
        raise ConfigError(f"{path}: {show(value)} is out of range; it must be <= {meta['max']}.")


def parse_section(cls: type, raw: Any, path: str = "") -> Any:
    """Builds dataclass `cls` from a JSON object, rejecting unknown keys and wrong values."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or 'config'}: expected an object, got {show(raw)}.")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            raise unknown_key_error(path, key, fields)
    hints = typing.get_type_hints(cls)
    values = {}
    for name, f in fields.items():
        if name not in raw:
            continue
        key_path = f"{path}.{name}" if path else name
        value = _coerce(raw[name], hints[name], key_path)
        if value is _NO_MATCH:
            raise ConfigError(f"{key_path}: {show(raw[name])} is not allowed; expected {describe(hints[name])}.")
        _check_bounds(value, f.metadata, key_path)
        values[name] = value
    return cls(**values)


def bounded(default: Any, **meta: Any) -> Any:
    """A dataclass field with a default and bounds metadata (min, max, gt)."""
    if isinstance(default, (dict, list)) or dataclasses.is_dataclass(default):
        raise TypeError("use section() for mutable defaults")
    return dataclasses.field(default=default, metadata=meta)


def section(cls: type) -> Any:
    """A nested section field whose default is the section with its own defaults."""
    return dataclasses.field(default_factory=cls)


def to_dict(obj: Any) -> Any:
    """A section (or nested value) as plain JSON data."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
