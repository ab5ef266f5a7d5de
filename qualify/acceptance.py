"""The frozen acceptance: loading and verifying it, its bounds, and the checks that need no evidence.

`Acceptance.load` is the one way a stage reads an acceptance: the manifest (schema, own digest) is
verified against the reference evidence, every bound file against the digest the acceptance names,
and the frozen rollout and targets are the ones it froze. `check_acceptance` checks what needs no
evidence (schema, bound-file digests, every bound obeying the rule): CI runs it on every committed
acceptance.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qualify.bounds.check import check_bounds
from qualify.bounds.files import BOUNDS_DIR, LAYER_BOUNDS_DIR, named_file_problem, read_bound_files
from qualify.bounds.rule import FAMILIES
from qualify.errors import EvidenceError, ManifestError, QualifyError
from qualify.hashing import file_digest
from qualify.manifest import VerifyReport, load_manifest, verify_manifest
from qualify.roles import ACTOR_ONLY, ROLES
from qualify.store import read_json

ACCEPTANCE_SCHEMA = "qualify.acceptance/4"


@dataclass(frozen=True, slots=True)
class Acceptance:
    """A verified acceptance: its document and, per (role, family), the bounds and the reference run they judge."""

    path: Path
    document: dict[str, Any]
    families: dict[tuple[str, str], dict[str, Any]]
    """(role, family) -> the bound file's document (reference_run, bounds keyed 'step<k>/<group>/<name>')."""

    @classmethod
    def load(cls, path: Path, evidence: Path | None = None, *, partial: bool = False) -> Acceptance:
        """Verify path against its evidence (the reference it names, or evidence) and read its bound files."""
        path = Path(path)
        if not path.is_file():
            raise EvidenceError(f"no acceptance at {path} (run 'qualify freeze' first)")
        doc = load_manifest(path)
        older = str(doc.get("schema_version", ""))
        if older.startswith("qualify.acceptance/") and older != ACCEPTANCE_SCHEMA:
            raise ManifestError(f"{path}: frozen under an earlier rule ({older}; this qualify reads "
                                f"{ACCEPTANCE_SCHEMA}): move it aside and freeze the reference again ('qualify freeze' on its run directory, "
                                "or 'qualify reference --rollout' then 'qualify freeze' for a committed one)")
        if doc.get("schema_version") != ACCEPTANCE_SCHEMA or not isinstance(doc.get("bounds"), dict):
            raise ManifestError(f"{path}: not an acceptance manifest (no '{ACCEPTANCE_SCHEMA}' schema or no "
                                "'bounds'; 'qualify freeze' writes one, 'qualify manifest create' does not)")
        report = verify_manifest(path, evidence, progress=False, partial=partial)
        if not report.ok:
            raise EvidenceError(f"reference evidence does not match {path}: {len(report.missing)} missing, "
                                f"{len(report.extra)} extra, {len(report.modified)} modified (run 'qualify verify')")
        chain = chain_problems(path, doc, Path(report.evidence))
        if chain:
            raise EvidenceError(f"{path} does not follow from what it was frozen from: {chain[0]}"
                                + (f" (and {len(chain) - 1} more; run 'qualify verify')" if len(chain) > 1 else ""))
        return cls(path, doc, read_bound_files(path.parent, doc["bounds"]))

    @property
    def digest(self) -> str:
        return self.document["digest"]

    @property
    def rollout_digest(self) -> str:
        return self.document["rollout_digest"]

    @property
    def targets_digest(self) -> str:
        return self.document["targets_digest"]

    def bounds(self, role: str, family: str) -> dict[str, dict[str, dict[str, Any]]]:
        """Every bound of a family: key ('step<k>/grads/x') -> metric -> entry (control_error, floor, bound ...)."""
        return self.families[(role, family)]["bounds"]

    def bound(self, role: str, family: str, key: str, metric: str) -> float:
        """The frozen bound of one (role, family, tensor key, metric)."""
        return float(self.bounds(role, family)[key][metric]["bound"])

    def reference_run(self, role: str, family: str) -> str:
        """The reference run ('fp32-r0') the family's bounds judge against."""
        return self.families[(role, family)]["reference_run"]

    def require_rollout(self, rollout_dir: Path) -> None:
        """The rollout at rollout_dir must be complete and the one this acceptance froze."""
        from qualify.stages import check_sealed

        sealed = check_sealed(rollout_dir)
        if sealed is None or sealed.info.get("digest") != self.rollout_digest:
            raise EvidenceError(f"rollout at {rollout_dir} is not the one the acceptance froze ({self.rollout_digest})")


def check_acceptance(path: Path) -> list[str]:
    """Problems with an acceptance and its bound files (empty when it is sound)."""
    path = Path(path)
    doc = load_manifest(path)  # schema of files, path safety, own digest
    problems = []
    if doc.get("schema_version") != ACCEPTANCE_SCHEMA:
        problems.append(f"schema_version {doc.get('schema_version')!r} != {ACCEPTANCE_SCHEMA!r}")
    rule = doc.get("rule", {})
    roles = ACTOR_ONLY if doc.get("algorithm") == "grpo" else ROLES  # GRPO has no critic
    expected = {f"{role}-{family}.json" for role in roles for family in FAMILIES}
    if set(doc.get("bounds", {})) != expected:
        problems.append(f"bound files {sorted(doc.get('bounds', {}))} != {sorted(expected)}")
    for name, digest in sorted(doc.get("bounds", {}).items()):
        file = path.parent / BOUNDS_DIR / name
        problem = named_file_problem(file, digest, "bound file")
        if problem is not None:
            problems.append(problem)
            continue
        problems += check_bounds(read_json(file), rule, name)
    for name, digest in sorted(doc.get("layer_bounds", {}).items()):  # qualify diagnose's, where frozen
        problem = named_file_problem(path.parent / LAYER_BOUNDS_DIR / name, digest, "layer bound file")
        if problem is not None:
            problems.append(problem)
    return problems


FROZEN_SECTIONS = ("models", "rollout", "algorithm", "ppo", "grpo", "optimizer", "reference", "freeze")
"""Matrix sections a reference and its acceptance are made from; `candidates` may change afterwards."""


def read_snapshot(path: Path) -> dict[str, Any]:
    """A sealed matrix snapshot read through the matrix schema: a field added to the schema after it was sealed
    holds its default (what the sealed matrix meant by leaving it out), not None."""
    from qualify.matrix import Matrix
    from qualify.schema import from_dict, to_dict

    return to_dict(from_dict(Matrix, read_json(path), str(path)))


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


R0_SCORES = re.compile(r"^scores/[^/]+-r0/")


def committed_part(path: str) -> bool:
    """Whether an acceptance's file belongs to the part a partial copy of its evidence must hold (what a committed
    acceptance carries because it cannot be made again elsewhere): the matrix snapshot, the reference summary, the
    rollout, the targets and the r0 scores."""
    return (path == "reference.json" or path.startswith(("matrix/", "rollout/", "targets/"))
            or R0_SCORES.match(path) is not None)


ACCEPTANCE_EVIDENCE = "../reference"
"""Where an acceptance's evidence lies, relative to it (RUN/acceptance/acceptance.json -> RUN/reference): fixed by
the run layout, so the manifest's own evidence hint cannot send verify to another, untouched copy."""


def is_acceptance(document: dict[str, Any]) -> bool:
    return str(document.get("schema_version", "")).startswith("qualify.acceptance/")


def chain_problems(path: Path, document: dict[str, Any], root: Path) -> list[str]:
    """The links between an acceptance and what it was frozen from, beyond each file's digest: the matrix snapshot it
    covers is sealed under the digest the acceptance names, and the rule the acceptance states (k, floors,
    floor_ulps, quantum) is the snapshot's freeze section. With check_acceptance (bound files by digest, every bound
    re-derived from the rule), no single file changes without the acceptance's own digest changing."""
    from qualify.stages import stage_info

    snapshot = Path(root) / "matrix"
    if "matrix/matrix.json" not in {e.get("path") for e in document.get("files", [])}:
        return [f"{path}: covers no matrix snapshot (matrix/matrix.json): its rule cannot be traced to a matrix"]
    if not (snapshot / "matrix.json").is_file():
        return [f"the matrix snapshot {snapshot / 'matrix.json'} is not here: the acceptance's rule cannot be checked"]
    if not (snapshot / "_complete.json").is_file():
        return [f"the matrix snapshot {snapshot} is not sealed here: the acceptance's rule cannot be checked"]
    problems = []
    if file_digest(snapshot / "matrix.json") != stage_info(snapshot).get("digest"):
        problems.append(f"the matrix snapshot {snapshot / 'matrix.json'} is not the file sealed as "
                        f"{stage_info(snapshot).get('digest')!r}: it was changed and sealed again")
    if stage_info(snapshot).get("digest") != document.get("matrix_digest"):
        problems.append(f"the matrix snapshot at {snapshot} is sealed as {stage_info(snapshot).get('digest')!r}, "
                        f"the acceptance names {document.get('matrix_digest')!r}")
    try:
        frozen = read_snapshot(snapshot / "matrix.json")["freeze"]
    except QualifyError as exc:
        return [*problems, f"the matrix snapshot cannot be read: {exc}"]
    rule = document.get("rule", {}) if isinstance(document.get("rule"), dict) else {}
    for key in ("k", "floors", "floor_ulps", "quantum"):
        if rule.get(key) != frozen.get(key):
            problems.append(f"the acceptance's rule says {key} = {rule.get(key)!r}, the matrix snapshot it covers "
                            f"says {frozen.get(key)!r}")
    return problems


def verify_evidence(manifest: Path, evidence: Path | None = None, *, jobs: int | None = None, progress: bool = True,
                    partial: bool = False, expect: str | None = None) -> VerifyReport:
    """What `qualify verify` checks: every file against the manifest (qualify.manifest.verify_manifest); for an
    acceptance also its bound files, its rule against the matrix snapshot it covers (chain_problems), and under
    partial that the committed part is present (a partial copy is a subset by design, never an empty one); with
    expect, that the manifest's own digest is that one (an anchor kept outside the run: a writer who recomputes
    every sha256 changes it)."""
    from dataclasses import replace

    manifest = Path(manifest)
    document = load_manifest(manifest)
    acceptance = is_acceptance(document)
    if partial and not acceptance:
        raise ManifestError(f"{manifest}: --partial is for an acceptance, whose committed part (matrix snapshot, "
                            "reference summary, rollout, targets, r0 scores) a partial copy must hold; a plain "
                            "manifest names no such part")
    if acceptance and evidence is None and document.get("evidence") != ACCEPTANCE_EVIDENCE:
        raise ManifestError(f"{manifest}: an acceptance's evidence is the reference/ of its own run (evidence "
                            f"{ACCEPTANCE_EVIDENCE!r}), but it names {document.get('evidence')!r}; to verify another "
                            "copy, name it with --evidence")
    report = verify_manifest(manifest, evidence, jobs=jobs, progress=progress, partial=partial)
    problems = []
    if expect is not None and document.get("digest") != expect:
        problems.append(f"{manifest}: digest {document.get('digest')} is not the expected {expect}")
    if acceptance:
        lacking = [p for p in report.missing if committed_part(p)]
        if partial and lacking:
            problems.append(f"the committed part of the acceptance is not all here: {len(lacking)} of its files are "
                            f"missing ({', '.join(lacking[:3])}{' ...' if len(lacking) > 3 else ''})")
        problems += [f"acceptance: {p}" for p in check_acceptance(manifest)]
        problems += chain_problems(manifest, document, Path(report.evidence))
    return replace(report, problems=problems)

