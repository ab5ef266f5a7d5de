"""Judge candidate evidence against frozen bounds: one row per (comparison, tensor, metric).

A row passes only when its value is finite and at most its bound. A missing tensor, an extra one,
a shape or dtype mismatch, a metric that could not be measured, NaN or Inf: each is a failing
row, never a pass. Evidence checks (FP32 gradient buffers, optimizer-state dtype, replicas
identical across TP ranks, padded vocabulary rows untouched) have bound 0.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from qualify.bounds.files import bound_rule
from qualify.case.meta import CaseMeta
from qualify.compare import DERIVED_OUTPUTS, RunTensors, pair_metrics, replay_metrics, structure_problems
from qualify.metrics import bf16_exact_counts, bf16_exact_fraction
from qualify.verdict import Row

STRUCTURE_RULE = "names, shapes and dtypes equal the reference's"
EVIDENCE_RULE = "== 0"


def judge_steps(case: str, role: str, comparison: str, candidate: list[RunTensors], reference: list[RunTensors],
                bounds: dict[str, dict[str, dict[str, Any]]], starts: list[dict], optimizer: Any,
                family: str | None = None) -> list[Row]:
    """Every step's bounds ('step<k>/...') applied to that step of candidate vs reference; rows name the step.

    starts[k] are the parameters the candidate's step k started from (for the AdamW replay check). family: the
    bound family of bounds, which comparison names (Row.family; None: read from comparison).
    """
    rows = []
    if len(candidate) != len(reference):
        rows.append(Row(case, role, comparison, "steps", "num_steps", float(len(candidate)), float(len(reference)),
                        False, f"the candidate took {len(candidate)} optimizer steps, the reference {len(reference)}",
                        family=family))
    for k in range(min(len(candidate), len(reference))):
        prefix = f"step{k}/"
        step_bounds = {key.removeprefix(prefix): b for key, b in bounds.items() if key.startswith(prefix)}
        rows += [replace(r, tensor=prefix + r.tensor, step=k) for r in judge_pair(
            case, role, comparison, candidate[k], reference[k], step_bounds, starts[k], optimizer, adam_step=k + 1,
            family=family)]
    return rows


def judge_pair(case: str, role: str, comparison: str, candidate: RunTensors, reference: RunTensors,
               bounds: dict[str, dict[str, dict[str, Any]]], params_before: dict, optimizer: Any,
               adam_step: int = 1, family: str | None = None) -> list[Row]:
    """Every bound of a family (one step's, keys without the step) applied to candidate vs reference (family: as in
    judge_steps)."""
    rows = [Row(case, role, comparison, key, "structure", math.inf, 0.0, False, problem, rule=STRUCTURE_RULE,
                family=family)
            for key, problem in structure_problems(candidate, reference)]
    broken = {r.tensor for r in rows}
    values = pair_metrics(candidate, reference)
    for key, ms in replay_metrics(candidate, params_before, optimizer, adam_step).items():
        values.setdefault(key, {}).update(ms)
    for key in sorted(bounds):
        if key in broken or derived_only(key):
            continue
        for metric, b in sorted(bounds[key].items()):
            value = values.get(key, {}).get(metric)
            if value is None:
                rows.append(Row(case, role, comparison, key, metric, math.inf, b["bound"], False, "not measured",
                                rule=bound_rule(b), family=family))
                continue
            ok = math.isfinite(value) and value <= b["bound"]
            rows.append(Row(case, role, comparison, key, metric, value, b["bound"], ok,
                            "" if math.isfinite(value) else "NaN or Inf in candidate", rule=bound_rule(b),
                            family=family))
    return rows


def derived_only(key: str) -> bool:
    """A bound an acceptance frozen before such outputs were judged by derivation alone holds
    (qualify.compare.DERIVED_OUTPUTS): not applied; the derivation and decision rows judge the output."""
    group, _, name = key.partition("/")
    return group == "outputs" and name in DERIVED_OUTPUTS


def unexposed_padding(per_rank: list[dict[str, Any]]) -> tuple[int, str]:
    """(padding rows the harness found that the engine's padded_rows() did not report, where), over every rank."""
    missing, where = 0, []
    for rank, p in enumerate(per_rank):
        found = sum(p.get("found", {}).values())
        if found > p.get("exposed", 0):
            missing += found - p.get("exposed", 0)
            where.append(f"rank {rank}: {', '.join(f'{n} ({k} rows)' for n, k in sorted(p['found'].items()))}")
    note = ("the engine holds vocabulary rows beyond the real vocabulary that padded_rows() does not report: "
            + "; ".join(where)) if where else ""
    return missing, note


def evidence_rows(case: str, role: str, meta: CaseMeta | dict[str, Any]) -> list[Row]:
    """Structural evidence of the candidate run itself (meta: the case's meta.json)."""
    meta = CaseMeta.of(meta)
    not_fp32_grads = sorted(n for n, d in meta.grad_dtypes.items() if d != "float32")
    not_fp32_state = sorted(n for n, d in meta.state_dtypes.items() if d != "float32")
    replicas = {name: float(v) for name, v in meta.replica_max_abs.items()}  # 'nan' / 'inf' read back as floats
    replica = max(replicas.values(), key=lambda v: math.inf if math.isnan(v) else v, default=0.0)
    padded = max((float(r["changed_max_abs"]) for r in meta.padded_rows.values()),
                 key=lambda v: math.inf if math.isnan(v) else v, default=0.0)
    unexposed, hidden = unexposed_padding(meta.padding)
    checks = [
        ("evidence/grad_buffers", "num_not_fp32", float(len(not_fp32_grads)), ", ".join(not_fp32_grads[:3])),
        ("evidence/optimizer_state", "num_not_fp32", float(len(not_fp32_state)), ", ".join(not_fp32_state[:3])),
        ("evidence/optimizer_state", "num_params", float(len(meta.grad_dtypes) - len(meta.state_dtypes)),
         "parameters without optimizer state"),
        ("evidence/replicas", "max_abs_across_ranks", replica,
         max(replicas, key=lambda n: math.inf if math.isnan(replicas[n]) else replicas[n], default="")),
        ("evidence/padded_vocab_rows", "changed_max_abs", padded, ""),
        ("evidence/padded_vocab_rows", "num_unexposed", float(unexposed), hidden),
        ("evidence/params", "num_extra", float(len(meta.extra_params)), ", ".join(meta.extra_params[:3])),
    ]
    return [Row(case, role, "evidence", t, m, v, 0.0, math.isfinite(v) and v == 0.0, note, rule=EVIDENCE_RULE)
            for t, m, v, note in checks]


PRECISION_MARGIN = 0.05
"""How much larger than the reference's the fraction of bf16-exact elements of an fp32 quantity may be."""
CHANCE_ELEMENTS = 4
"""...or this many elements' worth of it, in a tensor small enough that a few coincidences are a large fraction."""


def precision_rows(case: str, role: str, candidate: list[RunTensors], reference: list[RunTensors]) -> list[Row]:
    """The contract's fp32 quantities (every multi-element output, the master gradients) must not be values of the
    compute precision widened to fp32: per step and tensor, the fraction of elements bf16 holds exactly may exceed the
    reference's (same precision, r0) by at most PRECISION_MARGIN. Where the reference itself is bf16-valued (bf16
    gradients, a bf16 head's values) nothing is claimed; an fp32 quantity is bf16-exact about once in 2^16."""
    rows = []
    for k, (cand, ref) in enumerate(zip(candidate, reference)):
        for group in ("outputs", "grads"):
            c, r = getattr(cand, group), getattr(ref, group)
            for name in sorted(set(c) & set(r)):
                if c[name].numel() < 2 or c[name].shape != r[name].shape:
                    continue
                exact, counted = bf16_exact_counts(c[name])
                cf, rf = (exact / counted if counted else 0.0), bf16_exact_fraction(r[name])
                excess = max(0.0, cf - rf)
                # a few chance coincidences in a small tensor are no evidence: at least CHANCE_ELEMENTS elements' worth
                margin = max(PRECISION_MARGIN, CHANCE_ELEMENTS / counted) if counted else PRECISION_MARGIN
                rows.append(Row(case, role, "evidence", f"step{k}/{group}/{name}", "bf16_exact_excess", excess,
                                margin, excess <= margin,
                                "" if excess <= margin else
                                f"{cf:.0%} of its elements are bf16 values (reference {rf:.0%}): computed or stored "
                                "in bf16, where the contract says fp32", step=k,
                                rule=f"bf16-exact fraction <= the reference's + max({PRECISION_MARGIN}, "
                                     f"{CHANCE_ELEMENTS} / {counted} counted elements)"))
    return rows
