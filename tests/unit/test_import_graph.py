"""The package's import graph has no circles and no climbs: no module imports one that imports it back (through any
chain), no package of qualify/ does either, and every import goes down the floors of LAYERS (or stays within its own
package), counting every import: at module level, inside functions and under TYPE_CHECKING. A circle is how a floor
starts to climb (the bound rule imported back from the stage that uses it, the matrix importing the engines that read
it); these tests name the chain that closes one and the import that climbs."""

from __future__ import annotations

import ast
import itertools
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LAYERS = [  # top floor first: a package may import its own modules and any package on a lower floor, nothing else
    {"__main__"},
    {"cli"},
    {"report_html"},
    {"report"},
    {"report_verify", "junit"},
    {"diagnose", "rounds", "replay"},
    {"candidate", "freeze"},
    {"judge"},  # below every stage that judges: the candidate stage, the replay, the rounds' checks, the report
    {"reference", "examples"},
    {"signing"},
    {"engines", "rollout", "acceptance"},
    {"bounds", "models", "slurm", "case", "resident"},
    {"matrix", "compare", "manifest", "stages", "memory"},
    {"ppo", "schema", "store", "contract", "versions"},
    {"tensor_codec", "runname", "hashing", "rolemeta"},
    {"errors", "layout", "metrics", "hardware", "progress", "stagelog", "childlog", "verdict", "waivers", "roles",
     "engines.catalog"},
]
"""A dotted name (engines.catalog) is a module with a floor of its own, below its package's: the built-in engines'
catalog, plain data that the matrix's validation reads under the engines that build from it."""


RUNS_MODULE = ("start_module", "launch")
"""Calls whose first string argument names a module that runs (python -m): starting it is importing it."""


def started_modules(node: ast.AST) -> list[str]:
    """Module names this node starts in another process: the first string constant of a call to one of RUNS_MODULE
    (a module-level constant of that name counts too, as written), and the string after "-m" in a list or tuple of
    a command line."""
    if isinstance(node, ast.Call):
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if name in RUNS_MODULE:
            return [a.value for a in node.args[:1] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    if isinstance(node, (ast.List, ast.Tuple)):
        items = node.elts
        return [b.value for a, b in itertools.pairwise(items) if isinstance(a, ast.Constant) and a.value == "-m"
                and isinstance(b, ast.Constant) and isinstance(b.value, str)]
    if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            and any(isinstance(t, ast.Name) and t.id == "WORKER" for t in node.targets)):
        return [node.value.value]
    return []


def module_graph(package_dir: Path) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, every import statement counted, wherever it stands, and every
    module it starts in another process (started_modules: a module name given to start_module or after -m)."""
    top = package_dir.name
    modules = {}
    for path in package_dir.rglob("*.py"):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            else:
                targets = started_modules(node)
            for target in targets:
                found = resolve(target) if target.split(".")[0] == top else None
                if found and found not in (name, top):
                    graph[name].add(found)
    return graph


def package_graph(graph: dict[str, set[str]], layers: list[set[str]] = LAYERS) -> dict[str, set[str]]:
    """The same graph between the top level's packages and modules (qualify.<x>), a module that layers gives a floor
    of its own (a dotted name, qualify.<x>.<y>) kept apart from its package."""
    own = {name for names in layers for name in names if "." in name}

    def top(m: str) -> str:
        parts = m.split(".")
        return m if ".".join(parts[1:]) in own else ".".join(parts[:2])
    out: dict[str, set[str]] = defaultdict(set)
    for a, bs in graph.items():
        out[top(a)] |= {top(b) for b in bs if top(b) != top(a)}
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One chain a -> ... -> a per strongly connected component of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for root in sorted(set(graph) | {b for bs in graph.values() for b in bs}):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(chain(graph, set(component)))
    return found


def chain(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first node, as a readable chain."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w == start:
                    return [*paths[v], start]
                if w in component and w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    return sorted(component)


def test_qualify_has_no_module_circles():
    assert circles(module_graph(ROOT / "qualify")) == []


def test_qualify_has_no_package_circles():
    assert circles(package_graph(module_graph(ROOT / "qualify"))) == []


def climbs(graph: dict[str, set[str]], layers: list[set[str]], top: str) -> list[str]:
    """'a -> b' for every import from a package to one on the same or a higher floor (another package); a package on
    no floor is named too (a new one must be given its floor)."""
    floor = {f"{top}.{name}": i for i, names in enumerate(layers) for name in names}
    out = [f"{p} is on no floor of LAYERS" for p in sorted(set(graph) | {b for bs in graph.values() for b in bs})
           if p not in floor]
    out += [f"{a} -> {b}" for a, bs in sorted(graph.items()) for b in sorted(bs)
            if a in floor and b in floor and floor[b] <= floor[a]]
    return out


def test_every_import_goes_down_a_floor():
    assert climbs(package_graph(module_graph(ROOT / "qualify")), LAYERS, "qualify") == []


def package(tmp_path: Path, files: dict[str, str]) -> Path:
    """A package pkg/ with a subpackage pkg/low/ and the files given (path below pkg: source)."""
    pkg = tmp_path / "pkg"
    (pkg / "low").mkdir(parents=True)
    for name, text in {"__init__.py": "", "low/__init__.py": "", **files}.items():
        (pkg / name).write_text(text)
    return pkg


def test_an_import_that_climbs_or_crosses_a_floor_is_named(tmp_path):
    pkg = package(tmp_path, {"low/rule.py": "def f():\n    from pkg import stage\n    return stage\n",
                             "stage.py": "x = 1\n", "side.py": "from pkg import stage\n"})
    graph = package_graph(module_graph(pkg))
    assert climbs(graph, [{"stage", "side"}, {"low"}], "pkg") == ["pkg.low -> pkg.stage", "pkg.side -> pkg.stage"]
    assert climbs(graph, [{"side"}, {"stage"}, {"low"}], "pkg") == ["pkg.low -> pkg.stage"]
    assert climbs(graph, [{"side"}, {"low"}], "pkg") == ["pkg.stage is on no floor of LAYERS"]


def test_a_module_started_by_name_counts_as_imported(tmp_path):
    """The negative control of started_modules: a low package that starts a higher one's module by name (start_module,
    python -m in a command line, a WORKER constant) climbs as an import would; taking the name from its caller does
    not."""
    pkg = package(tmp_path, {"stage.py": "x = 1\n",
                             "low/run.py": "def go(start_module):\n    return start_module('pkg.stage', [])\n"})
    assert climbs(package_graph(module_graph(pkg)), [{"stage"}, {"low"}], "pkg") == ["pkg.low -> pkg.stage"]
    (pkg / "low" / "run.py").write_text("import sys\nCMD = [sys.executable, '-m', 'pkg.stage']\n")
    assert climbs(package_graph(module_graph(pkg)), [{"stage"}, {"low"}], "pkg") == ["pkg.low -> pkg.stage"]
    (pkg / "low" / "run.py").write_text("WORKER = 'pkg.stage'\n")
    assert climbs(package_graph(module_graph(pkg)), [{"stage"}, {"low"}], "pkg") == ["pkg.low -> pkg.stage"]
    (pkg / "low" / "run.py").write_text("def go(start_module, worker):\n    return start_module(worker, [])\n")
    assert climbs(package_graph(module_graph(pkg)), [{"stage"}, {"low"}], "pkg") == []


def test_a_circle_through_a_function_level_import_is_found_and_named(tmp_path):
    pkg = package(tmp_path, {"low/rule.py": "def f():\n    from pkg.stage import g\n    return g\n",
                             "stage.py": "from pkg.low.rule import f\n\ndef g():\n    return f\n",
                             "free.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import stage\n"})
    graph = module_graph(pkg)
    assert circles(graph) == [["pkg.low.rule", "pkg.stage", "pkg.low.rule"]]
    assert circles(package_graph(graph)) == [["pkg.low", "pkg.stage", "pkg.low"]]
    (pkg / "low" / "rule.py").write_text("def f():\n    return 1\n")  # the climb removed: no circle
    assert circles(module_graph(pkg)) == []


def test_a_module_with_a_floor_of_its_own_is_kept_apart_from_its_package(tmp_path):
    """A dotted name of LAYERS (engines.catalog) gives a module its own floor: its package may stand above what
    imports the module; without that floor the same imports close a circle and climb."""
    pkg = package(tmp_path, {"low/data.py": "X = 1\n", "low/rule.py": "from pkg import stage\n",
                             "stage.py": "from pkg.low.data import X\n"})
    layers = [{"low"}, {"stage"}, {"low.data"}]
    graph = package_graph(module_graph(pkg), layers)
    assert climbs(graph, layers, "pkg") == [] and circles(graph) == []
    whole = package_graph(module_graph(pkg), [{"low"}, {"stage"}])
    assert climbs(whole, [{"low"}, {"stage"}], "pkg") == ["pkg.stage -> pkg.low"]
    assert circles(whole) == [["pkg.low", "pkg.stage", "pkg.low"]]
