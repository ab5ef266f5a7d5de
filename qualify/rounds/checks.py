"""The checks of a rounds run as small functions, each leaving one verdict row (qualify.verdict.fact).

A row passes only when its rule holds; a row explains itself (check as its tensor, round as its step,
the observed value, what was required as its rule, detail as its note). Logprob agreement compares vLLM's sampled-token logprobs with an HF
teacher-forced fp32 forward of the version the engine claims to serve, on response tokens only.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from qualify.case.meta import CaseMeta
from qualify.verdict import Row, fact


def logprob_agreement(vllm_BT: torch.Tensor, hf_BT: torch.Tensor, mask_BT: torch.Tensor) -> dict[str, Any]:
    """|vLLM - HF| over response tokens: max, mean, count, and how many are not bitwise equal."""
    delta_N = (vllm_BT - hf_BT)[mask_BT].abs()
    finite = bool(torch.isfinite(delta_N).all())
    return {"num_tokens": int(mask_BT.sum()), "num_not_bitwise": int((delta_N != 0).sum()),
            "max_abs": float(delta_N.max()) if delta_N.numel() and finite else (0.0 if finite else math.inf),
            "mean_abs": float(delta_N.mean()) if delta_N.numel() and finite else (0.0 if finite else math.inf)}


def agreement_row(check: str, rnd: int, stats: dict[str, Any], bound: float, version: int) -> Row:
    ok = stats["num_tokens"] > 0 and math.isfinite(stats["max_abs"]) and stats["max_abs"] <= bound
    return fact(check, rnd, stats["max_abs"], f"<= {bound:.3g}", ok,
                f"vLLM vs HF fp32 forward of v{version}: {stats['num_tokens']} tokens, "
                f"{stats['num_not_bitwise']} not bitwise equal, mean |delta| {stats['mean_abs']:.3g}", bound=bound)


def sensitivity_row(rnd: int, stats: dict[str, Any], bound: float, served: int, other: int) -> Row:
    """The agreement check must be able to fail: vLLM at v(served) against HF of v(other) exceeds the bound."""
    ok = stats["max_abs"] > bound
    return fact("agreement discriminates versions", rnd, stats["max_abs"], f"> {bound:.3g}", ok,
                f"vLLM serving v{served} vs HF of v{other}: an engine still serving v{other} would fail the bound")


def cold_row(check: str, rnd: int, cached: list[int], detail: str) -> Row:
    return fact(check, rnd, cached, "every request 0 cached tokens", all(c == 0 for c in cached), detail)


def warm_row(check: str, rnd: int, cached: list[int], block_size: int, detail: str) -> Row:
    return fact(check, rnd, cached, f"every request >= {block_size} cached tokens",
                bool(cached) and all(c >= block_size for c in cached), detail)


def same_tokens_row(check: str, rnd: int, first: list[dict[str, Any]], again: list[dict[str, Any]]) -> Row:
    same = [a["tokens"] == b["tokens"] for a, b in zip(first, again)]
    return fact(check, rnd, sum(same), f"== {len(first)} identical responses",
                len(first) == len(again) and all(same), "same prompts and seeds replayed at the same version")


def equal_row(check: str, rnd: int | None, observed: Any, expected: Any, detail: str = "") -> Row:
    return fact(check, rnd, observed, f"== {expected}", observed == expected, detail)


ROUTES_REPLAYED = "trainer replays the round's routes"
NOT_OBSERVED = "not observed"


def routes_replayed(meta: CaseMeta | None) -> tuple[int | str, str] | None:
    """A round's training step against the routes of the rollout it trained on (a MoE actor under rollout.routing
    replay), from the case's sealed meta.json: ((token, MoE layer) pairs routed otherwise, summed over its steps; a
    description). An engine without a routes() hook (or that gave none) cannot show that it replays this round's
    routes, and nothing else in a rounds run would see it: 'not observed', which fails the row. None when the step
    replayed nothing (a dense actor, rollout.routing recompute); meta: None where it could not be read."""
    found = meta.routing_replay if meta is not None else None
    if not isinstance(found, list) or not found:
        return None
    if not all(isinstance(s, dict) for s in found):
        return NOT_OBSERVED, ("the trainer exposes no routes() hook (or it gave none): whether it replays this round's "
                              "routes is not verified")
    try:
        differ = sum(int(s["differ"]) for s in found)
        pairs = sum(int(s["pairs"]) for s in found)
    except (KeyError, TypeError, ValueError):
        return NOT_OBSERVED, "the step's replay record is not a count"
    first = next((f"; first at step {k}: {s.get('first')}" for k, s in enumerate(found) if s.get("differ")), "")
    return differ, (f"{differ} of {pairs} (token, MoE layer) pairs over {len(found)} step(s) not routed as the "
                    f"round's rollout routed them{first}")


ROLLOUT_EXACT = "trainer's step-0 logprobs are the round's rollout's"
EXACT_REPORTED = "reported, not judged (the trainer does not declare rollout_exact in the rollout's precision)"


def rollout_exact(train_dir: Path, targets_dir: Path) -> tuple[int, str, str]:
    """Seed 002's exact tier after a weight sync: the round's training step's step-0 logprobs against the logprobs
    vLLM sampled the round's rollout with (its targets' old_logprobs_BT), bit for bit on every response token, from
    the sealed step, targets and rollout: (tokens that differ, the rule: '== 0' where the trainer's spec declares
    rollout_exact in the rollout's precision, else reported, a description)."""
    from qualify.case.meta import read_case_meta
    from qualify.compare import load_run
    from qualify.judge.rollout_exact import mismatch
    from qualify.rollout.capture import load_rollout
    from qualify.store import read_tensors

    spec = read_case_meta(train_dir).spec
    judged = spec.get("rollout_exact") is True and spec.get("precision") == spec.get("rollout_dtype")
    own = load_run(Path(train_dir), 0).outputs["logprobs_BT"]
    old = read_tensors(Path(targets_dir) / "targets.safetensors")["old_logprobs_BT"]
    m = mismatch(own, old, load_rollout(Path(spec["rollout_dir"]))["response_mask_BT"])
    where = "" if m["first"] is None else f"; first at row {m['first'][0]} position {m['first'][1]}"
    note = (f"{m['num_not_bitwise']} of {m['num_tokens']} response tokens differ from the logprobs vLLM sampled "
            f"this round's rollout with, max |delta| {m['max_abs']:.3g}{where} ({spec.get('precision')} step, "
            f"{spec.get('logprob_formula', 'full')} formula)")
    return m["num_not_bitwise"], ("== 0" if judged else EXACT_REPORTED), note


def rollout_exact_row(rnd: int, observed: tuple[int, str, str]) -> Row:
    count, rule, note = observed
    return fact(ROLLOUT_EXACT, rnd, count, rule, count == 0 or rule == EXACT_REPORTED, note)
