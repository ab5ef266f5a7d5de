"""Checks of a frozen acceptance that need no evidence: schema, bound-file digests, the rule itself.

Used by CI on every committed acceptance (manifests/*/acceptance.json) and by `qualify verify`'s
callers who want more than file integrity.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

from qualify.errors import ManifestError
from qualify.freeze import ACCEPTANCE_SCHEMA, BOUNDS_SCHEMA, FAMILIES
from qualify.manifest import load_manifest
from qualify.store import read_json

REL_TOL = 1e-12  # the bound is recomputed in float64 from the same numbers


def check_acceptance(path: Path) -> list[str]:
    """Problems with an acceptance and its bound files (empty when it is sound)."""
    path = Path(path)
    doc = load_manifest(path)  # schema of files, path safety, own digest
    problems = []
    if doc.get("schema_version") != ACCEPTANCE_SCHEMA:
        problems.append(f"schema_version {doc.get('schema_version')!r} != {ACCEPTANCE_SCHEMA!r}")
    rule = doc.get("rule", {})
    expected = {f"{role}-{family}.json" for role in ("actor", "critic") for family in FAMILIES}
    if set(doc.get("bounds", {})) != expected:
        problems.append(f"bound files {sorted(doc.get('bounds', {}))} != {sorted(expected)}")
    for name, digest in sorted(doc.get("bounds", {}).items()):
        file = path.parent / "bounds" / name
        if not file.is_file():
            problems.append(f"missing bound file {file}")
            continue
        if "sha256:" + hashlib.sha256(file.read_bytes()).hexdigest() != digest:
            problems.append(f"bound file {file} does not match the acceptance's digest")
            continue
        problems += check_bounds(read_json(file), rule, name)
    return problems


def check_bounds(doc: dict[str, Any], rule: dict[str, Any], name: str) -> list[str]:
    """Every entry obeys bound = k * control_error + floor + quantum with the acceptance's k and floors."""
    problems = []
    if doc.get("schema") != BOUNDS_SCHEMA:
        problems.append(f"{name}: schema {doc.get('schema')!r}")
    if doc.get("k") != rule.get("k") or doc.get("floors") != rule.get("floors"):
        problems.append(f"{name}: k or floors differ from the acceptance's rule")
    for key, metrics in doc.get("bounds", {}).items():
        for metric, b in metrics.items():
            if b["floor"] != rule["floors"][b["kind"]]:
                problems.append(f"{name}: {key} {metric}: floor {b['floor']} is not the {b['kind']} floor")
            if b["quantum"] < 0 or (b["quantum"] > 0 and not rule.get("quantum", False)):
                problems.append(f"{name}: {key} {metric}: quantum {b['quantum']} not allowed by the rule")
            expect = rule["k"] * b["control_error"] + b["floor"] + b["quantum"]
            if not (math.isfinite(b["bound"]) and math.isclose(b["bound"], expect, rel_tol=REL_TOL, abs_tol=0)):
                problems.append(f"{name}: {key} {metric}: bound {b['bound']} != k*error+floor+quantum = {expect}")
    return problems


FROZEN_SECTIONS = ("models", "rollout", "ppo", "optimizer", "reference", "freeze")
"""Matrix sections a reference and its acceptance are made from; `candidates` may change afterwards."""


def frozen_field_differences(snapshot: dict[str, Any], matrix: dict[str, Any]) -> list[str]:
    """Dotted fields of the frozen sections whose value differs: 'optimizer.lr: 0.001 (frozen) != 0.002'."""
    out: list[str] = []

    def walk(a: Any, b: Any, where: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                walk(a.get(key), b.get(key), f"{where}.{key}")
        elif a != b:
            out.append(f"{where}: {a!r} (frozen) != {b!r}")

    for section in FROZEN_SECTIONS:
        walk(snapshot.get(section), matrix.get(section), section)
    return out


def require_sound(path: Path) -> None:
    problems = check_acceptance(path)
    if problems:
        raise ManifestError(f"{path}: " + "; ".join(problems[:5]) + (" ..." if len(problems) > 5 else ""))
