"""Judge a fresh reference, scored from a committed rollout, against the committed acceptance.

A frozen rollout is platform-specific evidence: it is captured once and carried, never assumed to
re-sample identically elsewhere. What can be re-run anywhere is the HF reference on that rollout
(`qualify reference --rollout`). This module says whether that fresh reference agrees with the
acceptance: bitwise where the platform fingerprint and the numerics versions match (every
artifact the acceptance lists reproduced byte for byte, metadata aside), and within the
frozen bounds where they do not (the fresh fp32-r0 and bf16-r0 runs judged as candidates against
the committed ones, with the committed bounds of their repeat family). A matching fingerprint is a
hint, never a promise (it cannot see every choice a math library makes on a CPU): when bytes differ
under it, the fresh reference is judged as another platform's is, within the committed bounds, and the
result says so (mode BYTES_DIFFER, the files in info['bytes_differ']). A file the acceptance lists that
the fresh reference lacks is a failure in every mode.

Across platforms the clip decisions are judged as a candidate's are (qualify.judge.decided): another CPU's
rounding may put a token within a rounding step of a clip edge on the other side, and from that step on the two
runs follow different branches. A token may be decided otherwise only where the committed run is within the frozen
bound of the deciding quantity of the edge (else a failing row names it); the steps from the first such token on
are then judged with the two sides on the same decisions: this platform's reference replayed on the committed
run's decisions (qualify.reference.forced, the replay the candidate stage uses, sealed under RUN/replay/) against
the committed run. The steps before it are the fresh run's own sealed evidence.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from qualify.acceptance import Acceptance
from qualify.compare import is_lean, load_steps, params_before_steps
from qualify.errors import EvidenceError
from qualify.hardware import platform_differences
from qualify.hashing import sha256_file
from qualify.judge.decided import SHOWN, decision_rows, first_divergence, run_decisions
from qualify.judge.steps import judge_steps
from qualify.layout import RunLayout
from qualify.manifest import default_evidence, load_manifest, verify_manifest
from qualify.matrix import PPO
from qualify.metrics import max_abs
from qualify.models.checkpoint import initial_parameters
from qualify.ppo.decisions import differing
from qualify.reference.context import ScoringContext
from qualify.reference.forced import ensure_replay, sealed_replay
from qualify.reference.inputs import StepInputs
from qualify.roles import MODEL_ROLES, ROLES
from qualify.rollout.capture import load_rollout
from qualify.runname import RunName
from qualify.schema import from_dict
from qualify.stages import require_complete
from qualify.store import read_json, read_tensors
from qualify.verdict import Row

# Versions that change the numbers a reference computes (bitwise is expected only when they match).
NUMERICS_PACKAGES = ("torch", "transformers", "safetensors")
# The modes of a replay: bytes equal; another platform judged within the bounds; the same fingerprint, yet bytes
# differed, so judged within the bounds as another platform's.
BITWISE, BOUNDS, BYTES_DIFFER = "bitwise", "bounds", "bounds (fingerprint matched, bytes differ)"


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """The outcome of judging a fresh reference against a committed acceptance."""

    mode: str
    """BITWISE (same platform and versions, every byte reproduced), BOUNDS (another platform: judged like a
    candidate) or BYTES_DIFFER (the same fingerprint and versions, yet bytes differed: judged as BOUNDS is)."""
    differences: list[str]
    """Why bitwise was not expected: differing platform fields and versions."""
    rows: list[Row]
    """Every judged value; a failing one names the tensor."""
    info: dict[str, Any] = field(default_factory=dict)
    """Unjudged figures (target drift, files reproduced; under BYTES_DIFFER, 'bytes_differ': the files that did not
    reproduce)."""

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.passed for r in self.rows)

    @property
    def bytes_differ(self) -> list[str]:
        """The tensor files whose bytes differed under a matching fingerprint (empty unless mode is BYTES_DIFFER)."""
        return list(self.info.get("bytes_differ", []))


def version_differences(a: dict[str, str], b: dict[str, str]) -> list[str]:
    return [f"{p}: {a.get(p)!r} != {b.get(p)!r}" for p in NUMERICS_PACKAGES if a.get(p) != b.get(p)]


def expectation(acceptance: dict[str, Any], fresh_summary: dict[str, Any]) -> list[str]:
    """Differences that excuse a fresh reference from reproducing the acceptance bitwise (empty: bitwise)."""
    return (platform_differences(acceptance.get("platform"), fresh_summary.get("platform"))
            + version_differences(acceptance.get("versions", {}), fresh_summary.get("versions", {})))


def judge_replay(acceptance_path: Path, fresh_run: Path, *, force_mode: str | None = None) -> ReplayResult:
    """Judge the reference in fresh_run (scored from the acceptance's own rollout) against the acceptance.

    Bitwise when expectation() finds no difference and every tensor file reproduces; when some only differ in
    their bytes, judged within the bounds as another platform's is (mode BYTES_DIFFER); when some are missing, the
    bitwise rows (failing on them) are the result. force_mode ('bitwise': bytes alone, no fallback, or 'bounds')
    overrides what the platform comparison decides; it exists so every branch can be exercised on one machine.
    """
    assert force_mode in (None, BITWISE, BOUNDS), force_mode
    acceptance_path = Path(acceptance_path)
    doc = load_manifest(acceptance_path)
    layout = RunLayout(Path(fresh_run))
    summary = read_json(layout.reference_summary)
    if summary.get("rollout_digest") != doc["rollout_digest"]:
        raise EvidenceError(f"the fresh reference in {fresh_run} was scored on rollout {summary.get('rollout_digest')}, "
                            f"not on the acceptance's {doc['rollout_digest']}: run 'qualify reference --rollout' "
                            "with the committed rollout")
    differences = expectation(doc, summary)
    mode = force_mode or (BOUNDS if differences else BITWISE)
    if mode == BOUNDS:
        return ReplayResult(mode, differences, *bound_rows(acceptance_path, doc, layout, summary))
    rows, info = bitwise_rows(acceptance_path, layout)
    moved = [r.tensor for r in rows if r.note == "bytes differ"]
    if force_mode or not moved or any(r.note == "missing" for r in rows):
        return ReplayResult(mode, differences, rows, info)
    # the fingerprint matched, the bytes did not: what decided those kernels is not in the fingerprint
    rows, judged = bound_rows(acceptance_path, doc, layout, summary)
    return ReplayResult(BYTES_DIFFER, differences, rows, judged | {"bytes_differ": moved, "bitwise": info})


def bitwise_rows(acceptance_path: Path, layout: RunLayout) -> tuple[list[Row], dict[str, Any]]:
    """One row per tensor file the acceptance lists: equal bytes or a failure; metadata (JSON) is not judged."""
    report = verify_manifest(acceptance_path, layout.reference, progress=False)
    doc = load_manifest(acceptance_path)
    modified = {m.path for m in report.modified}
    rows = []
    for entry in doc["files"]:
        path = entry["path"]
        if not path.endswith(".safetensors"):
            continue
        bad = path in modified or path in report.missing
        note = "missing" if path in report.missing else ("bytes differ" if bad else "")
        rows.append(Row("replay", role_of(path), "bitwise vs acceptance", path, "bytes_differ", float(bad), 0.0,
                        not bad, note))
    info = {"files": report.num_files, "tensor_files": len(rows), "not_reproduced": sorted(modified | set(report.missing)),
            "extra": report.extra}
    return rows, info


def role_of(path: str) -> str:
    for role in MODEL_ROLES:
        if f"/{role}/" in f"/{path}":
            return role
    return "-"


def committed_run(acceptance_path: Path, doc: dict[str, Any], relative: str) -> Path:
    """A committed reference run directory, each of its files checked against the acceptance's digest."""
    root = default_evidence(acceptance_path, doc)
    entries = {e["path"]: e["sha256"] for e in doc["files"] if e["path"].startswith(relative + "/")}
    if not entries:
        raise EvidenceError(f"the acceptance {acceptance_path} lists no files under {relative}/")
    for path, digest in sorted(entries.items()):
        file = root / path
        if not file.is_file():
            raise EvidenceError(f"{file} is not here: the acceptance's reference evidence under {relative}/ is needed "
                                "to judge a replay on another platform")
        if sha256_file(file)[1] != digest:
            raise EvidenceError(f"{file} does not match the acceptance's digest")
    return root / relative


def bound_rows(acceptance_path: Path, doc: dict[str, Any], layout: RunLayout,
               summary: dict[str, Any]) -> tuple[list[Row], dict[str, Any]]:
    """Fresh fp32-r0 and bf16-r0 judged against the committed ones with the committed repeat-family bounds, clip
    decisions as decisions (see the module)."""
    from qualify.matrix import Matrix

    matrix = from_dict(Matrix, summary["matrix"], str(layout.reference_summary))
    ctx = ScoringContext.of(matrix, layout, summary["rollout_digest"], summary["targets_digest"])
    objective = ctx.objective
    acc = Acceptance.load(acceptance_path, partial=True)  # the committed evidence beside it, and its bound files
    rows = model_rows(doc, layout)
    fresh_inputs = ctx.inputs()
    committed_inputs = committed_step_inputs(acceptance_path, doc, objective.ppo, ctx.primary_tp, layout)
    decided: dict[str, Any] = {}
    for role in ROLES:
        before = initial_parameters(ctx.models[role])
        for precision in matrix.reference.precisions:
            family = f"{precision}-repeat"
            ref_run = acc.reference_run(role, family)
            committed = load_steps(committed_run(acceptance_path, doc, f"scores/{ref_run}/{role}"))
            fresh_dir = layout.scores(*RunName.parse(ref_run), role)
            require_complete(fresh_dir, f"fresh reference {ref_run} {role}")
            lean = [which for which, steps in (("committed", committed), ("fresh", load_steps(fresh_dir)[:1]))
                    if is_lean(steps[0].meta)]
            if lean:
                raise EvidenceError(f"the {' and '.join(lean)} {ref_run} {role} kept no updates or moments "
                                    "(reference.evidence: lean): judging a reference on another platform judges r0's "
                                    "own updates; score both with reference.evidence summary or full")
            comparison = f"fresh vs committed {ref_run} [{family}]"
            bounds = acc.bounds(role, family)
            fresh, first, where = on_committed_decisions(ctx, role, ref_run, load_steps(fresh_dir), committed,
                                                         fresh_inputs, committed_inputs)
            mine = run_decisions(objective, role, fresh, fresh_inputs)
            theirs = run_decisions(objective, role, committed, committed_inputs)
            rows += judge_steps("replay", role, comparison, fresh, committed, bounds,
                                params_before_steps(fresh, before), objective.optimizer, family=family)
            rows += [replace(r, note=f"{r.note}; {where}" if r.note else where) if r.step == first else r
                     for r in decision_rows("replay", role, comparison, mine, theirs, bounds)]
            decided[f"{role} {ref_run}"] = {
                "tokens_decided_otherwise": {k: len(differing(a, b)) for k, (a, b) in enumerate(zip(mine, theirs))
                                             if a is not None and b is not None and differing(a, b)},
                "first_step": first, "replay": where}
    return rows, {"targets_max_abs": target_drift(acceptance_path, doc, layout), "decisions": decided}


def committed_step_inputs(acceptance_path: Path, doc: dict[str, Any], ppo: PPO, primary_tp: int,
                          layout: RunLayout) -> StepInputs:
    """Each step's targets and response mask as the committed run saw them: the committed targets (verified against
    the acceptance's digests) cut into the steps' rows, with the rollout's response mask."""
    targets = read_tensors(committed_run(acceptance_path, doc, "targets") / "targets.safetensors")
    mask = load_rollout(layout.rollout(primary_tp), doc["rollout_digest"])["response_mask_BT"]
    return StepInputs.split(ppo, targets, mask)


def on_committed_decisions(ctx: ScoringContext, role: str, ref_run: str, fresh: list, committed: list,
                           fresh_inputs: StepInputs, committed_inputs: StepInputs) -> tuple[list, int | None, str]:
    """(the fresh steps to judge against the committed ones, the first step the fresh run decided a token otherwise
    or None, where the replay is and why or ''): the fresh run itself when it decided as the committed run at every
    step; else its steps before that first step, then this platform's reference replayed on the committed run's
    decisions from that step on (before it the replay follows the same decisions as the fresh run), with the fresh
    run's own per-token outputs at that step."""
    layout = ctx.layout
    mine = run_decisions(ctx.objective, role, fresh, fresh_inputs)
    theirs = run_decisions(ctx.objective, role, committed, committed_inputs)
    first = first_divergence(mine, theirs)
    if first is None or any(d is None for d in mine + theirs) or len(fresh) != len(committed):
        return fresh, None, ""
    precision = RunName.parse(ref_run).precision
    decided = [d.clipped_BT for d in theirs if d is not None]
    ensure_replay(ctx, precision, role, decided, into=layout.platform_replay)
    replay, out = sealed_replay(ctx, precision, role, decided, into=layout.platform_replay)
    flips = differing(mine[first], theirs[first])
    shown = ", ".join(f"row {r} token {t}" for r, t in flips[:SHOWN])
    where = (f"this platform's {ref_run} decided {len(flips)} token(s) otherwise than the committed one at step "
             f"{first} ({shown}{' ...' if len(flips) > SHOWN else ''}): from step {first} on it is judged as "
             f"{ref_run} replayed here on the committed decisions ({out.relative_to(layout.root)})")
    # at the first step both ran from the same parameters: the per-token outputs, which the forward computes before
    # any clip is decided, are the fresh run's own (what its decisions were read from); the rest follows the replay
    at = replay[first]
    own = {k: v for k, v in fresh[first].outputs.items() if k.endswith("_BT")}
    steps = [fresh[k] for k in range(first)] + [replace(at, outputs=at.outputs | own)]
    return steps + [replay[k] for k in range(first + 1, len(replay))], first, where


def model_rows(doc: dict[str, Any], layout: RunLayout) -> list[Row]:
    """The weight files the fresh reference started from must be the acceptance's (seeded models reproduce
    across platforms; when they do not, nothing after them can be judged and this row says why)."""
    expected = {e["path"]: e["sha256"] for e in doc["files"] if e["path"].startswith("models/")
                and e["path"].endswith(".safetensors")}
    rows = []
    for path, digest in sorted(expected.items()):
        file = layout.reference / path
        same = file.is_file() and sha256_file(file)[1] == digest
        rows.append(Row("replay", role_of(path), "models vs acceptance", path, "bytes_differ", float(not same), 0.0,
                        same, "" if same else "this platform did not make the acceptance's weights"))
    return rows


def target_drift(acceptance_path: Path, doc: dict[str, Any], layout: RunLayout) -> dict[str, float]:
    """max |fresh - committed| per target tensor (information: targets have no bound of their own)."""
    committed = committed_run(acceptance_path, doc, "targets")
    old = read_tensors(committed / "targets.safetensors")
    new = read_tensors(layout.targets / "targets.safetensors")
    return {k: max_abs(new[k], old[k]) for k in sorted(old) if k in new and new[k].shape == old[k].shape}
