"""Load plain YAML/JSON data into frozen dataclasses, strictly.

An unknown key, a missing field or a value of the wrong type is a MatrixError
that names the file, the dotted key and what was expected. Field types are read
from the dataclass annotations: int, float, str, bool, Literal, tuples, dicts
of str to a scalar, optional fields and nested dataclasses.

YAML files must be UTF-8; a key written twice in one mapping, aliases that expand
past MAX_YAML_NODES (an alias bomb) or a recursive alias are errors. Every message
is one line and quotes a value only up to a few dozen characters.
"""

from __future__ import annotations

import dataclasses
import functools
import reprlib
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from qualify.errors import MatrixError

MAX_YAML_NODES = 10_000
"""Most nodes a YAML document may expand to, aliases counted at every use (a matrix has about 150)."""

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4
_REPR.maxlevel = 3


def show(value: Any) -> str:
    """repr of a value for a one-line message: at most about 120 characters however large the value is."""
    text = _REPR.repr(value)
    return text if len(text) <= 120 else text[:100] + "..." + text[-17:]


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
        raise MatrixError(f"{source}: {where}: expected {' or '.join(_type_name(o) for o in options)}, got {show(value)}")
    if origin is Literal:  # compare types too: True == 1, and YAML's 1 is not the string '1'
        if not any(type(value) is type(a) and value == a for a in get_args(tp)):
            raise MatrixError(f"{source}: {where}: expected one of {_type_name(tp)}, got {show(value)}")
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, source, where)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise MatrixError(f"{source}: {where}: expected a list, got {show(value)}")
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{where}[{i}]", source) for i, v in enumerate(value))
        if len(args) != len(value):
            raise MatrixError(f"{source}: {where}: expected {len(args)} items, got {len(value)}")
        return tuple(_convert(v, a, f"{where}[{i}]", source) for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        key_tp, val_tp = get_args(tp)
        if not isinstance(value, dict):
            raise MatrixError(f"{source}: {where}: expected a mapping, got {show(value)}")
        return {_convert(k, key_tp, f"{where} key", source): _convert(v, val_tp, f"{where}.{k}", source)
                for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise MatrixError(f"{source}: {where}: expected a number, got {show(value)}{_float_hint(value)}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise MatrixError(f"{source}: {where}: expected an integer, got {show(value)}")
        return value
    if tp in (str, bool):
        if not isinstance(value, tp):
            raise MatrixError(f"{source}: {where}: expected {tp.__name__}, got {show(value)}")
        return value
    raise AssertionError(f"unsupported annotation {tp!r} at {where}")


def from_dict(cls: type, data: Any, source: str, where: str = "") -> Any:
    """Build dataclass cls from a mapping, rejecting unknown keys and wrong types."""
    label = where or "top level"
    if not isinstance(data, dict):
        raise MatrixError(f"{source}: {label}: expected a mapping, got {show(data)}")
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


def _join(where: str, key: Any) -> str:
    text = str(key)
    if not (text.isascii() and text.isprintable() and len(text) <= 60):
        text = show(key)[1:-1] if isinstance(key, str) else show(key)  # escaped and cut, without repr's quotes
    return f"{where}.{text}" if where else text


def load_yaml_file(cls: type, path: Path | str, what: str, injected: dict[str, Any]) -> Any:
    """Read a YAML file into dataclass cls; keys the loader injects (injected) may not be set by the file."""
    path = Path(path)
    if not path.is_file():
        raise MatrixError(f"{what} not found: {path}")
    data = parse_yaml(read_text(path), str(path))
    if isinstance(data, dict):
        for key in injected:
            if key in data:
                raise MatrixError(f"{path}: key '{key}' is set by the loader, not the file")
        data = {**data, **injected}
    try:
        return from_dict(cls, data, str(path))
    except RecursionError as exc:
        raise MatrixError(f"{path}: nested too deeply") from exc


def read_text(path: Path) -> str:
    """A text file's content; it must be UTF-8."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise MatrixError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MatrixError(f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                          "save the file as UTF-8") from exc


def parse_yaml(text: str, source: str) -> Any:
    """Plain data from YAML text, refusing duplicate keys, alias bombs and recursive aliases."""
    import yaml

    try:
        loader = _strict_loader()(text)  # the reader checks for unprintable characters here
        loader.source = source
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _check_expansion(node, source)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise MatrixError(f"{source}: not valid YAML: {_yaml_problem(exc)}") from exc
    except RecursionError as exc:
        raise MatrixError(f"{source}: not valid YAML: nested too deeply") from exc
    except ValueError as exc:  # a scalar the constructor cannot make: an integer of more than 4300 digits
        raise MatrixError(f"{source}: not valid YAML: {str(exc).split(';')[0]}") from exc


@functools.cache
def _strict_loader() -> type:
    """yaml.SafeLoader that refuses a key written twice in one mapping (PyYAML keeps the last one)."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        source = ""

        def construct_mapping(self, node: Any, deep: bool = False) -> dict:
            seen: set = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue  # '<<' merges are overridden by design; other non-scalar keys fail in PyYAML
                key = self.construct_object(key_node)
                if key in seen:
                    raise MatrixError(f"{self.source}: line {key_node.start_mark.line + 1}: duplicate key "
                                      f"{show(key)} (each key may appear once in a mapping)")
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def _children(node: Any) -> list:
    if isinstance(node.value, list):  # sequence: nodes; mapping: (key, value) pairs
        return [n for item in node.value for n in (item if isinstance(item, tuple) else (item,))]
    return []


def _check_expansion(root: Any, source: str) -> None:
    """Refuse a node graph that expands past MAX_YAML_NODES or refers to itself (aliases share nodes).

    Iterative depth-first sizes, memoized per node: an alias bomb composes to a small graph, so this
    costs the graph's size, never its expansion.
    """
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            open_nodes.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in _children(node))
            if sizes[key] > MAX_YAML_NODES:
                raise MatrixError(f"{source}: YAML holds more than {MAX_YAML_NODES} values once its aliases are "
                                  "expanded (an alias bomb?); a matrix or profile needs a few hundred")
        elif key in open_nodes:
            raise MatrixError(f"{source}: line {node.start_mark.line + 1}: a YAML alias refers to itself")
        elif key not in sizes:
            open_nodes.add(key)
            stack.append((node, True))
            stack.extend((c, False) for c in _children(node) if id(c) not in sizes)


def _yaml_problem(exc: Exception) -> str:
    """One line from a PyYAML error (its str() spans several lines with a source excerpt)."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem and mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
