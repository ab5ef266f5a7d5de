"""`qualify report --format html`: one self-contained static page (inline CSS and SVG, no script, no network).

Sections: a banner (PASS or FAIL only for evidence that verified, NOT VERIFIED otherwise), what was
verified, the case matrix as a heatmap of worst value/bound (and one per optimizer step for
multi-step cases), value/bound per tensor family, the train-vs-rollout |delta| distribution per
precision, the coverage the acceptance sealed, rounds, each case's failing rows and the rows nearest their bound
per tensor family (a bounded number: qualify.report_html.rows; the page links the verdict JSON for every row) with
the bound family and term that set each bound, and provenance (versions, digests, host, git, platform). A forged
verdict renders too: its unreadable rows and fields are left out or shown as escaped text. Whatever an engine
wrote (an exception in a note, a tensor name) has its control characters escaped (qualify.childlog.printable).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qualify.childlog import printable
from qualify.report import RunDocs
from qualify.report_html import data, page
from qualify.report_html.case_rows import case_section, rows_note, verdict_href
from qualify.report_html.diagnosis import diagnosis_sections
from qualify.report_html.plots import delta_histogram, family_bars, heatmap
from qualify.report_html.rows import select_rows
from qualify.report_html.steps import step_cells
from qualify.report_verify import readable


def to_html(docs: RunDocs, summary: dict[str, Any], page_dir: Path | None = None) -> str:
    """The whole page as a string (page_dir: where it will be written, for the relative link to the verdict; the
    run directory when not given)."""
    cases = (summary["candidates"] or {}).get("cases", {})
    verified = summary["verification"]["ok"]
    # numbers of a verdict that does not verify are neither plotted nor tabled: they are not evidence
    all_rows = docs.verdict["rows"] if verified and readable(docs.verdict) else []
    rows = data.readable_rows(all_rows)
    parts = [page.banner(summary), page.verification(summary["verification"], summary.get("unfinished"))]
    if cases and verified:
        grid_rows, grid_cols, cells = data.heatmap_cells(cases)
        families, ratios = data.family_ratios(rows)
        parts.append(page.figure("Case matrix", heatmap(grid_rows, grid_cols, cells), "heatmap"))
        step_rows, step_cols, step_grid = step_cells(rows)
        if step_grid:
            parts.append(page.figure("Per optimizer step", heatmap(step_rows, step_cols, step_grid, "case and step"), "steps"))
        parts.append(page.figure("value/bound per tensor family", family_bars(list(cases), families, ratios),
                                 "families"))
    deltas = data.rollout_deltas(docs)
    parts.append(page.rollout_section(summary, delta_histogram(deltas) if deltas else None))
    coverage = (docs.acceptance or {}).get("coverage")
    if isinstance(coverage, dict):
        parts.append(page.coverage_section(coverage))
    parts.append(page.rounds_section(summary["rounds"]))
    bounds = data.bound_docs(docs)
    groups, caps = select_rows(rows, list(cases))
    if cases:
        parts.append(page.cases_overview(cases, verified))
    if cases and verified:
        href = verdict_href(docs.layout.verdict, docs.layout.root, page_dir)
        cand = summary["candidates"] or {}
        parts += [page.margin_line(cand.get("closest_passing"), cand.get("closest_derived")),
                  rows_note(groups, caps, len(all_rows) - len(rows), href)]
    parts += [case_section(name, c, groups[name], bounds, verified) for name, c in cases.items()]
    parts += diagnosis_sections(docs.layout.root, (docs.acceptance or {}).get("digest"), verified)  # qualify diagnose
    parts.append(page.mapping_section("Provenance", "provenance", summary["provenance"]))
    # the page's own lines are its newlines: any other control character in it came from a foreign string
    return printable(page.document(f"qualify report: {summary['matrix']}", parts), newlines=True)

