"""Packed sequences (remove-padding): a step's rows packed into micro-batches of whole samples, and back.

The rollout lays each row out as prompt, then response, then padding (right-padded): a sample's real tokens are a
prefix of its row. A packed micro-batch concatenates the real tokens of consecutive rows into one row of at most the
budget's tokens (greedy in row order, a sample never split), with position ids restarting at 0 per sample and
cu_seqlens marking the boundaries (qualify.case.context.PackedBatch). The engine scores the packed tokens; unpack puts
its per-token outputs back at (row, position) of the padded layout, 0 elsewhere, so that everything downstream (loss,
shares, judged outputs) reads the same tensors as in a padded case. The candidate worker and the reference's packed
control pack alike; at DP > 1 a rank with fewer micro-batches than another splits its largest until every rank runs
as many (split_to: a sharded engine's forward and backward are collectives per micro-batch, as verl's dynamic batching
makes every DP rank's count the same).
"""

from __future__ import annotations

import itertools

import torch

from qualify.case.context import Batch, PackedBatch
from qualify.errors import EvidenceError, QualifyError


def sample_lengths(prompt_mask_BT: torch.Tensor, response_mask_BT: torch.Tensor) -> torch.Tensor:
    """(B,) int64 real tokens of each row (prompt and response); each row's real tokens must be a prefix of it."""
    real_BT = prompt_mask_BT.bool() | response_mask_BT.bool()
    lengths_B = real_BT.sum(1)
    prefix_BT = torch.arange(real_BT.shape[1], device=real_BT.device)[None, :] < lengths_B[:, None]
    bad = (real_BT != prefix_BT).any(1).nonzero().flatten()
    if bad.numel():
        raise EvidenceError(f"row {int(bad[0])} of the rollout is not prompt, response, then padding: its real tokens "
                            "are not a prefix of the row, so it cannot be packed")
    return lengths_B.to(torch.int64)


def plan_packs(lengths: list[int], budget: int, first_row: int = 0) -> list[slice]:
    """Consecutive rows per micro-batch: greedy in row order, each at most budget tokens, a sample never split.
    first_row names rows in the message of a sample longer than the budget (an input error)."""
    packs, start, used = [], 0, 0
    for i, n in enumerate(lengths):
        if n > budget:
            raise QualifyError(f"sample of row {first_row + i} has {n} tokens, more than candidates.pack_tokens "
                               f"{budget} (a sample is never split)")
        if used + n > budget:
            packs.append(slice(start, i))
            start, used = i, 0
        used += n
    if start < len(lengths):
        packs.append(slice(start, len(lengths)))
    return packs


def split_to(plan: list[slice], lengths: list[int], count: int) -> list[slice]:
    """The plan with its micro-batches split until there are count of them (every DP rank of a step must run as many:
    a sharded engine's forward and backward are collectives per micro-batch). Each split halves the micro-batch of
    the most tokens that holds two samples or more, at the sample boundary nearest its middle; count must not exceed
    the rows."""
    plan = list(plan)
    assert count <= len(lengths), (count, len(lengths))
    while len(plan) < count:
        tokens = [sum(lengths[s]) if s.stop - s.start > 1 else -1 for s in plan]
        i = tokens.index(max(tokens))
        s = plan[i]
        before = list(itertools.accumulate(lengths[s.start:s.stop - 1]))  # tokens before each inner boundary
        k = min(range(len(before)), key=lambda j: abs(before[j] - tokens[i] / 2))
        plan[i:i + 1] = [slice(s.start, s.start + 1 + k), slice(s.start + 1 + k, s.stop)]
    return plan


def pack_rows(input_ids_BT: torch.Tensor, response_mask_BT: torch.Tensor, lengths_B: torch.Tensor, rows: slice,
              last: bool = True) -> PackedBatch:
    """The rows' real tokens as one packed micro-batch (rows: a slice of the batch's rows)."""
    index_S = torch.arange(input_ids_BT.shape[0])[rows]
    lens = [int(lengths_B[r]) for r in index_S]
    ids = torch.cat([input_ids_BT[r, :n] for r, n in zip(index_S.tolist(), lens)])
    mask = torch.cat([response_mask_BT[r, :n] for r, n in zip(index_S.tolist(), lens)])
    positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens])
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0).to(torch.int32)
    return PackedBatch(input_ids_1N=ids[None], position_ids_1N=positions[None].to(ids.device), cu_seqlens_S1=cu,
                       max_seqlen=max(lens, default=0), rows_S=index_S, response_mask_1N=mask[None], last=last)


def pack_batch(batch: Batch, lengths_B: torch.Tensor, budget: int, first_row: int = 0,
               count: int = 0) -> list[PackedBatch]:
    """A batch's rows packed into micro-batches of at most budget tokens, in row order (the last one marked last);
    count: at least that many micro-batches (split_to)."""
    lengths = [int(n) for n in lengths_B]
    plan = split_to(plan_packs(lengths, budget, first_row), lengths, count)
    return [pack_rows(batch.input_ids_BT, batch.response_mask_BT, lengths_B, rows, last=i == len(plan) - 1)
            for i, rows in enumerate(plan)]


def token_index(packed: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(sample_N, position_N): where each packed token sits in the (S, T) padded layout of the pack's rows."""
    lengths_S = (packed.cu_seqlens_S1[1:] - packed.cu_seqlens_S1[:-1]).long()
    sample_N = torch.repeat_interleave(torch.arange(lengths_S.numel()), lengths_S)
    return sample_N, packed.position_ids_1N[0].cpu()


def unpack(values_1N: torch.Tensor, packed: PackedBatch, seq_len: int) -> torch.Tensor:
    """(S, T, ...) values of the pack's rows in the padded layout, from (1, N, ...) per-token values; 0 where no
    packed token sits (padding). Differentiable: the loss is built from the unpacked scores."""
    sample_N, position_N = token_index(packed)
    sample_N, position_N = sample_N.to(values_1N.device), position_N.to(values_1N.device)
    shape = (packed.rows_S.numel(), seq_len, *values_1N.shape[2:])
    return values_1N.new_zeros(shape).index_put((sample_N, position_N), values_1N[0])


def repack(values_ST: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """(1, N, ...) values of the packed tokens from (S, T, ...) values of the pack's rows (unpack's inverse on the
    packed tokens)."""
    sample_N, position_N = token_index(packed)
    return values_ST[sample_N.to(values_ST.device), position_N.to(values_ST.device)][None]


def zero_sample_starts(values_1N: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """values with each sample's first token set to 0 (it has no context in its sample), differentiably."""
    starts = torch.zeros(values_1N.shape[:2], dtype=torch.bool, device=values_1N.device)
    starts[0, packed.sample_starts().to(values_1N.device)] = True
    return torch.where(starts.reshape(*starts.shape, *([1] * (values_1N.dim() - 2))), 0.0, values_1N)
