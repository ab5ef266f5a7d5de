"""Engine registry: a plain dict from name to factory, plus 'module:factory' plugins.

A plugin's factory is a function or class defined in Python source: its module's file is read (nothing imported but
its parent packages) before any rank starts (candidate's and rounds' first check), so a builtin or C function
('builtins:eval', 'os:abort') is refused in one line, never called; so is, where the source settles it
(qualify.engines.plugin_source), a factory that asks for arguments or makes a class that lacks a TrainEngine method.
When the engine is made, what the name is bound to is checked again, and the engine it returns.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from qualify.engines.base import TrainEngine
from qualify.engines.catalog import CATALOG, BuiltinEngine
from qualify.engines.plugin_source import PluginSource
from qualify.errors import EngineError
from qualify.matrix.engine_names import engine_name_problem

Factory = Callable[[], TrainEngine]


def _build(engine: BuiltinEngine) -> TrainEngine:
    """A built-in engine made from its catalog entry: its adapter's module imported now (never before), the class
    called with the entry's keyword arguments."""
    module_name, _, attr = engine.adapter.partition(":")
    return getattr(importlib.import_module(module_name), attr)(**dict(engine.kwargs))


ENGINES: dict[str, Factory] = {engine.name: partial(_build, engine) for engine in CATALOG}
"""Every built-in engine's factory, by name (qualify.engines.catalog.CATALOG lists them)."""

PRELOAD: dict[str, tuple[str, ...]] = {engine.name: engine.preload for engine in CATALOG if engine.preload}
"""Third-party modules a built-in engine's ranks import that a CPU launch's fork server imports before it forks them
(qualify.case.forkserver; torch and transformers are always there): each catalog entry's preload."""


def preload_modules(engine: str) -> tuple[str, ...]:
    """What a CPU launch of engine's ranks has its fork server import besides torch and transformers (a plugin:
    nothing more; its own modules are imported by each rank, so a changed plugin is the code that runs)."""
    return PRELOAD.get(engine, ())


NOT_PYTHON = "not a function or class defined in Python source"
"""What a factory must be (a builtin or C function is never called)."""


def _bound_names(body: list[ast.stmt]) -> set[str]:
    """Names a module's top level binds: def, class, assignment, import by name (under if/try/with too)."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {a.asname or a.name.split(".")[0] for a in node.names if a.name != "*"}
        elif isinstance(node, ast.If | ast.Try | ast.With):
            for block in ("body", "orelse", "finalbody"):
                names |= _bound_names(getattr(node, block, []))
            for handler in getattr(node, "handlers", []):
                names |= _bound_names(handler.body)
    return names


def plugin_source(name: str) -> PluginSource | str:
    """A plugin's module source, parsed (nothing imported but its parent packages), or why it cannot be: a module
    built or frozen into the interpreter or not loaded from a .py file, a file that cannot be read or parsed, a factory
    name its top level does not bind."""
    module_name, _, attr = name.partition(":")
    origin = _module_spec(module_name).origin
    if origin in ("built-in", "frozen"):
        return f"engine plugin '{name}': module '{module_name}' is {origin} into the interpreter: '{attr}' is {NOT_PYTHON}"
    if not origin.endswith(".py") or not Path(origin).is_file():
        return f"engine plugin '{name}': module '{module_name}' is loaded from {origin}: '{attr}' is {NOT_PYTHON}"
    try:
        tree = ast.parse(Path(origin).read_bytes(), origin)
    except (OSError, SyntaxError, ValueError) as exc:
        return f"engine plugin '{name}': cannot read {origin}: {type(exc).__name__}: {exc}"
    if attr not in _bound_names(tree.body):
        return f"engine plugin '{name}': {origin} does not bind '{attr}' at its top level: {NOT_PYTHON}"
    return PluginSource(name=name, origin=origin, tree=tree)


def factory_problem(name: str) -> str | None:
    """Why a plugin's factory is not one qualify may call (None: nothing its source shows is wrong): plugin_source's
    refusals, then what the source settles (qualify.engines.plugin_source): a factory that asks for arguments (a def's
    parameters, or the class's __init__'s, without a default), a class made that lacks a TrainEngine method."""
    source = plugin_source(name)
    if isinstance(source, str):
        return source
    return source.call_problem() or source.methods_problem(ENGINE_METHODS)


def require_engine(name: str, where: str = "") -> None:
    """name is a registered engine or a 'module:factory' plugin (qualify.matrix.engine_names.engine_name_problem) whose factory
    its module's source binds and shows nothing wrong with (factory_problem); anything else is an error listing the
    known ones."""
    problem = engine_name_problem(name) or (None if name in ENGINES else factory_problem(name))
    if problem:
        raise EngineError(f"{problem}{where}")


def _python_factory(factory: Any) -> bool:
    """A function defined in Python, or a class defined in Python source (not a builtin or C function or type)."""
    if inspect.isfunction(factory):
        return True
    try:
        return inspect.isclass(factory) and inspect.getfile(factory).endswith(".py")
    except TypeError:  # a built-in class
        return False


def get_engine(name: str) -> TrainEngine:
    """Build the engine called name: a registered name or 'package.module:factory'."""
    require_engine(name)
    if name in ENGINES:
        return ENGINES[name]()
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise EngineError(f"cannot import engine plugin module '{module_name}': {type(exc).__name__}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise EngineError(f"engine plugin '{name}': {module_name} has no callable '{attr}'")
    if not _python_factory(factory):
        raise EngineError(f"engine plugin '{name}': {attr} is a {type(factory).__name__}, {NOT_PYTHON}")
    try:
        engine = factory()
    except Exception as exc:
        raise EngineError(f"engine plugin '{name}': calling {attr}() failed: {type(exc).__name__}: {exc} (a factory "
                          "takes no argument and returns a TrainEngine)") from exc
    missing = [m for m in ENGINE_METHODS if not callable(getattr(engine, m, None))]
    if missing:
        raise EngineError(f"engine plugin '{name}': {attr}() returned a {type(engine).__name__}, which lacks "
                          f"{', '.join(missing)} of qualify.engines.base.TrainEngine")
    return engine


ENGINE_METHODS = ("setup", "score", "backward", "grads", "grad_dtypes", "step", "params", "optimizer_state",
                  "replicated", "padded_rows", "close")
"""The methods of qualify.engines.base.TrainEngine every engine implements."""


# The code that makes a case's evidence besides the adapter itself: a change here changes every case.
HARNESS_MODULES = ("qualify",)
"""Every module of qualify/ (a change anywhere in the harness, compare.py as much as the worker, is a redo); what a
case's ranks import from outside it is recorded when the case is sealed (qualify.candidate.imported)."""
BUILTIN_SOURCES = "qualify.engines"
"""Every module of this package is a built-in adapter's source (megatron's converter included)."""


def _module_spec(module_name: str) -> Any:
    """The import spec of a module, found without importing the module itself (its parent packages are)."""
    try:
        spec = importlib.util.find_spec(module_name)  # imports the parent packages, whose __init__ may raise
    except Exception as exc:
        raise EngineError(f"cannot find the source of engine module '{module_name}': {type(exc).__name__}: {exc}") \
            from exc
    if spec is None or spec.origin is None:
        raise EngineError(f"cannot find the source of engine module '{module_name}'")
    return spec


def _source_files(module_name: str) -> list[Path]:
    """The .py files of a module, or of every module of a package (without importing the module itself)."""
    spec = _module_spec(module_name)
    origin = Path(spec.origin)
    if spec.submodule_search_locations:
        return sorted(p for loc in spec.submodule_search_locations for p in Path(loc).rglob("*.py"))
    return [origin]


def engine_identity(name: str) -> dict[str, Any]:
    """What an engine's evidence depends on in code: the sha256 of every source file of the adapter (or the
    plugin's module) and of the harness modules a case runs, and the plugin's factory name."""
    import hashlib

    require_engine(name)
    if name in ENGINES:
        modules, factory = [BUILTIN_SOURCES], name
    else:
        module_name, _, factory = name.partition(":")
        modules = [module_name]
    files = {}
    for module in [*modules, *HARNESS_MODULES]:
        paths = _source_files(module)
        root = paths[0].parent if len(paths) == 1 else Path(importlib.util.find_spec(module).origin).parent
        for path in paths:
            files[f"{module}:{path.relative_to(root).as_posix()}"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"engine": name, "factory": factory, "sources": dict(sorted(files.items()))}
