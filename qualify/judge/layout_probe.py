"""Micro-batch-layout invariance: does a case's forward give the same per-token scores whatever rows it is batched with?

Before its first step, every case scores its step-0 rows again in other layouts, with no gradient: one row at a time,
four rows at a time, and all rows in reverse order; each layout's per-token scores (the actor's logprobs, the critic's
values) are compared bitwise with the step's own single batch, on response tokens. An engine whose forward depends on
the layout (GEMM blocking that follows the row count, a batch-dependent reduction) differs somewhere; one that scores
each row on its own cannot. The result is recorded for every case (meta.json 'layout') and judged only for the engines
the matrix declares invariant (candidates.layout_invariant): there a token that differs fails the case, naming the
layout; elsewhere the row reports, and does not judge (its bound is infinite).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from qualify.case.context import Batch
from qualify.case.meta import CaseMeta
from qualify.verdict import Row

LAYOUT = "layout"
DECLARED_RULE = "== 0 tokens not bitwise the single batch's, in every layout (declared layout-invariant)"
REPORTED_RULE = "reported, not judged (the engine does not declare layout invariance)"


def layouts(num_rows: int) -> dict[str, list[list[int]]]:
    """Layout name -> the row groups scored one batch each (every row exactly once)."""
    rows = list(range(num_rows))
    out = {"micro-batch 1": [[r] for r in rows]}
    if num_rows > 4:
        out["micro-batch 4"] = [rows[i:i + 4] for i in range(0, num_rows, 4)]
    out["reversed order"] = [rows[::-1]]
    return out


@torch.no_grad()
def probe_layouts(engine: Any, batch: Batch) -> dict[str, dict[str, Any]]:
    """Per layout: response tokens compared, how many are not bitwise the single batch's, and the largest |delta|."""
    whole = engine.score(batch).detach().float().cpu()
    mask = batch.response_mask_BT.cpu()
    out = {}
    for name, groups in layouts(batch.input_ids_BT.shape[0]).items():
        combined = torch.empty_like(whole)
        for rows in groups:
            index = torch.tensor(rows)
            part = engine.score(batch.rows(index))
            combined[index] = part.detach().float().cpu()
        differs = (combined != whole) & mask
        delta = (combined - whole).abs()[mask]
        out[name] = {"num_tokens": int(mask.sum()), "num_not_bitwise": int(differs.sum()),
                     "max_abs": float(delta.max()) if delta.numel() else 0.0}
    return out


def merge_ranks(by_rank: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Every rank's probe of its own rows, summed per layout (the largest |delta| over ranks)."""
    out: dict[str, dict[str, Any]] = {}
    for probe in by_rank:
        for name, p in probe.items():
            slot = out.setdefault(name, {"num_tokens": 0, "num_not_bitwise": 0, "max_abs": 0.0})
            slot["num_tokens"] += p["num_tokens"]
            slot["num_not_bitwise"] += p["num_not_bitwise"]
            slot["max_abs"] = max(slot["max_abs"], p["max_abs"])
    return out


def layout_rows(case: str, role: str, meta: CaseMeta | dict[str, Any]) -> list[Row]:
    """One row per case: the tokens that differ over every layout; failing only where the engine declared invariance
    (its sealed spec says so: candidates.layout_invariant when the case ran)."""
    meta = CaseMeta.of(meta)
    probe = meta.layout
    tensor = "step0/outputs/" + ("logprobs_BT" if role == "actor" else "values_BT")
    judged = meta.spec.get("layout_invariant") is True
    if not isinstance(probe, dict) or not probe:
        return [Row(case, role, LAYOUT, tensor, "num_not_bitwise", math.inf if judged else 0.0,
                    0.0 if judged else math.inf, not judged, "no layout probe in the case's evidence",
                    step=0, rule=DECLARED_RULE if judged else REPORTED_RULE)]
    differing = sum(p["num_not_bitwise"] for p in probe.values())
    detail = "; ".join(f"{name}: {p['num_not_bitwise']} of {p['num_tokens']} tokens differ, max |delta| "
                       f"{p['max_abs']:.3g}" for name, p in probe.items())
    verdict = ("layout-invariant" if differing == 0 else "not layout-invariant") + f" ({detail})"
    return [Row(case, role, LAYOUT, tensor, "num_not_bitwise", float(differing), 0.0 if judged else math.inf,
                differing == 0 or not judged, verdict, step=0, rule=DECLARED_RULE if judged else REPORTED_RULE)]
