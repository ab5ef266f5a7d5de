"""The rejection probes: each makes one thing go wrong on the real engine and must see it refused.

  stale version        install v0 again, or v2 while serving v0: refused before anything is
                       loaded; the engine still serves v0, cache and weights untouched
  wrong shard          one tensor loaded one ulp off on one rank: that rank's digest differs
  missing ack          one rank returns no acknowledgment
  duplicate ack        one rank acknowledges twice
  warm cache           v1 installed and verified but the prefix cache not reset: the engine
                       refuses the ack; forced past that rule, the first request after the update
                       reuses v0's KV, which the harness detects (cached tokens > 0, logprobs off
                       HF of v1 beyond the bound) and declares the engine failed
After every failing install the engine must refuse generate and install (unusable, not
half-updated and serving); each probe then rebuilds the engine from the verified v0 checkpoint.
A probe passes when its fault was rejected by the rule it targets, with the error recorded.
"""

from __future__ import annotations

from typing import Any

from qualify.matrix import ROUNDS_PROBES
from qualify.rounds import checks
from qualify.rounds.client import Refused
from qualify.rounds.session import InstallRejected, Session
from qualify.rounds.shards import moe_layers
from qualify.rounds.weights import Version
from qualify.store import write_json
from qualify.verdict import fact

PROBES = ROUNDS_PROBES


def corrupt_target(version: Version) -> tuple[str, str]:
    """A sharded tensor to corrupt, (its checkpoint name, the name of the vLLM tensor that holds it): the last
    layer's down_proj (row-parallel, every rank holds a block); in a MoE layer, expert 0's down_proj (held in the
    fused experts' w2)."""
    config = version.config
    last = config["num_hidden_layers"] - 1
    if last in moe_layers(config):
        return f"model.layers.{last}.mlp.experts.0.down_proj.weight", f"model.layers.{last}.mlp.experts.w2_weight"
    return (f"model.layers.{last}.mlp.down_proj.weight",) * 2


def record(s: Session, name: str, outcome: dict[str, Any]) -> dict[str, Any]:
    write_json(s.out / "probes" / f"{name}.json", outcome)
    s.probes[name] = {k: outcome[k] for k in ("observed", "required", "passed", "error")}
    s.add(fact(f"probe {name} rejected", None, outcome["observed"], outcome["required"], outcome["passed"],
               outcome.get("error", "")))
    return outcome


def stale_probes(s: Session, v0: Version) -> dict[str, Any]:
    """Install v0 again and v2 before v1: both refused, the engine still serves v0 with its cache."""
    out = {}
    for name, number in (("stale-reinstall-v0", 0), ("stale-skip-to-v2", 2)):
        req = {"cmd": "install", "version": number, "path": str(v0.weights_file), "expected": s.expected(v0)}
        reply = s.engine.request(req)
        state = s.engine.call({"cmd": "state"})
        ok = not reply["ok"] and reply.get("kind") == "stale_version" and state["state"] == "ready" \
            and state["version"] == 0
        out[name] = record(s, name, {"fault": f"install version {number} while serving v0", "reply": reply,
                                     "state_after": state, "observed": reply.get("kind"),
                                     "required": "stale_version, engine still ready at v0", "passed": ok,
                                     "error": reply.get("error", "")})
    after = s.generate(s.cache_prompts, s.cache_seeds)
    s.add(checks.warm_row("after stale probes: cache intact", 0, [r["num_cached_tokens"] for r in after["results"]],
                          s.settings.rollout.block_size, "v0 cache prompts replayed after the refused installs"))
    s.add(checks.agreement_row("after stale probes: still serves v0", 0, s.agreement(v0, after["results"]),
                               s.base.bound, 0))
    return out


def unusable_after(s: Session, next_version: Version) -> dict[str, Any]:
    """What a failed engine answers to generate and to a further install."""
    gen = s.refused_kind({"cmd": "generate", "prompts": s.cache_prompts, "seeds": s.cache_seeds,
                          "sampling": s.sampling})
    inst = s.refused_kind({"cmd": "install", "version": next_version.number, "path": str(next_version.weights_file),
                           "expected": s.expected(next_version)})
    return {"generate": gen, "install": inst, "state": s.engine.call({"cmd": "state"})}


def install_fault_probe(s: Session, name: str, v0: Version, v1: Version, fault: dict[str, Any],
                        must_mention: str) -> dict[str, Any]:
    """Restart at v0, install v1 with a rank fault: the engine must reject it and become unusable."""
    s.restart(v0)
    try:
        s.install(v1, fault=fault)
        kind, error, problems = None, "installed and acked", []
    except Refused as exc:
        kind, error, problems = exc.kind, str(exc), exc.details.get("problems", [])
    except InstallRejected as exc:
        kind, error, problems = "harness_rejected", str(exc), [str(exc)]
    after = unusable_after(s, v1)
    ok = kind == "install_failed" and any(must_mention in p for p in problems) and \
        after["generate"] == "unusable" and after["install"] == "unusable"
    return record(s, name, {"fault": fault, "observed": kind, "problems": problems, "after": after,
                            "required": f"install_failed naming '{must_mention}', then generate and install refused",
                            "passed": ok, "error": error})


def warm_cache_probe(s: Session, v0: Version, v1: Version) -> dict[str, Any]:
    """v1 installed without the cache reset: refused at ack; forced through, detected and failed."""
    s.restart(v0)
    s.generate(s.cache_prompts, s.cache_seeds)  # the cache now holds v0's KV of the cache prompts
    guard = None
    try:
        s.install(v1, reset=False)
    except Refused as exc:
        guard = {"kind": exc.kind, "error": str(exc)}
    if guard is not None:  # force the ack past the rule, to see that the observations catch it too
        pending = s.engine.call({"cmd": "state"})["pending"]
        s.engine.call({"cmd": "ack", "version": v1.number, "acks_digest": pending["acks_digest"],
                       "fault": {"allow_warm_cache": True}})
    first = s.generate(s.cache_prompts, s.cache_seeds)
    cached = [r["num_cached_tokens"] for r in first["results"]]
    cold = checks.cold_row("warm cache: first request after install cold", 1, cached, "no reset (fault)")
    agree = checks.agreement_row("warm cache: logprobs agree with HF v1", 1, s.agreement(v1, first["results"]),
                                 s.base.bound, 1)
    detected = not cold.passed and not agree.passed
    if detected:
        s.engine.call({"cmd": "fail", "reason": f"first request after v1 reused {cached} cached tokens of v0"})
    after = unusable_after(s, v1)
    ok = bool(guard) and guard["kind"] == "warm_cache" and detected and after["generate"] == "unusable"
    return record(s, "warm-cache", {"fault": "no prefix-cache reset after installing v1", "guard": guard,
                                    "first_cached_tokens": cached, "cold_check": cold.to_json(),
                                    "agreement_check": agree.to_json(), "after": after,
                                    "observed": {"guard": guard and guard["kind"], "cached_tokens": cached,
                                                 "logprob_max_abs": agree.value},
                                    "required": "ack refused (warm_cache); forced: cached > 0 and logprobs beyond "
                                                "the bound, engine failed", "passed": ok,
                                    "error": (guard or {}).get("error", "")})


def failure_probes(s: Session, versions: list[Version], selected: tuple[str, ...]) -> None:
    """The selected probes that fail an installation, each on an engine rebuilt at v0."""
    v0, v1 = versions[0], versions[1]
    last = s.tp - 1
    target, held = corrupt_target(v1)
    plan = {"wrong-shard": ({"corrupt_rank": last, "corrupt_tensor": target}, f"rank {last}: {held} holds"),
            "missing-ack": ({"silent_rank": last}, f"rank {last}: no acknowledgment"),
            "duplicate-ack": ({"duplicate_rank": 0}, "rank 0: 2 acknowledgments")}
    for name, (fault, mention) in plan.items():
        if name in selected:
            with s.log.step(f"probe: {name}"):
                install_fault_probe(s, name, v0, v1, fault, mention)
    if "warm-cache" in selected:
        with s.log.step("probe: warm cache"):
            warm_cache_probe(s, v0, v1)
