"""Whether an optimizer's state is sharded as its parameters and complete when gathered (DTensor evidence).

A data-parallel engine that shards its optimizer (torch FSDP2's AdamW on DTensor parameters) keeps each moment as a
DTensor laid out as its parameter. The evidence the harness judges is the gathered moment (full_tensor()); a gather
of a state that is not laid out that way (held whole on every rank, a rank's shard missing or of another size, a
rank without the state at all) would be judged as if it were the engine's, or would hang the collective. So before
anything is gathered every rank reports, per parameter, the blocks its shard of the moment covers, and the check
holds them to the parameter's: the same mesh layout and global shape, each rank's local block where the placements
put it, and the distinct blocks tiling the whole tensor, every element once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

Block = tuple[tuple[int, ...], tuple[int, ...]]
"""(global offset, shape) of one rank's local block of a tensor."""


def layout_of(t: Any) -> dict[str, Any] | None:
    """What this rank holds of t: its global shape, placements, mesh shape and local block as held (offset where its
    placements put it, shape as held); None for a state that is absent, {'plain': shape} for a tensor that is not a
    DTensor."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if t is None:
        return None
    if not isinstance(t, DTensor):
        return {"plain": tuple(t.shape)}
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return {"shape": tuple(t.shape), "placements": repr(tuple(t.placements)), "mesh": tuple(t.device_mesh.shape),
            "expected": tuple(shape), "held": tuple(t.to_local().shape), "offset": tuple(offset)}


def tiling_problem(shape: tuple[int, ...], blocks: list[Block]) -> str | None:
    """Why the distinct blocks do not cover a tensor of shape exactly once (None: they do)."""
    distinct = sorted(set(blocks))
    volume = sum(int(torch.Size(s).numel()) for _, s in distinct)
    for i, (o1, s1) in enumerate(distinct):
        if any(d1 + n1 > size for d1, n1, size in zip(o1, s1, shape)):
            return f"a block at {list(o1)} of shape {list(s1)} lies outside {list(shape)}"
        for o2, s2 in distinct[i + 1:]:
            if all(n1 and n2 and a < b + n2 and b < a + n1 for a, n1, b, n2 in zip(o1, s1, o2, s2)):
                return f"the blocks at {list(o1)} and {list(o2)} overlap"
    numel = int(torch.Size(shape).numel())
    if volume != numel:
        return f"the ranks' blocks hold {volume} of its {numel} elements"
    return None


def state_problems(by_rank: list[Mapping[str, Any]], params_by_rank: list[Mapping[str, Any]], key: str) -> list[str]:
    """Why moment key of each parameter is not sharded as the parameter and complete, from every rank's layouts
    (by_rank[r][name]: layout_of the rank's state; params_by_rank[r][name]: layout_of its parameter). Pure."""
    problems = []
    for name in params_by_rank[0]:
        states = [r.get(name) for r in by_rank]
        missing = [rank for rank, s in enumerate(states) if s is None]
        if len(missing) == len(states):
            continue  # no rank holds a state for it (a parameter without a gradient): nothing to gather
        if missing:
            problems.append(f"{key} of {name}: absent on rank {', '.join(map(str, missing))}")
            continue
        problem = _one_state_problem(states, [p[name] for p in params_by_rank])
        if problem:
            problems.append(f"{key} of {name}: {problem}")
    return problems


def _one_state_problem(states: list[dict[str, Any]], params: list[dict[str, Any]]) -> str | None:
    for rank, (s, p) in enumerate(zip(states, params)):
        if "plain" in s:
            return f"rank {rank} holds a plain tensor of shape {list(s['plain'])}, not a DTensor sharded as its parameter"
        if (s["shape"], s["placements"], s["mesh"]) != (p["shape"], p["placements"], p["mesh"]):
            return (f"rank {rank} holds shape {list(s['shape'])} {s['placements']} on mesh {list(s['mesh'])}, its "
                    f"parameter shape {list(p['shape'])} {p['placements']} on mesh {list(p['mesh'])}")
        if s["held"] != s["expected"]:
            return f"rank {rank} holds a local shard of shape {list(s['held'])}, its placements give {list(s['expected'])}"
    return tiling_problem(states[0]["shape"], [(s["offset"], s["held"]) for s in states])


def check_sharded_state(params: Mapping[str, torch.Tensor], state: Mapping[torch.Tensor, Mapping[str, Any]],
                        keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq"), group: Any = None) -> list[str]:
    """Every rank's layouts of the moments keys of params (name -> parameter) in state (an optimizer's), gathered over
    group, and the problems state_problems finds (the same list on every rank). A collective: every rank calls it."""
    params_local = {n: layout_of(p) for n, p in params.items()}
    local = {k: {n: layout_of(state[p].get(k)) if p in state else None for n, p in params.items()} for k in keys}
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (params_local, local), group=group)
    params_by_rank = [g[0] for g in gathered]
    return [p for k in keys for p in state_problems([g[1][k] for g in gathered], params_by_rank, k)]
