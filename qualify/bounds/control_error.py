"""Control errors and the bounds made from them: what `qualify freeze` computes from the reference's controls.

Per family and step, every control is compared with the run it stands against (its family's r0, or r0 replayed on
the control's own clip decisions), each metric's control error is the largest over controls, and the loss, the
grad norm and the scalar means take at least the error their per-token or per-element differences imply (a few
controls' scalar differences cancel by chance). qualify.bounds.rule turns each error into a bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from qualify.bounds.records import BIAS_GRAD, read_record
from qualify.bounds.rule import BOUNDS_SCHEMA, RULE, BoundRule, family_pairs, quantum
from qualify.compare import StepFiles, merge_max, pair_metrics, params_before_steps, replay_metrics, with_step
from qualify.errors import EvidenceError
from qualify.layout import RunLayout
from qualify.metrics import metrics_device
from qualify.runname import RunName
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
BIAS_TEXT = ("the larger of |difference| and the sum of |per-token contribution differences| "
             "(qualify.ppo.decisions.bias_terms: the value-head bias gradient is the sum over tokens of d loss / d "
             "value): a few controls' differences cancel by chance, and a shift of every value the same way adds up "
             "whole; rel_l2 the same sum over the reference's |gradient|")
ReplayOf = Callable[[str, str], Path | None]
NORM_KEY = "outputs/grad_norm"
NORM_TEXT = ("the larger of |grad norm difference| and the norm of the whole gradient's difference, which bounds it "
             "(| |a| - |b| | <= |a - b|) and, summed over every element, does not cancel by chance in a few controls")


def magnitudes(run: Any) -> dict[str, float]:
    """max |x| of every tensor of a run, by tensor key."""
    out = {}
    for group in ("outputs", "grads", "updates"):
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
    with base on its own decisions, as a case is.

    A control the reference kept as a summary (qualify.bounds.records: its control errors, computed by the same
    functions while it ran, instead of its gradients, updates and moments) enters through its sealed record; a
    control kept in full is measured here."""
    base_name, others = family_pairs(family, controls)
    base_steps = StepFiles(layout.scores(*RunName.parse(base_name), role))  # read step by step, not held whole
    recorded = {name: read_record(layout.scores(*RunName.parse(name), role)) for name in others}
    runs = {name: StepFiles(layout.scores(*RunName.parse(name), role)) for name in others if recorded[name] is None}
    _check_step_counts(role, family, base_name, len(base_steps), recorded, runs)
    compared: dict[str, str] = {name: rec["families"][family]["compared_with"]
                                for name, rec in recorded.items() if rec is not None}
    aligned = _aligned_bases(layout, role, base_name, base_steps, runs, replay_of, compared)
    base_starts = params_before_steps(base_steps, params_before)
    base_kept = lean_base(layout.scores(*RunName.parse(base_name), role), len(base_steps))
    starts = {name: params_before_steps(steps, params_before) for name, steps in runs.items()}
    bounds: dict[str, dict[str, Any]] = {}
    rule = BoundRule(k, floors, floor_ulps, "fp32" if family == "fp32-repeat" else "bf16", use_quantum)
    for step, base in enumerate(base_steps):
        records = {}
        for name in others:
            if name in runs:
                records[name] = pair_record(runs[name][step], aligned[name][step], starts[name][step], optimizer,
                                            step + 1, None if terms is None else (lambda run, s=step: terms(s, run)),
                                            None if means is None else (lambda run, by=None, s=step: means(s, run, by)))
            else:
                records[name] = recorded[name]["families"][family]["steps"][step]
        kept = None if base_kept is None else base_kept[step]
        step_bounds = bounds_from_records(base, records, rule, {} if kept is not None else base_starts[step],
                                          optimizer, step + 1, kept)
        bounds.update(with_step(step, step_bounds))
    return {"schema": BOUNDS_SCHEMA, "role": role, "family": family, "reference_run": base_name,
            "control_runs": others, "compared_with": {name: compared.get(name, base_name) for name in others},
            "num_steps": len(base_steps), "k": k, "floors": floors, "floor_ulps": floor_ulps,
            "rule": RULE, "bounds": bounds}


def _check_step_counts(role: str, family: str, base_name: str, num_steps: int, recorded: dict[str, Any],
                       runs: dict[str, Any]) -> None:
    """Every control, recorded or kept in full, took the base's number of steps (an EvidenceError otherwise)."""
    for name, record in recorded.items():
        if record is not None:
            runs_steps = len(record["families"].get(family, {}).get("steps", []))
            if family not in record["families"] or runs_steps != num_steps:
                raise EvidenceError(f"{role} {family}: the control record of {name} holds {runs_steps} step(s) "
                                    f"against {base_name}, which took {num_steps}")
    if any(len(steps) != num_steps for steps in runs.values()):
        raise EvidenceError(f"{role} {family}: controls took different numbers of steps than {base_name}")


def _aligned_bases(layout: RunLayout, role: str, base_name: str, base_steps: Any, runs: dict[str, Any],
                   replay_of: ReplayOf | None, compared: dict[str, str]) -> dict[str, Any]:
    """What each control kept in full is compared with: the base's steps, or the base replayed on the control's clip
    decisions where the reference sealed one (its place, relative to the reference, entered in compared)."""
    aligned: dict[str, Any] = {}
    for name in runs:
        where = None if replay_of is None else replay_of(base_name, name)
        if where is None:
            aligned[name] = base_steps
            continue
        require_complete(where, f"{base_name} {role} replayed on {name}'s clip decisions (run 'qualify reference' "
                                "again on this run directory: it makes the replays freeze needs)")
        aligned[name] = StepFiles(where)
        if len(aligned[name]) != len(base_steps):
            raise EvidenceError(f"{where}: {len(aligned[name])} steps, {base_name} took {len(base_steps)}")
        compared[name] = str(where.relative_to(layout.reference))
    return aligned


def lean_base(base_dir: Path, num_steps: int) -> list[dict[str, Any]] | None:
    """Each step's base_record of an r0 kept lean (None for an r0 kept in full)."""
    from qualify.compare import read_role_meta

    if not read_role_meta(base_dir).lean:
        return None
    record = read_record(base_dir)
    steps = None if record is None else record.get("base", {}).get("steps")
    if not isinstance(steps, list) or len(steps) != num_steps:
        raise EvidenceError(f"{base_dir} is kept lean (reference.evidence: lean) but its record holds no base record "
                            f"of its {num_steps} step(s): run the reference again in another --run directory")
    return steps


def grad_difference(run: Any, base: Any) -> float | None:
    """The norm of a control's whole-gradient difference from the run it is compared with; None unless both hold the
    same gradients (names and shapes)."""
    if not base.grads or {n: g.shape for n, g in run.grads.items()} != {n: g.shape for n, g in base.grads.items()}:
        return None
    device = metrics_device()  # the GPU when there is one: a 0.6B model's gradients are 600M elements a run
    total = 0.0
    for n in sorted(base.grads):  # one order whether the runs are in memory or read from their files
        g = base.grads[n]
        mine, theirs = (run.grads[n], g) if device is None else (run.grads[n].to(device), g.to(device))
        total += float((mine.double() - theirs.double()).square().sum())
    return math.sqrt(total)


def terms_difference(mine: Any, theirs: Any) -> float | None:
    """The sum of |per-token loss contribution differences|; None unless both could be read, with one shape."""
    if mine is None or theirs is None or mine.shape != theirs.shape:
        return None
    return float((mine - theirs).abs().sum())


def means_scales(mine: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float]:
    """Per scalar mean (MEAN_KEYS) both hold with one shape: the L2 norm of its per-token contribution differences;
    for the critic's value-head bias gradient (BIAS_GRAD), the sum of their absolute values."""
    out = {}
    for key in MEAN_KEYS:
        name = key.removeprefix("outputs/")
        if name in mine and name in theirs and mine[name].shape == theirs[name].shape:
            out[key] = float((mine[name] - theirs[name]).square().sum().sqrt())
    if BIAS_GRAD in mine and BIAS_GRAD in theirs and mine[BIAS_GRAD].shape == theirs[BIAS_GRAD].shape:
        out[BIAS_GRAD] = float((mine[BIAS_GRAD] - theirs[BIAS_GRAD]).abs().sum())
    return out


def pair_record(run: Any, other: Any, start: dict | None, optimizer: Any, adam_step: int,
                terms: Callable[[Any], Any] | None = None,
                means: Callable[..., dict[str, Any]] | None = None,
                replay: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything one control contributes to its family's bounds at one step, against the run it is compared with
    (other: the family's r0, or r0 replayed on the control's decisions): its metrics against it, the loss's and the
    means' per-token difference scales, its whole-gradient difference, and its own AdamW replay from its own start.
    What a control's summary keeps (qualify.bounds.records); bounds_from_records takes the largest over controls.
    replay: the run's own replay_metrics at this step when the caller has it (it does not depend on other: a control
    of two families measures it once), else measured here from start."""
    if replay is None:
        assert start is not None, "pair_record needs the run's start or its replay"
        replay = replay_metrics(run, start, optimizer, adam_step)
    return {"metrics": pair_metrics(run, other),
            "loss_terms": None if terms is None else terms_difference(terms(run), terms(other)),
            "grad_difference": grad_difference(run, other),
            "means": {} if means is None else means_scales(means(run), means(other, run)),
            "replay": replay}


def base_record(steps: Sequence[Any], starts: Iterable[dict], optimizer: Any,
                replays: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """What freeze needs of a reference r0's updates and moments, measured while it is in memory, for an r0 kept lean
    (reference.evidence: lean): per step, each update's magnitude, r0's own AdamW replay (replays[k] when the caller
    has measured it) and each parameter's magnitude at the step's start (the update's quantum). bounds_from_records
    makes the same bounds from it as from r0's tensors."""
    out = []
    for k, (run, start) in enumerate(zip(steps, starts)):
        replay = replays[k] if replays else replay_metrics(run, start, optimizer, k + 1)
        out.append({"update_max_abs": {f"updates/{n}": float(t.double().abs().max()) if t.numel() else 0.0
                                       for n, t in run.updates.items()},
                    "replay": replay,
                    "start_max_abs": {n: float(p.abs().max()) for n, p in start.items()}})
    return {"steps": out}


def bounds_from_records(base: Any, records: dict[str, dict[str, Any]], rule: BoundRule, base_start: dict,
                        optimizer: Any, adam_step: int, base_kept: dict[str, Any] | None = None
                        ) -> dict[str, dict[str, Any]]:
    """Bounds of one family at one step (keys without the step prefix) from each control's pair_record: a metric's
    control error is the largest over controls; the loss, the grad norm and the scalar means take at least their
    difference scales where every control has one. Magnitudes and the base's own AdamW replay are base's: measured
    here from its tensors and base_start, or, for a base kept lean, read from base_kept (that step of its
    base_record)."""
    errors: dict[str, dict[str, float]] = {}
    for record in records.values():
        merge_max(errors, record["metrics"])
    recs = list(records.values())
    by_terms = "max_abs" in errors.get(LOSS_KEY, {}) and raise_to(errors, LOSS_KEY, [r["loss_terms"] for r in recs])
    by_grads = "max_abs" in errors.get(NORM_KEY, {}) and raise_to(errors, NORM_KEY,
                                                                  [r["grad_difference"] for r in recs])
    by_means = [key for key in MEAN_KEYS if "max_abs" in errors.get(key, {})
                and raise_to(errors, key, [r["means"].get(key) for r in recs])]
    mags = magnitudes(base)
    if base_kept is not None:
        mags.update(base_kept["update_max_abs"])
    by_bias = raise_bias(errors, [r["means"].get(BIAS_GRAD) for r in recs], mags.get(BIAS_GRAD, 0.0))
    bounds = {key: {m: rule.entry(key, m, v, mags[key]) for m, v in ms.items()} for key, ms in errors.items()}
    if by_terms:
        bounds[LOSS_KEY]["max_abs"]["control_error_of"] = LOSS_TERMS_TEXT
    if by_grads:
        bounds[NORM_KEY]["max_abs"]["control_error_of"] = NORM_TEXT
    for key in by_means:
        bounds[key]["max_abs"]["control_error_of"] = MEANS_TEXT
    for metric in by_bias:
        bounds[BIAS_GRAD][metric]["control_error_of"] = BIAS_TEXT
    # an update is judged against what AdamW makes of the run's own moments and start (qualify.compare.pair_metrics)
    if base_kept is None:
        replay = replay_metrics(base, base_start, optimizer, adam_step)
        start_max = {n: float(p.abs().max()) for n, p in base_start.items()} if rule.use_quantum else {}
    else:
        replay = {key: dict(ms) for key, ms in base_kept["replay"].items()}
        start_max = base_kept["start_max_abs"]
    for record in recs:
        merge_max(replay, record["replay"])
    for key, ms in replay.items():
        # updates are fp32 master arithmetic: new - old carries one fp32 rounding step of the parameter
        p = start_max.get(key.removeprefix("updates/"))
        q = quantum("fp32", "max_abs", p) if rule.use_quantum and p is not None else 0.0
        bounds.setdefault(key, {}).update({m: rule.entry(key, m, v, mags.get(key, 0.0), "update", q)
                                           for m, v in ms.items()})
    return bounds


def raise_to(errors: dict[str, dict[str, float]], key: str, scales: list[float | None]) -> bool:
    """Raise errors[key]['max_abs'] to the largest scale when every control has one (and there is a control)."""
    if not scales or any(s is None for s in scales):
        return False
    errors[key]["max_abs"] = max(errors[key]["max_abs"], *scales)
    return True


def raise_bias(errors: dict[str, dict[str, float]], scales: list[float | None], magnitude: float) -> list[str]:
    """Raise the value-head bias gradient's control errors to the largest sum of |per-token contribution differences|
    when every control has one: its absolute metrics to the sum (a one-element tensor: max = p99 = mean), rel_l2 to
    the sum over the reference's |gradient|. Returns the metrics raised."""
    metrics = errors.get(BIAS_GRAD, {})
    if not metrics or not scales or any(x is None for x in scales):
        return []
    scale = max(scales)
    raised = []
    for metric in list(metrics):
        if metric == "rel_l2":
            if magnitude <= 0:
                continue
            value = scale / magnitude
        elif metric in ("max_abs", "p99_abs", "mean_abs"):
            value = scale
        else:
            continue
        metrics[metric] = max(metrics[metric], value)
        raised.append(metric)
    return raised


def grad_difference_error(pairs: list[tuple[Any, Any]], errors: dict[str, dict[str, float]]) -> bool:
    """Raise the grad norm's control error to the largest norm of a control's whole-gradient difference from the run
    it is compared with (pairs: (control, base)); True when every pair holds the same gradients (names and shapes)."""
    return raise_to(errors, NORM_KEY, [grad_difference(run, base) for run, base in pairs])


def loss_terms_error(pairs: list[tuple[Any, Any]], terms: Callable[[Any], Any],
                     errors: dict[str, dict[str, float]]) -> bool:
    """Raise the loss's control error to the largest sum of |per-token contribution differences| of a control from
    the run it is compared with (pairs: (control, base)); True when every pair's contributions could be read."""
    return raise_to(errors, LOSS_KEY, [terms_difference(terms(run), terms(base)) for run, base in pairs])


def means_scale_error(pairs: list[tuple[Any, Any]], means: Callable[[Any], dict[str, Any]],
                      errors: dict[str, dict[str, float]]) -> list[str]:
    """Raise each scalar mean's control error (MEAN_KEYS) to the largest random-sign scale of a control's per-token
    contribution differences from the run it is compared with (pairs: (control, base)): the L2 norm of the
    differences, what a sum of independent per-token errors amounts to. Returns the keys raised (a mean whose
    contributions some pair lacks is left as it is)."""
    scales = [means_scales(means(run), means(base)) for run, base in pairs]
    return [key for key in MEAN_KEYS if "max_abs" in errors.get(key, {})
            and raise_to(errors, key, [s.get(key) for s in scales])]


def step_family_bounds(base: Any, runs: dict[str, Any], rule: BoundRule, starts: dict[str, dict], base_name: str,
                       optimizer: Any, adam_step: int, terms: Callable[[Any], Any] | None = None,
                       bases: dict[str, Any] | None = None,
                       means: Callable[[Any], dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Bounds of one family at one step (keys without the step prefix) from controls held in full. bases[name]: what
    control name is compared with (base replayed on its decisions); base itself where not given. Magnitudes are
    base's."""
    records = {name: pair_record(run, (bases or {}).get(name, base), starts[name], optimizer, adam_step, terms, means)
               for name, run in runs.items()}
    return bounds_from_records(base, records, rule, starts[base_name], optimizer, adam_step)


SILENT_GROUPS = ("outputs", "grads")


def silent_controls(doc: dict[str, Any]) -> str | None:
    """A warning when a family's controls measured nothing: every control reproduced its r0 bit for bit on every
    output and gradient (a deterministic device and no reference.perturbations: a repeat is the same run again). Its
    bounds are then floors and rounding quanta alone, which a correct engine with other kernels or another reduction
    order fails (megatron bf16 at the Qwen3-0.6B shape failed hundreds of bf16-repeat rows by orders of magnitude
    while every fp32-vs-bf16 row passed: benchmarks/LOG.md). None when some control differed somewhere."""
    errors = [entry.get("control_error") for key, metrics in doc["bounds"].items()
              if key.split("/", 2)[1:2] and key.split("/", 2)[1] in SILENT_GROUPS for entry in metrics.values()]
    if not errors or any(e != 0 for e in errors):
        return None
    return (f"{doc['role']} {doc['family']}: every control ({', '.join(doc['control_runs'])}) reproduced "
            f"{doc['reference_run']} bit for bit on all {len(errors)} output and gradient metrics, so its bounds are "
            "floors and rounding quanta alone: an engine with other kernels or another reduction order fails them. "
            "Add reference.perturbations (microbatch_split, attn_impl, fused_projections, fused_norm, fused_adam, "
            "combined: matrices/README.md) so the controls measure how far a correct engine may differ")
