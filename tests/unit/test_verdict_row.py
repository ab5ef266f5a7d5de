"""The verdict row's typed family, group and step: what the reports read instead of parsing the row's text, and the
verdict file unchanged by them (the family is not written: the comparison names it)."""

from __future__ import annotations

import json
import math

import pytest

from qualify.verdict import Row, comparison_family


def judged(comparison: str, tensor: str = "step1/grads/w", step: int | None = 1, **kw) -> Row:
    return Row("torch-tp-fp32-tp2-actor", "actor", comparison, tensor, "max_abs", 0.5, 1.0, True, step=step, **kw)


def test_the_family_is_the_comparisons_and_is_not_written():
    row = judged("vs ref fp32-r0 [fp32-repeat]")
    assert row.family == "fp32-repeat" and judged("vs tp1 [bitwise]", family="bitwise").family == "bitwise"
    assert judged("evidence").family is None and comparison_family("derived") is None
    assert "family" not in row.to_json()
    assert list(row.to_json()) == ["case", "role", "comparison", "tensor", "metric", "value", "bound", "passed",
                                   "note", "step", "rule", "ratio"]


def test_a_family_the_comparison_does_not_name_is_refused():
    with pytest.raises(ValueError, match=r"row family 'bf16-repeat' is not the one its comparison .* \('fp32-repeat'\)"):
        judged("vs ref fp32-r0 [fp32-repeat]", family="bf16-repeat")
    with pytest.raises(ValueError, match=r"\(None\)"):
        judged("evidence", family="fp32-repeat")


def test_a_row_reads_back_from_its_json_with_its_family_group_and_step():
    row = Row("c", "critic", "vs ref bf16-r0 [fp32-vs-bf16]", "step3/updates/w", "max_abs", math.inf, 0.0, False, step=3)
    back = Row.from_json(json.loads(json.dumps(row.to_json())))
    assert back == row and (back.family, back.group, back.step) == ("fp32-vs-bf16", "updates", 3)


def test_the_group_is_the_check_group_or_the_tensor_family_over_steps():
    assert judged("vs tp1 [bf16-repeat]").group == "grads"
    assert judged("vs tp1 [bf16-repeat]", tensor="moments/exp_avg/x", step=None).group == "moments"
    assert judged("evidence", tensor="step0/outputs/x", step=0).group == "evidence"
    assert judged("own outputs", tensor="step2/outputs/loss", step=2).group == "outputs"
    # the step is the row's own: a tensor named for another step is not stripped
    assert judged("vs tp1 [bf16-repeat]", tensor="step2/grads/w", step=1).group == "step2"
