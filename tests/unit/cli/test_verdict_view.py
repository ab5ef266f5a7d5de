"""The console's verdict table: each failing case's rows from its first failing step and its own family, outputs
before gradients, capped per case, so that one case's many failing gradients never hide another case's rows."""

from __future__ import annotations

import io

from rich.console import Console

from qualify.cli.verdict_view import MAX_FAILING_PER_CASE, pick_rows, render_verdict
from qualify.verdict import VERDICT_SCHEMA, Row, make_verdict


def rows_of(case: str, failing_grads: int, first_step: int) -> list[Row]:
    own, other = "vs ref bf16-r0 [bf16-repeat]", "vs ref fp32-r0 [fp32-vs-bf16]"
    rows = [Row(case, "actor", comparison, f"step{k}/grads/w{i}", "max_abs", 2.0 + i, 1.0, False, step=k)
            for comparison in (own, other) for k in range(first_step, 3) for i in range(failing_grads)]
    rows.insert(0, Row(case, "actor", own, "step0/outputs/logprobs_BT", "max_abs", 0.5, 1.0, True, step=0))
    rows.append(Row(case, "actor", own, f"step{first_step}/outputs/loss", "max_abs", 1.5, 1.0, False, step=first_step))
    return rows  # as judge_case orders them: the case's own precision's family first, then steps


def verdict():
    rows = rows_of("a-fp32-tp1-actor", 30, 0) + rows_of("b-fp32-tp1-actor", 2, 1)
    rows.append(Row("c-fp32-tp1-actor", "actor", "run", "case", "exit", 1.0, 0.0, False,
                    "ContractError: engine c: objective()'s output ratio_BT is [bad] (rank 0); log /x/launch.log"))
    return make_verdict(VERDICT_SCHEMA, "m", rows, ["a-fp32-tp1-actor", "b-fp32-tp1-actor", "c-fp32-tp1-actor"]
                        ).to_json()


def test_failing_rows_are_capped_per_case_first_step_own_family_outputs_first():
    shown = pick_rows(verdict())
    failing = {case: [r for r in shown if r["case"] == case and not r["passed"]]
               for case in ("a-fp32-tp1-actor", "b-fp32-tp1-actor", "c-fp32-tp1-actor")}
    # 181 failing rows: the capped ones, plus the worst row of each comparison (always shown)
    assert MAX_FAILING_PER_CASE <= len(failing["a-fp32-tp1-actor"]) <= MAX_FAILING_PER_CASE + 2
    assert len(failing["c-fp32-tp1-actor"]) == 1
    first = failing["a-fp32-tp1-actor"][:MAX_FAILING_PER_CASE]
    assert (first[0]["tensor"], first[0]["comparison"]) == ("step0/outputs/loss", "vs ref bf16-r0 [bf16-repeat]")
    assert all(r["step"] == 0 and r["comparison"] == "vs ref bf16-r0 [bf16-repeat]" for r in first)
    assert failing["b-fp32-tp1-actor"][0]["tensor"] == "step1/outputs/loss"  # its first failing step is 1
    assert len(failing["b-fp32-tp1-actor"]) >= 5  # a's 181 rows do not crowd b out


def test_a_case_that_did_not_run_shows_its_note_whole():
    out = io.StringIO()
    render_verdict(verdict(), Console(file=out, width=300, highlight=False))
    text = out.getvalue()
    assert ("did not run: ContractError: engine c: objective()'s output ratio_BT is [bad] (rank 0); log "
            "/x/launch.log") in text


def test_an_engines_control_characters_are_shown_escaped():
    """Terminal injection: an engine's exception (the 'did not run' note) and a tensor name it exported are printed
    with their control characters escaped, never raw."""
    rows = [Row("c-fp32-tp1-actor", "actor", "run", "case", "exit", 1.0, 0.0, False,
                "RuntimeError: \x1b[2J\x1b]0;pwned\x07 wiped\u202e (rank 0)\nsecond line"),
            Row("d-fp32-tp1-actor", "actor", "vs ref fp32-r0 [fp32-repeat]", "step0/grads/w\x1b[8m", "max_abs", 2.0,
                1.0, False, step=0)]
    doc = make_verdict(VERDICT_SCHEMA, "m", rows, ["c-fp32-tp1-actor", "d-fp32-tp1-actor"]).to_json()
    out = io.StringIO()
    render_verdict(doc, Console(file=out, width=400, highlight=False))
    text = out.getvalue()
    assert not any(c in text for c in "\x1b\x07\u202e"), repr(text)
    assert "did not run: RuntimeError: \\x1b[2J\\x1b]0;pwned\\x07 wiped\\u202e (rank 0)" in text
    assert "w\\x1b[8m" in text
