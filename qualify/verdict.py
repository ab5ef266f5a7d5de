"""The verdict: one typed row shape and one document shape for the candidate stage and the rounds stage.

A row is one judged fact: which case (a candidate case, or `rounds-vllm-tp<N>`), which role and step
(optimizer step of a case, or round of a rounds run), what it was compared with, which tensor (or rounds
check) and metric, the value observed, the bound and the rule it was held to, whether it passed, and a note.
A row passes only when its rule holds; a verdict passes only when every row passes and nothing stopped it.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

VERDICT_SCHEMA = "qualify.verdict/1"
ROUNDS_SCHEMA = "qualify.rounds/1"
CHECK_GROUPS = ("run", "evidence", "derived", "layout", "rollout")
"""Comparisons that are check groups of their own (a report's testcase or table), not a tensor family's."""
COMPARISON_FAMILY = re.compile(r"\[(?P<family>[^\]]+)\]$")
"""How a comparison names its bound family: 'vs ref fp32-r0 [fp32-repeat]', 'vs tp1 [bitwise]'."""


def comparison_family(comparison: str) -> str | None:
    """The bound family a comparison names, None where it names none ('evidence', 'run', 'derived', 'rounds')."""
    m = COMPARISON_FAMILY.search(comparison)
    return None if m is None else m["family"]


@dataclass(frozen=True, slots=True)
class Row:
    """One judged value."""

    case: str
    role: str
    comparison: str
    """What the value compares: 'vs ref fp32-r0 [fp32-repeat]', 'vs tp1 [...]', 'evidence', 'run', 'rounds'."""
    tensor: str
    """A tensor key ('step0/grads/lm_head.weight'), an evidence check, or a rounds check."""
    metric: str
    value: Any
    """A number for a judged tensor; a rounds check may observe any JSON value (a list of cached tokens, a digest)."""
    bound: float | None
    """The numeric bound (value <= bound passes), or None where the rule is not a number."""
    passed: bool
    note: str = ""
    step: int | None = None
    """The optimizer step (0-based) of a case, or the round of a rounds run; None when not per step."""
    rule: str = ""
    """The rule the value was held to, in words ('<= 4 x control + floor ...', '== [0, 0]')."""
    family: str | None = None
    """The bound family the value was judged in ('fp32-repeat', 'fp32-vs-bf16', 'bitwise'), None for a row judged in
    none (evidence, run, derived, rounds). Not written: the file carries it as the comparison's '[family]' suffix
    (COMPARISON_FAMILY), so it is checked against the comparison when given and read from it when not (Row.from_json,
    and constructors that do not pass it)."""

    def __post_init__(self) -> None:
        found = comparison_family(self.comparison)
        if self.family is None:
            object.__setattr__(self, "family", found)
        elif self.family != found:
            raise ValueError(f"row family {self.family!r} is not the one its comparison {self.comparison!r} names "
                             f"({found!r})")

    @property
    def group(self) -> str:
        """The check group of a check row (CHECK_GROUPS: the comparison), else the tensor family, over all steps:
        the first part of the tensor key after its 'step<k>/' ('outputs', 'grads', 'updates', 'moments', ...)."""
        if self.comparison in CHECK_GROUPS:
            return self.comparison
        key = self.tensor if self.step is None else self.tensor.removeprefix(f"step{self.step}/")
        return key.split("/", 1)[0]

    @property
    def ratio(self) -> float:
        """value / bound (0 for a zero value at a zero bound, inf for any other value there); 0 without a bound."""
        if self.bound is None or not isinstance(self.value, int | float) or isinstance(self.value, bool):
            return 0.0
        if self.bound > 0:
            return self.value / self.bound
        return 0.0 if self.value == 0 else math.inf

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Row:
        """The row a verdict file holds (to_json's inverse; 'inf' and 'nan' read back as floats)."""
        def number(v: Any) -> Any:
            return float(v) if isinstance(v, str) and v in ("inf", "-inf", "nan") else v

        return cls(d["case"], d["role"], d["comparison"], d["tensor"], d["metric"], number(d["value"]),
                   number(d["bound"]), d["passed"], d.get("note", ""), d.get("step"), d.get("rule", ""))

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        del d["family"]  # the comparison names it
        d["ratio"] = self.ratio
        for k in ("value", "bound", "ratio"):
            if isinstance(d[k], float) and not math.isfinite(d[k]):
                d[k] = str(d[k])
        return d


def fact(check: str, step: int | None, observed: Any, required: str, passed: bool, note: str = "",
         bound: float | None = None) -> Row:
    """A rounds row: a check at a round, what was observed and what was required (the case is set when it is added)."""
    return Row("rounds", "actor", "rounds", check, "check", observed, bound, passed, note, step, required)


def worst_row(rows: list[Row]) -> Row | None:
    """The row closest to (or furthest past) its bound, among rows with a bound or failing."""
    return max((r for r in rows if (r.bound is not None and r.bound > 0) or not r.passed), key=lambda r: r.ratio,
               default=None)


@dataclass(frozen=True, slots=True)
class Verdict:
    """A verdict document: the rows, per case summaries, and the stage's own header fields (`details`)."""

    schema: str
    matrix: str
    rows: list[Row]
    cases: dict[str, dict[str, Any]]
    failure: str | None = None
    """What stopped the run before every check could be made (rounds), else None."""
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.failure is None and bool(self.cases) and all(c["passed"] for c in self.cases.values())

    @property
    def num_failed(self) -> int:
        return sum(not r.passed for r in self.rows)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Verdict:
        """The verdict a verdict file holds (to_json's inverse)."""
        own = {"schema", "matrix", "passed", "failure", "cases", "num_checks", "num_failed", "rows"}
        return cls(d["schema"], d["matrix"], [Row.from_json(r) for r in d["rows"]], d["cases"], d.get("failure"),
                   {k: v for k, v in d.items() if k not in own})

    def to_json(self) -> dict[str, Any]:
        return {"schema": self.schema, "matrix": self.matrix, **self.details, "passed": self.passed,
                "failure": self.failure, "cases": self.cases, "num_checks": len(self.rows),
                "num_failed": self.num_failed, "rows": [r.to_json() for r in self.rows]}


def case_summaries(rows: list[Row], names: list[str], extra: dict[str, dict[str, Any]] | None = None
                   ) -> dict[str, dict[str, Any]]:
    """Per case: passed (every row passes, and there is at least one), counts, the worst row, and extra fields."""
    out = {}
    for name in names:
        mine = [r for r in rows if r.case == name]
        worst = worst_row(mine)
        out[name] = {"passed": all(r.passed for r in mine) and bool(mine), "num_checks": len(mine),
                     "num_failed": sum(not r.passed for r in mine),
                     "worst": worst.to_json() if worst else None} | (extra or {}).get(name, {})
    return out


def make_verdict(schema: str, matrix: str, rows: list[Row], names: list[str], *, failure: str | None = None,
                 extra: dict[str, dict[str, Any]] | None = None, details: dict[str, Any] | None = None) -> Verdict:
    return Verdict(schema, matrix, rows, case_summaries(rows, names, extra), failure, details or {})
