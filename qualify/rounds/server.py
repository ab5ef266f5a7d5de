"""The long-lived vLLM rollout engine of a rounds run, driven over JSON lines on stdin/stdout.

One request per line in, one reply per line out; every reply has "ok", and "kind" and "error"
when the request was refused. The engine is a state machine:

  ready(v)    serves generate at version v
  pending(v)  v is installed on every rank and every rank's acknowledgment verified; it serves
              nothing until the harness acks exactly those acknowledgments, after a prefix-cache reset
  failed      an installation failed (or the harness declared a failure): every later request
              except state and shutdown is refused; the engine is never patched back to health,
              only rebuilt from a verified checkpoint (restart)

Commands: start (first line), generate, install, reset_prefix_cache, ack, state, fail, restart,
shutdown. A stale install (version other than current + 1) is refused before anything is loaded,
so it leaves the engine as it was. Faults (probes only) are passed through to the ranks
(qualify.rounds.vllm_ext) or, for ack's allow_warm_cache, skip the cache-reset rule.
vLLM's own output goes to stderr: stdout carries the protocol only.
Usage: python -m qualify.rounds.server
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import IO, Any

from qualify.errors import Refused
from qualify.hashing import digest_of_bytes
from qualify.rollout.invariant import BATCH_INVARIANT_SETTINGS
from qualify.rollout.vllm_worker import model_runner, result_of
from qualify.rounds.acks import ack_problems
from qualify.store import dumps_json

EXTENSION = "qualify.rounds.vllm_ext.RoundsWorkerExtension"


def acks_digest(acks: list[dict[str, Any]]) -> str:
    return digest_of_bytes(dumps_json(acks).encode("ascii"))


class Engine:
    """The vLLM LLM and the installation state around it."""

    def __init__(self, start: dict[str, Any]) -> None:
        self.config = start
        self.llm: Any = None
        self.state, self.version, self.failure = "starting", None, None
        self.pending: dict[str, Any] | None = None
        self.cache_reset = True

    # lifecycle ------------------------------------------------------------------------------
    def build(self, model_dir: str, version: int, expected: list[dict[str, str]]) -> dict[str, Any]:
        """Start vLLM on model_dir and verify that every rank holds `version` as expected."""
        c = self.config
        if c.get("batch_invariant"):  # the rollout engine of seed 002's exact tier: refused where it cannot run
            from qualify.rollout.capture import batch_invariant_problem

            problem = batch_invariant_problem()
            if problem is not None:
                self.fail(problem)
                raise Refused("batch_invariant", problem)
        from vllm import LLM

        started = time.monotonic()
        self.llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype=c["dtype"], enforce_eager=True, seed=c["seed"],
                       tensor_parallel_size=c["tp"], logprobs_mode="processed_logprobs",
                       max_model_len=c["max_model_len"], kv_cache_memory_bytes=c["kv_cache_memory_bytes"],
                       max_num_seqs=c["max_num_seqs"], block_size=c["block_size"], enable_prefix_caching=True,
                       worker_extension_cls=EXTENSION)
        loaded = time.monotonic()
        acks = self.rpc("qualify_report", version=version)
        problems = ack_problems(acks, version, expected)
        if problems:
            self.fail(f"version {version} as loaded at start is not what every rank must hold: {problems[:5]}")
            raise Refused("install_failed", self.failure, {"acks": acks, "problems": problems})
        self.state, self.version, self.pending, self.cache_reset = "ready", version, None, True
        invariant = {"batch_invariant": {k: os.environ.get(k) for k in BATCH_INVARIANT_SETTINGS}} \
            if c.get("batch_invariant") else {}
        return {"version": version, "acks": acks, "load_s": round(loaded - started, 3),
                "report_s": round(time.monotonic() - loaded, 3), "model_runner": model_runner(self.llm), **invariant}

    def shutdown(self) -> None:
        if self.llm is not None:
            engine_core = getattr(self.llm.llm_engine, "engine_core", None)
            if engine_core is not None:
                engine_core.shutdown()
            self.llm = None

    def fail(self, reason: str) -> None:
        self.state, self.failure, self.pending = "failed", reason, None

    def rpc(self, method: str, **kwargs: Any) -> list[dict[str, Any]]:
        """Call method on every rank; flatten the ranks' acknowledgment lists."""
        return [ack for per_rank in self.llm.collective_rpc(method, kwargs=kwargs) for ack in per_rank]

    # commands -------------------------------------------------------------------------------
    def generate(self, req: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.state != "ready":
            raise Refused("unusable", f"generate refused: engine is {self.describe()}")
        s = req["sampling"]
        stop = [s["eos_token_id"]] if s.get("eos_token_id") is not None else None
        params = [SamplingParams(n=1, temperature=s["temperature"], top_k=s["top_k"], top_p=s["top_p"],
                                 min_p=s.get("min_p", 0.0), seed=seed, max_tokens=s["max_tokens"], logprobs=0,
                                 detokenize=False, stop_token_ids=stop)
                  for seed in req["seeds"]]
        started = time.monotonic()
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in req["prompts"]]
        routed = {}
        if req.get("routes"):  # a MoE actor's rollout: every fed token's experts, one request at a time
            from qualify.errors import QualifyError
            from qualify.rollout.vllm_worker import generate_with_routes

            try:
                results, layers = generate_with_routes(self.llm, prompts, params)
            except QualifyError as exc:  # a request whose routes are incomplete (a prefix-cache hit feeds fewer)
                raise Refused("routes", f"generate with routes refused: {exc}") from exc
            routed = {"routes_layers": layers}
        else:
            results = [result_of(out) for out in self.llm.generate(prompts, params, use_tqdm=False)]
        return {"version": self.version, "cache_reset_since_install": self.cache_reset, "results": results,
                "seconds": round(time.monotonic() - started, 3), **routed}

    def install(self, req: dict[str, Any]) -> dict[str, Any]:
        version = req["version"]
        if self.state != "ready":
            raise Refused("unusable", f"install of version {version} refused: engine is {self.describe()}")
        if version != self.version + 1:
            raise Refused("stale_version", f"install of version {version} refused: engine serves version "
                          f"{self.version}, the next install must be version {self.version + 1}; nothing was loaded")
        # From here on a failure leaves the ranks half-updated: nothing is served until verified and acked.
        self.state, self.pending = "installing", None
        started = time.monotonic()
        try:
            acks = self.rpc("qualify_install", version=version, path=req["path"], fault=req.get("fault"))
        except Exception as exc:  # a rank raised: the weights on the ranks are now unknown
            self.fail(f"install of version {version} raised on a rank: {type(exc).__name__}: {exc}")
            raise Refused("install_failed", self.failure) from exc
        problems = ack_problems(acks, version, req["expected"])
        if problems:
            self.fail(f"install of version {version} rejected: {len(problems)} problem(s): " + "; ".join(problems[:3]))
            raise Refused("install_failed", self.failure, {"acks": acks, "problems": problems})
        digest = acks_digest(acks)
        self.state, self.cache_reset = "pending", False
        self.pending = {"version": version, "acks_digest": digest}
        return {"version": version, "acks": acks, "acks_digest": digest, "seconds": round(time.monotonic() - started, 3)}

    def reset_prefix_cache(self, req: dict[str, Any]) -> dict[str, Any]:
        if self.state == "failed":
            raise Refused("unusable", f"reset refused: engine is {self.describe()}")
        if not self.llm.reset_prefix_cache():
            raise Refused("reset_failed", "vLLM could not reset the prefix cache (requests still running)")
        self.cache_reset = True
        return {}

    def ack(self, req: dict[str, Any]) -> dict[str, Any]:
        version, fault = req["version"], req.get("fault") or {}
        if self.state != "pending" or self.pending["version"] != version:
            raise Refused("not_pending", f"ack of version {version} refused: engine is {self.describe()}")
        if req.get("acks_digest") != self.pending["acks_digest"]:
            raise Refused("ack_mismatch", f"ack of version {version} refused: it names acknowledgments "
                          f"{req.get('acks_digest')}, the ranks returned {self.pending['acks_digest']}")
        if not self.cache_reset and not fault.get("allow_warm_cache"):
            raise Refused("warm_cache", f"ack of version {version} refused: the prefix cache still holds KV computed "
                          f"with version {self.version}; reset it first")
        self.state, self.version, self.pending = "ready", version, None
        return {"version": version}

    def state_of(self, req: dict[str, Any]) -> dict[str, Any]:
        return {"state": self.state, "version": self.version, "pending": self.pending, "failure": self.failure,
                "cache_reset_since_install": self.cache_reset}

    def declare_failed(self, req: dict[str, Any]) -> dict[str, Any]:
        self.fail(f"declared failed by the harness: {req['reason']}")
        return self.state_of(req)

    def restart(self, req: dict[str, Any]) -> dict[str, Any]:
        """Rebuild from a verified checkpoint (the only way out of failed)."""
        self.shutdown()
        self.state = "starting"
        return self.build(req["model_dir"], req["version"], req["expected"])

    def describe(self) -> str:
        if self.state == "failed":
            return f"unusable ({self.failure})"
        if self.state == "pending":
            return f"pending version {self.pending['version']} (not acked), serving nothing"
        return f"{self.state} at version {self.version}"


COMMANDS = {"generate": Engine.generate, "install": Engine.install, "reset_prefix_cache": Engine.reset_prefix_cache,
            "ack": Engine.ack, "state": Engine.state_of, "fail": Engine.declare_failed, "restart": Engine.restart}


def reply(out: IO[str], obj: dict[str, Any]) -> None:
    out.write(json.dumps(obj, allow_nan=False) + "\n")
    out.flush()


def serve(inp: IO[str], out: IO[str]) -> None:
    start = json.loads(inp.readline())
    engine = Engine(start)
    try:
        try:
            reply(out, {"ok": True, **engine.build(start["model_dir"], start["version"], start["expected"])})
        except Refused as exc:
            reply(out, {"ok": False, "kind": exc.kind, "error": str(exc), **exc.details})
        for line in inp:
            req = json.loads(line)
            if req["cmd"] == "shutdown":
                break
            try:
                if req.get("cmd") not in COMMANDS:
                    raise Refused("bad_request", f"unknown command {req.get('cmd')!r} (known: {sorted(COMMANDS)})")
                reply(out, {"ok": True, **COMMANDS[req["cmd"]](engine, req)})
            except Refused as exc:
                reply(out, {"ok": False, "kind": exc.kind, "error": str(exc), **exc.details})
    finally:
        engine.shutdown()
    reply(out, {"ok": True, "shutdown": True})


def main() -> None:
    # The protocol keeps the real stdout; everything else (vLLM's logs, its workers') goes to stderr.
    out = os.fdopen(os.dup(1), "w", encoding="ascii")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    serve(sys.stdin, out)


if __name__ == "__main__":
    main()
