"""The layout probe's parts: every layout scores each row exactly once, ranks merge by sum, and a row is judged only
where the sealed spec declares invariance (an undeclared engine's count is reported with an infinite bound)."""

from __future__ import annotations

import math

import pytest
import torch

from qualify.engines.base import Batch
from qualify.judge.layout_probe import layout_rows, layouts, merge_ranks, probe_layouts


@pytest.mark.parametrize("rows", [1, 3, 8, 9])
def test_every_layout_scores_every_row_once(rows):
    for name, groups in layouts(rows).items():
        assert sorted(r for g in groups for r in g) == list(range(rows)), name
    assert ("micro-batch 4" in layouts(rows)) == (rows > 4)


class ByBatch:
    """Scores that follow the batch: each row's score carries the number of rows it was scored with (jitter > 0)."""

    def __init__(self, jitter: float) -> None:
        self.jitter = jitter

    def score(self, batch: Batch) -> torch.Tensor:
        base = batch.input_ids_BT.float() * 0.5
        return base + self.jitter * batch.input_ids_BT.shape[0]


def test_probe_counts_tokens_that_follow_the_layout():
    ids = torch.arange(6 * 5).reshape(6, 5)
    mask = torch.zeros(6, 5, dtype=torch.bool)
    mask[:, 2:] = True
    batch = Batch(input_ids_BT=ids, response_mask_BT=mask)
    same = probe_layouts(ByBatch(0.0), batch)
    assert all(p["num_not_bitwise"] == 0 and p["num_tokens"] == 18 for p in same.values())
    moved = probe_layouts(ByBatch(1e-3), batch)
    assert moved["micro-batch 1"]["num_not_bitwise"] == 18 and moved["reversed order"]["num_not_bitwise"] == 0
    merged = merge_ranks([moved, moved])
    assert merged["micro-batch 1"] == {"num_tokens": 36, "num_not_bitwise": 36,
                                       "max_abs": moved["micro-batch 1"]["max_abs"]}


def test_rows_are_judged_only_where_declared():
    probe = {"micro-batch 1": {"num_tokens": 10, "num_not_bitwise": 3, "max_abs": 1e-7}}
    [declared] = layout_rows("c", "actor", {"case": {"layout_invariant": True}, "layout": probe})
    assert not declared.passed and declared.value == 3 and declared.bound == 0
    assert declared.note.startswith("not layout-invariant (micro-batch 1: 3 of 10 tokens differ")
    [reported] = layout_rows("c", "critic", {"case": {}, "layout": probe})
    assert reported.passed and reported.bound == math.inf and reported.tensor == "step0/outputs/values_BT"
    [missing] = layout_rows("c", "actor", {"case": {"layout_invariant": True}})
    assert not missing.passed and "no layout probe" in missing.note
