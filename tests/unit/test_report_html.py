"""The HTML report page: self-contained, and no PASS banner for evidence that does not verify.

The page of a real, verified run is loaded in headless Chromium by tests/integration/test_html_report.py.
"""

from __future__ import annotations

import re

import numpy as np

from qualify.report import load_docs, summarize_docs, to_markdown
from qualify.report_html import to_html
from qualify.report_html.plots import delta_histogram, family_bars, heatmap
from qualify.report_verify import Verification, verify_run
from tests.unit.test_report_verify import CASE, make_run, row, verdict

# anything that could fetch: scripts, stylesheets, frames, and references that are neither '#id' nor 'data:'
EXTERNAL = re.compile(r"""<script|<link|<iframe|@import|(?:href|src)\s*=\s*(?!["']?(?:#|data:))|url\((?!#)""",
                      re.IGNORECASE)


def page_of(run, verification: Verification | None = None) -> tuple[str, dict]:
    """The page of a run, verified for real unless a verification outcome is given (to render a verified page of
    hand-made data: real verification needs real evidence, see tests/integration/test_html_report.py)."""
    docs = load_docs(run)
    verification = verification or verify_run(docs.layout, docs.reference, docs.acceptance, docs.verdict, docs.rounds)
    summary = summarize_docs(docs, verification)
    return to_html(docs, summary), summary


def test_unverified_verdict_gets_no_pass_banner(tmp_path):
    html, summary = page_of(make_run(tmp_path, verdict([row(0.5), row(0.25, tensor="grads/lm_head.weight")])))
    assert summary["status"] == "NOT VERIFIED"
    banner = re.search(r'<div id="banner"[^>]*>(.*?)</div>', html).group(1)
    assert banner.startswith("NOT VERIFIED") and "PASS" not in banner
    assert 'class="unverified"' in html and "no acceptance" in html
    assert f'data-case="{CASE}"' in html  # the cases are shown, marked unverified rather than passed
    assert ">unverified<" in html and ">PASS<" not in html


def test_page_is_self_contained(tmp_path):
    html, summary = page_of(make_run(tmp_path, verdict()), Verification(("hand-made data",), ()))
    assert summary["status"] == "PASSED" and 'data-status="PASSED"' in html
    assert not EXTERNAL.search(html), EXTERNAL.search(html)
    for fetching in ('<script src="https://cdn.example/plot.js">', '<image href="http://x/a.png"/>',
                     "<style>body { background: url(https://x/bg.png) }</style>", "<use xlink:href='file:///etc'/>"):
        assert EXTERNAL.search(html.replace("</body>", fetching + "</body>")), fetching
    assert html.count("<svg") >= 2  # the heatmap and the family bars are inline SVG


def test_hand_written_pass_shows_not_verified(tmp_path):
    html, _ = page_of(make_run(tmp_path, {"passed": True, "complete": True, "cases": {}}))
    assert 'data-status="NOT VERIFIED"' in html and ">PASS" not in html


def test_plots_are_deterministic_svg_without_external_references():
    cells = {("torch-tp actor", "fp32 tp1"): (0.1, True), ("torch-tp actor", "bf16 tp1"): (float("inf"), False)}
    rng = np.random.default_rng(0)
    deltas = {"fp32": np.abs(rng.normal(0, 1e-6, 50)), "bf16": np.concatenate([np.zeros(3), rng.random(20) * 1e-2])}
    for make in (lambda: heatmap(["torch-tp actor"], ["fp32 tp1", "bf16 tp1"], cells),
                 lambda: family_bars(["a", "b"], ["outputs", "grads"], {("a", "outputs"): 0.3, ("b", "grads"): 3.0}),
                 lambda: delta_histogram(deltas)):
        first, second = make(), make()
        assert first.startswith("<svg") and first == second
        assert "<metadata" not in first and not EXTERNAL.search(first)


def test_unverified_numbers_are_not_plotted_and_garbage_does_not_crash(tmp_path):
    v = verdict([row(0.5), row(0.25, tensor="grads/lm_head.weight") | {"value": "0.25x"}])
    v["cases"][CASE]["worst"] = {"tensor": "outputs/loss", "ratio": [1]}
    html, summary = page_of(make_run(tmp_path, v))
    assert summary["status"] == "NOT VERIFIED" and "not a number" in html
    assert "<svg" not in html.split('id="rollout"')[0]  # no heatmap, no family bars of unverified numbers
    assert "rows not shown: the evidence does not verify" in html
    assert "[1]" in to_markdown(summary)


def test_per_step_heatmap_cells_only_for_multi_step_cases():
    from qualify.report_html.steps import step_cells

    def r(step, value, bound=1.0, passed=True, case=CASE):
        return row(value, bound, passed, tensor=f"step{step}/grads/w", case=case)

    assert step_cells([row(0.5), r(0, 0.5)]) == ([], [], {})  # one step: the case heatmap says it all
    cases, steps, cells = step_cells([r(0, 0.5), r(0, 0.25), r(1, 2.0, passed=False), r(1, 3.0) | {"bound": 0.0, "ratio": "inf"}])
    assert cases == [CASE] and steps == ["step 0", "step 1"]
    assert cells == {(CASE, "step 0"): (0.5, True), (CASE, "step 1"): (2.0, False)}  # bound-0 rows: not a ratio


def test_coverage_table_marks_required_branches():
    from qualify.report_html.page import coverage_section

    html = coverage_section({"required": ["grad_clip"], "steps": {
        "actor": [{"grad_clip": True, "kl": 0}, {"grad_clip": False, "kl": 180}], "critic": [{"value_clip": 3}]}})
    assert "<th>grad_clip (required)</th><th>kl</th><th>value_clip</th>" in html
    assert html.count("<tr>") == 4  # header + two actor steps + one critic step
    assert "<td>critic</td><td class=\"num\">0</td><td></td><td></td><td class=\"num\">3</td>" in html
