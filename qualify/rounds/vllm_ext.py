"""Mixed into every vLLM worker (LLM(worker_extension_cls=...)): install a weight version, report what the rank holds.

What a rank "holds" is read back through the same GEMM the rank samples with, not from the
parameter objects: on CPU vLLM packs every linear weight (and lm_head) into a kernel-private
layout at load and leaves an empty `weight` parameter behind, which is why in-place parameter
edits do nothing there. Multiplying the rank's layer by an identity matrix returns exactly
(I @ W^T = W^T, every sum has one non-zero term) the weight that layer computes with. Embeddings
and norms are read directly: their forward uses the parameter itself. Every digest is therefore a
digest of this rank's own shard, in vLLM's names (qualify.rounds.shards says what it must be).
Per-rank shards rather than gathered full tensors: a gathered digest can say that the ranks
together are wrong, a per-rank one says which rank holds which wrong tensor, and needs no
collective that could itself be what is broken.

Faults (probes only; each one is recorded in the evidence): corrupt_rank/corrupt_tensor makes
that rank load its tensor one ulp off, silent_rank returns no acknowledgment from that rank,
duplicate_rank returns two.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import torch

from qualify.rounds.digests import tensor_digest

PROBE_ROWS = 2048  # identity rows per GEMM call: bounds the read-back buffer for wide layers


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


@torch.inference_mode()
def gemm_weight(module: torch.nn.Module) -> torch.Tensor:
    """(N, K) weight that module's GEMM actually applies: its output on the rows of I_K, transposed."""
    from vllm.model_executor.layers.linear import LinearBase

    K = module.input_size_per_partition if isinstance(module, LinearBase) else module.embedding_dim
    dtype = module.weight.dtype
    parts = []
    for start in range(0, K, PROBE_ROWS):
        eye = torch.zeros(min(PROBE_ROWS, K - start), K, dtype=dtype, device=module.weight.device)
        eye[:, start:start + eye.shape[0]].fill_diagonal_(1)
        parts.append(module.quant_method.apply(module, eye, bias=None).to(dtype).cpu())
    return torch.cat(parts).t().contiguous()


def held_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(vLLM name, tensor this rank computes with) for every parameter of the model.

    A tied lm_head (tie_word_embeddings) is not a parameter of its own, but on CPU its GEMM still
    has its own packed copy of the embedding: it is read back and reported as lm_head.weight.
    """
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.platforms import current_platform

    # Off CPU the GEMM reads the parameter itself; reading it back through a GEMM there could
    # round it (TF32), so the parameter is the truth.
    read_back = current_platform.is_cpu()
    modules = dict(model.named_modules())
    names = set()
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        module = modules[owner]
        names.add(name)
        if read_back and leaf == "weight" and isinstance(module, (LinearBase, ParallelLMHead)):
            yield name, gemm_weight(module)
        else:
            yield name, param.detach().cpu()
    head = modules.get("lm_head")
    if isinstance(head, ParallelLMHead) and "lm_head.weight" not in names:
        yield "lm_head.weight", gemm_weight(head) if read_back else head.weight.detach().cpu()


class RoundsWorkerExtension:
    """collective_rpc methods of every rank (names prefixed so they never shadow vLLM's own)."""

    def qualify_report(self, version: int) -> list[dict[str, Any]]:
        """This rank's acknowledgment of what it holds now, as `version`."""
        started = time.monotonic()
        model = self.model_runner.get_model()
        tensors = {name: tensor_digest(t) for name, t in held_tensors(model)}
        return [{"rank": _tp_rank(), "version": version, "tensors": tensors,
                 "seconds": round(time.monotonic() - started, 3)}]

    def qualify_install(self, version: int, path: str, fault: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Reload the rank's weights from the HF safetensors file at path; acknowledge what it then holds."""
        from safetensors import safe_open

        fault, rank, started = fault or {}, _tp_rank(), time.monotonic()

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    t = f.get_tensor(name)
                    if fault.get("corrupt_rank") == rank and fault.get("corrupt_tensor") == name:
                        t = torch.nextafter(t, torch.full_like(t, math.inf))
                    yield name, t

        self.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)
        loaded = time.monotonic()
        [ack] = self.qualify_report(version)
        ack["load_seconds"] = round(loaded - started, 3)
        if fault.get("silent_rank") == rank:
            return []
        if fault.get("duplicate_rank") == rank:
            return [ack, dict(ack)]
        return [ack]
