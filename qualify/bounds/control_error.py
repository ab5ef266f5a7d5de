"""Control errors and the bounds made from them: what `qualify freeze` computes from the reference's controls.

Per family and step, every control is compared with the run it stands against (its family's r0, or r0 replayed on
the control's own clip decisions), each metric's control error is the largest over controls, and the loss, the
grad norm and the scalar means take at least the error their per-token or per-element differences imply (a few
controls' scalar differences cancel by chance). qualify.bounds.rule turns each error into a bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qualify.bounds.rule import BOUNDS_SCHEMA, RULE, BoundRule, family_pairs, quantum
from qualify.compare import StepFiles, merge_max, pair_metrics, params_before_steps, replay_metrics, with_step
from qualify.errors import EvidenceError
from qualify.layout import RunLayout
from qualify.stages import require_complete

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
