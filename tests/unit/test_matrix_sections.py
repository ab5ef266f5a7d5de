"""Each function gets its own section of the matrix, not the whole of it: the functions of qualify/ that take the whole
Matrix (a parameter annotated Matrix, or named matrix) are the stages' entry points and the few that must see all of
it (its snapshot, the frozen-sections check, the scoring fingerprint, the memory estimate), at most ten, each named
here so that a new one is a decision, not a drift. Everything else takes a section (matrix.objective,
matrix.case_settings, matrix.capture, matrix.reference, ...) or a context made from the matrix once
(qualify.reference.context.ScoringContext).

Following the Matrix object from the candidate command (every call that passes it on) enters at most 12 modules."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

WHOLE_MATRIX = {
    "qualify.candidate.stage.run_candidates": "the candidate stage's entry",
    "qualify.candidate.stage.require_frozen_matrix": "compares every section with the sealed snapshot",
    "qualify.reference.stage.run_reference": "the reference stage's entry",
    "qualify.reference.stage.snapshot_matrix": "seals the whole matrix",
    "qualify.reference.context.ScoringContext.of": "takes the sections scoring reads, once",
    "qualify.reference.evidence.scoring_settings": "the fingerprint of the numerics sections",
    "qualify.rounds.stage.run_rounds": "the rounds stage's entry",
    "qualify.rounds.stage.rounds_options": "validates overrides against the whole matrix",
    "qualify.memory.misfits": "the memory estimate of every stage",
    "qualify.slurm.render.check_memory": "the memory check of a rendered chain",
}


def takes_matrix(args: ast.arguments) -> str | None:
    """The name of a parameter that is the whole matrix object: annotated Matrix, or named matrix and not a name, a
    path or the matrix as a JSON document (a dict: compared or hashed as data, not read section by section)."""
    for a in args.posonlyargs + args.args + args.kwonlyargs:
        annotation = ast.unparse(a.annotation).strip("'\"") if a.annotation is not None else ""
        if annotation.split(".")[-1] == "Matrix" or (a.arg == "matrix" and annotation not in ("str", "Path")
                                                      and not annotation.startswith("dict")):
            return a.arg
    return None


def functions(package: Path) -> dict[str, tuple[ast.FunctionDef, Path, str]]:
    """{'pkg.module.[Class.]function': (node, file, module)} of every function and method of the package."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

        todo: list[tuple[ast.AST, str]] = [(ast.parse(path.read_text(encoding="utf-8")), "")]
        while todo:
            node, prefix = todo.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    todo.append((child, f"{prefix}{child.name}."))
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{module}.{prefix}{child.name}"] = (child, path, module)
    return out


def whole_matrix_functions(package: Path) -> list[str]:
    """Every function of the package that takes the whole matrix, but the CLI's commands (they take its path)."""
    return sorted(name for name, (node, _, _) in functions(package).items()
                  if takes_matrix(node.args) and not name.startswith(f"{package.name}.cli."))


def test_at_most_ten_functions_take_the_whole_matrix_each_named():
    found = whole_matrix_functions(ROOT / "qualify")
    assert found == sorted(WHOLE_MATRIX), {"not listed": sorted(set(found) - set(WHOLE_MATRIX)),
                                           "listed but gone": sorted(set(WHOLE_MATRIX) - set(found))}
    assert len(WHOLE_MATRIX) <= 10


def test_a_function_that_takes_the_whole_matrix_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "cli").mkdir(parents=True)
    (pkg / "a.py").write_text("def f(matrix, x):\n    return matrix.ppo\n\n\ndef g(objective):\n    return objective\n")
    (pkg / "b.py").write_text("class C:\n    def m(self, m: 'Matrix'):\n        return m\n\n\n"
                              "def h(matrix: str):\n    return matrix\n")
    (pkg / "cli" / "c.py").write_text("def main(matrix):\n    return matrix\n")
    assert whole_matrix_functions(pkg) == ["pkg.a.f", "pkg.b.C.m"]


def matrix_path(package: Path, entry: str) -> set[str]:
    """The modules entered by following the Matrix object from entry: a function that holds it (as a parameter, or
    as the value a load_matrix or from_dict(Matrix, ...) call gave a name) and passes it, whole, to another function of
    the package enters that function's module. Callees are resolved by the names the caller's module imports or
    defines (the package's own functions only)."""
    table = functions(package)
    by_module: dict[str, dict[str, str]] = {}
    for name, (_, _, module) in table.items():
        by_module.setdefault(module, {})[name[len(module) + 1:]] = name  # 'f' or 'Class.f'

    def imports(path: Path, module: str) -> dict[str, str]:
        names = dict(by_module.get(module, {}))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package.name):
                for a in node.names:
                    target = f"{node.module}.{a.name}"
                    if target in table:
                        names[a.asname or a.name] = target
                    elif any(m.startswith(f"{target}.") and table[m][2] == node.module for m in table):  # a class
                        names.update({f"{a.asname or a.name}.{m.rpartition('.')[2]}": m
                                      for m in table if m.rpartition(".")[0] == target})
        return names

    seen, todo = set(), [entry]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        node, path, module = table[name]
        known = imports(path, module)
        holders = {takes_matrix(node.args)} - {None}
        for sub in ast.walk(node):
            if isinstance(sub, ast.Assign) and isinstance(sub.value, ast.Call):
                called = ast.unparse(sub.value.func)
                if called.endswith("load_matrix") or (called.endswith("from_dict") and sub.value.args and
                                                      ast.unparse(sub.value.args[0]) == "Matrix"):
                    holders |= {t.id for t in sub.targets if isinstance(t, ast.Name)}
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call) and any(isinstance(a, ast.Name) and a.id in holders
                                                 for a in [*sub.args, *(k.value for k in sub.keywords)]):
                callee = known.get(ast.unparse(sub.func))
                if callee is not None:
                    todo.append(callee)
    return {table[n][2] for n in seen}


def test_the_candidate_stage_follows_the_matrix_through_at_most_twelve_modules():
    entered = matrix_path(ROOT / "qualify", "qualify.cli.candidate.main")
    assert "qualify.candidate.stage" in entered and len(entered) <= 12, sorted(entered)


def test_following_the_matrix_enters_each_module_it_is_passed_to(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "entry.py").write_text("from pkg.stage import run\nfrom pkg.side import quiet\n\n\n"
                                  "def main(path):\n    matrix = load_matrix(path)\n    quiet(matrix.ppo)\n"
                                  "    return run(matrix)\n")
    (pkg / "stage.py").write_text("from pkg.low import deep\n\n\ndef run(matrix):\n    return deep(matrix)\n")
    (pkg / "low.py").write_text("def deep(matrix):\n    return matrix\n")
    (pkg / "side.py").write_text("def quiet(ppo):\n    return ppo\n")
    assert matrix_path(pkg, "pkg.entry.main") == {"pkg.entry", "pkg.stage", "pkg.low"}
