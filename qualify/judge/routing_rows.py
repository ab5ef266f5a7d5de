"""A MoE case's routing against the routes it was given to replay (rollout.routing: replay): one exact row per step.

The worker measures, on every rank and step, the experts the engine's routers returned (its routes() hook) against
the batch's routes on the tokens the rollout fed (replay_check, recorded in the case's meta.json); the judge makes the
rows (replay_rows). Their comparison is the derivation group's: like a derivation they hold the case to its own
inputs, not to a control-calibrated bound.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from qualify.case.meta import CaseMeta
from qualify.compare import RunTensors
from qualify.judge.derived import DERIVED
from qualify.verdict import Row

REPLAY_RULE = ("== 0: with rollout.routing replay, every token the rollout fed routes to the rollout's experts in every "
               "MoE layer (Rollout Routing Replay); counted: (token, layer) pairs whose expert set differs")
NOT_OBSERVED = ("the engine exposes no routes() hook (or it gave none): whether it replays the rollout's routes is not "
                "verified; its tensors are judged as every case's")


def replay_check(used_BTLK: torch.Tensor | None, given_BTLK: torch.Tensor, offset: int = 0) -> dict[str, Any] | None:
    """How far the experts an engine routed to (its routes() hook) are from the routes it was given to replay, on the
    tokens the rollout fed (given >= 0): (token, layer) pairs whose expert set differs, and the first of them (row
    offset: the batch's first row in the rollout). None when the engine gave no routes."""
    if used_BTLK is None:
        return None
    used, given = used_BTLK.long().cpu(), given_BTLK.long().cpu()
    fed = given[..., 0, 0] >= 0
    if used.shape != given.shape:
        return {"pairs": int(fed.sum()) * given.shape[2], "differ": int(fed.sum()) * given.shape[2],
                "first": f"routes of shape {tuple(used.shape)}, the batch's are {tuple(given.shape)}"}
    differs = (used.sort(-1).values != given.sort(-1).values).any(-1) & fed[..., None]
    first = ""
    if differs.any():
        b, t, layer = (int(i) for i in torch.nonzero(differs)[0])
        first = (f"row {b + offset} position {t} MoE layer {layer}: routed to experts {used[b, t, layer].tolist()}, the "
                 f"rollout's {given[b, t, layer].tolist()}")
    return {"pairs": int(fed.sum()) * given.shape[2], "differ": int(differs.sum()), "first": first}


def replay_rows(case: str, role: str, cand: list[RunTensors]) -> list[Row]:
    """A replaying case's routes against the rollout's, one row per step (recorded by the worker in meta.json); none
    for a case that replays nothing (a dense family, rollout.routing recompute, the critic)."""
    found = CaseMeta.of(cand[0].meta).routing_replay if cand else None
    if not isinstance(found, list) or not found:
        return []
    rows = []
    for k, step in enumerate(found):
        if not isinstance(step, dict):
            rows.append(Row(case, role, DERIVED, f"step{k}/routing/replayed", "not_observed", 0.0, math.inf, True,
                            NOT_OBSERVED, step=k, rule=REPLAY_RULE))
            continue
        try:
            value = float(step.get("differ"))
        except (TypeError, ValueError):
            value = math.nan  # not a count: fails below
        passed = value == 0
        note = "" if passed else (f"{value:g} of {step.get('pairs')} (token, MoE layer) pairs not routed as the "
                                  f"rollout routed them; first: {step.get('first')}")
        rows.append(Row(case, role, DERIVED, f"step{k}/routing/replayed", "pairs_not_replayed", value, 0.0, passed,
                        note, step=k, rule=REPLAY_RULE))
    return rows

