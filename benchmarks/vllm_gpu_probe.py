"""Where GPU vLLM fp32 and HF fp32 part ways: the same token sequences through both, compared layer by layer.

vLLM (in-process engine, eager, TP1) scores each sequence with prompt_logprobs while forward hooks record
layer 0's input norm, fused QKV projection, attention core (o_proj's input) and MLP, and every layer's
residual stream; HF fp32 (eager attention, float32_matmul_precision as given) runs the same sequences.
Prints one JSON line: vLLM's attention backend, the matmul precision it ran with, and max |delta| per point.
Run it once per setting to be compared (e.g. TRITON_F32_DEFAULT=ieee), each in a fresh process.
Usage: python benchmarks/vllm_gpu_probe.py MODEL_DIR LABEL
"""

from __future__ import annotations

import json
import os
import sys

import torch

NUM_SEQS, SEQ_LEN = 4, 40
POINTS = ("l0.input_norm", "l0.qkv", "l0.attn_core", "l0.mlp")


def sequences(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, (NUM_SEQS, SEQ_LEN), generator=g).tolist()


def first(x):
    return x[0] if isinstance(x, tuple | list) else x


def vllm_side(model_dir: str, seqs: list[list[int]]):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
              max_model_len=128, kv_cache_memory_bytes=256 << 20, block_size=32, enable_prefix_caching=False)
    seen: dict[str, torch.Tensor] = {}

    def keep(name, pre=False):
        def hook(module, args, out=None):
            if name not in seen:
                seen[name] = (first(args) if pre else first(out)).detach().float().cpu()
        return hook

    def keep_stream(name):
        def hook(module, args, out):
            if name not in seen:
                seen[name] = (out[0] + out[1]).detach().float().cpu()
        return hook  # returns None: a forward hook's return value would replace the module's output

    def install(model):
        layers = model.model.layers
        layers[0].input_layernorm.register_forward_hook(keep("l0.input_norm"))
        layers[0].self_attn.qkv_proj.register_forward_hook(keep("l0.qkv"))
        layers[0].self_attn.o_proj.register_forward_pre_hook(keep("l0.attn_core", pre=True))
        layers[0].mlp.register_forward_hook(keep("l0.mlp"))
        for i, layer in enumerate(layers):
            # a vLLM decoder layer returns (mlp output, residual before it): the stream is their sum
            layer.register_forward_hook(keep_stream(f"stream.{i}"))
        attn = layers[0].self_attn.attn
        return type(getattr(attn, "impl", attn)).__name__, torch.get_float32_matmul_precision()

    backend, precision = llm.apply_model(install)[0]
    runs = []
    for seq in seqs:
        seen.clear()
        out = llm.generate([TokensPrompt(prompt_token_ids=seq)],
                           SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False),
                           use_tqdm=False)[0]
        logp = [step[tok].logprob for step, tok in zip(out.prompt_logprobs[1:], seq[1:])]
        runs.append((dict(seen), torch.tensor(logp, dtype=torch.float32)))
    return backend, precision, runs


def hf_side(model_dir: str, seqs: list[list[int]]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").cuda()
    seen: dict[str, torch.Tensor] = {}

    def put(name, value):  # hooks must return None, or they replace the module's output
        seen.setdefault(name, value)

    layers = model.model.layers
    a = layers[0].self_attn
    layers[0].input_layernorm.register_forward_hook(lambda m, i, o: put("l0.input_norm", first(o)))
    for proj in ("q_proj", "k_proj", "v_proj"):
        getattr(a, proj).register_forward_hook(lambda m, i, o, p=proj: put(p, o))
    a.o_proj.register_forward_pre_hook(lambda m, i: put("l0.attn_core", first(i)))
    layers[0].mlp.register_forward_hook(lambda m, i, o: put("l0.mlp", first(o)))
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda m, args, o, i=i: put(f"stream.{i}", first(o)))
    runs = []
    with torch.no_grad():
        for seq in seqs:
            seen.clear()
            ids = torch.tensor([seq], device="cuda")
            logits = model(ids).logits[0].float()  # (T, V)
            logp = torch.log_softmax(logits, dim=-1)[:-1].gather(1, ids[0, 1:, None])[:, 0]
            got = {k: v[0].float().cpu() for k, v in seen.items()}
            got["l0.qkv"] = torch.cat([got.pop(p) for p in ("q_proj", "k_proj", "v_proj")], dim=-1)
            runs.append((got, logp.cpu()))
    return runs


def main() -> None:
    model_dir, label = sys.argv[1], sys.argv[2]
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    seqs = sequences(vocab)
    backend, precision, v_runs = vllm_side(model_dir, seqs)
    torch.set_float32_matmul_precision(os.environ.get("HF_FP32_MATMUL", "highest"))
    h_runs = hf_side(model_dir, seqs)
    keys = [*POINTS, *sorted(k for k in h_runs[0][0] if k.startswith("stream."))]
    keys = [k for k in keys if k in v_runs[0][0] and k in h_runs[0][0]]  # a hook that did not fire is left out
    delta = {k: max(float((v[0][k] - h[0][k]).abs().max()) for v, h in zip(v_runs, h_runs)) for k in keys}
    diffs = torch.cat([(v[1] - h[1]).abs() for v, h in zip(v_runs, h_runs)])
    print("PROBE " + json.dumps({
        "label": label, "attention_backend": backend, "vllm_fp32_matmul_precision": precision,
        "hf_fp32_matmul_precision": torch.get_float32_matmul_precision(),
        "TRITON_F32_DEFAULT": os.environ.get("TRITON_F32_DEFAULT"), "max_abs": delta,
        "logprob_max_abs": float(diffs.max()), "logprob_mean_abs": float(diffs.mean()),
        "logprob_bitwise": f"{int((diffs == 0).sum())}/{diffs.numel()}"}), flush=True)


if __name__ == "__main__":
    main()
