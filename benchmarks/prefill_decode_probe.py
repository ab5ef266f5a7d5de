"""Does the rollout engine agree with itself? vLLM's decode logprobs against its own prefill of the same sequences
(an honest verdict says whether the rollout engine's prefill and decode agree; if they do, a
teacher-forced trainer forward can in principle be exact; if not, only a replay of vLLM's decode steps can).

Samples N prompts at T = 1 with no truncation (seed 002's setting: then vLLM's processed logprobs and its prompt
logprobs are the same formula, log_softmax of the logits; at another temperature its prompt logprobs skip the
temperature and cannot be compared), then feeds each prompt + response back as a prompt with prompt_logprobs, batched
and one at a time, and counts the response tokens whose two logprobs differ bit for bit. Prefix caching is off, so the
second pass computes every position again.
Usage: python benchmarks/prefill_decode_probe.py MODEL_DIR [--dtype float32|bfloat16] [--prompts 8] [--tokens 24]
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype, enforce_eager=True, seed=0,
              logprobs_mode="processed_logprobs", max_model_len=256, kv_cache_memory_bytes=256 << 20, block_size=32,
              enable_prefix_caching=False)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, vocab - 1, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    sampling = [SamplingParams(temperature=1.0, top_k=-1, top_p=1.0, max_tokens=args.tokens, logprobs=0, seed=i,
                               detokenize=False, ignore_eos=True) for i in range(args.prompts)]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
    full = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    decode = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    again = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    for how in ("batched", "one at a time"):
        if how == "batched":
            second = llm.generate([TokensPrompt(prompt_token_ids=f) for f in full], again, use_tqdm=False)
        else:
            second = [llm.generate([TokensPrompt(prompt_token_ids=f)], again, use_tqdm=False)[0] for f in full]
        n = differ = 0
        worst = 0.0
        for p, f, o, d in zip(prompts, full, second, decode):
            prefill = [o.prompt_logprobs[i][f[i]].logprob for i in range(len(p), len(f))]
            for a, b in zip(prefill, d):
                n, differ, worst = n + 1, differ + (a != b), max(worst, abs(a - b))
        print(f"{args.dtype} prefill ({how}) vs decode: {differ} of {n} response tokens differ, max |delta| {worst:.3g}")


if __name__ == "__main__":
    main()
