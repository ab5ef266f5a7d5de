"""An engine whose step-0 logprobs can be GPU vLLM's own, bit for bit: seed 002's exact tier on a CUDA GPU.

A teacher-forced forward gives the rollout's logprobs bit for bit only if every kernel rounds as the rollout engine's
did. This engine is torch-tp whose bf16 actor forward is vLLM's Qwen3 forward, step for step, on vLLM's own kernels
(qualify.examples.vllm_cpu_exact is the CPU counterpart):
- the residual stream as vLLM carries it: the first layer's input RMSNorm alone, every later norm fused with the
  residual add (`fused_add_rms_norm`), the final norm too;
- q/k/v and gate/up as one GEMM each over the concatenated weights (vLLM's merged linears); every GEMM, the LM head's
  too, by `F.linear` (cuBLAS), or in batch-invariant mode by vLLM's `linear_batch_invariant` (its Triton persistent
  matmul, which vLLM's linear and LM-head methods call in the mode);
- RMSNorm by vLLM's CUDA kernel (`_C.rms_norm`), or in batch-invariant mode by its Triton `rms_norm_batch_invariant`,
  as vLLM's RMSNorm dispatches; q_norm and k_norm per head;
- rotary by `_C.rotary_embedding` (neox style) over a cos/sin cache vLLM's `get_rope` makes on the device;
- attention by vLLM's FlashAttention (`flash_attn_varlen_func`) over a paged KV cache written by
  `reshape_and_cache_flash` in the rollout's block size, with `num_splits=1` in batch-invariant mode (what vLLM's
  backend passes then) and FA's own heuristic otherwise;
- SiLU-and-mul by `_C.silu_and_mul`;
- each token's logprob as the rollout's sampler computed it: under vLLM's V2 model runner (vLLM 0.26's default on a GPU
  for a dense Qwen3; rollout.json records which), by the V2 runner's own kernels (its temperature kernel in place on
  the logits in the model's dtype, then `compute_token_logprobs`); under V1, the formula fp32 logits / T then
  log_softmax, by vLLM's Triton log_softmax in batch-invariant mode (vLLM's mode replaces aten's there), torch's
  otherwise.
With the rollout captured in batch-invariant mode, the engine puts the mode's cuBLAS settings in place in setup(),
before this process's first GEMM (CUBLAS_WORKSPACE_CONFIG=:16:8, CUBLASLT_WORKSPACE_SIZE=1, cuBLASLt preferred, no
reduced-precision bf16 reductions, IEEE fp32): settings installed after cuBLAS starts do not count. It does not install
vLLM's aten overrides, which would replace softmax, mean and bmm in the trainer's loss and backward too.

On a GPU (vLLM 0.26.0, the tiny family, bf16, T = 1, batch-invariant mode; benchmarks/gpu_vllm_chain.sh exact;
BENCHMARKS.md has the counts) the declared `rollout` row finds no token that differs at step 0, and `qualify rounds`
none after a bf16 update and a weight sync, nor after a second: seed 002's claim, qualified. Every decoder layer's output and residual, the final norm and the logits are vLLM's bit for bit
(benchmarks/exact_layers_probe.py). What had left a few tokens one fp32 step off was the last step: vLLM 0.26
runs its V2 model runner, whose logprob kernel reduces a row of logits loaded in bf16 and rounds otherwise than any
log_softmax over fp32 logits (torch's or vLLM's own Triton one). At T != 1 the V2 runner also divides the logits by T in
place and stores them back in bf16, so its processed logprobs are not the fp32 formula's (nearly every token at
T = 0.7: benchmarks/LOG.md); the engine follows it there too.

With `rollout.layer_outputs`, the exact tier compares the exact forward's residual stream with vLLM's layer by layer
(exact_layer_outputs; checked against Hugging Face's on the CPU with torch_kernels(), not yet run on a GPU).

Each kernel's backward is the reference formula's (recomputed in torch and differentiated): seed 002's claim is about
the forward, and the backward is not part of it. Everything else (the critic, cases in another precision than the
rollout's, diagnose's layer outputs) is torch-tp's HF forward.

Name it in a matrix as `qualify.examples.vllm_gpu_exact:engine`, declare it in `candidates.rollout_exact` and capture
the rollout with `rollout.batch_invariant: true`; its bf16 TP1 actor's step-0 logprobs must then equal the rollout's on
every response token (qualify.judge.rollout_exact), and after each weight sync in `qualify rounds --engine
qualify.examples.vllm_gpu_exact:engine`. CUDA, TP1, DP1, a dense Qwen3 with default RoPE, vLLM 0.26's module layout;
refused otherwise, before anything runs. The mode, the rollout's dtype and its block size are read from the sealed
rollout's rollout.json. `Kernels` holds the kernel set: `torch_kernels()` is the reference formula of each, which lets
the forward's wiring be checked against Hugging Face's on any device (tests/unit/examples/test_vllm_gpu_exact.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from qualify.engines.base import Batch, EngineContext
from qualify.engines.torch_tp import TorchTPEngine, local
from qualify.errors import EngineError
from qualify.examples.vllm_gpu_kernels import (
    Kernel,
    Kernels,
    RolloutMode,
    formula_token_logprobs,
    kernel,
    torch_add_rms_norm,
    torch_attention,
    torch_kernels,
    torch_log_softmax,
    torch_rms_norm,
    torch_rotary,
    torch_silu_and_mul,
    vllm_kernels,
)

__all__ = [  # the kernel set is qualify.examples.vllm_gpu_kernels's, named here too (where it was first written)
    "DEFAULT_BLOCK", "INVARIANT_ENV", "Kernel", "Kernels", "RolloutMode", "VllmGpuExactEngine", "engine",
    "formula_token_logprobs", "install_invariant_settings", "kernel", "residual_stream", "rollout_mode", "rope_cache",
    "sampler_logprobs", "torch_add_rms_norm", "torch_attention", "torch_kernels", "torch_log_softmax",
    "torch_rms_norm", "torch_rotary", "torch_silu_and_mul", "vllm_forward", "vllm_kernels",
]

DEFAULT_BLOCK = 32  # matrix rollout.block_size's default, for a rollout sealed before rollout.json recorded it
INVARIANT_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}
"""vLLM's batch-invariant mode on Hopper and later: split-K off through the cuBLAS workspace (read when cuBLAS starts)."""



def rollout_mode(rollout_dir: Path | None) -> RolloutMode:
    """The mode, dtype and KV block size a rollout was captured with, from its rollout.json (the reference's capture
    and each round's rollout of `qualify rounds` record them)."""
    from qualify.rollout.meta import read_rollout_meta

    if rollout_dir is None or not (Path(rollout_dir) / "rollout.json").is_file():
        raise EngineError(f"vllm_gpu_exact reads how the rollout was sampled from its rollout.json; none under "
                          f"{rollout_dir}")
    meta = read_rollout_meta(rollout_dir)
    if meta.dtype is None:
        raise EngineError(f"{rollout_dir}/rollout.json records no sampling.dtype: vllm_gpu_exact cannot tell the "
                          "precision the rollout was sampled in")
    if meta.model_runner not in (None, "v1", "v2"):
        raise EngineError(f"{rollout_dir}/rollout.json records model_runner {meta.model_runner!r}: vllm_gpu_exact "
                          "knows vLLM's 'v1' and 'v2' runners")
    return RolloutMode(dtype=meta.dtype, batch_invariant=meta.batch_invariant,
                       block_size=meta.block_size or DEFAULT_BLOCK, runner=meta.model_runner)



def rope_cache(config: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The cos/sin cache vLLM's rotary uses, (max positions, head_dim) = [cos | sin] of t x inv_freq in dtype: vLLM
    0.26's RotaryEmbedding._compute_cos_sin_cache, computed in fp32 on the device as vLLM builds its model there (its
    own note: on the GPU, not the CPU, so not bitwise Hugging Face's), then cast."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise EngineError(f"vllm_gpu_exact: RoPE type {rope['rope_type']!r} is not supported (default only)")
    theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    positions, dim = int(config.max_position_embeddings), int(config.head_dim)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
    freqs = torch.einsum("i,j -> ij", torch.arange(positions, dtype=torch.float, device=device), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def _w(t: torch.Tensor) -> torch.Tensor:
    return local(t)  # a TP1 DTensor's local tensor, differentiably


def vllm_forward(model: torch.nn.Module, ids_BT: torch.Tensor, kernels: Kernels, cache: torch.Tensor,
                 trace: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """(B, T, V) logits of an HF Qwen3 causal LM computed as vLLM's Qwen3 computes them, tokens flattened to one
    (B x T, hidden) batch, each row a sequence of its own (right padding sits after every real token: causal).
    trace, when given, receives what each vLLM module returns, by vLLM's module names (flattened tokens, detached):
    'model.layers.<i>.hidden' and '.residual' (what each decoder layer returns), 'model.norm.hidden' and 'logits'."""
    config = model.config
    rows, t = ids_BT.shape
    core = model.model
    eps = float(config.rms_norm_eps)
    dim, heads, kv = int(config.head_dim), int(config.num_attention_heads), int(config.num_key_value_heads)
    ids = ids_BT.reshape(-1)
    positions = torch.arange(t, device=ids.device).repeat(rows)
    h = F.embedding(ids, _w(core.embed_tokens.weight))
    residual = None
    for layer in core.layers:
        a, m = layer.self_attn, layer.mlp
        if residual is None:
            residual, x = h, kernels.rms_norm(h, _w(layer.input_layernorm.weight), eps)
        else:
            x, residual = kernels.add_rms_norm(h, residual, _w(layer.input_layernorm.weight), eps)
        qkv_w = torch.cat([_w(a.q_proj.weight), _w(a.k_proj.weight), _w(a.v_proj.weight)])
        qkv_b = None if a.q_proj.bias is None else torch.cat([_w(a.q_proj.bias), _w(a.k_proj.bias),
                                                               _w(a.v_proj.bias)])
        q, k, v = (kernels.linear(x, qkv_w) if qkv_b is None else F.linear(x, qkv_w, qkv_b)).split([heads * dim, kv * dim, kv * dim], dim=-1)
        q = kernels.rms_norm(q.view(-1, heads, dim), _w(a.q_norm.weight), eps).view(-1, heads * dim)
        k = kernels.rms_norm(k.view(-1, kv, dim), _w(a.k_norm.weight), eps).view(-1, kv * dim)
        q, k = kernels.rotary(positions, q, k, cache, dim)
        o = kernels.attention(q.view(-1, heads, dim), k.view(-1, kv, dim), v.reshape(-1, kv, dim), rows,
                              float(a.scaling))
        h = kernels.linear(o.reshape(-1, heads * dim), _w(a.o_proj.weight))
        x, residual = kernels.add_rms_norm(h, residual, _w(layer.post_attention_layernorm.weight), eps)
        gate_up = kernels.linear(x, torch.cat([_w(m.gate_proj.weight), _w(m.up_proj.weight)]))
        h = kernels.linear(kernels.silu_and_mul(gate_up), _w(m.down_proj.weight))
        if trace is not None:
            trace[f"model.layers.{len(trace) // 2}.hidden"] = h.detach()
            trace[f"model.layers.{(len(trace) - 1) // 2}.residual"] = residual.detach()
    x, _ = kernels.add_rms_norm(h, residual, _w(core.norm.weight), eps)
    logits = kernels.linear(x, _w(model.lm_head.weight))  # one GEMM: per sequence or position gives the same bits
    if trace is not None:
        trace["model.norm.hidden"], trace["logits"] = x.detach(), logits.detach()
    return logits.view(rows, t, -1)


def residual_stream(trace: dict[str, torch.Tensor], rows: int, t: int) -> dict[str, torch.Tensor]:
    """(B, T, H) fp32 'model.layers.<i>' and 'model.norm' from vllm_forward's trace: the residual stream after each
    decoder layer in Hugging Face's terms is what vLLM's layer returns, hidden + residual, added in fp32 and cast to the
    model's dtype as the next fused norm adds them (what a rollout's layers.safetensors holds, qualify.rollout.layers)."""
    out = {}
    for i in range(sum(name.endswith(".hidden") for name in trace) - 1):
        h, r = trace[f"model.layers.{i}.hidden"], trace[f"model.layers.{i}.residual"]
        out[f"model.layers.{i}"] = (h.float() + r.float()).to(h.dtype).float().view(rows, t, -1).cpu()
    out["model.norm"] = trace["model.norm.hidden"].float().view(rows, t, -1).cpu()
    return out


def sampler_logprobs(logits_BTV: torch.Tensor, ids_BT: torch.Tensor, temperature: float, vocab_size: int,
                     chunk_tokens: int, log_softmax: Callable[[torch.Tensor], torch.Tensor],
                     token_logprobs: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None
                     ) -> torch.Tensor:
    """(B, T) fp32 logprobs of ids_BT (position 0 is 0) as vLLM's sampler computes processed logprobs over the real
    vocabulary, chunk_tokens rows at a time: by token_logprobs (the rollout's own kernel) when given, else the formula
    (the logits in fp32, divided by T held as an fp32 tensor, log_softmax)."""
    rows, t = ids_BT.shape
    z = logits_BTV[:, :-1, :vocab_size].reshape(-1, vocab_size)
    tokens = ids_BT[:, 1:].reshape(-1, 1)
    parts = [token_logprobs(z[i:i + chunk_tokens], tokens[i:i + chunk_tokens], temperature)
             if token_logprobs is not None else
             formula_token_logprobs(z[i:i + chunk_tokens], tokens[i:i + chunk_tokens], temperature, log_softmax)
             for i in range(0, z.shape[0], chunk_tokens)]
    return F.pad(torch.cat(parts).view(rows, t - 1), (1, 0))


def install_invariant_settings() -> dict[str, str]:
    """vLLM's batch-invariant cuBLAS settings (Hopper and later), before this process's first GEMM; what was set."""
    os.environ.update(INVARIANT_ENV)
    torch.backends.cuda.preferred_blas_library(backend="cublaslt")
    try:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = (False, False)
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = (False, False)
    except (TypeError, RuntimeError):  # torch before 2.10 takes a bool
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    return dict(INVARIANT_ENV) | {"blas": "cublaslt", "bf16_reduced_precision_reduction": "off"}


class VllmGpuExactEngine(TorchTPEngine):
    """torch-tp whose bf16 actor forward is vLLM's Qwen3 forward on vLLM's CUDA kernels (see the module docstring)."""

    name = "vllm-gpu-exact"

    def setup(self, ctx: EngineContext) -> None:
        if not ctx.device.startswith("cuda") or ctx.tp != 1 or ctx.dp != 1:
            raise EngineError(f"vllm_gpu_exact runs GPU vLLM's kernels: CUDA, TP1 and DP1 only (this case: "
                              f"{ctx.device}, TP{ctx.tp}, DP{ctx.dp})")
        self.mode = rollout_mode(ctx.rollout_dir)
        self.settings = self.install_settings() if self.mode.batch_invariant else {}
        super().setup(ctx)
        config = self.compute.config
        if config.model_type != "qwen3":
            raise EngineError(f"vllm_gpu_exact computes a dense Qwen3 as vLLM does; this model is {config.model_type}")
        self.exact = ctx.role == "actor" and str(self.compute.dtype).removeprefix("torch.") == self.mode.dtype
        if self.exact:
            self.kernels = self.make_kernels(self.mode)
            self.cache = rope_cache(config, self.compute.dtype, torch.device(ctx.device))

    def install_settings(self) -> dict[str, str]:
        """The mode's cuBLAS settings, put in place before this process's first GEMM; what was set (a test's twin
        leaves them out)."""
        return install_invariant_settings()

    def make_kernels(self, mode: RolloutMode) -> Kernels:
        """The forward's kernels: vLLM's own (a test's twin swaps one out)."""
        return vllm_kernels(mode)

    def score(self, batch: Batch) -> torch.Tensor:
        if not self.exact:
            return super().score(batch)
        from qualify.models.hf import declared_logprobs

        c = self.ctx
        ids_BT = batch.input_ids_BT.to(c.device)
        logits_BTV = vllm_forward(self.compute, ids_BT, self.kernels, self.cache)
        self.declared_BT = declared_logprobs(c, logits_BTV.detach(), ids_BT)
        self.last_logits = logits_BTV.detach()
        return sampler_logprobs(logits_BTV, ids_BT, c.temperature, c.vocab_size, c.logprob_chunk_tokens,
                                self.kernels.log_softmax, self.kernels.token_logprobs).cpu()


    def exact_layer_outputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The exact tier's layers (qualify.judge.layer_probe): the residual stream of the forward score() runs,
        vLLM's on the exact path (residual_stream), else torch-tp's HF hooks. layer_outputs stays torch-tp's for
        qualify diagnose, which wants every sub-module's output by HF's names."""
        if not self.exact:
            return self.layer_outputs(batch)
        trace: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            vllm_forward(self.compute, batch.input_ids_BT.to(self.ctx.device), self.kernels, self.cache, trace)
        return residual_stream(trace, *batch.input_ids_BT.shape)


def engine() -> VllmGpuExactEngine:
    return VllmGpuExactEngine()
