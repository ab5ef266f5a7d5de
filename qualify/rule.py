"""The numbers of the bound rule that freeze applies and the acceptance check re-derives: rounding steps and floors."""

from __future__ import annotations

import math

MANTISSA_BITS = {"bf16": 7, "fp32": 23}


def ulp(precision: str, magnitude: float) -> float:
    """The spacing of the precision's values at magnitude (0 for 0 or a non-finite magnitude)."""
    if magnitude <= 0 or not math.isfinite(magnitude):
        return 0.0
    return 2.0 ** (math.floor(math.log2(magnitude)) - MANTISSA_BITS[precision])


def quantum(precision: str, metric: str, magnitude: float) -> float:
    """One rounding step of the compute precision: a value rounded to it can land one step away without error.

    Absolute metrics: the ulp at the reference tensor's largest magnitude; rel_l2: the precision's relative
    spacing. Controls rarely sample this for quantized scalars (a bf16 bias gradient can sit in the
    same rounding bucket in every control), so the rule adds it explicitly.
    """
    if metric == "rel_l2":
        return 2.0 ** -MANTISSA_BITS[precision]
    return ulp(precision, magnitude)


def tensor_floor(kind: str, metric: str, magnitude: float, floors: dict[str, float], floor_ulps: float) -> float:
    """The floor of one bound: the matrix's absolute floor of the kind, or floor_ulps fp32 ulps of the tensor's own
    magnitude (of 1 for a relative metric), whichever is larger."""
    scaled = floor_ulps * (2.0 ** -MANTISSA_BITS["fp32"] if metric == "rel_l2" else ulp("fp32", magnitude))
    return max(floors[kind], scaled)
