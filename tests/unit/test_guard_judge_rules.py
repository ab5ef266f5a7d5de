"""Exact texts and edges of the judge's newer rows (bound_rule, unexposed_padding, precision_rows), pinned so that a
mutation of their wording, their sums or their edge conditions fails a test (TESTING.md's mutation runs)."""

from __future__ import annotations

import torch

from qualify.bounds.files import bound_rule
from qualify.compare import RunTensors
from qualify.judge.steps import CHANCE_ELEMENTS, PRECISION_MARGIN, precision_rows, unexposed_padding


def test_bound_rule_names_each_part_that_made_the_bound():
    full = {"bound": 0.00415, "control_error": 0.000977, "floor": 1e-06, "quantum": 0.000244}
    assert bound_rule(full) == "<= 0.00415 = k x control 0.000977 + floor 1e-06 + quantum 0.000244"
    assert bound_rule(full | {"quantum": 0.0}) == "<= 0.00415 = k x control 0.000977 + floor 1e-06"
    assert bound_rule({"bound": 0.5, "floor": 0.25}) == "<= 0.5 = floor 0.25"
    assert bound_rule({"bound": 0.5, "control_error": 0.125}) == "<= 0.5 = k x control 0.125"
    assert bound_rule({"bound": 0.5}) == "<= 0.5"


def test_unexposed_padding_sums_each_rank_shortfall_and_names_it():
    per_rank = [{"found": {"emb": 2}, "exposed": 2},                   # reported: nothing missing here
                {"found": {"lm": 3, "emb": 4}, "exposed": 5},          # 2 of 7 rows unreported
                {"found": {"lm": 6}},                                  # nothing reported at all
                {}]
    missing, note = unexposed_padding(per_rank)
    assert missing == 8
    assert note == ("the engine holds vocabulary rows beyond the real vocabulary that padded_rows() does not report: "
                    "rank 1: emb (4 rows), lm (3 rows); rank 2: lm (6 rows)")
    assert unexposed_padding([{"found": {"lm": 1}, "exposed": 3}]) == (0, "")
    assert unexposed_padding([]) == (0, "")


def _run(outputs=None, grads=None) -> RunTensors:
    return RunTensors(outputs or {}, grads or {}, {}, {})


def test_precision_rows_every_step_and_group_with_exact_texts():
    g = torch.Generator().manual_seed(3)
    fp32 = torch.randn(200, generator=g) * 3 + 0.1
    widened = fp32.to(torch.bfloat16).float()
    cand = [_run({"x": fp32}, {"w": fp32}), _run({"x": widened}, {"w": fp32})]
    ref = [_run({"x": fp32}, {"w": fp32}), _run({"x": fp32}, {"w": fp32})]
    rows = precision_rows("c", "critic", cand, ref)
    assert [(r.tensor, r.step, r.passed) for r in rows] == [
        ("step0/outputs/x", 0, True), ("step0/grads/w", 0, True), ("step1/outputs/x", 1, False),
        ("step1/grads/w", 1, True)]
    bad = rows[2]
    assert (bad.case, bad.role, bad.comparison, bad.metric) == ("c", "critic", "evidence", "bf16_exact_excess")
    counted = int(((widened != 0) & (torch.frexp(widened).mantissa.abs() != 0.5)).sum())
    import math

    kept = [v for v in fp32.tolist() if v != 0 and abs(math.frexp(v)[0]) != 0.5]
    ref_fraction = sum(v == float(torch.tensor(v).to(torch.bfloat16)) for v in kept) / len(kept)
    assert bad.value == 1.0 - ref_fraction  # every widened element is a bf16 value
    assert bad.bound == max(PRECISION_MARGIN, CHANCE_ELEMENTS / counted)
    assert bad.note.endswith("of its elements are bf16 values (reference 0%): computed or stored in bf16, where the "
                             "contract says fp32") and bad.note.startswith("100%")
    assert bad.rule == f"bf16-exact fraction <= the reference's + max(0.05, 4 / {counted} counted elements)"
    assert rows[0].note == "" and rows[0].value == 0.0


def test_precision_rows_skip_what_cannot_be_compared():
    one = torch.tensor([1.5])
    pair = torch.tensor([1.1, 2.2])
    cand = [_run({"scalar": one, "only_here": pair, "shape": pair, "zeros": torch.zeros(4)},
                 {"w": torch.zeros(3)})]
    ref = [_run({"scalar": one, "shape": torch.tensor([[1.1, 2.2]]), "zeros": torch.zeros(4)},
                {"w": torch.zeros(3)})]
    rows = precision_rows("c", "actor", cand, ref)
    # one-element, one-sided and reshaped tensors are skipped; an all-zero tensor counts nothing and keeps the margin
    assert [(r.tensor, r.value, r.bound, r.passed) for r in rows] == [
        ("step0/outputs/zeros", 0.0, PRECISION_MARGIN, True), ("step0/grads/w", 0.0, PRECISION_MARGIN, True)]
    assert rows[0].rule == "bf16-exact fraction <= the reference's + max(0.05, 4 / 0 counted elements)"
    # steps beyond the shorter run are not judged here (judge_steps names a missing step)
    assert precision_rows("c", "actor", cand * 2, ref) == rows


def test_a_rank_that_reports_nothing_counts_from_zero():
    assert unexposed_padding([{"found": {"lm": 1}}]) == (
        1, ("the engine holds vocabulary rows beyond the real vocabulary that padded_rows() does not report: "
           "rank 0: lm (1 rows)"))


def test_an_excess_exactly_at_its_margin_passes_and_a_two_element_tensor_is_judged():
    g = torch.Generator().manual_seed(9)
    ref = torch.randn(80, generator=g) + 3.0
    assert all(float(v) != float(torch.tensor(v).to(torch.bfloat16)) for v in ref.tolist())
    cand = ref.clone()
    cand[:4] = cand[:4].to(torch.bfloat16).float()  # 4 of 80 counted elements: exactly 4/80 = 0.05 more
    [row] = precision_rows("c", "actor", [_run({"x": cand})], [_run({"x": ref})])
    assert row.value == row.bound == 0.05 and row.passed and row.note == ""
    pair = torch.tensor([1.1, 2.2])
    [row] = precision_rows("c", "actor", [_run({"p": pair.to(torch.bfloat16).float()})], [_run({"p": pair})])
    # judged (a row), though two elements can never show more than chance: the margin is 4 elements of 2
    assert row.tensor == "step0/outputs/p" and row.passed and row.bound == CHANCE_ELEMENTS / 2 and row.value == 1.0


def test_judged_rows_carry_their_step_and_rule():
    from qualify.bounds.rule import bound_entry
    from qualify.judge.steps import EVIDENCE_RULE, evidence_rows, judge_steps
    from tests.unit._runs import OPT, params

    ref = _run({"loss": torch.tensor(0.5)}, {})
    b = bound_entry("loss", 0.125, 4.0, {"loss": 0.25})
    rows = judge_steps("c", "actor", "cmp", [ref, ref], [ref, ref],
                       {"step0/outputs/loss": {"max_abs": b}, "step1/outputs/loss": {"max_abs": b}},
                       [params(), params()], OPT)
    assert [(r.tensor, r.step, r.rule) for r in rows] == [
        ("step0/outputs/loss", 0, bound_rule(b)), ("step1/outputs/loss", 1, bound_rule(b))]
    meta = {"grad_dtypes": {}, "state_dtypes": {}, "replica_max_abs": {}, "padded_rows": {}, "extra_params": []}
    assert {r.rule for r in evidence_rows("c", "actor", meta)} == {EVIDENCE_RULE} == {"== 0"}
