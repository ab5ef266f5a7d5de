"""Case names are written in one place (Case.name) and read back beside it (parse_case_name, Case.parse_name): every
case of every shipped matrix (matrices/, benchmarks/) reads back as itself, a plugin's case as a case of the same
name; what Case.name never writes reads as no case (the negative controls)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from qualify.errors import MatrixError
from qualify.matrix import BUILTIN_ENGINES, CASE_NAME, Case, load_matrix, parse_case_name
from qualify.matrix.cases import enumerate_cases
from qualify.roles import ROLES

ROOT = Path(__file__).resolve().parents[3]
FILES = sorted(ROOT.glob("matrices/*.yaml")) + sorted(ROOT.glob("benchmarks/*.yaml"))


def loaded() -> list:
    """Every shipped matrix that loads here (a checkpoint matrix whose config.json is here but refuses it is left out)."""
    out = []
    for path in FILES:
        try:
            out.append(load_matrix(path))
        except MatrixError:
            continue
    return out


MATRICES = loaded()


def safe(engine: str) -> str:
    """A plugin's engine as a case name writes it."""
    return engine.replace(":", "-").replace(".", "-")


def test_the_shipped_matrices_load():
    assert len(MATRICES) >= 10 and any(m.candidates.dp != (1,) for m in MATRICES)
    assert any(":" in e for m in MATRICES for e in m.candidates.engines)  # a plugin's cases are read back too


@pytest.mark.parametrize("matrix", MATRICES, ids=lambda m: Path(m.source).name)
def test_every_case_of_every_shipped_matrix_reads_back_as_itself(matrix):
    cases = matrix.cases()
    assert cases
    for case in cases + [replace(c, packing="packed") for c in cases]:  # and each one's packed layout
        parsed = parse_case_name(case.name)
        assert parsed == Case.parse_name(case.name) and parsed.name == case.name
        assert parsed == (case if case.engine in BUILTIN_ENGINES else replace(case, engine=safe(case.engine)))


@pytest.mark.parametrize("engine, written", [("my.pkg:make", "my-pkg-make"), ("pkg:f", "pkg-f")])
def test_a_plugin_case_reads_back_as_a_case_of_the_same_name(engine, written):
    case = Case(engine=engine, precision="bf16", tp=2, role="critic", dp=4, packing="packed")
    parsed = parse_case_name(case.name)
    assert parsed == Case(engine=written, precision="bf16", tp=2, role="critic", dp=4, packing="packed")
    assert parsed.name == case.name


@pytest.mark.parametrize("name", ["x-fp32-tp1-packed-padded-actor", "x-fp32-tp1-dp1-actor", "x-fp16-tp1-actor",
                                  "x-fp32-tp0-actor", "x-fp32-tp1-reward", "fp32-tp1-actor", "x-fp32-tp1-dp01-actor",
                                  "x-bf16-tp1-actor-packed"])
def test_what_case_name_never_writes_reads_as_no_case(name):
    assert parse_case_name(name) is None and Case.parse_name(name) is None


def test_the_pattern_is_the_verdicts():
    """The verdict's reader (qualify.report_verify.CASE_NAME) reads the same names as this one."""
    from qualify.report_verify import CASE_NAME as VERDICT_CASE_NAME

    assert CASE_NAME.pattern == VERDICT_CASE_NAME.pattern
    assert f"(?P<role>{'|'.join(ROLES)})" in CASE_NAME.pattern


def test_cases_enumerate_in_a_stable_order_within_max_ranks():
    m = load_matrix(ROOT / "matrices" / "tiny-qwen3-dp.yaml")
    cases = enumerate_cases(m.candidates)
    assert cases == m.cases() and len({c.name for c in cases}) == len(cases)
    assert all(c.world_size <= m.candidates.max_ranks for c in cases) if m.candidates.max_ranks else True
    first = cases[0]
    assert (first.engine, first.precision, first.tp, first.dp, first.role) == (
        m.candidates.engines[0], m.candidates.precisions[0], m.candidates.tp[0], m.candidates.dp[0],
        m.candidates.roles[0])
