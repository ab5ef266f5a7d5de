"""Extract, from a run made with reference.evidence: full, every control's own error per family (bf16-repeat and
fp32-vs-bf16) and every PAIR's error among the bf16 runs {r0, controls} (bf16-repeat), per step/key/metric.

A run c that decided a clip otherwise than bf16-r0 is aligned onto r0's decisions: A_c = c - R_c + r0, with R_c = r0
replayed on c's decisions (the reference's sealed replay), so that A_i - A_j = (c_i - R_i) - (c_j - R_j): the two
runs' numerics difference with the decisions held equal, to first order. Pairs (r0, c) reproduce freeze's own
control errors (checked against the frozen bound files: see 'check').

Usage: python extract.py RUN OUT.json
"""
from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

from qualify.bounds.control_error import (
    LOSS_KEY,
    MEAN_KEYS,
    NORM_KEY,
    grad_difference,
    means_scales,
    pair_record,
    terms_difference,
)
from qualify.bounds.records import means_of, terms_of
from qualify.compare import RunTensors, load_run, num_steps, pair_metrics
from qualify.freeze import replays_of, verified_reference
from qualify.layout import RunLayout
from qualify.reference.context import ScoringContext


def effective(record: dict) -> dict:
    return {"metrics": record["metrics"], "loss_terms": record["loss_terms"],
            "grad_difference": record["grad_difference"], "means": record["means"]}


def _unused(record: dict) -> dict:
    """A record's metrics with the loss / grad-norm / means raises applied (one control alone)."""
    out = {k: dict(v) for k, v in record["metrics"].items()}
    if LOSS_KEY in out and record.get("loss_terms") is not None:
        out[LOSS_KEY]["max_abs"] = max(out[LOSS_KEY]["max_abs"], record["loss_terms"])
    if NORM_KEY in out and record.get("grad_difference") is not None:
        out[NORM_KEY]["max_abs"] = max(out[NORM_KEY]["max_abs"], record["grad_difference"])
    for key in MEAN_KEYS:
        if key in out and key in record.get("means", {}):
            out[key]["max_abs"] = max(out[key]["max_abs"], record["means"][key])
    return out


def aligned(c: RunTensors, r: RunTensors | None, r0: RunTensors) -> RunTensors:
    """c moved onto r0's decisions: c - r + r0 in float64 (c itself, in float64, where r is None)."""
    def one(group):
        cg, r0g = getattr(c, group), getattr(r0, group)
        out = {}
        for n in r0g:
            if n not in cg:
                continue
            x = cg[n].double()
            if r is not None:
                x = x - getattr(r, group)[n].double() + r0g[n].double()
            out[n] = x
        return out
    return RunTensors(one("outputs"), one("grads"), {}, {}, c.meta)


def aligned_terms(fn, step, c, r, r0):
    tc = fn(step, c)
    if r is None or tc is None:
        return tc
    if isinstance(tc, dict):
        tr, t0 = fn(step, r), fn(step, r0)
        return {k: tc[k].double() - tr[k].double() + t0[k].double() for k in tc if k in tr and k in t0}
    return tc.double() - fn(step, r).double() + fn(step, r0).double()


def main(run: str, out: str) -> None:
    layout = RunLayout(Path(run))
    summary, matrix = verified_reference(layout)
    controls = summary["controls"]
    ctx = ScoringContext.of(matrix, layout)
    objective, inputs = ctx.objective, ctx.inputs()
    result = {"controls": controls, "roles": {}}
    for role in objective.roles:
        terms, means, replay_of = terms_of(objective, role, inputs), means_of(objective, role, inputs), \
            replays_of(ctx, role, inputs)
        names = [f"bf16-{c}" for c in controls]
        rep_bf = {n: replay_of("bf16-r0", n) for n in names[1:]}
        rep_fp = {n: replay_of("fp32-r0", n) for n in names}
        steps = num_steps(layout.scores("bf16", "r0", role))
        per_control = {"bf16-repeat": {}, "fp32-vs-bf16": {}}
        pairs = {}
        for k in range(steps):
            r0 = load_run(layout.scores("bf16", "r0", role), k)
            f0 = load_run(layout.scores("fp32", "r0", role), k)
            runs = {n: (r0 if n == "bf16-r0" else load_run(layout.scores("bf16", n[5:], role), k)) for n in names}
            tf = lambda run, s=k, f=terms: f(s, run)
            mf = lambda run, s=k, f=means: f(s, run)
            for n in names[1:]:
                base = r0 if rep_bf[n] is None else load_run(rep_bf[n], k)
                rec = pair_record(runs[n], base, None, None, k + 1, tf, mf, replay={})
                per_control["bf16-repeat"].setdefault(n, {})[f"step{k}"] = effective(rec)
            for n in names:
                base = f0 if rep_fp[n] is None else load_run(rep_fp[n], k)
                rec = pair_record(runs[n], base, None, None, k + 1, tf, mf, replay={})
                per_control["fp32-vs-bf16"].setdefault(n, {})[f"step{k}"] = effective(rec)
            # pairwise among the bf16 runs, each aligned onto r0's decisions
            reps = {n: (None if n == "bf16-r0" or rep_bf[n] is None else load_run(rep_bf[n], k)) for n in names}
            A = {n: aligned(runs[n], reps[n], r0) for n in names}
            T = {n: aligned_terms(terms, k, runs[n], reps[n], r0) for n in names}
            M = {n: aligned_terms(means, k, runs[n], reps[n], r0) for n in names}
            for a, b in itertools.combinations(names, 2):
                # b is the "reference" side (rel_l2's denominator): r0 where r0 is in the pair, as freeze does
                cand, ref = (b, a) if a == "bf16-r0" else (a, b)
                rec = {"metrics": pair_metrics(A[cand], A[ref]),
                       "loss_terms": terms_difference(T[cand], T[ref]),
                       "grad_difference": grad_difference(A[cand], A[ref]),
                       "means": means_scales(M[cand], M[ref])}
                pairs.setdefault(f"{cand}|{ref}", {})[f"step{k}"] = effective(rec)
        result["roles"][role] = {"per_control": per_control, "pairs": pairs, "steps": steps,
                                 "replayed_bf16": {n: rep_bf[n] is not None for n in rep_bf}}
        print(role, "done", file=sys.stderr)
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
