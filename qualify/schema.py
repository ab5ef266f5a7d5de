"""Load plain YAML/JSON data into frozen dataclasses, strictly.

An unknown key, a missing field or a value of the wrong type is a MatrixError
that names the file, the dotted key and what was expected. Field types are read
from the dataclass annotations: int, float, str, bool, Literal, tuples, dicts
of str to a scalar, optional fields and nested dataclasses.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from qualify.errors import MatrixError


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _convert(value: Any, tp: Any, where: str, source: str) -> Any:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        concrete = [o for o in options if o is not type(None)]
        if len(concrete) == 1:  # X | None: X's own error names the exact key (an unknown nested key, say)
            return _convert(value, concrete[0], where, source)
        for option in concrete:
            try:
                return _convert(value, option, where, source)
            except MatrixError:
                continue
        raise MatrixError(f"{source}: {where}: expected {' or '.join(_type_name(o) for o in options)}, got {value!r}")
    if origin is Literal:  # compare types too: True == 1, and YAML's 1 is not the string '1'
        if not any(type(value) is type(a) and value == a for a in get_args(tp)):
            raise MatrixError(f"{source}: {where}: expected one of {_type_name(tp)}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, source, where)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise MatrixError(f"{source}: {where}: expected a list, got {value!r}")
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{where}[{i}]", source) for i, v in enumerate(value))
        if len(args) != len(value):
            raise MatrixError(f"{source}: {where}: expected {len(args)} items, got {len(value)}")
        return tuple(_convert(v, a, f"{where}[{i}]", source) for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        key_tp, val_tp = get_args(tp)
        if not isinstance(value, dict):
            raise MatrixError(f"{source}: {where}: expected a mapping, got {value!r}")
        return {_convert(k, key_tp, f"{where} key", source): _convert(v, val_tp, f"{where}.{k}", source)
                for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise MatrixError(f"{source}: {where}: expected a number, got {value!r}{_float_hint(value)}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise MatrixError(f"{source}: {where}: expected an integer, got {value!r}")
        return value
    if tp in (str, bool):
        if not isinstance(value, tp):
            raise MatrixError(f"{source}: {where}: expected {tp.__name__}, got {value!r}")
        return value
    raise AssertionError(f"unsupported annotation {tp!r} at {where}")


def from_dict(cls: type, data: Any, source: str, where: str = "") -> Any:
    """Build dataclass cls from a mapping, rejecting unknown keys and wrong types."""
    label = where or "top level"
    if not isinstance(data, dict):
        raise MatrixError(f"{source}: {label}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            raise MatrixError(f"{source}: unknown key '{_join(where, key)}' (allowed: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], _join(where, name), source)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise MatrixError(f"{source}: missing field '{_join(where, name)}' ({_type_name(hints[name])})")
    try:
        return cls(**kwargs)
    except ValueError as exc:
        if isinstance(exc, MatrixError):
            raise
        raise MatrixError(f"{source}: {label}: {exc}") from exc


def to_dict(obj: Any) -> Any:
    """Plain data (dicts, lists, scalars) from a dataclass tree, for JSON and YAML."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple | list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _float_hint(value: Any) -> str:
    """YAML 1.1 (PyYAML) reads 1e-6 as a string: say how to write it."""
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return ""
        return " (YAML reads exponents without a dot as text: write 1.0e-6, not 1e-6)"
    return ""


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else str(key)


def load_yaml_file(cls: type, path: Path | str, what: str, injected: dict[str, Any]) -> Any:
    """Read a YAML file into dataclass cls; keys the loader injects (injected) may not be set by the file."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise MatrixError(f"{what} not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise MatrixError(f"{path}: not valid YAML: {exc}") from exc
    if isinstance(data, dict):
        for key in injected:
            if key in data:
                raise MatrixError(f"{path}: key '{key}' is set by the loader, not the file")
        data = {**data, **injected}
    return from_dict(cls, data, str(path))
