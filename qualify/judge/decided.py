"""Clip decisions judged as decisions, and the reference a case's continuous tensors are compared with.

A candidate may decide a token's clip otherwise than the reference only where the reference's deciding quantity
(values_BT for the critic, ratio_BT for the actor) lies within that step's frozen max_abs bound of the clip edge:
a difference the bound itself allows. Every other difference is a failing row naming the token. Where decisions
differ, the case's tensors are compared with the reference replayed on the candidate's decisions
(qualify.reference.forced) instead of with its own trajectory; against a TP1/DP1 case, only the steps before the
first step the two decided differently are compared.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from qualify.compare import RunTensors
from qualify.matrix import Objective
from qualify.ppo.decisions import Decisions, decisions, differing
from qualify.reference.context import ScoringContext
from qualify.reference.inputs import StepInputs
from qualify.verdict import Row

DECISION_RULE = "decided as the reference, or where the reference is within its {q} bound of the clip edge"
SHOWN = 4


def run_decisions(objective: Objective, role: str, steps: list[RunTensors],
                  inputs: StepInputs) -> list[Decisions | None]:
    return [decisions(role, objective.ppo, objective.grpo, s.outputs, inputs.targets[k], inputs.masks[k])
            if k < len(inputs.masks) else None for k, s in enumerate(steps)]


def _same(a: list[Decisions | None], b: list[Decisions | None]) -> bool:
    return all(x is None or y is None or not differing(x, y) for x, y in zip(a, b))


def decision_rows(case: str, role: str, comparison: str, mine: list[Decisions | None],
                  theirs: list[Decisions | None], bounds: dict[str, Any], steps: int | None = None) -> list[Row]:
    """One row per step (up to steps): how many tokens were decided otherwise than theirs with the edge beyond the
    bound of the deciding quantity (bound 0); the note names them, and those the bound explains."""
    rows = []
    for k, (a, b) in enumerate(zip(mine, theirs)):
        if steps is not None and k >= steps:
            break
        if a is None or b is None:
            continue
        entry = bounds.get(f"step{k}/outputs/{b.quantity}", {}).get("max_abs", {})
        bound = float(entry.get("bound", 0.0))
        explained, unexplained = [], []
        for r, t in differing(a, b):
            m = float(b.margin_BT[r, t])
            (explained if m <= bound else unexplained).append((r, t, m))
        note = ""
        if explained or unexplained:
            def show(items: list[tuple[int, int, float]]) -> str:
                text = ", ".join(f"row {r} token {t} at {m:.3g}" for r, t, m in items[:SHOWN])
                return text + (f" and {len(items) - SHOWN} more" if len(items) > SHOWN else "")
            parts = []
            if unexplained:
                parts.append(f"{len(unexplained)} decided otherwise with the edge beyond the {b.quantity} bound "
                             f"{bound:.3g}: {show(unexplained)}")
            if explained:
                parts.append(f"{len(explained)} within the bound of the edge (legitimate): {show(explained)}")
            note = "; ".join(parts)
        rows.append(Row(case, role, comparison, f"step{k}/decisions/{b.name}", "unexplained_flips",
                        float(len(unexplained)), 0.0, not unexplained, note, step=k,
                        rule=DECISION_RULE.format(q=b.quantity)))
    return rows


def replay_needed(mine: list[Decisions | None], theirs: list[Decisions | None], cand: list[RunTensors],
                  ref: list[RunTensors]) -> list[torch.Tensor] | None:
    """The case's clip decisions to replay the reference on (every step's), or None when the case is compared with
    the reference itself: it decided as the reference at every step, or its decisions or steps cannot be lined up."""
    if any(d is None for d in mine) or len(cand) != len(ref) or _same(mine, theirs):
        return None
    return [d.clipped_BT for d in mine if d is not None]


def aligned_reference(ctx: ScoringContext, inputs: StepInputs, case: str, role: str, comparison: str,
                      precision: str, cand: list[RunTensors], ref: list[RunTensors],
                      bounds: dict[str, Any]) -> tuple[list[RunTensors], list[Row]]:
    """(the reference to compare the case's tensors with, the decision rows): ref itself when the case decided as
    it did at every step, else ref replayed on the case's decisions (whose own decisions the rows judge against),
    read from where the candidate stage sealed it before judging (nothing is computed here)."""
    mine, theirs = run_decisions(ctx.objective, role, cand, inputs), run_decisions(ctx.objective, role, ref, inputs)
    decided = replay_needed(mine, theirs, cand, ref)
    if decided is None:
        return ref, decision_rows(case, role, comparison, mine, theirs, bounds)
    from qualify.reference.forced import sealed_replay

    replay, where = sealed_replay(ctx, precision, role, decided)
    # the replay follows the case's decisions, so from the first flip on its steps are the ones the case's decisions
    # are judged against (its own deciding quantity, step by step)
    rows = decision_rows(case, role, comparison, mine, run_decisions(ctx.objective, role, replay, inputs), bounds)
    out = []
    for row, a, b in zip(rows, mine, theirs):
        flips = differing(a, b) if a is not None and b is not None else []
        if flips:
            shown = ", ".join(f"row {r} token {t}" for r, t in flips[:SHOWN])
            more = f" and {len(flips) - SHOWN} more" if len(flips) > SHOWN else ""
            text = (f"{len(flips)} decided otherwise than {precision}-r0 ({shown}{more}): compared with {precision}-r0 "
                    f"replayed on this case's decisions ({where.parent.name})")
            row = replace(row, note=f"{row.note}; {text}" if row.note else text)
        out.append(row)
    return replay, out


def first_divergence(mine: list[Decisions | None], theirs: list[Decisions | None]) -> int | None:
    """The first step two runs decided differently (None: never)."""
    for k, (a, b) in enumerate(zip(mine, theirs)):
        if a is not None and b is not None and differing(a, b):
            return k
    return None


def comparable_steps(objective: Objective, role: str, cand: list[RunTensors], base: list[RunTensors],
                     inputs: StepInputs) -> tuple[int, list[Decisions | None], list[Decisions | None]]:
    """How many leading steps of two cases follow the same decisions (all when they never differ)."""
    mine, theirs = run_decisions(objective, role, cand, inputs), run_decisions(objective, role, base, inputs)
    k = first_divergence(mine, theirs)
    return (min(len(cand), len(base)) if k is None else k), mine, theirs



FP32_UNIT = 2.0 ** -24
OWN_LOSS_RULE = "<= (active tokens + 4) x 2^-24 x sum |per-token contribution|: fp32 rounding of the loss's sum"


def own_loss_rows(case: str, role: str, objective: Objective, cand: list[RunTensors], inputs: StepInputs) -> list[Row]:
    """One row per step: the case's loss against the matrix's objective evaluated (float64) on the case's own
    recorded outputs (qualify.ppo.decisions.loss_terms), within what fp32 rounding of the sum allows. A loss that is
    not the objective of the outputs it reports (a wrong normalizer, a term dropped from the loss but not from the
    outputs) fails here from step 0, whatever the reference's bounds."""
    from qualify.ppo.decisions import loss_terms

    rows = []
    for k, step in enumerate(cand):
        if k >= len(inputs.masks) or "loss" not in step.outputs:
            continue
        terms = loss_terms(role, objective.ppo, objective.grpo, step.outputs, inputs.targets[k], inputs.masks[k])
        if terms is None:
            continue
        loss = float(step.outputs["loss"].double().reshape(()))
        value = abs(loss - float(terms.sum())) if math.isfinite(loss) else math.inf
        bound = (int(inputs.masks[k].sum()) + 4) * FP32_UNIT * float(terms.abs().sum())
        rows.append(Row(case, role, "own outputs", f"step{k}/outputs/loss", "objective_abs", value, bound,
                        value <= bound, "" if value <= bound else
                        f"the loss is {loss:.9g}, the matrix's objective of this case's own outputs {float(terms.sum()):.9g}",
                        step=k, rule=OWN_LOSS_RULE))
    return rows
