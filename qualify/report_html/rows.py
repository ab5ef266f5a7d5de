"""Which verdict rows the HTML page tables: per case and tensor family, the failing rows and the passing rows nearest
their bound, a bounded number in all (ROW_BUDGET), so the page stays small at any number of rows (a 0.6B-shaped run
has about 500k). What is left out is counted on the page; the verdict JSON holds every row.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from qualify.report_html.data import ratio_of
from qualify.verdict import Row

MAX_FAILING = 20  # failing rows tabled per (case, family), furthest past the bound first
MAX_PASSING = 10  # passing rows tabled per (case, family), nearest the bound first
ROW_BUDGET = 1500  # rows tabled on the whole page (about 0.7 MB); many groups share it, each keeps one of each
FAMILY_ORDER = ("run", "evidence", "outputs", "grads", "updates", "moments", "decisions")


@dataclass(frozen=True, slots=True)
class Group:
    """The tabled rows of one case's tensor family (or check group: evidence, run, decisions) and its counts."""

    family: str
    shown: list[Row]
    """Failing rows, then passing rows; each part worst (largest value/bound) first."""
    num_rows: int
    num_failed: int

    @property
    def num_left_out(self) -> int:
        return self.num_rows - len(self.shown)


def severity(row: Row) -> float:
    """value/bound for ordering; NaN (a value that is not a number fails) counts as furthest past the bound."""
    ratio = ratio_of(row)
    return math.inf if math.isnan(ratio) else ratio


def row_caps(num_groups: int) -> tuple[int, int]:
    """(failing, passing) rows tabled per group: MAX_FAILING and MAX_PASSING while ROW_BUDGET allows, in the same
    proportion below that, and never fewer than one of each (so every failing group shows a failing row)."""
    share = ROW_BUDGET // max(1, num_groups)
    total = MAX_FAILING + MAX_PASSING
    return (max(1, min(MAX_FAILING, share * MAX_FAILING // total)),
            max(1, min(MAX_PASSING, share * MAX_PASSING // total)))


def family_key(family: str) -> tuple[int, str]:
    return (FAMILY_ORDER.index(family) if family in FAMILY_ORDER else len(FAMILY_ORDER), family)


def group_rows(rows: list[Row], cases: list[str]) -> dict[str, dict[str, list[Row]]]:
    """Readable rows by case (only the cases listed, in their order) and family (Row.group: FAMILY_ORDER, others
    after)."""
    by_case: dict[str, dict[str, list[Row]]] = {c: {} for c in cases}
    for r in rows:
        if r.case in by_case:
            by_case[r.case].setdefault(r.group, []).append(r)
    return {c: dict(sorted(fams.items(), key=lambda kv: family_key(kv[0]))) for c, fams in by_case.items()}


def select_group(family: str, rows: list[Row], caps: tuple[int, int]) -> Group:
    """The worst failing and the worst passing rows of one group, up to caps; ties keep the verdict's order."""
    failing = [r for r in rows if not r.passed]
    passing = [r for r in rows if r.passed]
    shown = heapq.nlargest(caps[0], failing, key=severity) + heapq.nlargest(caps[1], passing, key=severity)
    return Group(family, shown, len(rows), len(failing))


def select_rows(rows: list[Row], cases: list[str]) -> tuple[dict[str, list[Group]], tuple[int, int]]:
    """Per case (in the order given), its groups with the rows to table (every row of a listed case counted), and
    the (failing, passing) caps that applied."""
    grouped = group_rows(rows, cases)
    caps = row_caps(sum(len(fams) for fams in grouped.values()))
    return {c: [select_group(f, rs, caps) for f, rs in fams.items()] for c, fams in grouped.items()}, caps
