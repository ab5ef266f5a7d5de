"""Reading what freeze wrote: the bound files an acceptance names by digest, and diagnose's layer bounds.

The acceptance's loader, the report (text, JUnit, HTML), diagnose and the judge get their bounds here, each file
checked against the digest the acceptance gives it. qualify.acceptance.check_acceptance (`qualify verify` and
`qualify report` run it) checks each named file through named_file_problem, listing every problem instead of stopping
at the first as read_bound_files does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qualify.errors import EvidenceError
from qualify.hashing import digest_of_bytes, file_digest
from qualify.store import read_json

BOUNDS_DIR = "bounds"
"""acceptance/bounds/<role>-<family>.json"""
LAYER_BOUNDS_SCHEMA = "qualify.layer-bounds/1"
LAYER_BOUNDS_DIR = "layers"
"""acceptance/layers/<role>.json"""


def read_bound_files(acceptance_dir: Path, named: dict[str, str], *,
                     missing_ok: bool = False) -> dict[tuple[str, str], dict[str, Any]]:
    """{(role, family): bound file document} of every file named (name -> digest) under acceptance_dir/bounds/, each
    checked against its digest: an EvidenceError names the first that is missing or differs (missing_ok: such files
    are left out instead, for a report that shows what verifies)."""
    out = {}
    for name, digest in sorted(named.items()):
        file = Path(acceptance_dir) / BOUNDS_DIR / name
        if not file.is_file() or file_digest(file) != digest:
            if missing_ok:
                continue
            raise EvidenceError(f"bound file {file} is missing or does not match the acceptance's digest")
        doc = read_json(file)
        out[(doc["role"], doc["family"])] = doc
    return out


def named_file_problem(file: Path, digest: str, what: str) -> str | None:
    """Why a file an acceptance names by digest is not the file it names ('missing <what> FILE', '<what> FILE does
    not match the acceptance's digest'); None when it is."""
    if not file.is_file():
        return f"missing {what} {file}"
    if digest_of_bytes(file.read_bytes()) != digest:
        return f"{what} {file} does not match the acceptance's digest"
    return None


def layer_bounds_named(acceptance_path: Path, document: dict[str, Any]) -> dict[str, str]:
    """The acceptance's layer bound files and their digests; an acceptance frozen without them is refused clearly."""
    named = document.get("layer_bounds")
    if not named:
        raise EvidenceError(f"the acceptance {acceptance_path} has no layer bounds (it was frozen from a reference "
                            "scored without per-layer activations, or under reference.layer_activations: false): run "
                            "'qualify reference' with layer_activations true into a new run directory and 'qualify "
                            "freeze' it to diagnose layer by layer")
    return named


def read_layer_bounds(acceptance_path: Path, document: dict[str, Any], role: str) -> dict[str, Any]:
    """The role's layer bounds named by the acceptance, checked against its digest and schema."""
    named = layer_bounds_named(acceptance_path, document)
    file = Path(acceptance_path).parent / LAYER_BOUNDS_DIR / f"{role}.json"
    if f"{role}.json" not in named or not file.is_file() or file_digest(file) != named[f"{role}.json"]:
        raise EvidenceError(f"layer bound file {file} is missing or does not match the acceptance's digest")
    doc = read_json(file)
    if doc.get("schema") != LAYER_BOUNDS_SCHEMA:
        raise EvidenceError(f"{file}: schema {doc.get('schema')!r}, expected {LAYER_BOUNDS_SCHEMA!r}")
    return doc


def dominant_term(doc: dict[str, Any], entry: dict[str, Any]) -> str:
    """Which term of bound = k x control_error + floor + quantum is the largest in one entry of a bound file."""
    terms = {"k x control": doc["k"] * entry["control_error"], f"floor ({entry['kind']})": entry["floor"],
             "quantum": entry["quantum"]}
    return max(terms, key=terms.get)


def bound_rule(b: dict[str, Any]) -> str:
    """How a frozen bound was made, from its bound-file entry: '<= 0.00415 = k x control 0.000977 + floor 1e-06 +
    quantum 0.000244'."""
    terms = [f"k x control {b['control_error']:.3g}" if "control_error" in b else "",
             f"floor {b['floor']:.3g}" if "floor" in b else "",
             f"quantum {b['quantum']:.3g}" if b.get("quantum") else ""]
    made = " + ".join(t for t in terms if t)
    return f"<= {b['bound']:.3g}" + (f" = {made}" if made else "")
