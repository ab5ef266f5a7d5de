"""Capture the fixed rollout: prompts as token ids, per-request seeds, real vLLM at a TP degree.

The rollout directory holds rollout.safetensors (tokens, masks, the sampler's processed
logprobs) and rollout.json (sampling params, seeds, vLLM TP, versions, host, digest). It is
written once; its digest (sha256 of rollout.safetensors) names it, and every later stage checks
that digest before reading anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from qualify.errors import EvidenceError, QualifyError
from qualify.manifest import sha256_file
from qualify.matrix import Matrix
from qualify.stages import complete_stage, fingerprint, prepare_stage, require_complete, reuse_complete, stage_info
from qualify.store import read_json, read_tensors, write_json, write_tensors
from qualify.versions import provenance

ROLLOUT_FILE = "rollout.safetensors"


def make_prompts(matrix: Matrix, vocab_size: int, eos_token_id: int | None) -> list[list[int]]:
    """Prompt token ids: from prompts_file, or drawn from the rollout seed (never the EOS id)."""
    r = matrix.rollout
    if r.prompts_file is not None:
        data = read_json(matrix.resolve(r.prompts_file))
        if not isinstance(data, list) or not all(isinstance(p, list) and p for p in data):
            raise QualifyError(f"{r.prompts_file}: expected a JSON list of non-empty token-id lists")
        return [[int(t) for t in p] for p in data[: r.num_prompts]]
    import torch

    gen = torch.Generator().manual_seed(r.seed)
    high = vocab_size - 1 if eos_token_id == vocab_size - 1 else vocab_size
    return torch.randint(1, high, (r.num_prompts, r.prompt_len), generator=gen).tolist()


def cpu_bind(tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND splitting this process's CPUs evenly across TP ranks ('0|1' on 2 cores)."""
    cpus = sorted(os.sched_getaffinity(0))
    per = max(1, len(cpus) // tp)
    groups = [cpus[i * per:(i + 1) * per] or cpus[-1:] for i in range(tp)]
    return "|".join(",".join(str(c) for c in g) for g in groups)


def vllm_env(tp: int) -> dict[str, str]:
    """Environment for the vLLM child: in-process engine core, no dynamo compile, CPU thread binding."""
    env = dict(os.environ)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("TORCHDYNAMO_DISABLE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_bind(tp) if tp > 1 else "auto")
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return env


def shm_segments() -> set[str]:
    """vLLM's shared-memory segments currently in /dev/shm (vllm_dist_* and the like)."""
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("vllm*")} if shm.is_dir() else set()


def run_vllm(request: dict[str, Any]) -> dict[str, Any]:
    """Run the vLLM worker in a child process; check it left no process and no /dev/shm segment."""
    before = shm_segments()
    with tempfile.TemporaryDirectory(prefix="qualify-vllm-") as tmp:
        req, out = Path(tmp) / "request.json", Path(tmp) / "out.json"
        write_json(req, request)
        proc = subprocess.run([sys.executable, "-m", "qualify.rollout.vllm_worker", str(req), str(out)],
                              env=vllm_env(request["tp"]), capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not out.is_file():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
            raise QualifyError(f"vLLM capture at TP{request['tp']} failed (exit {proc.returncode}):\n{tail}")
        result = read_json(out)
    leftover = shm_segments() - before
    if leftover:
        raise EvidenceError(f"vLLM left shared-memory segments behind: {sorted(leftover)}")
    return result


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
    return {"input_ids_BT": input_ids, "prompt_mask_BT": prompt_mask, "response_mask_BT": response_mask,
            "sampler_logprobs_BT": logprobs}


def capture_rollout(matrix: Matrix, model_dir: Path, tp: int, out_dir: Path, *, vocab_size: int,
                    eos_token_id: int | None) -> str:
    """Capture the rollout at vLLM TP degree tp into out_dir (skipped when complete); return its digest."""
    r = matrix.rollout
    eos = r.eos_token_id if r.eos_token_id is not None else eos_token_id
    prompts = make_prompts(matrix, vocab_size, eos)
    seeds = [r.seed + i for i in range(len(prompts))]
    request = {"model_dir": str(model_dir), "tp": tp, "dtype": {"fp32": "float32", "bf16": "bfloat16"}[r.dtype],
               "seed": r.seed, "seeds": seeds, "prompts": prompts, "temperature": r.temperature, "top_k": r.top_k,
               "top_p": r.top_p, "max_new_tokens": r.max_new_tokens, "eos_token_id": eos,
               "max_model_len": r.max_model_len, "kv_cache_memory_bytes": r.kv_cache_memory_bytes,
               "block_size": r.block_size}
    settings = fingerprint({k: v for k, v in request.items() if k != "model_dir"})
    if reuse_complete(out_dir, settings, f"rollout TP{tp}"):
        return stage_info(out_dir)["digest"]
    result = run_vllm(request)
    prepare_stage(out_dir)
    write_tensors(out_dir / ROLLOUT_FILE, rollout_tensors(result["results"]))
    digest = "sha256:" + sha256_file(out_dir / ROLLOUT_FILE)[1]
    meta = {"digest": digest, "vllm_tp": tp, "sampling": {k: request[k] for k in (
        "temperature", "top_k", "top_p", "max_new_tokens", "eos_token_id", "seed", "seeds", "dtype")},
        "logprobs_mode": "processed_logprobs", "finish_reasons": [x["finish_reason"] for x in result["results"]],
        "timings_s": {"load": result["load_s"], "generate": result["generate_s"]},
        "model_dir": str(model_dir), "env": {k: v for k, v in vllm_env(tp).items() if k.startswith("VLLM_")},
        **provenance()}
    write_json(out_dir / "rollout.json", meta)
    complete_stage(out_dir, {"digest": digest, "settings": settings})
    return digest


def load_rollout(rollout_dir: Path, expected_digest: str | None = None) -> dict[str, Any]:
    """Read a rollout after checking it is complete and (when given) that its digest is the expected one."""
    require_complete(rollout_dir, "rollout")
    digest = "sha256:" + sha256_file(Path(rollout_dir) / ROLLOUT_FILE)[1]
    if expected_digest is not None and digest != expected_digest:
        raise EvidenceError(f"rollout {rollout_dir} has digest {digest}, expected {expected_digest}: "
                            "refusing to run on a different rollout")
    return read_tensors(Path(rollout_dir) / ROLLOUT_FILE)
