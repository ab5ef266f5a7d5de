"""Packing (qualify.case.packing): the plan packs whole samples greedily in row order within the budget, the packed
micro-batch holds exactly the samples' real tokens with position ids restarting per sample and cu_seqlens at the
boundaries, and unpacking puts per-token values back at (row, position), each compared with an obvious loop; a
sample longer than the budget and a row that is not prompt-response-padding are input errors."""

from __future__ import annotations

import pytest
import torch

from qualify.case.context import Batch
from qualify.case.packing import (
    pack_batch,
    pack_rows,
    plan_packs,
    repack,
    sample_lengths,
    split_to,
    unpack,
    zero_sample_starts,
)
from qualify.errors import EvidenceError, QualifyError


def rollout(lengths: list[int], prompt: int = 3, T: int = 12, seed: int = 0) -> tuple[Batch, torch.Tensor]:
    """A right-padded batch: prompt tokens, then response tokens up to each length, then padding (id 0)."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    ids = torch.randint(1, 50, (B, T), generator=g)
    prompt_mask = torch.zeros(B, T, dtype=torch.bool)
    response_mask = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        ids[b, n:] = 0
        prompt_mask[b, :prompt] = True
        response_mask[b, prompt:n] = True
    return Batch(input_ids_BT=ids, response_mask_BT=response_mask), prompt_mask


def greedy_by_loop(lengths: list[int], budget: int) -> list[list[int]]:
    packs, current, used = [], [], 0
    for i, n in enumerate(lengths):
        if current and used + n > budget:
            packs.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    return packs + ([current] if current else [])


@pytest.mark.parametrize(("lengths", "budget"), [([5, 5, 5], 10), ([12, 1, 12, 3], 13), ([4], 4), ([3, 9, 2, 2, 7], 11),
                                                 ([1, 1, 1, 1], 100)])
def test_plan_is_greedy_in_row_order_within_the_budget(lengths, budget):
    plan = plan_packs(lengths, budget)
    assert [list(range(len(lengths)))[s] for s in plan] == greedy_by_loop(lengths, budget)
    assert [i for s in plan for i in range(s.start, s.stop)] == list(range(len(lengths)))  # each row once, in order
    assert all(sum(lengths[s]) <= budget for s in plan)


@pytest.mark.parametrize(("lengths", "budget", "count", "expected"), [
    ([5, 5, 5, 5], 20, 2, [[0, 1], [2, 3]]),  # one micro-batch split at its middle
    ([5, 5, 5, 5], 20, 4, [[0], [1], [2], [3]]),
    ([9, 1, 1, 1, 8], 20, 2, [[0, 1], [2, 3, 4]]),  # the boundary nearest half of 20 tokens: after 10
    ([4, 4, 10, 3, 3], 12, 4, [[0], [1], [2], [3, 4]]),  # the plan [[0, 1], [2], [3, 4]]: the largest with two splits
    ([6, 6, 6], 12, 2, [[0, 1], [2]]),  # already as many: the plan unchanged
])
def test_a_rank_with_fewer_micro_batches_splits_its_largest(lengths, budget, count, expected):
    plan = split_to(plan_packs(lengths, budget), lengths, count)
    assert [list(range(len(lengths)))[s] for s in plan] == expected


def test_a_sample_longer_than_the_budget_is_refused_naming_its_row():
    with pytest.raises(QualifyError, match=r"^sample of row 12 has 9 tokens, more than candidates.pack_tokens 8 "):
        plan_packs([3, 9], 8, first_row=11)


def test_lengths_are_the_real_tokens_and_must_be_a_prefix():
    batch, prompt_mask = rollout([12, 7, 3])
    assert sample_lengths(prompt_mask, batch.response_mask_BT).tolist() == [12, 7, 3]
    holed = batch.response_mask_BT.clone()
    holed[1, 4] = False  # a response token missing in the middle: not prompt, response, then padding
    with pytest.raises(EvidenceError, match="row 1 of the rollout"):
        sample_lengths(prompt_mask, holed)


def test_packed_micro_batch_holds_the_samples_back_to_back():
    lengths = [12, 7, 3, 9, 5]
    batch, prompt_mask = rollout(lengths)
    packs = pack_batch(batch, sample_lengths(prompt_mask, batch.response_mask_BT), 16)
    assert [p.rows_S.tolist() for p in packs] == greedy_by_loop(lengths, 16)
    assert [p.last for p in packs] == [False] * (len(packs) - 1) + [True]
    for p in packs:
        rows = p.rows_S.tolist()
        ids, pos, mask, cu = [], [], [], [0]
        for r in rows:  # the obvious loop
            ids += batch.input_ids_BT[r, :lengths[r]].tolist()
            mask += batch.response_mask_BT[r, :lengths[r]].tolist()
            pos += list(range(lengths[r]))
            cu.append(cu[-1] + lengths[r])
        assert p.input_ids_1N.tolist() == [ids] and p.position_ids_1N.tolist() == [pos]
        assert p.response_mask_1N.tolist() == [mask]
        assert p.cu_seqlens_S1.dtype == torch.int32 and p.cu_seqlens_S1.tolist() == cu
        assert p.max_seqlen == max(lengths[r] for r in rows) and p.num_tokens == cu[-1] <= 16
        assert p.sample_starts().tolist() == cu[:-1]


def test_unpack_puts_values_at_row_and_position_and_round_trips():
    lengths = [12, 7, 3, 9]
    batch, prompt_mask = rollout(lengths)
    p = pack_rows(batch.input_ids_BT, batch.response_mask_BT, sample_lengths(prompt_mask, batch.response_mask_BT),
                  slice(1, 4))
    values_1N = torch.randn(1, p.num_tokens, 5, requires_grad=True)
    out_STX = unpack(values_1N, p, 12)
    expected = torch.zeros(3, 12, 5)
    i = 0
    for s, r in enumerate([1, 2, 3]):  # the obvious loop
        for t in range(lengths[r]):
            expected[s, t] = values_1N[0, i]
            i += 1
    assert torch.equal(out_STX.detach(), expected)
    assert torch.equal(repack(out_STX, p), values_1N)
    out_STX.sum().backward()  # differentiable: the loss is built from unpacked scores
    assert torch.equal(values_1N.grad, torch.ones_like(values_1N))


def test_zero_sample_starts_zeroes_each_first_token_only():
    batch, prompt_mask = rollout([5, 4, 6])
    p = pack_rows(batch.input_ids_BT, batch.response_mask_BT, sample_lengths(prompt_mask, batch.response_mask_BT),
                  slice(0, 3))
    values = torch.arange(1.0, p.num_tokens + 1)[None]
    out = zero_sample_starts(values, p)
    assert out.tolist() == [[0.0 if i in (0, 5, 9) else float(i + 1) for i in range(15)]]
