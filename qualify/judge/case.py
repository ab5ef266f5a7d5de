"""judge_case: every row a candidate case is judged by, from its sealed evidence and the sealed reference.

Each step against the reference's families (its precision's repeat family, and under bf16 also fp32-vs-bf16), its
clip decisions as decisions (qualify.judge.decided), its derivations (qualify.judge.derived), routing replay, layout
probe, exact tier, evidence checks and precision, and TPn against TP1, DPn against DP1 and packed against padded where
that case ran. The candidate stage judges with it, and `qualify report` judges every case again with it; it only reads
sealed directories (the replays on a case's clip decisions are sealed before, by the candidate stage).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from qualify.case.meta import CaseMeta
from qualify.compare import RunTensors, load_steps, params_before_steps
from qualify.judge.decided import (
    StepInputs,
    aligned_reference,
    comparable_steps,
    decision_rows,
    own_loss_rows,
    replay_needed,
    run_decisions,
)
from qualify.judge.derived import derived_rows
from qualify.judge.formula import declared_formula, explain_formula, formula_bounds, formula_steps
from qualify.judge.layout_probe import layout_rows
from qualify.judge.rollout_exact import exact_rows
from qualify.judge.routing_rows import replay_rows
from qualify.judge.steps import evidence_rows, judge_steps, precision_rows
from qualify.judge.tiers import bitwise_rows, tensor_tiers, tier_summary
from qualify.layout import RunLayout
from qualify.matrix import Case
from qualify.reference.context import ScoringContext
from qualify.resident import Resident
from qualify.rollout.meta import read_rollout_meta
from qualify.runname import RunName
from qualify.stages import stage_is_complete
from qualify.tensor_codec import decoding
from qualify.verdict import Row


def case_families(case: Case) -> list[tuple[str, str]]:
    """(bound family, reference run) a case is judged against: its precision's repeat family against that
    precision's r0, and under bf16 also fp32-vs-bf16 against fp32-r0 (the case's own precision first)."""
    families = [(f"{case.precision}-repeat", f"{case.precision}-r0")]
    if case.precision == "bf16":
        families.append(("fp32-vs-bf16", "fp32-r0"))
    return families


def case_replays(ctx: ScoringContext, case: Case, inputs: StepInputs) -> list[tuple[str, list]]:
    """(reference run, the case's decisions to replay it on) for each reference run the case decided a token
    otherwise than (qualify.judge.decided.replay_needed)."""
    layout, objective = ctx.layout, ctx.objective
    cand = load_steps(layout.case(case.name))
    out = []
    for _, ref_run in case_families(case):
        precision, control = RunName.parse(ref_run)
        ref = load_steps(layout.scores(precision, control, case.role))
        decided = replay_needed(run_decisions(objective, case.role, cand, inputs),
                                run_decisions(objective, case.role, ref, inputs), cand, ref)
        if decided is not None:
            out.append((ref_run, decided))
    return out


def invariance_bases(case: Case) -> list[tuple[str, Case]]:
    """('tp1', the case at TP1) when TP > 1, ('dp1', the case at DP1) when DP > 1 and ('padded', the case padded) when
    packed."""
    return [(axis, base) for axis, base in (("tp1", replace(case, tp=1)), ("dp1", replace(case, dp=1)),
                                            ("padded", replace(case, packing="padded"))) if base != case]


def judged_reads(ctx: ScoringContext, case: Case, inputs: StepInputs, verified: frozenset[str]) -> list[Path]:
    """The sealed directories judge_case reads besides the reference (which the acceptance's digest covers): the
    case, the replays on its clip decisions, and the TP1/DP1 cases it is compared with where they ran (as
    judge_case decides it: verified names cases whose seal this process has checked)."""
    from qualify.reference.forced import replay_location

    layout = ctx.layout
    reads = [layout.case(case.name)]
    reads += [replay_location(ctx, RunName.parse(ref_run).precision, case.role, decided)
              for ref_run, decided in case_replays(ctx, case, inputs)]
    reads += [layout.case(base.name) for _, base in invariance_bases(case)
              if base.name in verified or stage_is_complete(layout.case(base.name))]
    return reads


def judge_case(ctx: ScoringContext, case: Case, bounds: dict, before: dict, verified: frozenset[str] = frozenset(),
               inputs: StepInputs | None = None, resident: Resident | None = None) -> list[Row]:
    """Every step of a case against the reference's families, its evidence checks, and TPn against TP1 (verified
    names cases whose seal this process has checked since they were last written: not hashed again).

    Clip decisions are judged as decisions (qualify.judge.decided): where the case decided a token otherwise
    than the reference, its tensors are compared with the reference replayed on its decisions. resident: the
    stage's copies on the metrics GPU (qualify.resident; one made here when not given): the case's run is moved there
    once for every comparison and derivation, each r0 and each role's fp64 start once for the stage. What the case's
    coded evidence decodes (qualify.tensor_codec) is kept while it is judged, in a DecodeCache of its own, and dropped
    after it."""
    resident = resident or Resident()
    with decoding():
        return _case_rows(ctx, case, bounds, before, verified, inputs, resident)


def _case_rows(ctx: ScoringContext, case: Case, bounds: dict, before: dict, verified: frozenset[str],
               inputs: StepInputs | None, resident: Resident) -> list[Row]:
    layout, objective = ctx.layout, ctx.objective
    cand = resident.transient(load_steps(layout.case(case.name)))
    starts = params_before_steps(cand, resident.start(case.role, before))
    inputs = inputs or ctx.inputs()
    meta = CaseMeta.of(cand[0].meta)  # its meta.json
    formula, truncates = declared_formula(meta)  # its logprobs are judged against the reference's formula
    rows, own_ref = family_rows(ctx, case, bounds, cand, starts, inputs, resident, formula, truncates)
    rows += own_loss_rows(case.name, case.role, objective, cand, inputs)
    rows += derived_rows(case.name, case.role, objective, cand, inputs, scored=formula == "full" or not truncates,
                         starts=starts)
    rows += replay_rows(case.name, case.role, cand)
    rows += layout_rows(case.name, case.role, meta)
    rows += exact_rows(case.name, case.role, cand[0].outputs, meta, inputs.targets[0]["old_logprobs_BT"],
                       inputs.masks[0], read_rollout_meta(layout.rollout(ctx.primary_tp)).prefill_vs_decode)
    rows += evidence_rows(case.name, case.role, meta)
    rows += precision_rows(case.name, case.role, cand, own_ref)
    rows += invariance_rows(ctx, case, bounds, cand, starts, inputs, resident, formula, truncates, verified)
    return rows


def family_rows(ctx: ScoringContext, case: Case, bounds: dict, cand: list[RunTensors], starts: Any,
                inputs: StepInputs, resident: Resident, formula: str,
                truncates: bool) -> tuple[list[Row], RunTensors | None]:
    """The case's steps against each reference family's r0 (replayed on the case's clip decisions where they differ),
    in the case's declared logprob formula; and the case's own precision's r0 (the first family's)."""
    rows, own_ref = [], None
    for family, ref_run in case_families(case):
        precision, control = RunName.parse(ref_run)
        ref_dir = ctx.layout.scores(precision, control, case.role)
        r0, fam = resident.base(ref_dir, load_steps(ref_dir)), bounds[(case.role, family)]
        own_ref = r0 if own_ref is None else own_ref  # the case's own precision's r0 comes first
        comparison = f"vs ref {ref_run} [{family}]"
        ref, decided = aligned_reference(ctx, inputs, case.name, case.role, comparison, precision, cand, r0, fam)
        ref = ref if ref is r0 else resident.transient(ref)  # r0 replayed on the case's decisions: this case's alone
        judged = judge_steps(case.name, case.role, comparison, cand, formula_steps(ref, formula, truncates),
                             formula_bounds(fam, formula, truncates), starts, ctx.objective.optimizer, family=family)
        rows += explain_formula(judged, cand, ref, fam, formula) + decided
    return rows, own_ref


def invariance_rows(ctx: ScoringContext, case: Case, bounds: dict, cand: list[RunTensors], starts: Any,
                    inputs: StepInputs, resident: Resident, formula: str, truncates: bool,
                    verified: frozenset[str]) -> list[Row]:
    """TPn against TP1, DPn against DP1 (the same case at the lower degree) and packed against padded, when that case
    ran; and, for an engine that declares determinism: bitwise, the bitwise rows across TP x DP."""
    layout, objective, rows = ctx.layout, ctx.objective, []
    bitwise = CaseMeta.of(cand[0].meta).spec.get("determinism") == "bitwise"
    for axis, base in invariance_bases(case):
        if not (base.name in verified or stage_is_complete(layout.case(base.name))):
            continue
        base_steps = resident.transient(load_steps(layout.case(base.name)))
        comparison = f"vs {axis} [{case.precision}-repeat]"
        fam = formula_bounds(bounds[(case.role, f"{case.precision}-repeat")], formula, truncates)
        same, mine, theirs = comparable_steps(objective, case.role, cand, base_steps, inputs)
        rows += judge_steps(case.name, case.role, comparison, cand[:same], base_steps[:same], fam, starts,
                            objective.optimizer, family=f"{case.precision}-repeat")
        if same < min(len(cand), len(base_steps)):
            rows += [replace(r, note=f"{r.note}; steps {same} to {len(cand) - 1} are not compared with {axis}: the "
                                     f"two cases decided differently at step {same}, each is compared with the "
                                     f"reference replayed on its own decisions")
                     for r in decision_rows(case.name, case.role, comparison, mine, theirs, fam, steps=same + 1)[-1:]]
        if bitwise and axis != "padded":  # the declaration is across TP x DP; packing is another layout
            rows += bitwise_rows(case.name, case.role, axis, cand, base_steps)
    return rows


def case_invariance(layout: RunLayout, case: Case, rows: list[Row]) -> dict[str, Any]:
    """Per comparison with a TP1/DP1 case: each judged tensor's tier (qualify.judge.tiers), counted."""
    out = {}
    for axis, base in invariance_bases(case):
        mine = [r for r in rows if r.case == case.name and r.comparison == f"vs {axis} [{case.precision}-repeat]"]
        if mine:
            tiers = tensor_tiers(mine, load_steps(layout.case(case.name)), load_steps(layout.case(base.name)))
            out[f"vs {axis}"] = tier_summary(tiers)
    return out
