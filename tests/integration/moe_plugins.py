"""MoE plugin engines with one routing-replay bug each (named 'tests.integration.moe_plugins:<factory>').

Each is the correct torch-tp engine (which replays a batch's routes, qualify.engines.torch_tp.routes_replayed) with
one bug its review threads name put back in. Qualification of a matrix with rollout.routing replay must fail for
every one of them, naming the tensor or the replay row (negative controls, tests/integration/test_moe.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from qualify.engines.base import Batch
from qualify.engines.torch_tp import TorchTPEngine, local, routes_replayed


class ShiftedRoutes(TorchTPEngine):
    """Aligns the routes one position late (the causal shift: the routes of seq_len - 1 inputs put at the positions of
    the predicted tokens), so the token at t is routed as the rollout routed the token at t - 1."""

    def score(self, batch: Batch) -> torch.Tensor:
        routes = batch.routes_BTLK
        if routes is not None:
            routes = torch.cat([torch.full_like(routes[:, :1], -1), routes[:, :-1]], dim=1)
        return super().score(Batch(input_ids_BT=batch.input_ids_BT, response_mask_BT=batch.response_mask_BT,
                                   routes_BTLK=routes))


class ZeroedScores(TorchTPEngine):
    """Gathers the replayed experts' weights from the router's post-top-k probabilities (zero outside its own top-k):
    wherever the live router would pick another expert than the rollout did, that slot's weight is exactly 0 and its
    gradient dies. Its routes are the rollout's; its weights are not."""

    def score(self, batch: Batch) -> torch.Tensor:
        ids_BT = batch.input_ids_BT.to(self.ctx.device)
        with self.routed(self.compute, batch), zeroed_replay(self.compute, batch.routes_BTLK):
            return self.scores_from(local(self.compute(input_ids=ids_BT, use_cache=False).logits), ids_BT)


@contextmanager
def zeroed_replay(model: torch.nn.Module, routes_BTLK: torch.Tensor | None) -> Iterator[None]:
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    if routes_BTLK is None:
        yield
        return
    for layer, gate in enumerate(gates):
        given = routes_BTLK[:, :, layer].reshape(-1, routes_BTLK.shape[-1]).long()

        def forward(hidden, gate=gate, given=given):
            logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            top = torch.topk(probs, gate.top_k, dim=-1)
            kept = torch.zeros_like(probs).scatter(1, top.indices, top.values)  # the bug: zero outside its own top-k
            experts = torch.where(given < 0, top.indices, given)
            weights = kept.gather(1, experts)
            if gate.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
            return logits, weights.to(logits.dtype), experts

        gate.forward = forward
    try:
        yield
    finally:
        for gate in gates:
            del gate.forward


class ReplaysFirstMicrobatchOnly(TorchTPEngine):
    """Scores each batch in two micro-batches and hands the routes to the first alone (the replay keyed by the
    micro-batch and looked up wrong): the second half of the rows routes afresh."""

    def score(self, batch: Batch) -> torch.Tensor:
        if batch.input_ids_BT.shape[0] < 2:
            return super().score(batch)
        half = batch.input_ids_BT.shape[0] // 2
        first = super().score(batch.rows(slice(0, half)))
        declared, logits, routes, router = self.declared_BT, self.last_logits, self.last_routes, self.last_router
        rest = batch.rows(slice(half, None))
        second = super().score(Batch(input_ids_BT=rest.input_ids_BT, response_mask_BT=rest.response_mask_BT))
        # the hooks report the whole batch, as scored
        self.declared_BT = None if declared is None else torch.cat([declared, self.declared_BT])
        self.last_logits = None if logits is None else torch.cat([logits, self.last_logits])
        self.last_routes = None if routes is None else torch.cat([routes, self.last_routes])
        self.last_router = None if router is None else {k: torch.cat([t, self.last_router[k]]) for k, t in router.items()}
        return torch.cat([first, second])


class CheckpointedReplay(TorchTPEngine):
    """The correct twin under activation checkpointing (reentrant, as many trainers run it): the backward runs each
    layer's forward again, so the routes stay installed from score() until backward() has run."""

    def setup(self, ctx):
        super().setup(ctx)
        self.compute.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        self.compute.train()  # transformers checkpoints in train mode only (the tiny family has no dropout)
        self.held = ExitStack()

    def score(self, batch: Batch) -> torch.Tensor:
        self.held.close()
        ids_BT = batch.input_ids_BT.to(self.ctx.device)
        with self.routed(self.compute, batch):
            self.held.enter_context(routes_replayed(self.compute, batch.routes_BTLK))
            scores = self.scores_from(local(self.compute(input_ids=ids_BT, use_cache=False).logits), ids_BT)
        self.after_forward()
        return scores

    def after_forward(self) -> None:
        """The routes stay for the backward's recompute."""

    def backward(self, loss):
        super().backward(loss)
        self.held.close()


class CheckpointedReroute(CheckpointedReplay):
    """Replays in the forward only: the backward's recompute of every checkpointed layer routes afresh, so wherever
    the live router picks other experts than the rollout did, the gradients are those of another forward."""

    def after_forward(self) -> None:
        self.held.close()


STALE_ROUTES = "QUALIFY_TEST_STALE_ROUTES"


class StaleRoutes(TorchTPEngine):
    """Keeps the routes of the first rollout it trains on, by prompt, in a file that outlives the step (the path in
    $QUALIFY_TEST_STALE_ROUTES), and replays those in every later step and round: after a weight sync it replays
    the routes of the rollout from before the sync, not of the rollout it trains on. Within one round (one rollout)
    it is the correct engine."""

    def score(self, batch: Batch) -> torch.Tensor:
        routes = batch.routes_BTLK
        if routes is not None:
            routes = self.kept_routes(batch.input_ids_BT, batch.response_mask_BT, routes)
        return super().score(Batch(input_ids_BT=batch.input_ids_BT, response_mask_BT=batch.response_mask_BT,
                                   routes_BTLK=routes))

    @staticmethod
    def kept_routes(ids_BT: torch.Tensor, response_BT: torch.Tensor, routes_BTLK: torch.Tensor) -> torch.Tensor:
        path = Path(os.environ[STALE_ROUTES])
        keys = [bytes(ids[:int(resp.float().argmax())].numpy().astype("int64")) for ids, resp in
                zip(ids_BT.cpu(), response_BT.cpu())]
        if not path.exists():
            torch.save({k: r.clone() for k, r in zip(keys, routes_BTLK.cpu())}, path)
            return routes_BTLK
        kept = torch.load(path)
        out = torch.full_like(routes_BTLK, -1)
        for b, key in enumerate(keys):
            row = kept.get(key, routes_BTLK[b].cpu())  # an unseen prompt: its own routes
            n = min(row.shape[0], out.shape[1])
            out[b, :n] = row[:n].to(out.device)
        return out


def stale_routes() -> TorchTPEngine:
    return StaleRoutes()


def checkpointed_replay() -> TorchTPEngine:
    return CheckpointedReplay()


def checkpointed_reroute() -> TorchTPEngine:
    return CheckpointedReroute()


def shifted_routes() -> TorchTPEngine:
    return ShiftedRoutes()


def zeroed_scores() -> TorchTPEngine:
    return ZeroedScores()


def replays_first_microbatch_only() -> TorchTPEngine:
    return ReplaysFirstMicrobatchOnly()
