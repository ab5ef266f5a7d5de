"""One rounds run's working state: the engine, the prompts, the versions, and the steps every round repeats.

The steps are: start (or restart) the engine at a verified version, generate and record what the
engine served, compare vLLM's logprobs with an HF forward of a version, and install a version on
every rank (the harness re-verifies every acknowledgment itself, resets the prefix cache, then
acks exactly the acknowledgments it verified).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from qualify.errors import QualifyError, RoundsError
from qualify.layout import rounds_case
from qualify.matrix import Capture, CaseSettings, Rollout
from qualify.models.precision import DTYPE_NAMES, torch_dtype
from qualify.rollout.capture import make_prompts, rollout_tensors
from qualify.rounds.acks import ack_problems
from qualify.rounds.base import Base
from qualify.rounds.checks import logprob_agreement
from qualify.rounds.client import Refused, RolloutEngine
from qualify.rounds.digests import version_digest
from qualify.rounds.shards import expected_shard_digests
from qualify.rounds.weights import Version
from qualify.stagelog import StageLog
from qualify.store import write_tensors
from qualify.verdict import Row

NUM_CACHE_PROMPTS = 2
CACHE_SEED_OFFSET = 7919  # cache-probe prompts and seeds are drawn apart from the rollout's


class InstallRejected(RoundsError):
    """The harness's own verification of the acknowledgments failed."""


def cache_prompts(r: Rollout, vocab_size: int, eos: int | None) -> list[list[int]]:
    """Prompts of 2 full KV blocks + 1 token (1 block if max_model_len is tight): long enough to hit the cache."""
    blocks = min(2, (r.max_model_len - r.max_new_tokens - 1) // r.block_size)
    if blocks < 1:
        raise QualifyError(f"max_model_len {r.max_model_len} leaves no room for a {r.block_size}-token cache block "
                           f"plus {r.max_new_tokens} new tokens: the prefix-cache checks need one")
    gen = torch.Generator().manual_seed(r.seed + CACHE_SEED_OFFSET)
    high = vocab_size - 1 if eos == vocab_size - 1 else vocab_size
    return torch.randint(1, high, (NUM_CACHE_PROMPTS, blocks * r.block_size + 1), generator=gen).tolist()


class Session:
    """Engine, prompts and rows of one rounds run."""

    def __init__(self, settings: CaseSettings, capture: Capture, base: Base, out: Path, tp: int,
                 log: StageLog) -> None:
        from qualify.store import read_json

        self.settings, self.base, self.out, self.tp, self.log = settings, base, out, tp, log
        self.config = read_json(base.models["actor"] / "config.json")
        self.vocab = self.config["vocab_size"]
        r = settings.rollout
        eos = r.eos_token_id if r.eos_token_id is not None else self.config.get("eos_token_id")
        self.sampling = {"temperature": r.temperature, "top_k": r.top_k, "top_p": r.top_p, "min_p": r.min_p,
                         "max_tokens": r.max_new_tokens, "eos_token_id": eos}
        self.prompts = make_prompts(capture, self.vocab, eos)
        self.seeds = [r.seed + i for i in range(len(self.prompts))]
        self.cache_prompts = cache_prompts(r, self.vocab, eos)
        self.cache_seeds = [r.seed + CACHE_SEED_OFFSET + i for i in range(NUM_CACHE_PROMPTS)]
        self.rows: list[Row] = []
        self.probes: dict[str, dict[str, Any]] = {}
        self.made: dict[str, str] = {}  # digests of inputs this run made itself (no reference): checked at the end
        self.engine: RolloutEngine | None = None
        self.expected_cache: dict[int, list[dict[str, str]]] = {}
        self.hf_model: tuple[int | None, Any] = (None, None)  # the last version's HF model, reused
        # a MoE actor's rollouts record their routes, as the reference's capture does: a round trains on them
        self.routed = self.config.get("model_type") == "qwen3_moe"

    # engine ---------------------------------------------------------------------------------
    def expected(self, version: Version) -> list[dict[str, str]]:
        """What every rank must hold for version (computed here from the HF tensors)."""
        if version.number not in self.expected_cache:
            self.expected_cache[version.number] = expected_shard_digests(
                version.tensors, version.config, self.tp, torch_dtype(self.settings.rollout.dtype))
        return self.expected_cache[version.number]

    def start(self, version: Version) -> dict[str, Any]:
        """Start the engine at version; every rank's report of what it holds must match."""
        r = self.settings.rollout
        start = {"model_dir": str(version.path), "version": version.number, "expected": self.expected(version),
                 "tp": self.tp, "dtype": DTYPE_NAMES[r.dtype], "seed": r.seed,
                 "max_model_len": r.max_model_len, "kv_cache_memory_bytes": r.kv_cache_memory_bytes,
                 "block_size": r.block_size, "max_num_seqs": len(self.prompts) + NUM_CACHE_PROMPTS,
                 "batch_invariant": r.batch_invariant}
        self.engine = RolloutEngine(start, self.out / "engine.log")
        return self.summarize_acks(self.engine.started, version)

    def rollout_meta(self, version: int) -> dict[str, Any]:
        """What a round's sealed rollout.json says of how it was sampled, as the reference's capture records it: the
        version, vLLM's TP degree, the sampling settings with the dtype, the KV block size, vLLM's model runner and, in
        batch-invariant mode, the mode's settings as the engine held them (an engine computing with vLLM's kernels follows these)."""
        r = self.settings.rollout
        started = {} if self.engine is None else self.engine.started
        invariant = {"batch_invariant": started.get("batch_invariant") or {"VLLM_BATCH_INVARIANT": "1"}} \
            if r.batch_invariant else {}
        return {"version": version, "vllm_tp": self.tp, "sampling": self.sampling | {"dtype": DTYPE_NAMES[r.dtype]},
                "block_size": r.block_size, "model_runner": started.get("model_runner"), **invariant}

    def restart(self, version: Version) -> dict[str, Any]:
        """Rebuild the engine from version's checkpoint (the way out of a failed engine)."""
        reply = self.engine.call({"cmd": "restart", "model_dir": str(version.path), "version": version.number,
                                  "expected": self.expected(version)})
        return self.summarize_acks(reply, version)

    def summarize_acks(self, reply: dict[str, Any], version: Version) -> dict[str, Any]:
        """Per rank: the version it acknowledges and the digest of everything it holds vs expected."""
        expected = self.expected(version)
        problems = ack_problems(reply["acks"], version.number, expected)
        if problems:
            raise InstallRejected(f"version {version.number}: " + "; ".join(problems[:5]))
        return {"version": version.number, "version_digest": version.digest,
                "acks": [{"rank": a["rank"], "version": a["version"], "num_tensors": len(a["tensors"]),
                          "holds": version_digest(a["tensors"]), "expected": version_digest(expected[a["rank"]]),
                          "seconds": a.get("load_seconds", a.get("seconds"))} for a in reply["acks"]],
                "rank_tensors": reply["acks"], **{k: reply[k] for k in ("load_s", "report_s", "seconds")
                                                  if k in reply}}

    def install(self, version: Version, *, fault: dict[str, Any] | None = None, reset: bool = True,
                ack_fault: dict[str, Any] | None = None) -> dict[str, Any]:
        """Install version on every rank: engine-verified, then harness-verified, cache reset, acked."""
        reply = self.engine.call({"cmd": "install", "version": version.number, "path": str(version.weights_file),
                                  "expected": self.expected(version), "fault": fault})
        try:
            record = self.summarize_acks(reply, version)
        except InstallRejected as exc:
            self.engine.call({"cmd": "fail", "reason": f"harness rejected the acknowledgments: {exc}"})
            raise
        if reset:
            self.engine.call({"cmd": "reset_prefix_cache"})
        self.engine.call({"cmd": "ack", "version": version.number, "acks_digest": reply["acks_digest"],
                          "fault": ack_fault})
        return record | {"cache_reset": reset}

    def generate(self, prompts: list[list[int]], seeds: list[int], rollout: bool = False) -> dict[str, Any]:
        """Sample prompts at the served version; rollout (a request whose rows a round trains on, on a cold cache):
        with a MoE actor, each result also holds its routes (qualify.rollout.routes)."""
        routes = {"routes": True} if rollout and self.routed else {}
        return self.engine.call({"cmd": "generate", "prompts": prompts, "seeds": seeds, "sampling": self.sampling,
                                 **routes})

    def refused_kind(self, req: dict[str, Any]) -> str | None:
        """The kind of refusal of req (None: it was accepted)."""
        try:
            self.engine.call(req)
        except Refused as exc:
            return exc.kind
        return None

    # numerics -------------------------------------------------------------------------------
    def agreement(self, version: Version, results: list[dict[str, Any]], save: Path | None = None) -> dict[str, Any]:
        """vLLM's sampled-token logprobs vs an HF fp32 forward of version, on the same tokens (saved to save).

        The HF side is the processed formula of the rollout's sampling settings (vLLM's logprobs are
        renormalized over what top-k / top-p / min-p keep); with truncation off it is the full formula.
        """
        from qualify.models.hf import load_model
        from qualify.ppo.logprob import processed_logprobs

        tensors = rollout_tensors(results)
        if self.hf_model[0] != version.number:
            self.hf_model = (version.number, load_model(version.path, "actor"))
        model, r, ids_BT = self.hf_model[1], self.settings.rollout, tensors["input_ids_BT"]
        with torch.no_grad():
            logits_BTV = model(input_ids=ids_BT, use_cache=False).logits
            processed_BT1 = processed_logprobs(logits_BTV[:, :-1], ids_BT[:, 1:], temperature=r.temperature,
                                               top_k=r.top_k, top_p=r.top_p, min_p=r.min_p,
                                               chunk_tokens=self.settings.reference.logprob_chunk_tokens,
                                               vocab_size=self.vocab).processed
            hf_BT = torch.nn.functional.pad(processed_BT1, (1, 0))
        if save is not None:
            write_tensors(save, {"input_ids_BT": tensors["input_ids_BT"], "response_mask_BT": tensors["response_mask_BT"],
                                 "vllm_logprobs_BT": tensors["sampler_logprobs_BT"], "hf_logprobs_BT": hf_BT})
        return logprob_agreement(tensors["sampler_logprobs_BT"], hf_BT, tensors["response_mask_BT"])

    def add(self, row: Row) -> Row:
        """Record a row under this run's case name (rounds-vllm-tp<N>)."""
        row = replace(row, case=rounds_case(self.tp))
        self.rows.append(row)
        return row

    def close(self) -> list[str]:
        return self.engine.close() if self.engine is not None else []
