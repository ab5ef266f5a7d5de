"""The kernel set of qualify.examples.vllm_gpu_exact's vLLM-shaped Qwen3 forward: each kernel's reference formula in
torch (torch_kernels(), also the backward of the fast ones) and vLLM's own CUDA kernels (vllm_kernels(), dispatched as
vLLM 0.26's modules dispatch them in eager mode), each fast kernel's values taken with its formula's gradient."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class RolloutMode:
    """How the sealed rollout was sampled, as far as the forward must follow it."""

    dtype: str
    """'bfloat16', 'float32', ... (rollout.json sampling.dtype)."""
    batch_invariant: bool
    block_size: int
    runner: str | None = None
    """vLLM's model runner, 'v1' or 'v2' (rollout.json model_runner; None for a rollout sealed before it was recorded,
    taken as V1's log_softmax formula). V2 computes each token's logprob with its own Triton kernel over the logits in
    the model's dtype, after its temperature kernel divides them in place (rounded back to that dtype)."""


class Kernel(torch.autograd.Function):
    """out = fast(*inputs) in the forward; the backward differentiates reference(*inputs), recomputed in torch."""

    @staticmethod
    def forward(ctx, fast: Callable[..., Any], reference: Callable[..., Any], *inputs: torch.Tensor):
        ctx.reference = reference
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            out = fast(*inputs)
        ctx.tuple_out = isinstance(out, tuple)
        return out

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        needs = ctx.needs_input_grad[2:]
        inputs = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, needs, strict=True)]
        with torch.enable_grad():
            out = ctx.reference(*inputs)
        outs = out if ctx.tuple_out else (out,)
        used = [(o, g) for o, g in zip(outs, grads, strict=True) if g is not None and o.requires_grad]
        wanted = [t for t in inputs if t.requires_grad]
        if not used or not wanted:
            return (None, None, *(None for _ in inputs))
        found = iter(torch.autograd.grad([o for o, _ in used], wanted, [g for _, g in used], allow_unused=True))
        return (None, None, *(next(found) if t.requires_grad else None for t in inputs))


def kernel(fast: Callable[..., Any], reference: Callable[..., Any], *inputs: torch.Tensor) -> Any:
    """fast's values with reference's gradient."""
    return Kernel.apply(fast, reference, *inputs)


# the reference formula of each kernel (torch; also the backward of the fast ones) -----------------------------------

def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as vLLM's kernels define it: fp32 statistics, the normalized value rounded, times the weight."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def torch_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return torch_rms_norm(summed, weight, eps), summed


def torch_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor,
                 head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary of q (N, Hq*D) and k (N, Hkv*D) at positions by cache (P, D) = [cos | sin]."""
    cos, sin = cache[positions].chunk(2, dim=-1)  # (N, D/2) each

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.shape[0], -1, head_dim)
        x1, x2 = x.chunk(2, dim=-1)
        c, s = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(1)

    return rotate(q), rotate(k)


def torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int, scale: float) -> torch.Tensor:
    """Causal attention of `rows` sequences of equal length, tokens flattened: q (N, Hq, D), k and v (N, Hkv, D) in,
    (N, Hq, D) out (grouped kv heads repeated)."""
    n, heads, dim = q.shape
    t = n // rows
    qb, kb, vb = (x.view(rows, t, x.shape[1], dim).transpose(1, 2) for x in (q, k, v))
    groups = heads // kb.shape[1]
    kb, vb = kb.repeat_interleave(groups, dim=1), vb.repeat_interleave(groups, dim=1)
    scores = (qb.float() @ kb.float().transpose(-1, -2)) * scale
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    return (probs @ vb.float()).to(q.dtype).transpose(1, 2).reshape(n, heads, dim)


def torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True, slots=True)
class Kernels:
    """The kernels of a vLLM-shaped Qwen3 forward, each (inputs) -> outputs with gradients."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
    attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    log_softmax: Callable[[torch.Tensor], torch.Tensor]
    """fp32 (N, V) -> fp32 (N, V), over the last dimension."""
    name: str
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear
    """x (N, K) and weight (M, K) -> (N, M): every GEMM of the forward, the LM head's too (no biases in Qwen3's)."""
    token_logprobs: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None
    """logits (N, V) in the model's dtype, token ids (N, 1) and T -> (N,) fp32, each token's logprob as the rollout's
    sampler computed it; None: the formula log_softmax(fp32 logits / T), by log_softmax (vLLM's V1 runner)."""


def torch_kernels() -> Kernels:
    """The reference formula of every kernel: the forward's wiring checked against Hugging Face's, on any device."""
    return Kernels(rms_norm=torch_rms_norm, add_rms_norm=torch_add_rms_norm, rotary=torch_rotary,
                   attention=torch_attention, silu_and_mul=torch_silu_and_mul,
                   log_softmax=lambda x: torch.log_softmax(x, dim=-1), name="torch")


def vllm_kernels(mode: RolloutMode) -> Kernels:
    """vLLM's own CUDA kernels, dispatched as vLLM 0.26's modules dispatch them in eager mode (enforce_eager: the IR
    ops' CUDA implementations), in batch-invariant mode when the rollout was captured in it."""
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version

    fa_version = get_flash_attn_version()
    splits = 1 if mode.batch_invariant else 0
    invariant = _batch_invariant_kernels() if mode.batch_invariant else None
    v2 = _v2_sampler_kernels() if mode.runner == "v2" else None
    return Kernels(rms_norm=_rms_norm(invariant), add_rms_norm=_add_rms_norm(ops), rotary=_rotary(ops),
                   attention=_attention(ops, flash_attn_varlen_func, fa_version, splits, mode.block_size),
                   silu_and_mul=_silu_and_mul, log_softmax=_log_softmax(invariant), linear=_linear(invariant),
                   token_logprobs=_token_logprobs(v2) if v2 is not None else None,
                   name=f"vllm (FA{fa_version}, batch-invariant {'on' if mode.batch_invariant else 'off'}, "
                        f"{'V2 logprob kernel' if mode.runner == 'v2' else 'log_softmax'})")


@dataclass(frozen=True, slots=True)
class _Invariant:
    """vLLM's batch-invariant mode's kernels (vllm.model_executor.layers.batch_invariant)."""

    linear: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor]
    log_softmax: Callable[..., torch.Tensor]


def _batch_invariant_kernels() -> _Invariant:
    from vllm.model_executor.layers.batch_invariant import linear_batch_invariant, rms_norm_batch_invariant
    from vllm.model_executor.layers.batch_invariant import log_softmax as invariant_log_softmax

    return _Invariant(linear_batch_invariant, rms_norm_batch_invariant, invariant_log_softmax)


def _v2_sampler_kernels() -> tuple[Callable[..., Any], Callable[..., torch.Tensor]]:
    """vLLM's V2 runner's temperature kernel and token logprob kernel."""
    from vllm.v1.worker.gpu.sample.gumbel import apply_temperature
    from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

    return apply_temperature, compute_token_logprobs


def _rms_norm(invariant: _Invariant | None) -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]:
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        def fast(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            if invariant is not None:
                return invariant.rms_norm(x, weight, eps)
            out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
            torch.ops._C.rms_norm(out, x, weight, eps)
            return out

        return kernel(fast, lambda x, w: torch_rms_norm(x, w, eps), x, weight)

    return rms_norm


def _add_rms_norm(ops: Any) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        def fast(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x, residual = x.clone(), residual.clone()  # in place in vLLM: x becomes the output, residual the sum
            ops.fused_add_rms_norm(x, residual, weight, eps)
            return x, residual

        return kernel(fast, lambda x, r, w: torch_add_rms_norm(x, r, w, eps), x, residual, weight)

    return add_rms_norm


def _rotary(ops: Any) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor,
               head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        def fast(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            q, k = q.clone(), k.clone()  # rotated in place
            ops.rotary_embedding(positions, q, k, head_dim, cache, True)
            return q, k

        return kernel(fast, lambda q, k: torch_rotary(positions, q, k, cache, head_dim), q, k)

    return rotary


def _attention(ops: Any, flash_attn_varlen_func: Callable[..., Any], fa_version: int, splits: int,
               block: int) -> Callable[..., torch.Tensor]:
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int, scale: float) -> torch.Tensor:
        def fast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            n, _, dim = q.shape
            t, kv = n // rows, k.shape[1]
            blocks = -(-t // block)
            device = q.device
            # vLLM's NHD cache: (blocks, block_size, kv heads, 2 x head_dim), keys and values packed in the last dim
            cache = torch.zeros(rows * blocks, block, kv, 2 * dim, dtype=q.dtype, device=device)
            key_cache, value_cache = cache.split(dim, dim=-1)
            slots = (torch.arange(rows, device=device)[:, None] * blocks * block
                     + torch.arange(t, device=device)[None]).reshape(-1)
            one = torch.ones((), dtype=torch.float32, device=device)
            ops.reshape_and_cache_flash(k, v, key_cache, value_cache, slots, "auto", one, one)
            out = torch.empty_like(q)
            flash_attn_varlen_func(
                q=q, k=key_cache, v=value_cache, out=out, max_seqlen_q=t, max_seqlen_k=t,
                cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32, device=device) * t,
                seqused_k=torch.full((rows,), t, dtype=torch.int32, device=device), softmax_scale=scale, causal=True,
                block_table=torch.arange(rows * blocks, dtype=torch.int32, device=device).view(rows, blocks),
                fa_version=fa_version, num_splits=splits)
            return out

        return kernel(fast, lambda q, k, v: torch_attention(q, k, v, rows, scale), q, k, v)

    return attention


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    def fast(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=x.dtype, device=x.device)
        torch.ops._C.silu_and_mul(out, x)
        return out

    return kernel(fast, torch_silu_and_mul, x)


def _log_softmax(invariant: _Invariant | None) -> Callable[[torch.Tensor], torch.Tensor]:
    def log_softmax(x: torch.Tensor) -> torch.Tensor:
        if invariant is None:  # vLLM's sampler: aten's log_softmax, per row whatever the row count
            return torch.log_softmax(x, dim=-1)
        return kernel(lambda x: invariant.log_softmax(x, dim=-1), lambda x: torch.log_softmax(x, dim=-1), x)

    return log_softmax


def _linear(invariant: _Invariant | None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # in the mode vLLM's linear layers and its LM head (UnquantizedLinearMethod, UnquantizedEmbeddingMethod) call
        # linear_batch_invariant, its Triton persistent matmul, not cuBLAS; outside it F.linear
        if invariant is None:
            return F.linear(x, weight)
        return kernel(lambda x, w: invariant.linear(x, w), F.linear, x, weight)

    return linear


def _token_logprobs(v2: tuple[Callable[..., Any], Callable[..., torch.Tensor]]) -> Callable[..., torch.Tensor]:
    apply_temperature, compute_token_logprobs = v2

    def token_logprobs(z: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
        # vLLM 0.26's V2 runner (its sampler and its prompt logprobs alike): the logits stay in the model's dtype, its
        # temperature kernel divides them in place in fp32 and stores them back in that dtype (skipped at T = 1 or 0),
        # then _topk_log_softmax_kernel gives x - max - log(sum exp) of each wanted token; its reduction over a row
        # of bf16 loads differs from log_softmax's over fp32 ones in the last bit of some tokens
        def fast(z: torch.Tensor) -> torch.Tensor:
            z = z.contiguous().clone()
            if temperature not in (0.0, 1.0):
                apply_temperature(z, torch.zeros(z.shape[0], dtype=torch.int32, device=z.device),
                                  torch.full((1,), temperature, dtype=torch.float32, device=z.device))
            return compute_token_logprobs(z, tokens)[:, 0]

        return kernel(fast, lambda z: formula_token_logprobs(z, tokens, temperature, torch_log_softmax), z)

    return token_logprobs


def torch_log_softmax(z: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(z, dim=-1)


def formula_token_logprobs(z: torch.Tensor, tokens: torch.Tensor, temperature: float,
                           log_softmax: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """(N,) fp32: the sampler formula, log_softmax of the logits in fp32 divided by T held as an fp32 tensor, at each
    token of tokens (N, 1)."""
    temp = torch.full((1, 1), temperature, dtype=torch.float32, device=z.device)
    return log_softmax(z.float() / temp).gather(-1, tokens)[:, 0]

