"""The megatron engine's Qwen3-MoE: the MoE settings of its TransformerConfig, and routing replay through
megatron-core's own RouterReplay (moe_enable_routing_replay) with the routes() and router_outputs() records.

Router math. Qwen3-MoE's router (transformers' Qwen3MoeTopKRouter) takes the softmax over every expert in fp32, its
top-k, and renormalizes them (norm_topk_prob). megatron-core's softmax router with moe_router_pre_softmax off takes
the top-k of the logits and the softmax over those k: exp(l_i) / sum_k exp(l_j) = p_i / sum_k p_j, the same value
(the normalizer over every expert cancels) up to rounding, and the same experts (softmax is monotone). Its gradient
reaches the chosen logits only, as the reference's does (p_i / sum_k p_j does not depend on an unchosen logit). Both
round the weights to the logits' dtype at the end. With norm_topk_prob off the HF weights are the unrenormalized
softmax: moe_router_pre_softmax on gives those.

Replay. With a layer's RouterReplay set to REPLAY_FORWARD, megatron-core takes the experts from its target indices
and gathers the live scores at them, so the routing weights come from the live router logits and the router gets its
gradient. RouterReplay has no "no route" marker: where the batch holds NO_ROUTE (a token the rollout did not feed)
the router's own top-k is filled in before megatron gathers, as the reference does (qualify.models.routing).
megatron-core's tokens are seq-first ([S, B] flattened). Under TP megatron-core trains MoE with sequence parallelism
only (MoELayer refuses TP > 1 without it in training: its allgather dispatcher would count every token TP times in the
experts' gradients), and its local spec's norms (torch's, without TransformerEngine or apex) refuse sequence
parallelism, so the engine runs a MoE model at TP 1. The recorder also takes sequence-parallel ranks (as megatron-core
runs MoE with TransformerEngine's norms, and as the layer test runs its MoE layer at TP2): each rank routes its own
sequence chunk, its targets are that chunk and its records are all-gathered over the TP group.
megatron.core is imported inside the functions only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from qualify.engines.megatron_convert import Qwen3Layout
from qualify.errors import EngineError
from qualify.models.routing import NO_ROUTE, ROUTER_OUTPUTS


def moe_config(layout: Qwen3Layout) -> dict[str, Any]:
    """TransformerConfig fields of a Qwen3-MoE (every layer sparse, local experts sharded over TP (expert TP = TP), no
    expert parallelism, no auxiliary loss, routing replay on); {} for a dense Qwen3."""
    if not layout.num_experts:
        return {}
    return {"num_moe_experts": layout.num_experts, "moe_router_topk": layout.moe_top_k,
            "moe_ffn_hidden_size": layout.moe_intermediate_size, "moe_router_score_function": "softmax",
            "moe_router_pre_softmax": not layout.norm_topk_prob, "moe_router_load_balancing_type": "none",
            "moe_aux_loss_coeff": 0.0, "moe_token_dispatcher_type": "allgather", "moe_grouped_gemm": False,
            "moe_permute_fusion": False, "moe_router_fusion": False, "moe_enable_routing_replay": True}


def define_router_gemm() -> None:
    """megatron-core 0.16.1 imports te_general_gemm from TransformerEngine inside a try and tests `te_general_gemm is
    not None` in its router's linear (RouterGatingLinearFunction) without defining the name when TransformerEngine is
    missing: the router fails with a NameError. Define it None where it is missing, which takes megatron-core's own
    torch.mm path (the one a TransformerEngine-less install means)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def seq_chunk(routes_BTLK: torch.Tensor, layer: int, sp: int, sp_rank: int) -> torch.Tensor:
    """The (S/sp x B, top_k) int64 targets of one MoE layer for this rank's sequence chunk (sp sequence-parallel
    ranks; 1: the whole sequence), seq-first as megatron-core flattens its tokens (row s x B + b)."""
    B, T = routes_BTLK.shape[:2]
    if T % sp:
        raise EngineError(f"{T} tokens a row do not split over {sp} sequence-parallel ranks")
    per = T // sp
    chunk_SBK = routes_BTLK[:, sp_rank * per:(sp_rank + 1) * per, layer].transpose(0, 1)
    return chunk_SBK.reshape(per * B, -1).to(torch.long)


class RouteRecorder:
    """Replays a batch's routes through every MoE layer's RouterReplay of a GPTModel and records, per layer, the
    router logits, the experts used and their routing weights of the last forward. sp: the sequence-parallel ranks
    (the TP degree under sequence parallelism, else 1), sp_rank this one, sp_group their process group."""

    def __init__(self, gpt: torch.nn.Module, sp: int = 1, sp_rank: int = 0, sp_group: Any = None) -> None:
        self.sp, self.sp_rank, self.sp_group = sp, sp_rank, sp_group
        self.routers = [layer.mlp.router for layer in gpt.decoder.layers if hasattr(layer.mlp, "router")]
        assert all(r.router_replay is not None for r in self.routers), "moe_enable_routing_replay is off"
        self.logits: list[torch.Tensor | None] = [None] * len(self.routers)
        self.experts: list[torch.Tensor | None] = [None] * len(self.routers)
        self.weights: list[torch.Tensor | None] = [None] * len(self.routers)
        self.handles = []
        for layer, router in enumerate(self.routers):
            self._instrument(layer, router)

    def _instrument(self, layer: int, router: torch.nn.Module) -> None:
        """Record the layer's logits (gating), fill NO_ROUTE targets with its own top-k and record the experts it
        used (RouterReplay.get_replay_topk), and record their weights (the router's output, gathered at them)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        replay, gating = router.router_replay, router.gating
        replay_topk = replay.get_replay_topk

        def recorded_gating(hidden: torch.Tensor) -> torch.Tensor:
            logits = gating(hidden)
            self.logits[layer] = logits.detach()
            return logits

        def filled_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            if replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
                _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                target = replay.target_topk_idx.to(own.device)
                replay.target_topk_idx = torch.where(target == NO_ROUTE, own, target)
            probs, experts = replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
            self.experts[layer] = experts.detach()
            return probs, experts

        def record_weights(module, args, output) -> None:
            routing_probs_NE = output[0]
            self.weights[layer] = routing_probs_NE.detach().gather(1, self.experts[layer])

        router.gating, replay.get_replay_topk = recorded_gating, filled_replay_topk
        self.handles.append(router.register_forward_hook(record_weights))

    @contextmanager
    def replaying(self, routes_BTLK: torch.Tensor | None) -> Iterator[None]:
        """Inside the block every forward replays routes_BTLK (B, T, MoE layers, top_k; NO_ROUTE: the router's own
        top-k), or routes afresh (recording) when it is None."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if routes_BTLK is not None and routes_BTLK.shape[2] != len(self.routers):
            raise EngineError(f"the batch holds routes of {routes_BTLK.shape[2]} MoE layers, the model has "
                              f"{len(self.routers)}")
        for layer, router in enumerate(self.routers):
            replay = router.router_replay
            replay.clear_indices()
            if routes_BTLK is None:
                replay.set_router_replay_action(RouterReplayAction.RECORD)
            else:
                replay.set_target_indices(seq_chunk(routes_BTLK, layer, self.sp, self.sp_rank))
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            yield
        finally:
            for router in self.routers:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()

    def _full_BTLX(self, per_layer: list[torch.Tensor | None], B: int, T: int) -> torch.Tensor:
        """(B, T, MoE layers, X) of every layer's (S/sp x B, X) record, all-gathered over the sequence-parallel ranks."""
        out = []
        for t in per_layer:
            assert t is not None, "no forward ran in the replaying block"
            if self.sp > 1:
                parts = [torch.empty_like(t) for _ in range(self.sp)]
                dist.all_gather(parts, t.contiguous(), group=self.sp_group)
                t = torch.cat(parts)
            out.append(t.reshape(T, B, -1).transpose(0, 1))
        return torch.stack(out, dim=2)

    def routes(self, B: int, T: int) -> torch.Tensor:
        """(B, T, MoE layers, top_k) int32 on CPU: the experts the last forward routed each token to."""
        return self._full_BTLX(self.experts, B, T).to(torch.int32).cpu()

    def router_outputs(self, B: int, T: int) -> dict[str, torch.Tensor]:
        """The last forward's router logits (B, T, MoE layers, E) and routing weights (B, T, MoE layers, top_k, in
        the slot order of routes()) as ROUTER_OUTPUTS, fp32 on CPU."""
        tensors = (self._full_BTLX(self.logits, B, T), self._full_BTLX(self.weights, B, T))
        return dict(zip(ROUTER_OUTPUTS, (t.float().cpu() for t in tensors), strict=True))

    def close(self) -> None:
        """Take the records' hooks off and drop the layers' RouterReplay from megatron-core's global list."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        for handle in self.handles:
            handle.remove()
        mine = {id(r.router_replay) for r in self.routers}
        RouterReplay.global_router_replay_instances[:] = [
            r for r in RouterReplay.global_router_replay_instances if id(r) not in mine]
        self.routers = []
