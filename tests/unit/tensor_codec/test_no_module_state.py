"""qualify.tensor_codec holds no state of its own: no module of it binds a name, at its top level or in a class body,
to a mutable container (what a read keeps lies in its caller's DecodeCache, what crc() counts in its caller's
CrcMeter), and no function rebinds a module's name (global). Constants, a ContextVar naming the caller's open
object and functools.lru_cache of a pure function are not state of this kind."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "qualify" / "tensor_codec"

MUTABLE_CALLS = frozenset({
    "list", "dict", "set", "bytearray", "OrderedDict", "defaultdict", "deque", "Counter", "ChainMap", "local",
    "WeakSet", "WeakKeyDictionary", "WeakValueDictionary", "Queue", "SimpleQueue", "LifoQueue", "PriorityQueue",
    "ThreadPoolExecutor", "ProcessPoolExecutor",
})
"""Calls that make a mutable container (by the called name, however it is reached: threading.local(),
__import__("threading").local())."""


def makes_container(node: ast.expr | None) -> bool:
    """Whether an expression makes a mutable container: a list, dict or set display or comprehension, or a call to
    one of MUTABLE_CALLS."""
    if isinstance(node, ast.List | ast.Dict | ast.Set | ast.ListComp | ast.DictComp | ast.SetComp):
        return True
    if isinstance(node, ast.Call):
        func = node.func
        return (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")) in MUTABLE_CALLS
    return False


def _bound(stmt: ast.stmt) -> list[ast.expr]:
    if isinstance(stmt, ast.Assign):
        return stmt.targets if makes_container(stmt.value) else []
    if isinstance(stmt, ast.AnnAssign | ast.AugAssign):
        return [stmt.target] if makes_container(stmt.value) else []
    return []


def module_state(source: str) -> list[str]:
    """'line N: name' for each name the source binds to a mutable container outside any function (at its top level,
    under an if, try or with there, or in a class body), and for each global statement."""
    found = []

    def visit(body: list[ast.stmt], where: str) -> None:
        for stmt in body:
            found.extend(f"line {stmt.lineno}: {where}{ast.unparse(t)}" for t in _bound(stmt))
            if isinstance(stmt, ast.ClassDef):
                visit(stmt.body, f"{where}{stmt.name}.")
            elif not isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    visit([s for s in getattr(stmt, field, []) if isinstance(s, ast.stmt | ast.ExceptHandler)],
                          where)

    visit(ast.parse(source).body, "")
    found += [f"line {n.lineno}: global {', '.join(n.names)}" for n in ast.walk(ast.parse(source))
              if isinstance(n, ast.Global)]
    return found


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_no_module_of_the_codec_holds_state(path):
    assert module_state(path.read_text(encoding="utf-8")) == [], path


def test_the_check_finds_each_kind_of_module_state():
    """The negative control: a module-level dict, an OrderedDict, a threading.local, a pool, a list made in a try,
    a class attribute list and a global statement are each found; constants, tuples, frozensets, a ContextVar and
    containers inside functions are not."""
    source = '''
import threading
from collections import OrderedDict
from contextvars import ContextVar

_X: dict = {}
_LRU = OrderedDict()
_PINNED = __import__("threading").local()
_THREAD = threading.local()
try:
    _POOL = [n for n in range(2)]
except ImportError:
    pass
LIMIT = 256 << 20
NAMES = ("a", "b")
KINDS = frozenset({"moment", "param"})
_OPEN: ContextVar[tuple] = ContextVar("open", default=())


class Cache:
    seen = []
    size: int = 0

    def __init__(self):
        self.held = {}


def count():
    global LIMIT
    local = []
    return local
'''
    assert module_state(source) == ["line 6: _X", "line 7: _LRU", "line 8: _PINNED", "line 9: _THREAD",
                                    "line 11: _POOL", "line 21: Cache.seen", "line 29: global LIMIT"]
