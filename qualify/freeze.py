"""`qualify freeze`: turn a reference into per-tensor bounds and an acceptance manifest.

Rule: bound = k x control error + floor, per (role, tensor, metric), k and floors taken from the
matrix snapshot recorded by the reference stage (so the rule is fixed before any candidate
runs). Six families: actor and critic x fp32-repeat (fp32 controls vs fp32 r0), bf16-repeat
(bf16 controls vs bf16 r0), fp32-vs-bf16 (bf16 runs vs fp32 r0); a control that decided a clip otherwise than that
r0 is compared with r0 replayed on its decisions (qualify.reference.forced), as a case is. The acceptance manifest
lists every reference artifact with its sha256 and names the bound files by digest. An
acceptance is written once: freezing again is refused unless the result is byte-identical,
so a frozen bound can never be widened.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qualify.acceptance import ACCEPTANCE_SCHEMA, BOUNDS_SCHEMA, FAMILIES
from qualify.compare import (
    StepFiles,
    merge_max,
    metric_kind,
    pair_metrics,
    params_before_steps,
    replay_metrics,
    with_step,
)
from qualify.diagnose.bounds import LAYER_BOUNDS_DIR, layer_bound_files
from qualify.errors import EvidenceError, FrozenError
from qualify.layout import ROLES_ALL, RunLayout
from qualify.manifest import build_manifest
from qualify.models.checkpoint import checkpoint_tensors
from qualify.models.family import model_dir
from qualify.ppo.coverage import inert
from qualify.reference.inputs import StepInputs
from qualify.rule import quantum, tensor_floor, ulp  # noqa: F401  (ulp: part of the rule as freeze states it)
from qualify.schema import from_dict
from qualify.stages import require_complete, stage_info
from qualify.store import atomic_write_bytes, dumps_json, read_json, read_json_object

RULE = ("bound = k * control_error + floor + quantum (per role, tensor, metric; control_error = max over the "
        "family's controls, each compared with the family's r0 replayed on the control's own clip decisions where they "
        "differ (for the loss and the grad norm, scalars whose few control differences cancel by chance, "
        "at least the sum of |per-token loss contribution differences| and the norm of the gradient's difference; for "
        "the scalar means kl_mean and policy_loss at least the L2 norm of their weighted per-token differences); "
        "floor = max(floors[kind], floor_ulps fp32 ulps of the reference tensor's largest magnitude); quantum = one rounding step of the compute precision at that magnitude, for what the contract "
        "computes in it: bf16 gradients, moments and values, and one fp32 step of every update)")


def family_pairs(family: str, controls: list[str]) -> tuple[str, list[str]]:
    """(reference run, candidate-like runs) of a family: run names are '<precision>-<control>'."""
    if family == "fp32-repeat":
        return "fp32-r0", [f"fp32-{c}" for c in controls[1:]]
    if family == "bf16-repeat":
        return "bf16-r0", [f"bf16-{c}" for c in controls[1:]]
    return "fp32-r0", [f"bf16-{c}" for c in controls]


def in_compute_precision(key: str) -> bool:
    """Whether the contract computes a tensor in the compute precision (bf16 under bf16): the gradients of the compute
    copy (cast to the FP32 master), the moments made from them, and the critic's head output. Logprobs, ratio, KL, the
    loss and the grad norm are fp32 computations, so no rounding step of bf16 is theirs to spend."""
    group = key.partition("/")[0]
    return group in ("grads", "moments") or key == "outputs/values_BT"


def bound_entry(kind: str, error: float, k: float, floors: dict[str, float], q: float = 0.0,
                floor: float | None = None, magnitude: float | None = None) -> dict[str, Any]:
    """One frozen bound: k x control error + floor + quantum, with its parts (floor: the kind's unless given)."""
    floor = floors[kind] if floor is None else floor
    entry = {"kind": kind, "control_error": error, "floor": floor, "quantum": q, "bound": k * error + floor + q}
    if magnitude is not None:
        entry["magnitude"] = magnitude
    return entry


def magnitudes(run: Any) -> dict[str, float]:
    """max |x| of every tensor of a run, by tensor key."""
    out = {}
    for group in ("outputs", "grads", "updates", "moments"):
        for name, t in getattr(run, group).items():
            out[f"{group}/{name}"] = float(t.double().abs().max()) if t.numel() else 0.0
    return out


def family_bounds(layout: RunLayout, role: str, family: str, controls: list[str], k: float,
                  floors: dict[str, float], params_before: dict, optimizer: Any, use_quantum: bool,
                  floor_ulps: float = 0.0, terms: TermsOf | None = None,
                  replay_of: ReplayOf | None = None, means: MeansOf | None = None) -> dict[str, Any]:
    """Bounds of one family for one role: every step's tensors, keyed 'step<k>/<group>/<name>'. terms(step, run):
    the run's per-token loss contributions at that step (qualify.ppo.decisions.loss_terms), which set the loss's
    control error when given; means(step, run): its per-token contributions to the other scalar means
    (qualify.ppo.decisions.mean_terms), which raise theirs to the random-sign scale of their differences.
    replay_of(base, control): where the reference sealed base replayed on the control's clip decisions
    (qualify.reference.forced.control_replay), None where the control decided as base: each control is compared
    with base on its own decisions, as a case is."""
    base_name, others = family_pairs(family, controls)
    base_steps = StepFiles(layout.scores(*base_name.split("-", 1), role))  # read step by step, not held whole
    runs = {name: StepFiles(layout.scores(*name.split("-", 1), role)) for name in others}
    if any(len(steps) != len(base_steps) for steps in runs.values()):
        raise EvidenceError(f"{role} {family}: controls took different numbers of steps than {base_name}")
    aligned: dict[str, Any] = {}
    replays: dict[str, str] = {}
    for name in others:
        where = None if replay_of is None else replay_of(base_name, name)
        if where is None:
            aligned[name] = base_steps
            continue
        require_complete(where, f"{base_name} {role} replayed on {name}'s clip decisions (run 'qualify reference' "
                                "again on this run directory: it makes the replays freeze needs)")
        aligned[name] = StepFiles(where)
        if len(aligned[name]) != len(base_steps):
            raise EvidenceError(f"{where}: {len(aligned[name])} steps, {base_name} took {len(base_steps)}")
        replays[name] = str(where.relative_to(layout.reference))
    starts = {name: params_before_steps(steps, params_before) for name, steps in [(base_name, base_steps),
                                                                                 *runs.items()]}
    bounds: dict[str, dict[str, Any]] = {}
    rule = BoundRule(k, floors, floor_ulps, "fp32" if family == "fp32-repeat" else "bf16", use_quantum)
    for step, base in enumerate(base_steps):
        others_at = {name: steps[step] for name, steps in runs.items()}
        step_bounds = step_family_bounds(base, others_at, rule, {name: starts[name][step] for name in starts},
                                         base_name, optimizer, step + 1,
                                         None if terms is None else (lambda run, s=step: terms(s, run)),
                                         {name: aligned[name][step] for name in others},
                                         None if means is None else (lambda run, s=step: means(s, run)))
        bounds.update(with_step(step, step_bounds))
    return {"schema": BOUNDS_SCHEMA, "role": role, "family": family, "reference_run": base_name,
            "control_runs": others, "compared_with": {name: replays.get(name, base_name) for name in others},
            "num_steps": len(base_steps), "k": k, "floors": floors, "floor_ulps": floor_ulps,
            "rule": RULE, "bounds": bounds}


@dataclass(frozen=True, slots=True)
class BoundRule:
    """The rule of one family: k, the floors, and the compute precision whose rounding step may be spent."""

    k: float
    floors: dict[str, float]
    floor_ulps: float
    precision: str
    use_quantum: bool

    def entry(self, key: str, metric: str, error: float, magnitude: float, kind: str | None = None,
              q: float | None = None) -> dict[str, Any]:
        kind = kind or ("relative" if metric == "rel_l2" else metric_kind(key))
        if q is None:
            low = self.precision != "fp32" and in_compute_precision(key)
            q = quantum(self.precision, metric, magnitude) if self.use_quantum and low else 0.0
        return bound_entry(kind, error, self.k, self.floors, q,
                           tensor_floor(kind, metric, magnitude, self.floors, self.floor_ulps), magnitude)


LOSS_KEY = "outputs/loss"
LOSS_TERMS_TEXT = ("the larger of |loss difference| and the sum of |per-token loss contribution differences| "
                   "(qualify.ppo.decisions.loss_terms): a few controls' loss differences cancel by chance")
TermsOf = Callable[[int, Any], Any]
MeansOf = Callable[[int, Any], dict[str, Any]]
MEAN_KEYS = ("outputs/kl_mean", "outputs/policy_loss")
MEANS_TEXT = ("the larger of |difference| and the random-sign scale of its per-token contribution differences, "
              "sqrt(sum over tokens of (weight x difference)^2) (qualify.ppo.decisions.mean_terms): a few controls' "
              "mean differences cancel by chance; a shift of every token the same way is sqrt(tokens) times that scale")
ReplayOf = Callable[[str, str], Path | None]
NORM_KEY = "outputs/grad_norm"
NORM_TEXT = ("the larger of |grad norm difference| and the norm of the whole gradient's difference, which bounds it "
             "(| |a| - |b| | <= |a - b|) and, summed over every element, does not cancel by chance in a few controls")


def grad_difference_error(pairs: list[tuple[Any, Any]], errors: dict[str, dict[str, float]]) -> bool:
    """Raise the grad norm's control error to the largest norm of a control's whole-gradient difference from the run
    it is compared with (pairs: (control, base)); True when every pair holds the same gradients (names and shapes)."""
    if not pairs or any(not base.grads or {n: g.shape for n, g in run.grads.items()} !=
                        {n: g.shape for n, g in base.grads.items()} for run, base in pairs):
        return False
    l2 = max(math.sqrt(sum(float((run.grads[n].double() - g.double()).square().sum()) for n, g in base.grads.items()))
             for run, base in pairs)
    errors[NORM_KEY]["max_abs"] = max(errors[NORM_KEY]["max_abs"], l2)
    return True


def loss_terms_error(pairs: list[tuple[Any, Any]], terms: Callable[[Any], Any],
                     errors: dict[str, dict[str, float]]) -> bool:
    """Raise the loss's control error to the largest sum of |per-token contribution differences| of a control from
    the run it is compared with (pairs: (control, base)); True when every pair's contributions could be read."""
    both = [(terms(run), terms(base)) for run, base in pairs]
    if not both or any(t is None or m is None or t.shape != m.shape for t, m in both):
        return False
    l1 = max(float((t - m).abs().sum()) for t, m in both)
    errors[LOSS_KEY]["max_abs"] = max(errors[LOSS_KEY]["max_abs"], l1)
    return True


def means_scale_error(pairs: list[tuple[Any, Any]], means: Callable[[Any], dict[str, Any]],
                      errors: dict[str, dict[str, float]]) -> list[str]:
    """Raise each scalar mean's control error (MEAN_KEYS) to the largest random-sign scale of a control's per-token
    contribution differences from the run it is compared with (pairs: (control, base)): the L2 norm of the
    differences, what a sum of independent per-token errors amounts to. Returns the keys raised (a mean whose
    contributions some pair lacks is left as it is)."""
    both = [(means(run), means(base)) for run, base in pairs]
    raised = []
    for key in MEAN_KEYS:
        name = key.removeprefix("outputs/")
        if "max_abs" not in errors.get(key, {}) or not both or any(
                name not in a or name not in b or a[name].shape != b[name].shape for a, b in both):
            continue
        scale = max(float((a[name] - b[name]).square().sum().sqrt()) for a, b in both)
        errors[key]["max_abs"] = max(errors[key]["max_abs"], scale)
        raised.append(key)
    return raised


def step_family_bounds(base: Any, runs: dict[str, Any], rule: BoundRule, starts: dict[str, dict], base_name: str,
                       optimizer: Any, adam_step: int, terms: Callable[[Any], Any] | None = None,
                       bases: dict[str, Any] | None = None,
                       means: Callable[[Any], dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Bounds of one family at one step (keys without the step prefix). bases[name]: what control name is compared
    with (base replayed on its decisions); base itself where not given. Magnitudes are base's."""
    errors: dict[str, dict[str, float]] = {}
    pairs = [(run, (bases or {}).get(name, base)) for name, run in runs.items()]
    for run, other in pairs:
        merge_max(errors, pair_metrics(run, other))
    by_terms = terms is not None and "max_abs" in errors.get(LOSS_KEY, {}) and loss_terms_error(pairs, terms, errors)
    by_grads = "max_abs" in errors.get(NORM_KEY, {}) and grad_difference_error(pairs, errors)
    by_means = [] if means is None else means_scale_error(pairs, means, errors)
    mags = magnitudes(base)
    bounds = {key: {m: rule.entry(key, m, v, mags[key]) for m, v in ms.items()} for key, ms in errors.items()}
    if by_terms:
        bounds[LOSS_KEY]["max_abs"]["control_error_of"] = LOSS_TERMS_TEXT
    if by_grads:
        bounds[NORM_KEY]["max_abs"]["control_error_of"] = NORM_TEXT
    for key in by_means:
        bounds[key]["max_abs"]["control_error_of"] = MEANS_TEXT
    # an update is judged against what AdamW makes of the run's own moments and start (qualify.compare.pair_metrics)
    replay: dict[str, dict[str, float]] = {}
    for name, run in [(base_name, base), *runs.items()]:
        merge_max(replay, replay_metrics(run, starts[name], optimizer, adam_step))
    for key, ms in replay.items():
        # updates are fp32 master arithmetic: new - old carries one fp32 rounding step of the parameter
        p = starts[base_name].get(key.removeprefix("updates/"))
        q = quantum("fp32", "max_abs", float(p.abs().max())) if rule.use_quantum and p is not None else 0.0
        bounds.setdefault(key, {}).update({m: rule.entry(key, m, v, mags.get(key, 0.0), "update", q)
                                           for m, v in ms.items()})
    return bounds


def acceptance_document(layout: RunLayout, name: str, bound_files: dict[str, bytes], summary: dict[str, Any],
                        matrix: Any, layer_files: dict[str, bytes] | None = None) -> dict[str, Any]:
    """The manifest of the reference evidence plus rule, digests and provenance (and the layer bounds' digests)."""
    extra = {
        "schema_version": ACCEPTANCE_SCHEMA,
        "name": name,
        "matrix": matrix.name,
        "rule": {"text": RULE, "k": matrix.freeze.k, "floors": dict(matrix.freeze.floors),
                 "floor_ulps": matrix.freeze.floor_ulps,
                 "quantum": matrix.freeze.quantum, "families": list(FAMILIES)},
        "matrix_digest": summary["matrix_digest"],
        "rollout_digest": summary["rollout_digest"],
        "targets_digest": summary["targets_digest"],
        "bounds": {f: "sha256:" + hashlib.sha256(data).hexdigest() for f, data in sorted(bound_files.items())},
        "versions": summary["versions"],
        "host": summary["host"],
        "platform": summary.get("platform"),
        "coverage": {"required": list(matrix.freeze.require), "steps": summary["coverage"]},
        "rollout_platform": summary.get("rollout_platform"),
        "git": summary["git"],
        "evidence": "../reference",
    }
    if matrix.algorithm == "grpo":  # the actor's bound files alone (qualify.acceptance.check_acceptance)
        extra["algorithm"] = "grpo"
    if layer_files:  # qualify diagnose's per-layer bounds (qualify.diagnose.bounds); absent when none were frozen
        extra["layer_bounds"] = {f: "sha256:" + hashlib.sha256(d).hexdigest() for f, d in sorted(layer_files.items())}
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

    if not layout.reference_summary.is_file():
        raise FrozenError(f"no complete reference in {layout.reference} (run 'qualify reference' first)")
    summary = read_json_object(layout.reference_summary, "reference summary",
                               ("controls", "matrix_digest", "rollout_digest", "targets_digest"))
    require_complete(layout.matrix_snapshot, "matrix snapshot (made by 'qualify reference'; rerun it)")
    if stage_info(layout.matrix_snapshot).get("digest") != summary.get("matrix_digest"):
        raise EvidenceError(f"{layout.reference_summary} names matrix snapshot {summary.get('matrix_digest')}, "
                            f"not the sealed {stage_info(layout.matrix_snapshot).get('digest')}")
    matrix = from_dict(Matrix, read_json(layout.matrix_snapshot / "matrix.json"), str(layout.matrix_snapshot))
    if matrix.models.tiny is not None:
        for role in ROLES_ALL:
            require_complete(layout.model(role), f"{role} model")
    for tp in matrix.rollout.vllm_tp:
        require_complete(layout.rollout(tp), f"rollout TP{tp}")
    primary = stage_info(layout.rollout(matrix.rollout.vllm_tp[0]))["digest"]
    require_complete(layout.targets, "targets")
    for what, recorded, sealed in (("rollout", summary.get("rollout_digest"), primary),
                                   ("targets", summary.get("targets_digest"), stage_info(layout.targets)["digest"])):
        if recorded != sealed:
            raise EvidenceError(f"{layout.reference_summary} names {what} {recorded}, the sealed one is {sealed}")
    for precision in matrix.reference.precisions:
        for control in summary["controls"]:
            for role in matrix.roles:
                require_complete(layout.scores(precision, control, role), f"reference {precision} {control} {role}")
    return summary, matrix


def terms_of(matrix: Any, role: str, inputs: Any) -> TermsOf:
    """terms(step, run) for family_bounds: the run's per-token loss contributions at that step."""
    from qualify.ppo.decisions import loss_terms

    def terms(step: int, run: Any) -> Any:
        if step >= len(inputs.masks):
            return None
        return loss_terms(role, matrix.ppo, matrix.grpo, run.outputs, inputs.targets[step], inputs.masks[step])
    return terms


def means_of(matrix: Any, role: str, inputs: Any) -> MeansOf:
    """means(step, run) for family_bounds: the run's per-token contributions to its scalar means at that step."""
    from qualify.ppo.decisions import mean_terms

    def means(step: int, run: Any) -> dict[str, Any]:
        if step >= len(inputs.masks):
            return {}
        return mean_terms(role, matrix.ppo, matrix.grpo, run.outputs, inputs.targets[step], inputs.masks[step])
    return means


def replays_of(matrix: Any, layout: RunLayout, role: str, inputs: Any, summary: dict[str, Any]) -> ReplayOf:
    """replay_of(base, control) for family_bounds: where the reference sealed base replayed on the control's clip
    decisions, None where the control decided as base (decided here from the recorded outputs, not from the
    unsealed summary)."""
    from qualify.reference.forced import control_replay
    from qualify.reference.stage import scoring_settings

    settings = scoring_settings(matrix, summary["rollout_digest"])

    def replay_of(base: str, control: str) -> Path | None:
        found = control_replay(matrix, layout, role, base, control, inputs, settings)
        return None if found is None else found[0]
    return replay_of


def freeze(run_dir: Path, name: str | None = None) -> dict[str, Any]:
    """Freeze the reference of run_dir; returns the acceptance document (refuses to change a frozen one)."""
    layout = RunLayout(run_dir_of(run_dir))
    summary, matrix = verified_reference(layout)
    controls = summary["controls"]
    coverage = reference_coverage(layout, controls[0], matrix.roles)
    missing = inert(matrix.freeze.require, coverage)
    if missing:
        raise FrozenError(f"the reference left {len(missing)} required branch(es) inert (freeze.require): "
                          + "; ".join(missing))
    files: dict[str, bytes] = {}
    inputs = StepInputs.load(matrix, layout)
    for role in matrix.roles:
        before = checkpoint_tensors(model_dir(matrix, layout.models, role))
        for family in FAMILIES:
            doc = family_bounds(layout, role, family, controls, matrix.freeze.k, dict(matrix.freeze.floors), before,
                                matrix.optimizer, matrix.freeze.quantum, matrix.freeze.floor_ulps,
                                terms_of(matrix, role, inputs), replays_of(matrix, layout, role, inputs, summary),
                                means_of(matrix, role, inputs))
            files[f"{role}-{family}.json"] = dumps_json(doc).encode("ascii")
    layers = layer_bound_files(layout, matrix, controls)  # {} for a reference scored without layer activations
    document = acceptance_document(layout, name or matrix.name, files, summary | {"coverage": coverage}, matrix, layers)
    _write_once(layout, files, document, layers)
    return document


def reference_coverage(layout: RunLayout, control: str,
                       roles: tuple[str, ...] = ("actor", "critic")) -> dict[str, list[dict[str, Any]]]:
    """Per role, the branches each step of the fp32 reference run took (recorded by the reference)."""
    return {role: read_json(layout.scores("fp32", control, role) / "meta.json").get("coverage", [])
            for role in roles}


def _write_once(layout: RunLayout, files: dict[str, bytes], document: dict[str, Any],
                layer_files: dict[str, bytes] | None = None) -> None:
    """Write bounds and acceptance unless they exist; identical content is fine, anything else is refused."""
    targets = {layout.bounds / f: data for f, data in files.items()}
    targets.update({layout.acceptance_dir / LAYER_BOUNDS_DIR / f: data for f, data in (layer_files or {}).items()})
    targets[layout.acceptance] = dumps_json(document).encode("ascii")
    changed = [p for p, data in targets.items() if p.exists() and p.read_bytes() != data]
    if changed:
        raise FrozenError(f"an acceptance already exists for this reference and differs: {', '.join(map(str, changed))}"
                          " (a frozen acceptance is never rewritten or widened)")
    for path, data in targets.items():  # bounds first, the acceptance that names them last
        if not path.exists():
            atomic_write_bytes(path, data)
