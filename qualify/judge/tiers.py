"""Invariance tiers of a TP > 1 or DP > 1 case against the same case at TP1 or DP1, per judged tensor: bitwise (the
same bits), within bound (differs, inside the frozen bound), failing. An engine that declares determinism: bitwise
(candidates.determinism) is held to the first tier: every tensor of every step must be bitwise its TP1/DP1 case's.

Matmul partial sums split over TP ranks round differently, so full-model gradients are rarely bitwise across TP;
the tiers say so per tensor instead of claiming or denying it for the case.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from qualify.compare import GROUPS, split_step
from qualify.verdict import Row

TIERS = ("bitwise", "within_bound", "failing")
BITWISE_RULE = "bitwise equal to the {axis} case's (the engine declares determinism: bitwise)"


def _tensor(run: Any, key: str) -> torch.Tensor | None:
    group, _, name = key.partition("/")
    return getattr(run, group).get(name) if group in GROUPS else None


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Same shape, dtype and bits (NaN payloads and signed zeros included)."""
    if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.numel():
        return True
    b = b.to(a.device)  # either may be held on the metrics GPU (qualify.resident): bits are bits anywhere
    return bool((a.reshape(-1).contiguous().view(torch.uint8) == b.reshape(-1).contiguous().view(torch.uint8)).all())


def tensor_tiers(rows: list[Row], cand: list[Any], base: list[Any]) -> dict[str, str]:
    """{tensor key: tier} of one comparison's judged tensors (rows: that comparison's rows)."""
    failing = {r.tensor for r in rows if not r.passed}
    out = {}
    for key in sorted({r.tensor for r in rows}):
        step, rest = split_step(key)
        if key in failing:
            out[key] = "failing"
        else:
            out[key] = "bitwise" if same_bits(_tensor(cand[step], rest), _tensor(base[step], rest)) else "within_bound"
    return out


def tier_summary(tiers: dict[str, str]) -> dict[str, Any]:
    """Counts per tier and the tensors that are not bitwise (the verdict's per-case invariance record)."""
    return {"counts": {t: sum(v == t for v in tiers.values()) for t in TIERS},
            "not_bitwise": {k: v for k, v in tiers.items() if v != "bitwise"}}


def bitwise_rows(case: str, role: str, axis: str, cand: list[Any], base: list[Any]) -> list[Row]:
    """A declared-bitwise engine's rows: every tensor of every step and group against the TP1/DP1 case, bound 0."""
    rows = []
    for k, (c, b) in enumerate(zip(cand, base, strict=False)):
        for group in GROUPS:
            for name in sorted(set(getattr(c, group)) | set(getattr(b, group))):
                x, y = getattr(c, group).get(name), getattr(b, group).get(name)
                equal = same_bits(x, y)
                value = 0.0 if equal else math.inf if x is None or y is None or x.shape != y.shape else \
                    float((x.double() - y.to(x.device).double()).abs().max().nan_to_num(math.inf))
                rows.append(Row(case, role, f"vs {axis} [bitwise]", f"step{k}/{group}/{name}", "max_abs", value, 0.0,
                                equal, note="" if equal else "not bitwise (signed zeros or NaN bits if max_abs is 0)",
                                step=k, rule=BITWISE_RULE.format(axis=axis), family="bitwise"))
    return rows
