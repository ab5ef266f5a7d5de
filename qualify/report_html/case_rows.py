"""The HTML page's per-case sections: per tensor family, the rows qualify.report_html.rows selected and how many were
left out, and one note that says where every row is (the run's verdict JSON, linked by a relative path).
"""

from __future__ import annotations

import os
from html import escape
from pathlib import Path
from typing import Any

from qualify.report_html.data import row_view
from qualify.report_html.page import table
from qualify.report_html.rows import Group

HEADER = ["comparison", "tensor", "metric", "value", "bound", "value/bound", "bound set by", "", "note"]
NEAR = 0.5  # rows at or above half their bound are highlighted
MAX_CELL_CHARS = 500  # longer text in a cell (a long note) is cut; the verdict holds it whole


def clip(v: Any) -> Any:
    """Text cut to MAX_CELL_CHARS, saying how much was cut; anything else as it is."""
    if not isinstance(v, str) or len(v) <= MAX_CELL_CHARS:
        return v
    return f"{v[:MAX_CELL_CHARS]}... ({len(v) - MAX_CELL_CHARS} more characters in the verdict)"


def verdict_href(verdict: Path, run_dir: Path, page_dir: Path | None) -> str:
    """The verdict's path relative to the page's directory (the run directory when not given), '/'-separated."""
    return Path(os.path.relpath(verdict, page_dir if page_dir is not None else run_dir)).as_posix()


def count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def shown_text(group: Group) -> str:
    """What a group's table holds, in words: 'grads: 3000 rows, 3000 failing; shown: the 20 failing rows ...'."""
    shown_failed = sum(not r.passed for r in group.shown)
    shown_passing = len(group.shown) - shown_failed
    parts = []
    if group.num_failed:
        parts.append("every failing row" if shown_failed == group.num_failed
                     else f"the {count(shown_failed, 'failing row')} furthest past their bound")
    if group.num_rows > group.num_failed:
        parts.append("every passing row" if shown_passing == group.num_rows - group.num_failed
                     else f"the {count(shown_passing, 'passing row')} nearest their bound")
    left = f"; {group.num_left_out} left out" if group.num_left_out else ""
    return (f"{group.family}: {count(group.num_rows, 'row')}, {group.num_failed} failing; shown: {' and '.join(parts)}"
            f"{left}")


def group_html(case: str, group: Group, bounds: dict[tuple[str, str], dict[str, Any]]) -> str:
    """One family's table of a case, worst first, with the bound family and term that set each bound."""
    views = [row_view(r, bounds) for r in group.shown]
    body = [[*map(clip, (v["comparison"], v["tensor"], v["metric"], v["value"], v["bound"])), v["ratio_value"],
             clip(v["set_by"]), "ok" if v["passed"] else "FAIL", clip(v.get("note", ""))] for v in views]
    classes = ["failed" if not v["passed"] else "near" if v["ratio_value"] >= NEAR else "" for v in views]
    return (f'<div class="rows" data-case="{escape(case)}" data-family="{escape(group.family)}" '
            f'data-rows="{group.num_rows}" data-failed="{group.num_failed}" data-left-out="{group.num_left_out}">'
            f"<h3>{escape(shown_text(group))}</h3>" + table(HEADER, body, classes) + "</div>")


def case_section(name: str, case: dict[str, Any], groups: list[Group], bounds: dict[tuple[str, str], dict[str, Any]],
                 verified: bool) -> str:
    """One case: its outcome and, per family, its tabled rows (open when it failed)."""
    head = f'<section class="case" id="case-{escape(name)}" data-case="{escape(name)}">'
    if not verified:
        return head + f"<p>{escape(name)}: rows not shown: the evidence does not verify</p></section>"
    outcome = "PASS" if case["passed"] else "FAIL"
    line = f"{name}: {outcome}, {case['num_checks']} checks, {case['num_failed']} failed"
    return (head + f'<details{"" if case["passed"] else " open"}><summary>{escape(line)}</summary>'
            + "".join(group_html(name, g, bounds) for g in groups) + "</details></section>")


def rows_note(groups: dict[str, list[Group]], caps: tuple[int, int], num_unreadable: int, href: str) -> str:
    """How many rows the case tables show and leave out, and the link to the verdict that holds them all."""
    num_rows = sum(g.num_rows for gs in groups.values() for g in gs)
    num_shown = sum(len(g.shown) for gs in groups.values() for g in gs)
    unreadable = (f" {num_unreadable} rows of the verdict are not readable rows (text fields, numbers, a pass flag) "
                  "and are not shown." if num_unreadable else "")
    return (f'<p id="rows-note" data-rows="{num_rows}" data-shown="{num_shown}" '
            f'data-left-out="{num_rows - num_shown}" data-unreadable="{num_unreadable}" '
            f'data-max-failing="{caps[0]}" data-max-passing="{caps[1]}">'
            f"The case tables show {num_shown} of {num_rows} rows: per case and tensor family, the failing rows "
            f"furthest past their bound (up to {caps[0]}) and the passing rows nearest it (up to {caps[1]}). "
            f"{num_rows - num_shown} rows are left out.{unreadable} "
            f'Every row is in the run\'s verdict: <a href="{escape(href)}">{escape(href)}</a>.</p>')
