"""Every frozen bound re-derived from the rule it names: what the acceptance check runs on each bound file."""

from __future__ import annotations

import math
from typing import Any

from qualify.bounds.rule import BOUNDS_SCHEMA, tensor_floor

REL_TOL = 1e-12  # the bound is recomputed in float64 from the same numbers


def check_bounds(doc: dict[str, Any], rule: dict[str, Any], name: str) -> list[str]:
    """Every entry obeys bound = k * control_error + floor + quantum with the acceptance's k and floors."""
    problems = []
    if doc.get("schema") != BOUNDS_SCHEMA:
        problems.append(f"{name}: schema {doc.get('schema')!r}")
    if (doc.get("k"), doc.get("floors"), doc.get("floor_ulps", 0.0)) != (
            rule.get("k"), rule.get("floors"), rule.get("floor_ulps", 0.0)):
        problems.append(f"{name}: k, floors or floor_ulps differ from the acceptance's rule")
    if not isinstance(rule.get("k"), int | float) or not isinstance(rule.get("floors"), dict):
        return [*problems, f"{name}: the acceptance has no rule (k and floors) to check its bounds against"]
    for key, metrics in doc.get("bounds", {}).items():
        for metric, b in metrics.items():
            if b.get("kind") not in rule["floors"]:
                problems.append(f"{name}: {key} {metric}: kind {b.get('kind')!r} has no floor in the rule")
                continue
            floor = rule["floors"][b["kind"]]
            if "magnitude" in b:  # a per-tensor floor: floor_ulps fp32 steps of the tensor's magnitude, at least the kind's
                floor = tensor_floor(b["kind"], metric, b["magnitude"], rule["floors"], rule.get("floor_ulps", 0.0))
            if b["floor"] != floor:
                problems.append(f"{name}: {key} {metric}: floor {b['floor']} is not the rule's {b['kind']} floor {floor}")
            if b["quantum"] < 0 or (b["quantum"] > 0 and not rule.get("quantum", False)):
                problems.append(f"{name}: {key} {metric}: quantum {b['quantum']} not allowed by the rule")
            expect = rule["k"] * b["control_error"] + b["floor"] + b["quantum"]
            if not (math.isfinite(b["bound"]) and math.isclose(b["bound"], expect, rel_tol=REL_TOL, abs_tol=0)):
                problems.append(f"{name}: {key} {metric}: bound {b['bound']} != k*error+floor+quantum = {expect}")
    return problems
