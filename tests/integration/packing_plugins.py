"""Plugin engines with the classic packed-sequence bugs, named in matrices as 'tests.integration.packing_plugins:<factory>'.

Each is the correct torch-tp engine, whose packed micro-batches go through transformers' packed position_ids path,
with one bug of the field put back in. Qualification of their packed cases must fail, for the bug's reason (negative
controls: tests/integration/test_packing.py).
"""

from __future__ import annotations

import torch

from qualify.case.context import PackedBatch
from qualify.engines.torch_tp import TorchTPEngine, local
from qualify.ppo.logprob import sampler_logprobs


class PositionsNotReset(TorchTPEngine):
    """Position ids 0..N-1 over the whole pack instead of restarting per sample. transformers reads the sample
    boundaries from the restarts, so it finds one sequence: RoPE positions continue and attention runs causally over
    every earlier sample."""

    def packed_score(self, batch: PackedBatch) -> torch.Tensor:
        self.accumulating = not batch.last
        ids_1N = batch.input_ids_1N.to(self.ctx.device)
        pos_1N = torch.arange(ids_1N.shape[1], device=ids_1N.device)[None]
        return self.packed_scores_from(local(self.compute(input_ids=ids_1N, position_ids=pos_1N, use_cache=False)
                                             .logits), batch)


class AttentionOverWholePack(TorchTPEngine):
    """Position ids restart per sample, but an all-ones attention mask goes with them (as a padded batch's would):
    transformers looks for packed samples only without an attention mask, so attention is causal over the whole pack
    and every sample after the first sees the samples before it."""

    def packed_score(self, batch: PackedBatch) -> torch.Tensor:
        self.accumulating = not batch.last
        ids_1N, pos_1N = batch.input_ids_1N.to(self.ctx.device), batch.position_ids_1N.to(self.ctx.device)
        ones_1N = torch.ones_like(ids_1N)
        return self.packed_scores_from(local(self.compute(input_ids=ids_1N, position_ids=pos_1N,
                                                          attention_mask=ones_1N, use_cache=False).logits), batch)


class BoundaryTokenKept(TorchTPEngine):
    """Computes logprobs only where the loss needs them, selecting the predicting positions by the response mask
    unshifted: the position before a sample's first response token is a prompt token, so that token gets no score,
    and each sample's last token is scored against the first token of the next sample (its score kept there). The
    loss mask is shifted by one at every prompt-response and sample boundary."""

    def packed_score(self, batch: PackedBatch) -> torch.Tensor:
        self.accumulating = not batch.last
        ids_1N, pos_1N = batch.input_ids_1N.to(self.ctx.device), batch.position_ids_1N.to(self.ctx.device)
        logits_1NV = local(self.compute(input_ids=ids_1N, position_ids=pos_1N, use_cache=False).logits)
        chosen = batch.response_mask_1N[0].clone()  # should be the next token's mask, within the sample
        chosen[-1] = False  # the pack's last token predicts nothing
        at_N = chosen.nonzero().flatten().to(ids_1N.device)
        c = self.ctx
        logp = sampler_logprobs(logits_1NV[:, at_N], ids_1N[:, at_N + 1], c.temperature, c.logprob_chunk_tokens,
                                c.vocab_size)
        self.declared_BT, self.last_logits = None, logits_1NV.detach()
        return torch.zeros(ids_1N.shape, dtype=torch.float32, device=ids_1N.device).index_put(
            (torch.zeros_like(at_N), at_N + 1), logp[0]).cpu()


class CuSeqlensOffByOne(TorchTPEngine):
    """Builds each token's position from cu_seqlens (as trainers fed varlen metadata do) with every inner boundary
    one token late: a sample's first token continues the previous sample (its position and its attention), and the
    sample attends from its second token on without its first."""

    def packed_score(self, batch: PackedBatch) -> torch.Tensor:
        self.accumulating = not batch.last
        cu = batch.cu_seqlens_S1.clone().long()
        cu[1:-1] += 1
        n = batch.num_tokens
        sample_N = torch.bucketize(torch.arange(n), cu[1:], right=True)
        pos_1N = (torch.arange(n) - cu[sample_N])[None].to(self.ctx.device)
        ids_1N = batch.input_ids_1N.to(self.ctx.device)
        return self.packed_scores_from(local(self.compute(input_ids=ids_1N, position_ids=pos_1N, use_cache=False)
                                             .logits), batch)


def positions_not_reset() -> TorchTPEngine:
    return PositionsNotReset()


def attention_over_whole_pack() -> TorchTPEngine:
    return AttentionOverWholePack()


def boundary_token_kept() -> TorchTPEngine:
    return BoundaryTokenKept()


def cu_seqlens_off_by_one() -> TorchTPEngine:
    return CuSeqlensOffByOne()


class Undeclared(TorchTPEngine):
    """torch-tp as a plugin that does not say it takes packed batches."""

    packed = False


def undeclared() -> TorchTPEngine:
    return Undeclared()
