"""What an engine plugin's module source shows of its factory and of the class the factory makes, read without
importing the module (ast only).

Only what the source settles is judged: a name bound once, by a def or class statement at the module's top level,
undecorated; a class whose every base is a class so defined in the same module, a class of qualify.engines.base, or
object, with no metaclass. A module that could change its names or classes at run time (setattr, exec, globals(),
__dict__, __getattr__, __new__, a global statement ...) is judged on nothing more than that it binds the factory; a
class handed to code the source does not show (register(Engine), install(self)) is not judged; nor is a member that
any statement of the module assigns as an attribute (self.score = ... may give an instance what its class lacks). Everything else is left to the ranks, which import the module and make the engine.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from typing import Any, Literal

from qualify.engines import base

DYNAMIC = frozenset({"setattr", "delattr", "exec", "eval", "globals", "locals", "vars", "__dict__", "__getattr__",
                     "__getattribute__", "__setattr__", "__delattr__", "__new__", "__init_subclass__", "__set_name__",
                     "__import__", "__builtins__", "builtins"})
"""Names whose use (called, read, assigned or defined anywhere in the module) lets a module change at run time what
its source shows: such a module's factory and class are not judged."""

KNOWN_BASES = {name: cls for name, cls in vars(base).items()
               if inspect.isclass(cls) and cls.__module__ == base.__name__}
"""qualify's own base classes a plugin's engine class may inherit from (TrainEngine, OutputScoring): their members
are read from the classes themselves."""

Entry = ast.ClassDef | type
"""One class of a method resolution order: a class defined in the plugin's module, or a known class."""

SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


@dataclass(kw_only=True, frozen=True, slots=True)
class Member:
    """How an engine class's method resolution binds a name: 'defined' (node: its one statement in the body of a class
    of the module; value: a known class's attribute), 'absent' (nothing binds it), or 'unknown' (bound otherwise, more
    than once, or assigned as an attribute somewhere: left to the ranks)."""

    state: Literal["defined", "absent", "unknown"]
    node: ast.stmt | None = None
    value: Any = None
    owner: str = ""
    """The class of the module whose body defines it."""


def _scope_bindings(body: list[ast.stmt]) -> dict[str, list[ast.stmt]]:
    """Every statement of one scope (a module's or a class body's top level) that binds or deletes each name, nested
    blocks included; another scope's body is not read (its def or class name, decorators, defaults and bases are)."""
    found: dict[str, list[ast.stmt]] = {}

    def visit(node: ast.AST, stmt: ast.stmt) -> None:
        names: list[str] = []
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.append(node.name)
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.append(node.id)
        elif isinstance(node, ast.alias):
            names.append(node.asname or node.name.split(".")[0])
        elif isinstance(node, ast.ExceptHandler | ast.MatchAs | ast.MatchStar) and node.name:
            names.append(node.name)
        for name in names:
            found.setdefault(name, []).append(stmt)
        for field, child in ast.iter_fields(node):
            if isinstance(node, SCOPES) and field == "body":
                continue
            for item in child if isinstance(child, list) else [child]:
                if isinstance(item, ast.AST):
                    visit(item, stmt)

    for stmt in body:
        visit(stmt, stmt)
    return found


def _once(body: list[ast.stmt], name: str) -> ast.stmt | None:
    """The statement of body that binds name where it is the only one and stands directly in body."""
    statements = _scope_bindings(body).get(name, [])
    return statements[0] if len(statements) == 1 and any(s is statements[0] for s in body) else None


def _dynamic(tree: ast.Module) -> bool:
    """Whether the module uses anything that changes its names or classes at run time (DYNAMIC, a global or nonlocal
    statement, a star import, sys.modules)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Global | ast.Nonlocal) or isinstance(node, ast.alias) and node.name == "*":
            return True
        if isinstance(node, ast.Attribute) and node.attr == "modules" and getattr(node.value, "id", "") == "sys":
            return True  # sys.modules[__name__] = ...
        name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                else node.name if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else None)
        if name in DYNAMIC:
            return True
    return False


def required_parameters(args: ast.arguments, method: bool) -> list[str] | None:
    """The parameters a call must pass (no default, not *args or **kwargs); method: the first positional one is the
    instance (None where there is none to take it: not judged)."""
    positional = [*args.posonlyargs, *args.args]
    if method and not positional:
        return None
    required = [a.arg for a in positional[:len(positional) - len(args.defaults)]]
    if method and required and required[0] == positional[0].arg:
        required = required[1:]
    return required + [a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is None]


def signature_of(args: ast.arguments, method: bool) -> inspect.Signature | None:
    """The signature a def's parameters give (defaults stand as ...); method: as bound to an instance (None where no
    positional parameter takes the instance)."""
    P = inspect.Parameter
    positional = [*args.posonlyargs, *args.args]
    defaults = [P.empty] * (len(positional) - len(args.defaults)) + [...] * len(args.defaults)
    params = [P(a.arg, P.POSITIONAL_ONLY if i < len(args.posonlyargs) else P.POSITIONAL_OR_KEYWORD, default=d)
              for i, (a, d) in enumerate(zip(positional, defaults, strict=True))]
    if method:
        if not params:
            return None
        params = params[1:]
    if args.vararg:
        params.append(P(args.vararg.arg, P.VAR_POSITIONAL))
    params += [P(a.arg, P.KEYWORD_ONLY, default=P.empty if d is None else ...)
               for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    if args.kwarg:
        params.append(P(args.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


def _own_nodes(scope: ast.AST) -> list[ast.AST]:
    """Every node of a def's own body, the bodies of the defs, classes and lambdas in it left out."""
    nodes, stack = [], [*ast.iter_child_nodes(scope)]
    while stack:
        node = stack.pop()
        nodes.append(node)
        if not isinstance(node, SCOPES):
            stack.extend(ast.iter_child_nodes(node))
    return nodes


def _ancestors(parents: dict[ast.AST, ast.AST], node: ast.AST) -> list[ast.AST]:
    """The nodes node stands in, innermost first."""
    found = []
    while node in parents:
        node = parents[node]
        found.append(node)
    return found


def _c3(head: Entry, seqs: list[list[Entry]]) -> list[Entry] | None:
    """Python's method resolution order (C3) of head from its bases' orders and the bases (None: none exists, and the
    class statement would raise)."""
    result, seqs = [head], [s for s in seqs if s]
    while seqs:
        pick = next((s[0] for s in seqs if not any(s[0] in t[1:] for t in seqs)), None)
        if pick is None:
            return None
        result.append(pick)
        seqs = [t for t in ([x for x in s[1:]] if s[0] is pick else s for s in seqs) if t]
    return result


@dataclass(kw_only=True, frozen=True, slots=True)
class EngineClass:
    """The class a plugin's factory makes, as its module's source defines it, with its whole method resolution order
    known."""

    name: str
    """The class's name in the module."""
    order: tuple[Entry, ...]
    """Its method resolution order: classes of the module (their class statements) and known classes."""
    stored: frozenset[str]
    """Every attribute name a statement of the module assigns or deletes (x.name = ...): such a member is unknown."""

    def member(self, name: str) -> Member:
        """How the class binds name: the first class of its order whose body binds it (a def there decorated, or a
        name bound there more than once or in a nested block: unknown)."""
        if name in self.stored:
            return Member(state="unknown")
        for entry in self.order:
            if isinstance(entry, type):
                if name in vars(entry):
                    return Member(state="defined", value=vars(entry)[name])
                continue
            if name in _scope_bindings(entry.body):
                node = _once(entry.body, name)
                decorated = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and \
                    bool(node.decorator_list)
                if node is None or decorated:
                    return Member(state="unknown")
                return Member(state="defined", node=node, owner=entry.name)
        return Member(state="absent")


@dataclass(kw_only=True, frozen=True, slots=True)
class PluginSource:
    """A plugin's module source, parsed: what its factory is, and the class it makes, where the source settles them."""

    name: str
    """The plugin, 'module:factory'."""
    origin: str
    """The module's source file."""
    tree: ast.Module
    """The parsed source."""

    @property
    def attr(self) -> str:
        """The factory's name."""
        return self.name.partition(":")[2]

    def factory(self) -> ast.FunctionDef | ast.ClassDef | None:
        """The factory's def or class statement, where the source settles that it is the factory: bound once, at the
        top level, undecorated, in a module that changes nothing at run time."""
        if _dynamic(self.tree):
            return None
        node = _once(self.tree.body, self.attr)
        return node if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.decorator_list else None

    def made_class(self) -> EngineClass | None:
        """The class the factory makes where the source settles it: the factory itself, or the one top-level class a
        def factory's every return statement calls (return Engine(...))."""
        node = self.factory()
        if isinstance(node, ast.FunctionDef):
            node = self._returned_class(node)
        mro = None if node is None else self._mro(node, frozenset())
        stored = frozenset(n.attr for n in ast.walk(self.tree)
                           if isinstance(n, ast.Attribute) and not isinstance(n.ctx, ast.Load))
        return None if mro is None else EngineClass(name=node.name, order=tuple(mro), stored=stored)

    def _handed_out(self, node: ast.ClassDef) -> bool:
        """Whether code the source does not show could change the class or its instances while one is made: the class
        named anywhere but as a base or as the callee inside a def, or a method passing its instance (or class) on
        bare (register(self), type(self))."""
        parents = {child: parent for parent in ast.walk(self.tree) for child in ast.iter_child_nodes(parent)}
        for name in (n for n in ast.walk(self.tree) if isinstance(n, ast.Name) and n.id == node.name):
            parent = parents.get(name)
            called = isinstance(parent, ast.Call) and parent.func is name and any(
                isinstance(p, ast.FunctionDef | ast.AsyncFunctionDef) for p in _ancestors(parents, parent))
            if not (called or isinstance(parent, ast.ClassDef) and name in parent.bases):
                return True
        for fn in (f for f in node.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)):
            first = [*fn.args.posonlyargs, *fn.args.args][:1]
            if first and any(isinstance(n, ast.Name) and n.id == first[0].arg and not isinstance(
                    parents.get(n), ast.Attribute) for n in ast.walk(fn)):
                return True
        return False

    def _returned_class(self, fn: ast.FunctionDef) -> ast.ClassDef | None:
        """The top-level class every return of fn calls, none of fn's own names shadowing it; None otherwise."""
        own = _own_nodes(fn)
        if any(isinstance(n, ast.Yield | ast.YieldFrom | ast.Await) for n in own):
            return None
        called = {n.value.func.id if isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name) else None
                  for n in own if isinstance(n, ast.Return)}
        if len(called) != 1 or None in called:
            return None
        cls = called.pop()
        local = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)} | set(_scope_bindings(fn.body))
        node = None if cls in local else _once(self.tree.body, cls)
        return node if isinstance(node, ast.ClassDef) else None

    def _base(self, expr: ast.expr, seen: frozenset[str]) -> tuple[Entry, list[Entry]] | None:
        """A base of a class statement and its method resolution order, where the source settles them: object, a
        class of qualify.engines.base imported by name, or a class of the module."""
        if not isinstance(expr, ast.Name):
            return None
        node = _once(self.tree.body, expr.id)
        if expr.id == "object" and expr.id not in _scope_bindings(self.tree.body):
            return object, [object]
        if isinstance(node, ast.ImportFrom) and node.module == base.__name__ and node.level == 0:
            cls = next((KNOWN_BASES.get(a.name) for a in node.names if (a.asname or a.name) == expr.id), None)
            return None if cls is None else (cls, list(cls.__mro__))
        mro = self._mro(node, seen) if isinstance(node, ast.ClassDef) else None
        return None if mro is None else (node, mro)

    def _mro(self, node: ast.ClassDef, seen: frozenset[str]) -> list[Entry] | None:
        """The class statement's method resolution order where every base is settled (no metaclass, no decorator)."""
        if node.keywords or node.decorator_list or node.name in seen or self._handed_out(node):
            return None
        bases = [self._base(b, seen | {node.name}) for b in node.bases]
        if any(b is None for b in bases):
            return None
        if not bases:
            return [node, object]
        return _c3(node, [mro for _, mro in bases] + [[entry for entry, _ in bases]])

    def call_problem(self) -> str | None:
        """Why calling the factory with no argument certainly fails: a def factory's, or the factory class's
        __init__'s, parameters without a default."""
        node = self.factory()
        made = self.made_class() if isinstance(node, ast.ClassDef) else None
        init = made.member("__init__").node if made is not None else None
        if isinstance(node, ast.FunctionDef):
            what, args, method = f"def {node.name}({ast.unparse(node.args)})", node.args, False
        elif isinstance(init, ast.FunctionDef):
            owner = made.member("__init__").owner
            what = f"class {self.attr}'s __init__({ast.unparse(init.args)})" + (
                "" if owner == self.attr else f" (class {owner}'s)")
            args, method = init.args, True
        else:
            return None
        required = required_parameters(args, method)
        if not required:
            return None
        return (f"engine plugin '{self.name}': {self.origin}: {what} asks for {', '.join(required)}; the factory "
                f"takes no argument (it is called as {self.attr}() and returns a TrainEngine)")

    def methods_problem(self, methods: tuple[str, ...]) -> str | None:
        """The methods (of qualify.engines.base.TrainEngine) the class the factory makes certainly lacks."""
        made = self.made_class()
        missing = [] if made is None else [m for m in methods if made.member(m).state == "absent"]
        if not missing:
            return None
        returned = "" if made.name == self.attr else f" (what {self.attr}() returns)"
        return (f"engine plugin '{self.name}': {self.origin}: class {made.name}{returned} lacks {', '.join(missing)} "
                "of qualify.engines.base.TrainEngine (neither it nor its bases define them)")
