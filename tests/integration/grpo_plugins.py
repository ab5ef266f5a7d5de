"""GRPO plugin engines with known data-parallel bugs, named in matrices as 'tests.integration.grpo_plugins:<factory>'.

Each is the correct torch-tp engine whose own objective (the engine hook qualify.candidate.worker.objective calls)
puts one DP trap from the field back in; at DP2 qualification must fail naming the tensor the bug changes.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from qualify.engines.torch_tp import TorchTPEngine
from qualify.ppo.objective import GRPOShare, grpo_objective, grpo_share
from qualify.ppo.share import Normalizers, count_normalizers


class _GRPOObjective(TorchTPEngine):
    """torch-tp bringing GRPO's objective as its own, with the rank's share changed by bent()."""

    def objective(self, role, ppo, scores_BT, mask_BT, targets, grpo=None, share=None):
        mask_BT, share = self.bent(grpo, mask_BT, targets, share)
        return grpo_objective(ppo, grpo, scores_BT, mask_BT, targets, share)

    def bent(self, grpo, mask_BT, targets, share):
        raise NotImplementedError


class LocalNormalizer(_GRPOObjective):
    """Divides by its own rank's active tokens instead of the step's (the global normalizer all-reduced)."""

    name = "grpo-local-normalizer"

    def bent(self, grpo, mask_BT, targets, share):
        return mask_BT, GRPOShare(share.advantages_B, count_normalizers(mask_BT))


class RankLocalGroups(_GRPOObjective):
    """Normalizes each advantage group with its own rank's rows (a group straddling two DP ranks is split in two)."""

    name = "grpo-rank-local-groups"

    def bent(self, grpo, mask_BT, targets, share):
        rewards_b = targets["score_B"]
        start = self.ctx.dp_rank * rewards_b.shape[0]  # this rank's first row in the step (equal slices)
        group_b = (torch.arange(rewards_b.shape[0]) + start) // grpo.group_size
        advantages_b = torch.empty_like(rewards_b)
        for g in group_b.unique():  # each group from the rows of it this rank holds
            rows = group_b == g
            advantages_b[rows] = grpo_share(replace(grpo, group_size=int(rows.sum())), rewards_b[rows],
                                            mask_BT[rows]).advantages_B
        return mask_BT, GRPOShare(advantages_b, share.normalizers)


class DroppedTrailingSequence(_GRPOObjective):
    """Drops the batch's trailing sequence (the last DP rank's last row), as a partition that floors B / dp does; the
    step's normalizers are then counted without it."""

    name = "grpo-dropped-trailing-sequence"

    def bent(self, grpo, mask_BT, targets, share):
        last_rank = self.ctx.dp_rank == self.ctx.dp - 1
        last_T = mask_BT[-1] if last_rank else torch.zeros_like(mask_BT[-1])
        if last_rank:
            mask_BT = mask_BT.clone()
            mask_BT[-1] = False
        # the step counted without the dropped row, as an all-reduce of what each rank kept would give it
        dropped = self._dropped_counts(last_T)
        n = share.normalizers
        return mask_BT, GRPOShare(share.advantages_B, Normalizers(n.num_active_tokens - dropped[0],
                                                                  n.num_active_sequences - dropped[1]))

    def _dropped_counts(self, last_T):
        import torch.distributed as dist

        counts = torch.stack([last_T.sum(), last_T.any().to(torch.int64)]).to(torch.int64)
        if self.dp_group is not None:
            dist.all_reduce(counts, group=self.dp_group)
        return counts


def local_normalizer():
    return LocalNormalizer()


def rank_local_groups():
    return RankLocalGroups()


def dropped_trailing_sequence():
    return DroppedTrailingSequence()


class EpsInsideStd(_GRPOObjective):
    """Puts the group std's epsilon inside the square root: (r - mean) / sqrt(var + eps)."""

    name = "grpo-eps-inside-std"

    def bent(self, grpo, mask_BT, targets, share):
        from qualify.ppo.grpo import all_gather_rewards

        rewards_B = all_gather_rewards(targets["score_B"], self.dp_group) if self.ctx.dp > 1 else targets["score_B"]
        groups = rewards_B.reshape(-1, grpo.group_size)
        var = groups.var(dim=1, keepdim=True, unbiased=grpo.std_estimator == "unbiased")
        adv = ((groups - groups.mean(dim=1, keepdim=True)) / torch.sqrt(var + grpo.eps)).reshape(-1)
        start = self.ctx.dp_rank * targets["score_B"].shape[0]
        return mask_BT, GRPOShare(adv[start:start + targets["score_B"].shape[0]], share.normalizers)


def eps_inside_std():
    return EpsInsideStd()


def trl_bnpo():
    """TRL's loss (qualify.examples.trl_grpo) with loss_type 'bnpo': each process divides by its own tokens, and the
    processes' gradients are averaged (DDP). Right at DP1; at DP > 1 a mean of per-process token means."""
    from qualify.examples.trl_grpo import TRLGRPOEngine

    return TRLGRPOEngine({"loss_type": "bnpo"})
