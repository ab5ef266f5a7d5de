"""`qualify freeze`: turn a reference into per-tensor bounds and an acceptance manifest (the stage; the rule and
the control errors live in qualify.bounds).

Rule: bound = k * control_error + floor + quantum (qualify.bounds.rule.FORMULA; the quantum is one rounding step of
the precision the contract computes a tensor in), per (role, tensor, metric), k, floors and floor_ulps taken from the
matrix snapshot recorded by the reference stage (so the rule is fixed before any candidate
runs). Six families: actor and critic x fp32-repeat (fp32 controls vs fp32 r0), bf16-repeat
(bf16 controls vs bf16 r0), fp32-vs-bf16 (bf16 runs vs fp32 r0); a control that decided a clip otherwise than that
r0 is compared with r0 replayed on its decisions (qualify.reference.forced), as a case is. The acceptance manifest
lists every reference artifact with its sha256 and names the bound files by digest. An
acceptance is written once: freezing again is refused unless the result is byte-identical,
so a frozen bound can never be widened.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from qualify.acceptance import ACCEPTANCE_SCHEMA
from qualify.bounds.control_error import ReplayOf, family_bounds, silent_controls
from qualify.bounds.layers import layer_bound_files
from qualify.bounds.records import means_of, terms_of
from qualify.bounds.rule import BOUNDS_SCHEMA, FAMILIES, RULE
from qualify.errors import EvidenceError, FrozenError
from qualify.hashing import digest_of_bytes, file_digest
from qualify.layout import RunLayout
from qualify.manifest import build_manifest
from qualify.matrix import Freeze
from qualify.models.checkpoint import initial_parameters
from qualify.ppo.coverage import inert
from qualify.reference.context import ScoringContext
from qualify.reference.inputs import StepInputs
from qualify.roles import MODEL_ROLES, ROLES
from qualify.schema import from_dict
from qualify.stages import fingerprint, require_all_complete, require_complete, stage_info
from qualify.store import atomic_write_bytes, dumps_json, read_json, read_json_object


def acceptance_document(layout: RunLayout, name: str, bound_files: dict[str, bytes], summary: dict[str, Any],
                        matrix_name: str, rule: Freeze, algorithm: str,
                        layer_files: dict[str, bytes] | None = None) -> dict[str, Any]:
    """The manifest of the reference evidence plus the rule (the matrix's freeze section), digests and provenance (and
    the layer bounds' digests)."""
    extra = {
        "schema_version": ACCEPTANCE_SCHEMA,
        "name": name,
        "matrix": matrix_name,
        "rule": {"text": RULE, "k": rule.k, "floors": dict(rule.floors),
                 "floor_ulps": rule.floor_ulps,
                 "quantum": rule.quantum, "families": list(FAMILIES)},
        "matrix_digest": summary["matrix_digest"],
        "rollout_digest": summary["rollout_digest"],
        "targets_digest": summary["targets_digest"],
        "bounds": {f: digest_of_bytes(data) for f, data in sorted(bound_files.items())},
        "versions": summary["versions"],
        "host": summary["host"],
        "platform": summary.get("platform"),
        "coverage": {"required": list(rule.require), "steps": summary["coverage"]},
        "rollout_platform": summary.get("rollout_platform"),
        "git": summary["git"],
        "evidence": "../reference",
    }
    if algorithm == "grpo":  # the actor's bound files alone (qualify.acceptance.check_acceptance)
        extra["algorithm"] = "grpo"
    if layer_files:  # qualify diagnose's per-layer bounds (qualify.bounds.layers); absent when none were frozen
        extra["layer_bounds"] = {f: digest_of_bytes(d) for f, d in sorted(layer_files.items())}
    return build_manifest(layout.reference, progress=False, extra=extra)


def run_dir_of(path: Path) -> Path:
    """The run directory, whether given itself or as its reference/ directory."""
    path = Path(path)
    return path.parent if (path / "reference.json").is_file() else path


def verified_reference(layout: RunLayout) -> tuple[dict[str, Any], Any]:
    """The reference summary and the matrix snapshot, after checking every sealed stage of the reference.

    Models, every captured rollout, the targets and every score must be complete and match the
    digests recorded when each was sealed; the summary's digests must be the stages' own; the rule
    comes from the sealed matrix snapshot, never from reference.json, which nothing seals.
    """
    from qualify.matrix import Matrix
    from qualify.reference.step import controls_of

    if not layout.reference_summary.is_file():
        raise FrozenError(f"no complete reference in {layout.reference} (run 'qualify reference' first)")
    summary = read_json_object(layout.reference_summary, "reference summary",
                               ("controls", "matrix_digest", "rollout_digest", "targets_digest"))
    require_complete(layout.matrix_snapshot, "matrix snapshot (made by 'qualify reference'; rerun it)")
    if stage_info(layout.matrix_snapshot).get("digest") != summary.get("matrix_digest"):
        raise EvidenceError(f"{layout.reference_summary} names matrix snapshot {summary.get('matrix_digest')}, "
                            f"not the sealed {stage_info(layout.matrix_snapshot).get('digest')}")
    sealed_as = stage_info(layout.matrix_snapshot).get("digest")
    if file_digest(layout.matrix_snapshot / "matrix.json") != sealed_as:  # re-sealed with its old digest kept
        raise EvidenceError(f"the matrix snapshot {layout.matrix_snapshot / 'matrix.json'} is not the file sealed as "
                            f"{sealed_as}: it was changed and sealed again")
    matrix = from_dict(Matrix, read_json(layout.matrix_snapshot / "matrix.json"), str(layout.matrix_snapshot))
    declared = [c.name for c in controls_of(matrix.reference, matrix.candidates.tp,
                                               matrix.candidates.pack_tokens)]
    if summary["controls"] != declared:  # the list is the sealed snapshot's; reference.json is only checked against it
        raise EvidenceError(f"{layout.reference_summary} lists controls {summary['controls']}, but the sealed matrix "
                            f"snapshot declares {declared}: the summary was changed, or made from another matrix")

    stages = [(layout.model(role), f"{role} model") for role in MODEL_ROLES] if matrix.models.tiny is not None else []
    stages += [(layout.rollout(tp), f"rollout TP{tp}") for tp in matrix.rollout.vllm_tp]
    stages.append((layout.targets, "targets"))
    stages += [(layout.scores(precision, control, role), f"reference {precision} {control} {role}")
               for precision in matrix.reference.precisions for control in summary["controls"]
               for role in matrix.roles]
    require_all_complete(stages)  # every sealed stage of the reference, hashed in one parallel pass
    primary = stage_info(layout.rollout(matrix.rollout.vllm_tp[0]))["digest"]
    for what, recorded, sealed in (("rollout", summary.get("rollout_digest"), primary),
                                   ("targets", summary.get("targets_digest"), stage_info(layout.targets)["digest"])):
        if recorded != sealed:
            raise EvidenceError(f"{layout.reference_summary} names {what} {recorded}, the sealed one is {sealed}")
    return summary, matrix


def replays_of(ctx: ScoringContext, role: str, inputs: StepInputs) -> ReplayOf:
    """replay_of(base, control) for family_bounds: where the reference sealed base replayed on the control's clip
    decisions, None where the control decided as base (decided here from the recorded outputs, not from the
    unsealed summary)."""
    from qualify.reference.forced import control_replay

    def replay_of(base: str, control: str) -> Path | None:
        found = control_replay(ctx, role, base, control, inputs)
        return None if found is None else found[0]
    return replay_of


class FreezeWork:
    """The bound files an interrupted freeze finished, under acceptance.work/, keyed by everything they are made from
    (freeze_key): a freeze run again on the same evidence with the same code takes them instead of computing them
    again; any other key discards them."""

    KEY_FILE = "key.json"

    def __init__(self, layout: RunLayout, key: str, log: Any) -> None:
        self.root, self.key = layout.freeze_work, key
        kept = read_json(self.root / self.KEY_FILE).get("key") if (self.root / self.KEY_FILE).is_file() else None
        if kept != key and self.root.exists():
            log.note(f"discarding {self.root}: an interrupted freeze of other evidence or other code")
            shutil.rmtree(self.root)
        self.root.mkdir(parents=True, exist_ok=True)
        if kept != key:
            atomic_write_bytes(self.root / self.KEY_FILE, dumps_json({"key": key}).encode("ascii"))

    def get(self, name: str) -> bytes | None:
        path = self.root / name
        return path.read_bytes() if path.is_file() else None

    def put(self, name: str, data: bytes) -> None:
        atomic_write_bytes(self.root / name, data)

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def freeze_key(layout: RunLayout, summary: dict[str, Any]) -> str:
    """What a bound file is made from: the bound schema, the sealed matrix, rollout and targets, every scored run's and
    replay's seal (which names the digest of each of its files), qualify's own code and torch's version."""
    import torch

    from qualify.stages import MARKER

    seals = {str(p.relative_to(layout.reference)): file_digest(p) for p in sorted(layout.reference.rglob(MARKER))}
    package = Path(__file__).resolve().parent
    code = {str(p.relative_to(package)): file_digest(p) for p in sorted(package.rglob("*.py"))}
    return fingerprint({"schema": BOUNDS_SCHEMA, "matrix": summary["matrix_digest"],
                        "rollout": summary["rollout_digest"], "targets": summary["targets_digest"], "seals": seals,
                        "code": code, "torch": torch.__version__})


def freeze(run_dir: Path, name: str | None = None, log: Any = None) -> dict[str, Any]:
    """Freeze the reference of run_dir; returns the acceptance document (refuses to change a frozen one). Each bound
    file is kept as it is made (FreezeWork): an interrupted freeze resumes where it stopped."""
    from qualify.stagelog import StageLog

    layout = RunLayout(run_dir_of(run_dir))
    log = log or StageLog("freeze")
    with log.step("verify the reference's seals"):
        summary, matrix = verified_reference(layout)
    controls, rule, ctx = summary["controls"], matrix.freeze, ScoringContext.of(matrix, layout)
    objective = ctx.objective
    coverage = reference_coverage(layout, controls[0], objective.roles)
    missing = inert(rule.require, coverage)
    if missing:
        raise FrozenError(f"the reference left {len(missing)} required branch(es) inert (freeze.require): "
                          + "; ".join(missing))
    files: dict[str, bytes] = {}
    inputs = ctx.inputs()
    work = FreezeWork(layout, freeze_key(layout, summary), log)
    for role in objective.roles:
        before = None
        for family in FAMILIES:
            file = f"{role}-{family}.json"
            kept = work.get(file)
            if kept is not None:
                log.skip(f"bounds {role} {family} (made by an interrupted freeze of this evidence)")
                files[file] = kept
                continue
            with log.step(f"bounds {role} {family}"):
                before = before if before is not None else initial_parameters(ctx.models[role])
                doc = family_bounds(layout, role, family, controls, rule.k, dict(rule.floors), before,
                                    objective.optimizer, rule.quantum, rule.floor_ulps,
                                    terms_of(objective, role, inputs), replays_of(ctx, role, inputs),
                                    means_of(objective, role, inputs))
                files[file] = dumps_json(doc).encode("ascii")
                work.put(file, files[file])
    for data in files.values():  # a family whose controls measured nothing says so (its bounds stay as frozen)
        warning = silent_controls(json.loads(data))
        if warning is not None:
            log.note(f"warning: {warning}")
    with log.step("layer bounds"):
        # {} for a reference scored without layer activations
        layers = layer_bound_files(layout, rule, ctx.reference.precisions, objective.roles, controls)
    document = acceptance_document(layout, name or matrix.name, files, summary | {"coverage": coverage}, matrix.name,
                                   rule, objective.algorithm, layers)
    _write_once(layout, files, document, layers)
    work.clear()
    return document


def reference_coverage(layout: RunLayout, control: str,
                       roles: tuple[str, ...] = ROLES) -> dict[str, list[dict[str, Any]]]:
    """Per role, the branches each step of the fp32 reference run took (recorded by the reference)."""
    from qualify.compare import read_role_meta

    return {role: read_role_meta(layout.scores("fp32", control, role)).coverage for role in roles}


def _write_once(layout: RunLayout, files: dict[str, bytes], document: dict[str, Any],
                layer_files: dict[str, bytes] | None = None) -> None:
    """Write bounds and acceptance unless they exist; identical content is fine, anything else is refused."""
    targets = {layout.bounds / f: data for f, data in files.items()}
    targets.update({layout.layer_bounds / f: data for f, data in (layer_files or {}).items()})
    targets[layout.acceptance] = dumps_json(document).encode("ascii")
    changed = [p for p, data in targets.items() if p.exists() and p.read_bytes() != data]
    if changed:
        raise FrozenError(f"an acceptance already exists for this reference and differs: {', '.join(map(str, changed))}"
                          " (a frozen acceptance is never rewritten or widened)")
    for path, data in targets.items():  # bounds first, the acceptance that names them last
        if not path.exists():
            atomic_write_bytes(path, data)
