"""The reference's MoE routing: replay the rollout's routes in a Hugging Face Qwen3-MoE, or record its own.

A Qwen3-MoE router (transformers' Qwen3MoeTopKRouter, each sparse layer's `mlp.gate`) returns its logits, the
routing weights and the expert ids: softmax over every expert in fp32, the top-k, renormalized over them when
norm_topk_prob, cast to the logits' dtype. Replaying (Rollout Routing Replay, R3) keeps the logits and the softmax
live and takes the experts from the rollout: the weights are the live probabilities of the replayed experts,
renormalized the same way, so the router still gets its gradient through them. Where the rollout fed no token
(padding, each row's last sampled token: qualify.rollout.routes.NO_ROUTE) the router's own top-k stands.

routing() is a forward hook on every router for the duration of a with block: it must hold the backward too, since
activation checkpointing runs the forward again inside it (a recompute outside the block would route afresh).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

NO_ROUTE = -1
"""Same value as qualify.rollout.routes.NO_ROUTE (the rollout's marker): this floor does not import the rollout's."""


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every MoE router of an HF model, in layer order (empty for a dense model)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    return [m for m in model.modules() if isinstance(m, Qwen3MoeTopKRouter)]


def replayed_routes(settings: Any, role: str, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The routes a step of role replays: the batch's routes_BTLK (the rollout's) for the actor when the matrix's
    rollout.routing (settings: the rollout section) is replay; None otherwise (the router's own top-k)."""
    if role != "actor" or getattr(settings, "routing", None) != "replay":
        return None
    if "routes_BTLK" not in batch:
        raise ValueError("rollout.routing is replay, but the rollout holds no routes (routes_BTLK): capture it again "
                         "with a MoE actor")
    return batch["routes_BTLK"]


ROUTER_OUTPUTS = ("router_logits_BTLE", "routing_weights_BTLK")
"""A MoE actor's judged router outputs (outputs/<name> of every step): each MoE layer's router logits over every
expert and the routing weights of the experts it routed to, in its slot order; (B, T, MoE layers, E or top_k) fp32."""


@contextmanager
def routing(model: torch.nn.Module, routes_BTLK: torch.Tensor | None,
            own: list[list[torch.Tensor]] | None = None,
            outputs: list[list[tuple[torch.Tensor, torch.Tensor]]] | None = None) -> Iterator[None]:
    """Inside the block every forward of model replays routes_BTLK (B, T, layers, top_k; the rows of the forward's
    input, in order), or routes afresh when it is None. own, when given, gets per router the list of each forward's
    own top-k ids ((B x T, top_k), what the router would have picked), for agreement with the rollout; outputs, per
    router, each forward's (logits, routing weights) as used (router_outputs reads the first forward's)."""
    routers = moe_routers(model)
    if routes_BTLK is not None and routes_BTLK.shape[2] != len(routers):
        raise ValueError(f"routes for {routes_BTLK.shape[2]} MoE layers, the model has {len(routers)}")
    if own is not None:
        own[:] = [[] for _ in routers]
    if outputs is not None:
        outputs[:] = [[] for _ in routers]
    handles = []
    for layer, router in enumerate(routers):
        def hook(module, args, output, layer=layer):
            logits, weights, ids = output
            if own is not None:
                own[layer].append(ids.detach())
            if routes_BTLK is None:
                if outputs is not None:
                    outputs[layer].append((logits.detach(), weights.detach()))
                return output
            given = routes_BTLK[:, :, layer].reshape(-1, routes_BTLK.shape[-1]).to(ids.device, torch.long)
            if given.shape != ids.shape:
                raise ValueError(f"routes for {given.shape[0]} tokens x top-{given.shape[1]}, the forward routes "
                                 f"{ids.shape[0]} x top-{ids.shape[1]}")
            chosen = torch.where(given == NO_ROUTE, ids, given)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            picked = probs.gather(-1, chosen)
            if module.norm_topk_prob:
                picked = picked / picked.sum(dim=-1, keepdim=True)
            if outputs is not None:
                outputs[layer].append((logits.detach(), picked.to(weights.dtype).detach()))
            return logits, picked.to(weights.dtype), chosen

        handles.append(router.register_forward_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def router_outputs(outputs: list[list[tuple[torch.Tensor, torch.Tensor]]], B: int, T: int) -> dict[str, torch.Tensor]:
    """The first forward's router outputs a routing() block recorded, as ROUTER_OUTPUTS (fp32); {} for a dense model.
    (A later forward in the block is the backward's recompute, which must route the same: its rows are not taken.)"""
    if not outputs or not all(outputs):
        return {}
    logits = torch.stack([forwards[0][0].reshape(B, T, -1) for forwards in outputs], dim=2)
    weights = torch.stack([forwards[0][1].reshape(B, T, -1) for forwards in outputs], dim=2)
    return dict(zip(ROUTER_OUTPUTS, (logits.float(), weights.float()), strict=True))


def own_routes_BTLK(own: list[list[torch.Tensor]], B: int, T: int) -> torch.Tensor:
    """The routes a routing() block recorded, as (B, T, layers, top_k) int32 (one forward of B x T tokens)."""
    per_layer = [torch.cat(forwards, 0).reshape(B, T, -1) for forwards in own]
    return torch.stack(per_layer, dim=2).to(torch.int32).cpu()


def agreement(rollout_BTLK: torch.Tensor, other_BTLK: torch.Tensor) -> list[dict[str, float | int]]:
    """Per MoE layer, where the rollout fed a token: how many tokens route to another set of experts and how many
    (token, slot) pairs hold another expert (slots in each side's order of weight)."""
    fed = rollout_BTLK[..., 0, 0] != NO_ROUTE
    out = []
    for layer in range(rollout_BTLK.shape[2]):
        a, b = rollout_BTLK[:, :, layer][fed].long(), other_BTLK[:, :, layer][fed].long()
        sets = (a.sort(-1).values != b.sort(-1).values).any(-1)
        out.append({"layer": layer, "tokens": int(fed.sum()), "tokens_differ": int(sets.sum()),
                    "pairs": int(a.numel()), "pairs_differ": int((a != b).sum())})
    return out
