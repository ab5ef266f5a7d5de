"""The exact train-rollout tier (seed 002): does a case's step-0 forward give the rollout's own logprobs, bit for bit?

An engine built to reproduce the rollout engine's numerics (its norm, rotary, attention split and logprob kernel, with
the rollout captured in batch-invariant mode) can claim that its step-0 logprobs, at the rollout's weights and in the
rollout's precision, equal the logprobs vLLM sampled with on every response token. The claim is declared per engine
(candidates.rollout_exact) and sealed in each case's spec; a declared case in the rollout's precision fails on any
token that differs, naming how many of how many, the largest |delta| and the first token. Every other actor case
reports the same count against an infinite bound (the mismatch an engine that does not claim exactness has).

Compared: the case's outputs/logprobs_BT at step 0 (its declared formula: the processed formula is the rollout's under
truncating sampling) against the sealed rollout's sampler logprobs (the targets' old_logprobs_BT), on step 0's
response tokens, in float32 without rounding either side. Where the rollout carries vLLM's per-layer activations
(rollout.layer_outputs), a declared case's note also names the first layer whose vectors differ from vLLM's prefill
(qualify.judge.layer_probe); the layers judge nothing.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from qualify.case.meta import CaseMeta
from qualify.judge.layer_probe import layers_note
from qualify.verdict import Row

ROLLOUT = "rollout"
TENSOR = "step0/outputs/logprobs_BT"
DECLARED_RULE = "== 0 response tokens whose step-0 logprob is not bitwise the rollout's (declared rollout_exact)"
REPORTED_RULE = "reported, not judged (the engine does not declare rollout_exact)"


def other_precision_rule(dtype: str) -> str:
    return f"reported, not judged (rollout_exact is claimed in the rollout's precision, {dtype})"


def mismatch(own_BT: torch.Tensor, rollout_BT: torch.Tensor, mask_BT: torch.Tensor) -> dict[str, Any]:
    """Response tokens compared, how many differ bitwise (a non-finite score counts as differing), the largest
    finite |delta| and the first differing (row, position)."""
    own, old, mask = own_BT.float(), rollout_BT.float(), mask_BT.bool()
    differs = ((own != old) | ~torch.isfinite(own)) & mask
    delta = (own - old).abs()[differs & torch.isfinite(own)]
    first = differs.nonzero()[0].tolist() if bool(differs.any()) else None
    return {"num_tokens": int(mask.sum()), "num_not_bitwise": int(differs.sum()),
            "max_abs": float(delta.max()) if delta.numel() else 0.0, "first": first}


def engine_self_note(record: dict[str, Any] | None) -> str:
    """What the rollout engine's prefill of its own sequences says of an exact claim (the rollout's
    prefill_vs_decode, qualify.rollout.capture): '' when the rollout predates the check."""
    if not record:
        return ""
    if "skipped" in record:
        return f"; the rollout engine's prefill against its decode: not measured ({record['skipped']})"
    n, differ = record["num_tokens"], record["num_not_bitwise"]
    if differ == 0:
        return (f"; the rollout engine's prefill reproduces its decode (0 of {n} tokens differ): a teacher-forced "
                "forward can be exact")
    first = ", ".join(f"row {t['row']} position {t['position']}" for t in record["tokens"][:3])
    return (f"; the rollout engine's own prefill differs from its decode on {differ} of {n} tokens (max |delta| "
            f"{record['max_abs']:.3g}; {first}): no teacher-forced forward can be exact there, only a replay of its "
            "decode steps")


def exact_rows(case: str, role: str, outputs: dict[str, torch.Tensor], meta: CaseMeta | dict[str, Any],
               rollout_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor,
               engine_self: dict[str, Any] | None = None) -> list[Row]:
    """One row for an actor case (none for a critic): its step-0 logprobs against the rollout's. engine_self: the
    rollout's prefill_vs_decode record, cited in the note."""
    if role != "actor":
        return []
    meta = CaseMeta.of(meta)
    spec = meta.spec
    dtype = spec.get("rollout_dtype")
    declared = spec.get("rollout_exact") is True
    judged = declared and spec.get("precision") == dtype
    rule = DECLARED_RULE if judged else (other_precision_rule(str(dtype)) if declared else REPORTED_RULE)
    own = outputs.get("logprobs_BT")
    if own is None or tuple(own.shape) != tuple(rollout_logprobs_BT.shape):
        found = "none" if own is None else f"shape {list(own.shape)}"
        return [Row(case, role, ROLLOUT, TENSOR, "num_not_bitwise", math.inf if judged else 0.0,
                    0.0 if judged else math.inf, not judged,
                    f"no step-0 logprobs to compare with the rollout's {list(rollout_logprobs_BT.shape)} ({found})",
                    step=0, rule=rule)]
    m = mismatch(own, rollout_logprobs_BT, mask_BT)
    formula = spec.get("logprob_formula", "full")
    where = "" if m["first"] is None else f"; first at row {m['first'][0]} position {m['first'][1]}"
    note = (f"{'exact' if m['num_not_bitwise'] == 0 else 'not exact'}: {m['num_not_bitwise']} of {m['num_tokens']} "
            f"response tokens differ from the rollout's logprobs, max |delta| {m['max_abs']:.3g}{where} "
            f"({formula} formula, {spec.get('precision')} case{'' if dtype is None else f', {dtype} rollout'})"
            f"{engine_self_note(engine_self)}{layers_note(meta.rollout_layers, declared)}")
    return [Row(case, role, ROLLOUT, TENSOR, "num_not_bitwise", float(m["num_not_bitwise"]),
                0.0 if judged else math.inf, m["num_not_bitwise"] == 0 or not judged, note, step=0, rule=rule)]
