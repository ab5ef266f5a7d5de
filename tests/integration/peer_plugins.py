"""torch-tp engines that bring the harness's own PPO objective through the engine hook with one of the matrix's peer
policy settings (ppo.clip_eps_low/high, dual_clip_c, entropy_coef) dropped, named in matrices as
'tests.integration.peer_plugins:<factory>'. Each must fail qualification naming the tensors the setting moves; the
unbent one (`same_objective`) must pass, so that a failure is the bug's and not the hook path's.
"""

from __future__ import annotations

from dataclasses import replace

from qualify.engines.torch_tp import TorchTPEngine
from qualify.ppo.objective import role_objective


class _PeerObjective(TorchTPEngine):
    """torch-tp whose objective() is role_objective with the ppo section bent by bent() and the entropy of
    own_entropy()."""

    def objective(self, role, ppo, scores_BT, mask_BT, targets):
        return role_objective(role, self.bent(ppo), scores_BT, mask_BT, targets, entropy_BT=self.own_entropy(role))

    def bent(self, ppo):
        return ppo

    def own_entropy(self, role):
        return self.entropy() if role == "actor" else None


class SymmetricClip(_PeerObjective):
    """Clips the ratio to [1 - clip_eps, 1 + clip_eps] where the matrix sets clip_eps_low and clip_eps_high (a trainer
    that reads clip_ratio and ignores clip_ratio_low/high)."""

    def bent(self, ppo):
        return replace(ppo, clip_eps_low=None, clip_eps_high=None)


class NoDualClip(_PeerObjective):
    """Leaves out the dual clip: a negative-advantage token whose ratio exceeds dual_clip_c keeps its gradient."""

    def bent(self, ppo):
        return replace(ppo, dual_clip_c=None)


class DetachedEntropy(_PeerObjective):
    """Adds the entropy bonus from a detached copy of the entropy: the loss's value is right, its gradient lacks the
    bonus's (the trap of computing the entropy from logits taken out of the graph)."""

    def own_entropy(self, role):
        entropy = super().own_entropy(role)
        return None if entropy is None else entropy.detach()


def same_objective() -> TorchTPEngine:
    return _PeerObjective()


def symmetric_clip() -> TorchTPEngine:
    return SymmetricClip()


def no_dual_clip() -> TorchTPEngine:
    return NoDualClip()


def detached_entropy() -> TorchTPEngine:
    return DetachedEntropy()
