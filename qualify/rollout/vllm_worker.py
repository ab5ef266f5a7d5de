"""Child process that runs vLLM once: load the actor, sample every prompt, write raw results.

It runs in its own process so that vLLM's engine, its worker processes and its shared-memory
segments are created and torn down in isolation: the parent checks that nothing is left over.
With layer_outputs, every sampled sequence is fed again, one at a time, with hooks on vLLM's layers
(qualify.rollout.layers), and the activations are written to the request's layers_path.
Usage: python -m qualify.rollout.vllm_worker REQUEST.json OUT.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from qualify.errors import QualifyError
from qualify.store import write_json


def run(request: dict) -> dict:
    """Sample every prompt with its own seed; return tokens and the sampler's logprobs."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.monotonic()
    llm = _load(LLM, request)
    loaded = time.monotonic()
    runner = model_runner(llm)
    platform = _platform(request)
    try:
        sampling, params = _sampling_params(SamplingParams, request)
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in request["prompts"]]
        if request.get("routes"):
            results, moe_layers = generate_with_routes(llm, prompts, params)
        else:
            results, moe_layers = [result_of(out) for out in llm.generate(prompts, params, use_tqdm=False)], None
        generated = time.monotonic()
        prefill, prefill_error, layers = _prefill(llm, request, results, sampling)
        prefilled = time.monotonic()
    finally:
        shutdown(llm)
    for i, logprobs in prefill.items():
        results[i]["prefill_logprobs"] = logprobs
    return {"results": results, "load_s": loaded - started, "generate_s": generated - loaded,
            "prefill_s": prefilled - generated, "prefill_error": prefill_error,
            **({"layers": layers} if layers is not None else {}),
            "platform": platform, "routes_layers": moe_layers, "batch_invariant_settings": platform.get("batch_invariant"),
            "model_runner": runner}


def _load(llm_class, request: dict):
    """vLLM's engine for the request's actor (vllm.LLM)."""
    return llm_class(
        model=request["model_dir"],
        skip_tokenizer_init=True,
        dtype=request["dtype"],
        enforce_eager=True,
        seed=request["seed"],
        tensor_parallel_size=request["tp"],
        logprobs_mode="processed_logprobs",
        max_model_len=request["max_model_len"],
        kv_cache_memory_bytes=request["kv_cache_memory_bytes"],
        max_num_seqs=max(1, len(request["prompts"])),
        block_size=request["block_size"],
        # a cached prompt block is never fed again, so it has no routes: a routed capture computes every token
        **({"enable_prefix_caching": False} if request.get("routes") else {}),
    )


def _platform(request: dict) -> dict:
    """The platform's fingerprint taken here, where vLLM has set its threads, not in the parent (with what vLLM's
    batch-invariant mode set in this process, when asked for)."""
    from qualify.hardware import platform_fingerprint

    platform = platform_fingerprint()
    if request.get("batch_invariant"):
        import os

        from qualify.rollout.invariant import BATCH_INVARIANT_SETTINGS

        platform["batch_invariant"] = {k: os.environ.get(k) for k in BATCH_INVARIANT_SETTINGS}
    return platform


def _sampling_params(params_class, request: dict) -> tuple[list[dict], list]:
    """Every prompt's sampling settings (the request's, or its own ones in a merged request) and its
    vllm.SamplingParams, seeded with the prompt's seed."""
    sampling = request.get("prompt_sampling") or [
        {k: request.get(k, 0.0) for k in ("temperature", "top_k", "top_p", "min_p")}] * len(request["seeds"])
    params = [
        params_class(n=1, temperature=s["temperature"], top_k=s["top_k"], top_p=s["top_p"], min_p=s["min_p"],
                     seed=seed, max_tokens=request["max_new_tokens"], logprobs=0, detokenize=False,
                     stop_token_ids=[request["eos_token_id"]] if request["eos_token_id"] is not None else None)
        for seed, s in zip(request["seeds"], sampling, strict=True)
    ]
    return sampling, params


def _prefill(llm, request: dict, results: list[dict],
             sampling: list[dict]) -> tuple[dict[int, list[float]], str | None, dict | None]:
    """(the prefill's logprobs by result index, why they are missing, the layers' record): the same pass records
    vLLM's layers when asked for (a failure then fails the capture); a routed capture has none (its hooks would see
    the pass's rows too); otherwise a failure is recorded, and the rollout stands."""
    prefill, prefill_error, layers = {}, None, None
    if request.get("layer_outputs"):
        prefill, layers = prefill_logprobs(llm, results, sampling, request["max_model_len"], request["layers_path"])
    elif not request.get("routes"):
        try:
            prefill, _ = prefill_logprobs(llm, results, sampling, request["max_model_len"])
        except Exception as exc:  # noqa: BLE001 - recorded: the rollout stands, its meta says why the check is missing
            prefill_error = f"{type(exc).__name__}: {exc}"
    return prefill, prefill_error, layers


def prefill_comparable(sampling: dict) -> bool:
    """Whether a prompt's decode logprobs are the formula vLLM's prompt logprobs compute: log_softmax of the raw
    logits, so T = 1 and nothing truncated (at another temperature or with truncation they differ by definition)."""
    return (float(sampling["temperature"]) == 1.0 and int(sampling["top_k"]) in (-1, 0)
            and float(sampling["top_p"]) == 1.0 and not float(sampling.get("min_p") or 0.0))


def prefill_logprobs(llm, results: list[dict], sampling: list[dict], max_model_len: int,
                     layers_path: str | None = None) -> tuple[dict[int, list[float]], dict | None]:
    """Does the rollout engine agree with itself? Each comparable prompt's sequence (prompt and sampled tokens) fed
    back as one prompt with prompt logprobs (one pass, batched; vLLM reads no prefix cache for such a request): the
    logprob its prefill gives each sampled token, by result index. Sequences without room for the one token the pass
    asks for are left out.

    With layers_path (rollout.layer_outputs) the pass feeds every response-bearing sequence with room, comparable or
    not, with hooks on vLLM's layers (qualify.rollout.layers): their activations in this very batch are written to
    layers_path as (B, T, H) float32 tensors, so that the layers and the prefill's logprobs are one computation (vLLM's
    forward may depend on what else is in its batch). Returns the logprobs and, with layers_path, the names, the fed
    rows and the pass's seconds."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.monotonic()
    room = [i for i, r in enumerate(results) if r["tokens"] and len(r["prompt"]) + len(r["tokens"]) < max_model_len]
    chosen = [i for i in room if prefill_comparable(sampling[i])]
    fed = room if layers_path else chosen
    if not fed:
        if layers_path:
            raise QualifyError("rollout.layer_outputs: no sampled sequence has room for a prefill pass "
                               "(max_model_len)")
        return {}, None
    full = {i: results[i]["prompt"] + results[i]["tokens"] for i in fed}
    names = bind_layers(llm) if layers_path else None
    again = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    outs = dict(zip(fed, llm.generate([TokensPrompt(prompt_token_ids=full[i]) for i in fed], again, use_tqdm=False),
                    strict=True))
    logprobs = {i: [outs[i].prompt_logprobs[t][full[i][t]].logprob for t in range(len(results[i]["prompt"]),
                                                                                  len(full[i]))] for i in chosen}
    if not layers_path:
        return logprobs, None
    from qualify.rollout import layers
    from qualify.store import write_tensors

    (taken,) = llm.apply_model(layers.take)
    per_row = layers.split_forwards(taken, names, full)
    write_tensors(Path(layers_path),
                  layers.layers_tensors(per_row, [len(r["prompt"]) + len(r["tokens"]) for r in results]))
    return logprobs, {"names": names, "rows": sorted(per_row), "seconds": time.monotonic() - started}


def bind_layers(llm) -> list[str]:
    """Hooks on vLLM's layers in its one worker (the capture runs at TP1), nothing kept yet; their names."""
    from qualify.rollout import layers

    bound = llm.apply_model(layers.bind)
    if len(bound) != 1:
        raise QualifyError(f"rollout.layer_outputs: vLLM runs {len(bound)} TP ranks; the layer capture runs at TP1")
    return layers.layer_names(bound[0])


def result_of(out) -> dict:
    """One request's prompt, sampled tokens, their processed logprobs, why it stopped and how many of its prompt
    tokens came from the prefix cache."""
    completion = out.outputs[0]
    token_logprobs = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
    return {"prompt": list(out.prompt_token_ids), "tokens": list(completion.token_ids),
            "logprobs": token_logprobs, "finish_reason": completion.finish_reason,
            "num_cached_tokens": int(out.num_cached_tokens or 0)}


def generate_with_routes(llm, prompts: list, params: list) -> tuple[list[dict], list[int]]:
    """Sample every prompt with its routes (qualify.rollout.routes): one request at a time, so that every row the
    routers see belongs to it; the MoE layer ids."""
    from qualify.errors import QualifyError
    from qualify.rollout import routes

    bound = llm.apply_model(routes.bind)
    layers = bound[0]
    if not layers or any(b != layers for b in bound):
        raise QualifyError(f"routes asked for, but vLLM's model has MoE layers {bound} per TP rank")
    results = []
    for i, (prompt, param) in enumerate(zip(prompts, params, strict=True)):
        llm.apply_model(routes.take)  # nothing left over from an earlier request
        result = result_of(llm.generate([prompt], [param], use_tqdm=False)[0])
        rows = len(result["prompt"]) + len(result["tokens"]) - 1
        result["routes"] = routes.request_routes(llm.apply_model(routes.take), layers, rows, f"request {i}")
        results.append(result)
    return results, layers


def model_runner(llm) -> str | None:
    """Which of vLLM's model runners this engine runs, 'v1' or 'v2' (None where the version does not say). They
    compute the sampler's logprobs differently: V1 by log_softmax over fp32 logits, V2 (vLLM 0.26's default on a GPU
    for a dense Qwen3) by its own Triton kernel over the logits in the model's dtype, so an engine that reproduces the
    rollout's logprobs bit for bit must know which one sampled it."""
    v2 = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "use_v2_model_runner", None)
    return None if v2 is None else ("v2" if v2 else "v1")


def shutdown(llm) -> None:
    """Stop the engine core and its workers explicitly (else /dev/shm segments can be left behind)."""
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None:
        engine_core.shutdown()


def main() -> None:
    request = json.loads(Path(sys.argv[1]).read_text())
    write_json(Path(sys.argv[2]), run(request))


if __name__ == "__main__":
    main()
